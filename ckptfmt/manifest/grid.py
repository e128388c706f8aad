"""Geometry of a tensor's shard grid and of the inner chunks inside one shard.

A tensor of shape ``S`` is cut by a regular grid of shard shape ``H`` (zarr's chunk grid); each
grid cell is one shard file. Each shard is cut by the inner chunk shape ``C`` (``H`` is a multiple
of ``C`` on every axis); each inner chunk is stored with its own CRC32C.

The default choice (:func:`choose_grid`) makes inner chunks and shards *C-contiguous blocks*: whole
along every axis after a split axis ``j``, one element thick before it. Such a block is one
contiguous run of the array's bytes, so the writer hands the array's own memory to ``writev``
and the reader ``readv``s straight into the destination: no gather, no copy.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ckptfmt.manifest.limits import MAX_CHUNKS_PER_SHARD

Shape = tuple[int, ...]

DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_SHARD_BYTES = 16 << 20


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def choose_grid(
    shape: Sequence[int],
    itemsize: int,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> tuple[Shape, Shape]:
    """Pick ``(shard_shape, chunk_shape)`` for a whole tensor: C-contiguous blocks of about
    ``chunk_bytes`` (inner chunks) and ``shard_bytes`` (shards), split on the same axis.

    A 0-d tensor gets ``((), ())``; a zero-size dimension gets extent 1 (zarr needs positive
    chunk extents; such a tensor has no shard files).
    """
    shape = tuple(int(d) for d in shape)
    if not shape:
        return (), ()
    if math.prod(shape) == 0:
        return tuple(max(1, d) for d in shape), tuple(max(1, d) for d in shape)
    nd = len(shape)
    # split axis j: scanning from the last axis, the first whose slices together exceed one chunk
    j = 0
    trailing = itemsize
    for axis in range(nd - 1, -1, -1):
        if trailing * shape[axis] > chunk_bytes:
            j = axis
            break
        trailing *= shape[axis]
    trailing = itemsize * math.prod(shape[j + 1 :])
    k = max(1, min(shape[j], chunk_bytes // trailing))
    chunks_per_shard = min(MAX_CHUNKS_PER_SHARD, max(1, shard_bytes // (k * trailing)))
    n_chunks_along = cdiv(shape[j], k)
    m = min(chunks_per_shard, n_chunks_along)
    chunk = (1,) * j + (k,) + shape[j + 1 :]
    shard = (1,) * j + (k * m,) + shape[j + 1 :]
    return shard, chunk


def grid_shape(shape: Sequence[int], block: Sequence[int]) -> Shape:
    """Number of blocks along each axis (``ceil(shape / block)``)."""
    return tuple(cdiv(s, b) for s, b in zip(shape, block))


def cells(lo: Sequence[int], hi: Sequence[int]) -> Iterator[Shape]:
    """Grid indices from ``lo`` (inclusive) to ``hi`` (exclusive), C order."""
    return itertools.product(*(range(a, b) for a, b in zip(lo, hi)))


def shard_key(array_path: str, index: Sequence[int]) -> str:
    """Path of a shard file relative to the checkpoint root (zarr's default key encoding, '/')."""
    if not index:
        return f"{array_path}/c"
    return f"{array_path}/c/" + "/".join(str(i) for i in index)


def shard_cell(key: str) -> tuple[int, ...]:
    """Inverse of :func:`shard_key`: ``path/c/i/j`` -> ``(i, j)``; ``path/c`` -> ``()``."""
    tail = key.rsplit("/c", 1)[1]
    return tuple(int(x) for x in tail.split("/")[1:])


@dataclass(frozen=True)
class ChunkSlot:
    """One inner chunk of a shard: its position in the shard index and its box in the array.

    ``box_lo``/``box_hi`` are clipped to the array; ``padded`` says the stored chunk is larger
    (filled with the fill value past the array's edge).
    """

    slot: int
    box_lo: Shape
    box_hi: Shape
    padded: bool


def shard_slots(
    array_shape: Sequence[int],
    shard_shape: Sequence[int],
    chunk_shape: Sequence[int],
    shard_index: Sequence[int],
) -> tuple[int, list[ChunkSlot]]:
    """The inner chunks of one shard that hold data, and the number of index slots.

    Inner chunks lying wholly outside the array are absent (their index entries are empty).
    """
    per = tuple(h // c for h, c in zip(shard_shape, chunk_shape))
    n_slots = math.prod(per)
    origin = tuple(i * h for i, h in zip(shard_index, shard_shape))
    out: list[ChunkSlot] = []
    for slot, inner in enumerate(cells((0,) * len(per), per)):
        lo = tuple(o + i * c for o, i, c in zip(origin, inner, chunk_shape))
        if any(a >= s for a, s in zip(lo, array_shape)):
            continue
        full_hi = tuple(a + c for a, c in zip(lo, chunk_shape))
        hi = tuple(min(h, s) for h, s in zip(full_hi, array_shape))
        out.append(ChunkSlot(slot, lo, hi, hi != full_hi))
    return n_slots, out


def is_contiguous_box(array_shape: Sequence[int], lo: Sequence[int], hi: Sequence[int]) -> bool:
    """Whether a box is one contiguous run of a C-order array's bytes."""
    nd = len(array_shape)
    for j in range(nd):
        if all(hi[i] - lo[i] == 1 for i in range(j)) and all(
            lo[i] == 0 and hi[i] == array_shape[i] for i in range(j + 1, nd)
        ):
            return True
    return nd == 0


def flat_range(array_shape: Sequence[int], lo: Sequence[int], hi: Sequence[int]) -> tuple[int, int]:
    """Element range ``[start, stop)`` of a contiguous box (see :func:`is_contiguous_box`)."""
    start = 0
    for i, d in enumerate(array_shape):
        start = start * d + lo[i]
    return start, start + math.prod(h - lo_ for lo_, h in zip(lo, hi))
