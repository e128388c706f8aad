"""Writing the shard files of one tensor region (``spec/FORMAT.md`` §8), and the geometry the
shard codec works with (the reader is ``shard_read``).

The writer turns a region's array into whole shard files: every in-bounds inner chunk present, in
slot order, each followed by its CRC32C (and, from 4 KiB on, zeros up to a multiple of 64 bytes:
``shard.chunk_stride``), then the index. Chunks that are contiguous runs of the
array (the default grid makes all but edge chunks so) go to ``writev`` as views of the array's
own memory; the manifest's data CRC is combined from the chunk CRCs (``codecs/crc32c.py``).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ckptfmt.checksum import crc32c
from ckptfmt.dtypes import by_name, of_array
from ckptfmt.errors import CkptError
from ckptfmt.format.incremental import Incremental
from ckptfmt.format.shard import (
    CRC_BYTES,
    ZEROS,
    FileCrc,
    chunk_stride,
    encode_index,
    index_nbytes,
)
from ckptfmt.manifest.grid import ChunkSlot, flat_range, is_contiguous_box, shard_key, shard_slots
from ckptfmt.manifest.model import FileRef
from ckptfmt.storage.files import COPY_BATCH
from ckptfmt.storage.progress import current_meter
from ckptfmt.storage.store.base import Draft
from ckptfmt.storage.store.directory import DirectoryDraft, draft_at

CRC_FORMAT = struct.Struct("<I")  # a chunk's CRC32C as stored after it


@dataclass(frozen=True)
class Geometry:
    """What the shard codec needs to know about a tensor."""

    path: str
    dtype: np.dtype
    shape: tuple[int, ...]
    shard_shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]

    @classmethod
    def of(
        cls, path: str, dtype: str, shape: Sequence[int], shard: Sequence[int], chunk: Sequence[int]
    ) -> Geometry:
        return cls(path, by_name(dtype).numpy, tuple(shape), tuple(shard), tuple(chunk))

    @property
    def chunk_nbytes(self) -> int:
        return math.prod(self.chunk_shape) * self.dtype.itemsize

    def cell_of(self, offset: Sequence[int]) -> tuple[int, ...]:
        return tuple(o // h for o, h in zip(offset, self.shard_shape))

    @property
    def n_slots(self) -> int:
        """Inner-chunk slots per shard (the index's length)."""
        return math.prod(h // c for h, c in zip(self.shard_shape, self.chunk_shape))

    def slots(self, cell: Sequence[int]) -> tuple[int, list[ChunkSlot]]:
        return shard_slots(self.shape, self.shard_shape, self.chunk_shape, cell)


def byte_view(arr: np.ndarray) -> memoryview:
    """A flat byte view of a C-contiguous array (ml_dtypes types have no buffer format)."""
    return memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def local_box(box: Sequence[int], origin: Sequence[int]) -> tuple[int, ...]:
    """A corner of a chunk's box in the coordinates of an array that starts at ``origin``."""
    return tuple(b - o for b, o in zip(box, origin))


def _chunk_buffer(
    geo: Geometry, data: np.ndarray, origin: Sequence[int], s: ChunkSlot
) -> memoryview:
    """The stored bytes of one inner chunk: a view of ``data`` when possible, else a padded copy."""
    lo, hi = local_box(s.box_lo, origin), local_box(s.box_hi, origin)
    if not s.padded and is_contiguous_box(data.shape, lo, hi):
        start, stop = flat_range(data.shape, lo, hi)
        return byte_view(data.reshape(-1)[start:stop])
    chunk = np.zeros(geo.chunk_shape, dtype=data.dtype)
    chunk[tuple(slice(0, b - a) for a, b in zip(lo, hi))] = data[
        tuple(slice(a, b) for a, b in zip(lo, hi))
    ]
    return byte_view(chunk)


@dataclass(frozen=True)
class ShardJob:
    """One shard file to write: into which draft (``dest``), at which ``key``, and which part of
    which array goes into it. ``target``: its path when the draft is a directory (an
    incremental save hard-links the base's file there), else None."""

    dest: Draft
    target: Path | None
    key: str
    geo: Geometry
    data: np.ndarray
    origin: tuple[int, ...]
    cell: tuple[int, ...]

    def run(
        self,
        fsync: bool = True,
        into: np.ndarray | None = None,
        incremental: Incremental | None = None,
    ) -> FileRef:
        """Write the file. ``into`` (uint8, exactly :meth:`nbytes` long): also leave the file's
        bytes there, and write them from it (the redundancy encoding then needs no read-back).
        ``incremental``: also hash the content, and hard-link the base's file instead of writing
        when it holds the same bytes (``format/incremental.py``)."""
        return _write_shard(
            self.dest,
            self.target,
            self.key,
            self.geo,
            self.data,
            self.origin,
            self.cell,
            fsync,
            into,
            incremental,
        )

    def nbytes(self) -> int:
        return shard_file_nbytes(self.geo, self.cell)


def shard_file_nbytes(geo: Geometry, cell: Sequence[int]) -> int:
    """The size of the shard file of ``cell`` as :func:`_write_shard` lays it out: every
    in-bounds chunk (edge chunks padded to the chunk shape) and its CRC, then the index. Known
    from the geometry alone, before any byte is written."""
    if not geo.shape:
        return geo.dtype.itemsize + CRC_BYTES
    n_slots, slots = geo.slots(cell)
    return len(slots) * chunk_stride(geo.chunk_nbytes) + index_nbytes(n_slots)


def region_cells(
    geo: Geometry, offset: Sequence[int], shape: Sequence[int]
) -> list[tuple[int, ...]]:
    """The shard-grid cells of a region, in C order (the order of its files)."""
    lo = geo.cell_of(offset)
    hi = tuple(-(-(o + s) // h) for o, s, h in zip(offset, shape, geo.shard_shape))
    if not lo:
        return [()]
    return [
        tuple(a + c for a, c in zip(lo, rel))
        for rel in np.ndindex(*(b - a for a, b in zip(lo, hi)))
    ]


def region_file_nbytes(geo: Geometry, offset: Sequence[int], shape: Sequence[int]) -> list[int]:
    """The sizes of a region's shard files, in order, before they are written."""
    return [shard_file_nbytes(geo, cell) for cell in region_cells(geo, offset, shape)]


def plan_region(
    root: Path | Draft,
    geo: Geometry,
    data: np.ndarray,
    offset: Sequence[int],
    made_dirs: set[Path] | None = None,
) -> list[ShardJob]:
    """The shard files of the region of ``geo`` at ``offset`` holding ``data``, C order of their
    shard indices, to be written into ``root`` (a draft of a store, or a directory written
    directly); in a directory, creates their directories (``made_dirs``: those made already).

    ``data`` is C-contiguous, little-endian, of the tensor's dtype; ``offset`` and the region's end
    lie on the shard grid.
    """
    dest = draft_at(root, made_dirs) if isinstance(root, Path) else root
    local = dest if isinstance(dest, DirectoryDraft) else None
    jobs: list[ShardJob] = []
    for cell in region_cells(geo, offset, data.shape):
        key = shard_key(geo.path, cell)
        target = local.local(key) if local is not None else None
        jobs.append(ShardJob(dest, target, key, geo, data, tuple(offset), cell))
    return jobs


def run_jobs(
    jobs: Sequence[ShardJob],
    pool: Executor | None,
    fsync: bool = True,
    into: Sequence[np.ndarray | None] | None = None,
    incremental: Incremental | None = None,
) -> list[FileRef]:
    """Write the shard files, concurrently with ``pool`` (the file system takes two streams faster
    than one; writev and CRC32C release the GIL). Results in the order of ``jobs``. ``into[i]``:
    where job ``i`` also leaves its file's bytes (:meth:`ShardJob.run`).

    When a job fails, the jobs not started are cancelled and those running are waited for
    before the error is raised (the pool is shared and outlives the save).

    Each file written is counted on the operation's progress meter (``storage.progress``), in
    this thread, as its result comes back: the meter is told every file's size first (a file
    hard-linked by an incremental save, ``incremental``, counts as written)."""
    dests = list(into) if into is not None else [None] * len(jobs)
    meter = current_meter()
    meter.expect(sum(j.nbytes() for j in jobs) if meter.active else 0)
    out = []
    if pool is None or len(jobs) < 2:
        for j, d in zip(jobs, dests):
            ref = j.run(fsync, d, incremental)
            meter.add(ref.size, "write")
            out.append(ref)
        return out
    futures = [pool.submit(j.run, fsync, d, incremental) for j, d in zip(jobs, dests)]
    try:
        for f in futures:
            ref = f.result()
            meter.add(ref.size, "write")
            out.append(ref)
    finally:
        # on a failure, no job may still be writing once this returns: the caller removes the
        # draft, and the buffers ``into`` are reused by the next save (the pool outlives it)
        for f in futures:
            f.cancel()
        wait(futures)
    return out


def _write_shard(
    dest: Draft,
    target: Path | None,
    key: str,
    geo: Geometry,
    data: np.ndarray,
    origin: Sequence[int],
    cell: tuple[int, ...],
    fsync: bool,
    into: np.ndarray | None = None,
    incremental: Incremental | None = None,
) -> FileRef:
    refused = False  # the fast path found the file unchanged but could not link it
    if incremental is not None and into is None and incremental.can_place(target):
        fast, refused = _link_if_unchanged(target, key, geo, data, origin, cell, incremental)
        if fast is not None:
            return fast
    if incremental is None and isinstance(dest, DirectoryDraft):
        # each chunk's CRC32C computed as its batch is written, while the chunk is in the cache
        stream = _ShardStream(geo, data, origin, cell)
        if into is not None and into.size != stream.size:
            raise CkptError(f"internal: {key} laid out {stream.size} bytes, {into.size} planned")
        dest.set(key, stream, fsync=fsync, copy_to=into)
        return FileRef(key, stream.size, stream.data_crc.crc)
    pieces: list[memoryview | bytes] = []
    data_crc = FileCrc()  # CRC32C of the chunk payloads in slot order (the manifest's crc32c)
    # the content hash, chunk by chunk right after its CRC while the chunk is in the cache
    hasher = incremental.hasher() if incremental is not None else None
    offset = 0
    if not geo.shape:  # 0-d: plain [bytes, crc32c] chunk, no shard index
        buf = byte_view(data)
        c = crc32c(buf)
        if hasher is not None:
            hasher.add(buf)
        pieces = [buf, CRC_FORMAT.pack(c)]
        data_crc.add(c, len(buf))
        offset = len(buf) + CRC_BYTES
    else:
        n_slots, slots = geo.slots(cell)
        stride = chunk_stride(geo.chunk_nbytes)
        pad = ZEROS[: stride - geo.chunk_nbytes - CRC_BYTES]
        placed = []
        for s in slots:
            buf = _chunk_buffer(geo, data, origin, s)
            c = crc32c(buf)
            if hasher is not None:
                hasher.add(buf)
            placed.append((s.slot, offset, len(buf) + CRC_BYTES))
            pieces += [buf, CRC_FORMAT.pack(c), pad] if pad else [buf, CRC_FORMAT.pack(c)]
            data_crc.add(c, len(buf))
            offset += stride
        index = encode_index(n_slots, placed)
        pieces.append(index)
        offset += len(index)
    if into is not None and into.size != offset:
        raise CkptError(f"internal: {key} laid out {offset} bytes, {into.size} planned")
    if incremental is not None and hasher is not None:
        digest = hasher.hexdigest()
        geo_key = (_dtype_name(geo), geo.shape, geo.shard_shape, geo.chunk_shape)
        linked = not refused and bool(
            incremental.place(key, geo_key, offset, data_crc.crc, digest, target)
        )
        if linked:
            if into is not None:  # the parity covers this file too: its bytes, from memory
                _gather(pieces, into)
        else:
            dest.set(key, pieces, fsync=fsync, copy_to=into)
        incremental.record(key, digest, offset, linked)
        return FileRef(key, offset, data_crc.crc)
    dest.set(key, pieces, fsync=fsync, copy_to=into)
    return FileRef(key, offset, data_crc.crc)


class _ShardStream:
    """A shard file's pieces as :func:`_write_shard` lays them out (every in-bounds chunk and its
    CRC32C, then the index), made a batch of about ``COPY_BATCH`` bytes at a time
    (``storage.files.Stream``): each chunk's CRC32C is computed just before the chunk is
    written, so the write reads it from the cache instead of memory (one pass over the data
    instead of two). ``data_crc``: the manifest's CRC32C of the chunk payloads, whole once every
    batch was made."""

    def __init__(
        self, geo: Geometry, data: np.ndarray, origin: Sequence[int], cell: tuple[int, ...]
    ) -> None:
        self.data_crc = FileCrc()
        self.pad = b""
        if not geo.shape:  # 0-d: plain [bytes, crc32c] chunk, no shard index
            self.bufs = [byte_view(data)]
            self.index = b""
        else:
            n_slots, slots = geo.slots(cell)
            stride = chunk_stride(geo.chunk_nbytes)
            self.pad = ZEROS[: stride - geo.chunk_nbytes - CRC_BYTES]
            self.bufs = [_chunk_buffer(geo, data, origin, s) for s in slots]
            placed = [
                (s.slot, k * stride, geo.chunk_nbytes + CRC_BYTES) for k, s in enumerate(slots)
            ]
            self.index = encode_index(n_slots, placed)
        self.size = sum(len(b) + CRC_BYTES + len(self.pad) for b in self.bufs) + len(self.index)

    def batches(self) -> Iterator[list[memoryview | bytes]]:
        batch: list[memoryview | bytes] = []
        n = 0
        for buf in self.bufs:
            c = crc32c(buf)
            self.data_crc.add(c, len(buf))
            batch += [buf, CRC_FORMAT.pack(c), self.pad] if self.pad else [buf, CRC_FORMAT.pack(c)]
            n += len(buf) + CRC_BYTES + len(self.pad)
            if n >= COPY_BATCH:
                yield batch
                batch, n = [], 0
        if self.index:
            batch.append(self.index)
        if batch:
            yield batch


def _link_if_unchanged(
    target: Path | None,
    key: str,
    geo: Geometry,
    data: np.ndarray,
    origin: Sequence[int],
    cell: tuple[int, ...],
    incremental: Incremental,
) -> tuple[FileRef | None, bool]:
    """An incremental save's fast path (no parity to feed): when the base has a file at
    ``key`` of this geometry and size, hash the shard's chunk payloads alone (one pass, no
    CRC32C) and, if the base's recorded hash is the same, link the base's file; its manifest
    CRC32C is the base's. None when the file is to be written (the caller then computes the
    CRC32C and the hash in its one pass: a changed file's payloads are hashed twice), with
    True when it was unchanged but the file system refused the link (not to be tried again)."""
    geo_key = (_dtype_name(geo), geo.shape, geo.shard_shape, geo.chunk_shape)
    size = shard_file_nbytes(geo, cell)
    known = incremental.candidate(key, geo_key, size)
    if known is None:
        return None, False
    hasher = incremental.hasher()
    if not geo.shape:
        hasher.add(byte_view(data))
    else:
        for s in geo.slots(cell)[1]:
            hasher.add(_chunk_buffer(geo, data, origin, s))
    digest = hasher.hexdigest()
    placed = incremental.place(key, geo_key, size, known.crc32c, digest, target)
    if placed is None:
        return None, False
    if not placed:
        return None, True
    incremental.record(key, digest, size, True)
    return FileRef(key, size, known.crc32c), False


def _dtype_name(geo: Geometry) -> str:
    return of_array(geo.dtype, geo.path).name


def _gather(pieces: Sequence[memoryview | bytes], into: np.ndarray) -> None:
    """Copy ``pieces`` back to back into ``into`` (what a write with ``copy_to`` leaves)."""
    at = 0
    for p in pieces:
        view = np.frombuffer(memoryview(p).cast("B"), dtype=np.uint8)
        into[at : at + view.size] = view
        at += view.size
