"""Writing and reading the shard files of one tensor region (``spec/FORMAT.md`` §8).

The writer turns a region's array into whole shard files: every in-bounds inner chunk present, in
slot order, each followed by its CRC32C, then the index. Chunks that are contiguous runs of the
array (the default grid makes all but edge chunks so) go to ``writev`` as views of the array's
own memory; the manifest's data CRC is combined from the chunk CRCs (``codecs/crc32c.py``).

The reader has a fast path for files laid out the way ckptfmt writes them: one ``preadv`` of the
whole file straight into the destination array, then every chunk CRC and the data CRC checked.
Any other valid layout goes through :func:`decode_shard`, which reads the file into memory.
"""

from __future__ import annotations

import functools
import math
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ckptfmt.checksum import crc32c
from ckptfmt.dtypes import by_name
from ckptfmt.errors import (
    AllocationLimitError,
    ChecksumError,
    CkptError,
    CorruptShardError,
    MissingFileError,
    NotRegularFileError,
    SizeMismatchError,
)
from ckptfmt.format.shard import (
    CRC_BYTES,
    EMPTY,
    FileCrc,
    decode_index,
    encode_index,
    index_nbytes,
)
from ckptfmt.manifest.grid import ChunkSlot, flat_range, is_contiguous_box, shard_key, shard_slots
from ckptfmt.manifest.model import FileRef
from ckptfmt.storage.files import Inside, make_dirs, physical_memory, read_scatter, write_gather
from ckptfmt.storage.progress import current_meter

_CRC = struct.Struct("<I")


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


def _local(box: Sequence[int], origin: Sequence[int]) -> tuple[int, ...]:
    return tuple(b - o for b, o in zip(box, origin))


def _chunk_buffer(
    geo: Geometry, data: np.ndarray, origin: Sequence[int], s: ChunkSlot
) -> memoryview:
    """The stored bytes of one inner chunk: a view of ``data`` when possible, else a padded copy."""
    lo, hi = _local(s.box_lo, origin), _local(s.box_hi, origin)
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
    """One shard file to write: where, and which part of which array goes into it."""

    target: Path
    key: str
    geo: Geometry
    data: np.ndarray
    origin: tuple[int, ...]
    cell: tuple[int, ...]

    def run(self, fsync: bool = True, into: np.ndarray | None = None) -> FileRef:
        """Write the file. ``into`` (uint8, exactly :meth:`nbytes` long): also leave the file's
        bytes there, and write them from it (the redundancy encoding then needs no read-back)."""
        return _write_shard(
            self.target, self.key, self.geo, self.data, self.origin, self.cell, fsync, into
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
    return len(slots) * (geo.chunk_nbytes + CRC_BYTES) + index_nbytes(n_slots)


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
    root: Path,
    geo: Geometry,
    data: np.ndarray,
    offset: Sequence[int],
    made_dirs: set[Path] | None = None,
) -> list[ShardJob]:
    """The shard files of the region of ``geo`` at ``offset`` holding ``data``, C order of their
    shard indices; creates their directories.

    ``data`` is C-contiguous, little-endian, of the tensor's dtype; ``offset`` and the region's end
    lie on the shard grid.
    """
    made_dirs = set() if made_dirs is None else made_dirs
    jobs: list[ShardJob] = []
    for cell in region_cells(geo, offset, data.shape):
        key = shard_key(geo.path, cell)
        target = root / key
        if target.parent not in made_dirs:
            make_dirs(target.parent)
            made_dirs.add(target.parent)
        jobs.append(ShardJob(target, key, geo, data, tuple(offset), cell))
    return jobs


def run_jobs(
    jobs: Sequence[ShardJob],
    pool: Executor | None,
    fsync: bool = True,
    into: Sequence[np.ndarray | None] | None = None,
) -> list[FileRef]:
    """Write the shard files, concurrently with ``pool`` (the file system takes two streams faster
    than one; writev and CRC32C release the GIL). Results in the order of ``jobs``. ``into[i]``:
    where job ``i`` also leaves its file's bytes (:meth:`ShardJob.run`).

    Each file written is counted on the operation's progress meter (``storage.progress``), in
    this thread, as its result comes back: the meter is told every file's size first."""
    dests = list(into) if into is not None else [None] * len(jobs)
    meter = current_meter()
    meter.expect(sum(j.nbytes() for j in jobs) if meter.active else 0)
    results: Iterator[FileRef]
    if pool is None or len(jobs) < 2:
        results = (j.run(fsync, d) for j, d in zip(jobs, dests))
    else:
        results = pool.map(lambda jd: jd[0].run(fsync, jd[1]), zip(jobs, dests))
    out = []
    for ref in results:
        meter.add(ref.size, "write")
        out.append(ref)
    return out


def _write_shard(
    target: Path,
    key: str,
    geo: Geometry,
    data: np.ndarray,
    origin: Sequence[int],
    cell: tuple[int, ...],
    fsync: bool,
    into: np.ndarray | None = None,
) -> FileRef:
    pieces: list[memoryview | bytes] = []
    data_crc = FileCrc()  # CRC32C of the chunk payloads in slot order (the manifest's crc32c)
    offset = 0
    if not geo.shape:  # 0-d: plain [bytes, crc32c] chunk, no shard index
        buf = byte_view(data)
        c = crc32c(buf)
        pieces = [buf, _CRC.pack(c)]
        data_crc.add(c, len(buf))
        offset = len(buf) + CRC_BYTES
    else:
        n_slots, slots = geo.slots(cell)
        placed = []
        for s in slots:
            buf = _chunk_buffer(geo, data, origin, s)
            c = crc32c(buf)
            placed.append((s.slot, offset, len(buf) + CRC_BYTES))
            pieces += [buf, _CRC.pack(c)]
            data_crc.add(c, len(buf))
            offset += len(buf) + CRC_BYTES
        index = encode_index(n_slots, placed)
        pieces.append(index)
        offset += len(index)
    if into is not None and into.size != offset:
        raise CkptError(f"internal: {key} laid out {offset} bytes, {into.size} planned")
    write_gather(target, pieces, fsync, copy_to=into)
    return FileRef(key, offset, data_crc.crc)


# --- reading -------------------------------------------------------------------------------------


def read_file(src: Inside, ref: FileRef, tensors: Sequence[str] = ()) -> bytes:
    """Read a whole stored file and check its size (its checksums: :func:`decode_shard`). A
    file larger than the memory this process may use is refused before anything is allocated
    (:class:`AllocationLimitError`): a manifest may claim a huge file over a sparse one."""
    limit = physical_memory()
    if limit and ref.size > limit:
        raise AllocationLimitError(", ".join(tensors) or ref.path, ref.size, limit)
    try:
        blob = src.read(ref.path, ref.size + 1)
    except NotRegularFileError as exc:
        raise NotRegularFileError(ref.path, exc.what, tensors) from None
    except FileNotFoundError:
        raise MissingFileError(ref.path, tensors) from None
    if len(blob) != ref.size:
        raise SizeMismatchError(ref.path, ref.size, len(blob), tensors)
    return blob


def decode_shard(
    blob: bytes, geo: Geometry, cell: tuple[int, ...], ref: FileRef, tensors: Sequence[str] = ()
) -> list[tuple[ChunkSlot, np.ndarray]]:
    """Check every CRC in a shard file's bytes (each chunk's, the index's, and the manifest's
    CRC of all chunk payloads); return each in-bounds chunk at full chunk shape."""
    file = ref.path
    data_crc = FileCrc()
    if not geo.shape:
        chunk, c = _check_chunk(blob, 0, len(blob), geo, file, tensors)
        data_crc.add(c, len(blob) - CRC_BYTES)
        _check_data_crc(data_crc.crc, ref, tensors)
        return [(ChunkSlot(0, (), (), False), chunk)]
    if len(blob) < index_nbytes(geo.n_slots):
        raise CorruptShardError(file, "shorter than its index", tensors)
    n_slots, slots = geo.slots(cell)
    table = decode_index(
        memoryview(blob)[-index_nbytes(n_slots) :], n_slots, len(blob), file, tensors
    )
    out = []
    for s in slots:
        off, nb = int(table[s.slot, 0]), int(table[s.slot, 1])
        if off == EMPTY:
            raise CorruptShardError(file, f"inner chunk {s.slot} is missing", tensors)
        chunk, c = _check_chunk(blob, off, nb, geo, file, tensors)
        data_crc.add(c, nb - CRC_BYTES)
        out.append((s, chunk))
    _check_data_crc(data_crc.crc, ref, tensors)
    return out


def _check_data_crc(actual: int, ref: FileRef, tensors: Sequence[str]) -> None:
    if actual != ref.crc32c:
        raise ChecksumError(ref.path, "data (all chunks)", ref.crc32c, actual, tensors)


def _check_chunk(
    blob: bytes, off: int, nb: int, geo: Geometry, file: str, tensors: Sequence[str]
) -> tuple[np.ndarray, int]:
    if nb != geo.chunk_nbytes + CRC_BYTES:
        raise CorruptShardError(
            file,
            f"chunk at {off} has {nb} bytes, expected {geo.chunk_nbytes + CRC_BYTES}",
            tensors,
        )
    payload = memoryview(blob)[off : off + nb - CRC_BYTES]
    (stored,) = _CRC.unpack_from(blob, off + nb - CRC_BYTES)
    actual = crc32c(payload)
    if actual != stored:
        raise ChecksumError(file, f"chunk at offset {off}", stored, actual, tensors)
    chunk = np.frombuffer(payload, dtype=geo.dtype.newbyteorder("<")).reshape(geo.chunk_shape)
    return chunk, actual


def read_region(
    src: Inside,
    geo: Geometry,
    files: Sequence[FileRef],
    offset: Sequence[int],
    out: np.ndarray,
    tensors: Sequence[str] = (),
) -> None:
    """Fill ``out`` (the region at ``offset``, C-contiguous) from its shard files, verifying every
    chunk CRC and every file's size and data CRC."""
    for job in region_reads(src, geo, files, offset, out, tensors):
        job()


def region_reads(
    src: Inside,
    geo: Geometry,
    files: Sequence[FileRef],
    offset: Sequence[int],
    out: np.ndarray,
    tensors: Sequence[str] = (),
) -> list[Callable[[], None]]:
    """One job per shard file of a region (see :func:`read_region`); independent of each other,
    so a caller may run them concurrently (preadv and CRC32C release the GIL)."""
    lo = geo.cell_of(offset)
    hi = tuple(-(-(o + s) // h) for o, s, h in zip(offset, out.shape, geo.shard_shape))
    cell_iter = np.ndindex(*(b - a for a, b in zip(lo, hi))) if lo else iter([()])
    jobs: list[Callable[[], None]] = []
    for ref, rel in zip(files, cell_iter):
        cell = tuple(a + c for a, c in zip(lo, rel))
        jobs.append(
            functools.partial(_read_shard, src, geo, ref, cell, tuple(offset), out, tuple(tensors))
        )
    return jobs


def _read_shard(
    src: Inside,
    geo: Geometry,
    ref: FileRef,
    cell: tuple[int, ...],
    origin: tuple[int, ...],
    out: np.ndarray,
    tensors: tuple[str, ...],
) -> None:
    if not _read_shard_fast(src, geo, ref, cell, origin, out, tensors):
        blob = read_file(src, ref, tensors)
        for s, chunk in decode_shard(blob, geo, cell, ref, tensors):
            _place(chunk, s, origin, out)


def _place(chunk: np.ndarray, s: ChunkSlot, origin: Sequence[int], out: np.ndarray) -> None:
    lo, hi = _local(s.box_lo, origin), _local(s.box_hi, origin)
    out[tuple(slice(a, b) for a, b in zip(lo, hi))] = chunk[
        tuple(slice(0, b - a) for a, b in zip(lo, hi))
    ]


def _read_shard_fast(
    src: Inside,
    geo: Geometry,
    ref: FileRef,
    cell: tuple[int, ...],
    origin: Sequence[int],
    out: np.ndarray,
    tensors: Sequence[str],
) -> bool:
    """Read a shard laid out as ckptfmt writes it directly into ``out``; False if it is not."""
    fd = src.open_exact(ref.path, ref.size, tensors)
    size = ref.size
    try:
        index_blob = b""
        if not geo.shape:
            slots: list[ChunkSlot] = [ChunkSlot(0, (), (), False)]
        else:
            n_idx = index_nbytes(geo.n_slots)
            if size < n_idx:
                raise CorruptShardError(ref.path, "shorter than its index", tensors)
            n_slots, slots = geo.slots(cell)
            index_blob = os.pread(fd, n_idx, size - n_idx)
            table = decode_index(index_blob, n_slots, size, ref.path, tensors)
            step = geo.chunk_nbytes + CRC_BYTES
            for i, s in enumerate(slots):
                if int(table[s.slot, 0]) != i * step or int(table[s.slot, 1]) != step:
                    return False  # valid zarr perhaps, but not our packed layout
            if size != len(slots) * step + n_idx:
                return False
        data_crc = FileCrc()
        crc_buf = bytearray(CRC_BYTES)
        pos = 0
        for s in slots:  # chunk by chunk: its CRC is computed while it is still in cache
            lo, hi = _local(s.box_lo, origin), _local(s.box_hi, origin)
            tmp: np.ndarray | None = None
            if not s.padded and is_contiguous_box(out.shape, lo, hi):
                start, stop = flat_range(out.shape, lo, hi)
                payload = byte_view(out.reshape(-1)[start:stop])
            else:
                tmp = np.empty(geo.chunk_shape, dtype=out.dtype)
                payload = byte_view(tmp)
            try:
                read_scatter(fd, [payload, memoryview(crc_buf)], pos)
            except EOFError:
                raise SizeMismatchError(ref.path, ref.size, size, tensors) from None
            pos += len(payload) + CRC_BYTES
            actual = crc32c(payload)
            (stored,) = _CRC.unpack_from(crc_buf, 0)
            if actual != stored:
                raise ChecksumError(ref.path, f"chunk {s.slot}", stored, actual, tensors)
            data_crc.add(actual, len(payload))
            if tmp is not None:
                _place(tmp, s, origin, out)
        _check_data_crc(data_crc.crc, ref, tensors)
        return True
    finally:
        os.close(fd)


VERIFY_WINDOW = 4 << 20  # bytes read at once by verify_file, whatever a file claims


def verify_file(
    src: Inside,
    geo: Geometry,
    ref: FileRef,
    cell: tuple[int, ...],
    tensors: Sequence[str] = (),
    window: int = VERIFY_WINDOW,
) -> int:
    """Check one stored data file in bounded memory (``verify``): its size against the manifest,
    its index (CRC, placement, every in-bounds slot present), every chunk's CRC32C and the
    file's data CRC, reading at most ``window`` bytes (and the index, at most 1 MiB) at a time.
    Returns the bytes read. Raises the :class:`DamagedError` that :func:`decode_shard` would."""
    fd = src.open_exact(ref.path, ref.size, tensors)
    try:
        buf = np.empty(max(1, min(window, ref.size)), np.uint8)
        crc_buf = bytearray(CRC_BYTES)
        read = 0
        if not geo.shape:
            spans = [(0, ref.size)]
            if ref.size != geo.dtype.itemsize + CRC_BYTES:
                raise CorruptShardError(ref.path, f"{ref.size} bytes, not one element", tensors)
        else:
            n_idx = index_nbytes(geo.n_slots)
            if ref.size < n_idx:
                raise CorruptShardError(ref.path, "shorter than its index", tensors)
            n_slots, slots = geo.slots(cell)
            index_blob = os.pread(fd, n_idx, ref.size - n_idx)
            read += len(index_blob)
            if len(index_blob) != n_idx:
                raise SizeMismatchError(ref.path, ref.size, ref.size - n_idx, tensors)
            table = decode_index(index_blob, n_slots, ref.size, ref.path, tensors)
            spans = []
            for s in slots:
                off, nb = int(table[s.slot, 0]), int(table[s.slot, 1])
                if off == EMPTY:
                    raise CorruptShardError(ref.path, f"inner chunk {s.slot} is missing", tensors)
                if nb != geo.chunk_nbytes + CRC_BYTES:
                    raise CorruptShardError(
                        ref.path,
                        f"chunk at {off} has {nb} bytes, expected {geo.chunk_nbytes + CRC_BYTES}",
                        tensors,
                    )
                spans.append((off, nb))
        data_crc = FileCrc()
        for off, nb in spans:
            payload = nb - CRC_BYTES
            c = 0
            for at in range(0, payload, buf.size):
                view = buf[: min(buf.size, payload - at)]
                try:
                    read_scatter(fd, [memoryview(view)], off + at)  # type: ignore[arg-type]
                except EOFError:
                    raise SizeMismatchError(ref.path, ref.size, off + at, tensors) from None
                c = crc32c(view, c)
            try:
                read_scatter(fd, [memoryview(crc_buf)], off + payload)
            except EOFError:
                raise SizeMismatchError(ref.path, ref.size, off + payload, tensors) from None
            read += nb
            (stored,) = _CRC.unpack_from(crc_buf, 0)
            if c != stored:
                raise ChecksumError(ref.path, f"chunk at offset {off}", stored, c, tensors)
            data_crc.add(c, payload)
        _check_data_crc(data_crc.crc, ref, tensors)
        return read
    finally:
        os.close(fd)
