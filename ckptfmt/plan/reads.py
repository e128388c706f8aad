"""Read planning for another layout (a pure function): which inner chunks of which shard files
give a wanted box of a tensor, and where each piece goes.

A saved tensor is a set of grid-aligned regions, each written by one rank as whole shard files
(``spec/FORMAT.md`` §7-§9). A reader wants a box of it (a rank of a job of another size wants its
own FSDP rows, a replica wants everything). :func:`plan_reads` intersects the two:

    (saved regions, wanted box) -> [FileRead(file, cell, writer, [Piece(slot, overlap box)])]

Every element of the wanted box is in exactly one piece, and every piece lies inside the box.

*Why whole inner chunks, not byte ranges.* The inner chunk is the unit of the CRC32C (§10): the
bytes of part of a chunk cannot be verified, and a reader must verify every byte it uses (§14).
So the plan names inner chunks (index slots); the reader reads each whole, checks its CRC, and
copies out the overlap. The cost is over-reading: at most the part of each touched chunk that
lies outside the wanted box (with the default 1 MiB C-contiguous chunks, less than one chunk at
each end of each contiguous run of the box per file). The byte offset of a chunk comes from the
shard's index (ckptfmt's writer places chunks in slot order, slot position ``i`` at
``i·stride(B)``, ``format.shard.chunk_stride``, but readers must accept any valid placement,
§8), so a reader reads the index (``16·n + 4`` bytes) once per file, then the chunks,
coalescing neighbours into one read.
When a read covers all of a file's in-bounds chunks the file's data CRC (§10) is checked too.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ckptfmt.errors import UsageError
from ckptfmt.manifest.model import TensorEntry

Shape = tuple[int, ...]
Box = tuple[Shape, Shape]  # (offset, shape), global coordinates


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def ravel(index: Sequence[int], extents: Sequence[int]) -> int:
    """Position of ``index`` in C order of a grid of ``extents``."""
    out = 0
    for i, e in zip(index, extents):
        out = out * e + i
    return out


def _cells(lo: Sequence[int], hi: Sequence[int]) -> list[Shape]:
    out: list[Shape] = [()]
    for a, b in zip(lo, hi):
        out = [(*c, i) for c in out for i in range(a, b)]
    return out


@dataclass(frozen=True)
class SavedRegion:
    """A stored region: its box, its writer rank and how many shard files it has."""

    offset: Shape
    shape: Shape
    rank: int
    n_files: int


@dataclass(frozen=True)
class Layout:
    """How a tensor is stored: its shape, grids and regions (the manifest's tensor entry)."""

    shape: Shape
    shard_shape: Shape
    chunk_shape: Shape
    regions: tuple[SavedRegion, ...]

    @classmethod
    def of(cls, t: TensorEntry) -> Layout:
        return cls(
            t.shape,
            t.shard_shape,
            t.chunk_shape,
            tuple(SavedRegion(r.offset, r.shape, r.rank, len(r.files)) for r in t.regions),
        )

    @property
    def chunks_per_shard(self) -> Shape:
        return tuple(h // c for h, c in zip(self.shard_shape, self.chunk_shape))

    def present_slots(self, cell: Sequence[int]) -> int:
        """Number of in-bounds inner chunks of the shard at grid ``cell`` (§8)."""
        out = 1
        for i, h, c, s, per in zip(
            cell, self.shard_shape, self.chunk_shape, self.shape, self.chunks_per_shard
        ):
            out *= min(per, cdiv(s - i * h, c))
        return out


@dataclass(frozen=True)
class Piece:
    """The part of one inner chunk that a reader wants: the chunk's index ``slot`` in its shard,
    the chunk's global origin, and the overlap box (global ``lo``, ``shape``) to copy."""

    slot: int
    chunk_lo: Shape
    lo: Shape
    shape: Shape

    @property
    def nelems(self) -> int:
        return math.prod(self.shape)

    def src(self) -> tuple[slice, ...]:
        """The overlap as a slice of the chunk (chunk-shaped array)."""
        return tuple(slice(a - c, a - c + n) for a, c, n in zip(self.lo, self.chunk_lo, self.shape))

    def dst(self, origin: Sequence[int]) -> tuple[slice, ...]:
        """The overlap as a slice of the wanted box's array (whose global origin is ``origin``)."""
        return tuple(slice(a - o, a - o + n) for a, o, n in zip(self.lo, origin, self.shape))


@dataclass(frozen=True)
class FileRead:
    """Inner chunks to read from one shard file: region ``region``'s ``file``-th file (grid
    ``cell``, written by ``writer``), for the part ``[lo, hi)`` (global) of the wanted box that
    lies in it. ``pieces`` (one per chunk, ascending slots) are made on first use: a reader of
    its own box needs them, the other ranks' plans mostly need how many chunks they read."""

    region: int
    file: int
    cell: Shape
    writer: int
    n_present: int  # in-bounds chunks of the file
    lo: Shape
    hi: Shape
    shard_shape: Shape
    chunk_shape: Shape

    @property
    def key(self) -> tuple[int, int]:
        return self.region, self.file

    def _inner(self) -> tuple[Shape, Shape, Shape]:
        origin = tuple(i * h for i, h in zip(self.cell, self.shard_shape))
        k_lo = tuple((a - o) // c for a, o, c in zip(self.lo, origin, self.chunk_shape))
        k_hi = tuple(cdiv(b - o, c) for b, o, c in zip(self.hi, origin, self.chunk_shape))
        return origin, k_lo, k_hi

    @property
    def n_chunks(self) -> int:
        """How many inner chunks are read (without making the pieces)."""
        _, k_lo, k_hi = self._inner()
        return math.prod(b - a for a, b in zip(k_lo, k_hi))

    @property
    def whole(self) -> bool:
        """Whether every in-bounds chunk is read (the file's data CRC can be checked)."""
        return self.n_chunks == self.n_present

    @functools.cached_property
    def pieces(self) -> tuple[Piece, ...]:
        origin, k_lo, k_hi = self._inner()
        if not origin:  # 0-d: the one element
            return (Piece(0, (), (), ()),)
        # each axis's chunks (index, chunk origin, overlap origin, overlap extent) once; the
        # pieces are their products (a file of a row block has one chunk per row group)
        axes = []
        for o, a, b, lo, hi, c in zip(origin, k_lo, k_hi, self.lo, self.hi, self.chunk_shape):
            axis = []
            for i in range(a, b):
                x = o + i * c
                p_lo = lo if lo > x else x
                p_hi = hi if hi < x + c else x + c
                axis.append((i, x, p_lo, p_hi - p_lo))
            axes.append(axis)
        per = tuple(h // c for h, c in zip(self.shard_shape, self.chunk_shape))
        out = []
        for combo in itertools.product(*axes):
            inner, c_lo, p_lo, shape = zip(*combo)
            out.append(Piece(ravel(inner, per), c_lo, p_lo, shape))
        return tuple(out)

    @functools.cached_property
    def slots(self) -> tuple[int, ...]:
        """The slots of the chunks read, ascending (C order of the inner grid), without making
        the pieces (a rank reading for itself into its own rows needs only these)."""
        _, k_lo, k_hi = self._inner()
        per = (h // c for h, c in zip(self.shard_shape, self.chunk_shape))
        idx = np.zeros(1, np.int64)
        for a, b, n in zip(k_lo, k_hi, per):
            idx = (idx[:, None] * n + np.arange(a, b)).reshape(-1)
        return tuple(idx.tolist())

    def rows_into(self, origin: Sequence[int], shape: Sequence[int]) -> int | None:
        """Where this read's chunks go in a C-order array of ``shape`` at global ``origin``
        (the reader's box), when each is a whole chunk that is a run of whole rows of it: the
        element offset of the first chunk, the others following back to back in slot order;
        else None (pieces are then placed one by one). The common case of FSDP-style row
        blocks (chunks as wide as the tensor) read by another number of ranks."""
        if not self.lo or tuple(self.chunk_shape[1:]) != tuple(shape[1:]):
            return None
        if any(
            a != o or b - a != n
            for a, b, o, n in zip(self.lo[1:], self.hi[1:], origin[1:], shape[1:])
        ):
            return None  # not the box's whole width
        for a, b, i, h, c in zip(self.lo, self.hi, self.cell, self.shard_shape, self.chunk_shape):
            if (a - i * h) % c or (b - i * h) % c:
                return None  # a chunk cut at either end (or padded past the tensor's end)
        return (self.lo[0] - origin[0]) * math.prod(shape[1:])


def check_box(shape: Sequence[int], box: Box, what: str = "wanted box") -> None:
    """Raise :class:`UsageError` unless ``box`` lies inside a tensor of ``shape``."""
    off, ext = box
    if len(off) != len(shape) or len(ext) != len(shape):
        raise UsageError(f"{what} {list(off)}+{list(ext)} has not {len(shape)} dimensions")
    if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(off, ext, shape)):
        raise UsageError(f"{what} {list(off)}+{list(ext)} is outside the tensor {list(shape)}")


def plan_reads(layout: Layout, want: Box) -> tuple[FileRead, ...]:
    """The chunks of ``layout``'s files that hold the box ``want`` (files in manifest order:
    regions, then each region's files in C order of their cells).

    Pure and deterministic. The pieces partition ``want`` (every element in exactly one piece,
    none outside it). A 0-d tensor's box is ``((), ())``: its one file, slot 0, whole.
    """
    check_box(layout.shape, want)
    if not layout.shape:
        return tuple(
            FileRead(i, 0, (), r.rank, 1, (), (), (), ()) for i, r in enumerate(layout.regions)
        )
    w_lo, w_ext = want
    if 0 in w_ext:
        return ()
    w_hi = tuple(a + n for a, n in zip(w_lo, w_ext))
    shard, chunk, shape = layout.shard_shape, layout.chunk_shape, layout.shape
    out: list[FileRead] = []
    for ri, reg in enumerate(layout.regions):
        lo = tuple(max(a, b) for a, b in zip(w_lo, reg.offset))
        hi = tuple(min(a, b + n) for a, b, n in zip(w_hi, reg.offset, reg.shape))
        if any(b <= a for a, b in zip(lo, hi)):
            continue
        first = tuple(o // h for o, h in zip(reg.offset, shard))
        extents = tuple(cdiv(n, h) for n, h in zip(reg.shape, shard))
        for cell in _cells(
            tuple(a // h for a, h in zip(lo, shard)), tuple(cdiv(b, h) for b, h in zip(hi, shard))
        ):
            origin = tuple(i * h for i, h in zip(cell, shard))
            b_lo = tuple(max(a, o) for a, o in zip(lo, origin))
            b_hi = tuple(min(b, o + h, s) for b, o, h, s in zip(hi, origin, shard, shape))
            rel = tuple(c - f for c, f in zip(cell, first))
            out.append(
                FileRead(
                    ri,
                    ravel(rel, extents),
                    cell,
                    reg.rank,
                    layout.present_slots(cell),
                    b_lo,
                    b_hi,
                    shard,
                    chunk,
                )
            )
    return tuple(out)
