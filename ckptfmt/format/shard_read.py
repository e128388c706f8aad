"""Reading and checking the shard files of one tensor region (``spec/FORMAT.md`` §8); the
writer and the geometry are ``shard_io``'s.

The reader has a fast path for files laid out the way ckptfmt writes them: one ``preadv`` of the
whole file straight into the destination array, then every chunk CRC and the data CRC checked.
Any other valid layout goes through :func:`decode_shard`, which reads the file into memory.
``verify_file`` checks a file in bounded memory without keeping its data.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np

from ckptfmt.checksum import crc32c
from ckptfmt.errors import (
    AllocationLimitError,
    ChecksumError,
    CorruptShardError,
    MissingFileError,
    NotRegularFileError,
    SizeMismatchError,
)
from ckptfmt.format.shard import (
    CRC_BYTES,
    EMPTY,
    FileCrc,
    check_zeros,
    decode_index,
    gaps,
    index_nbytes,
    packed_strides,
    padding_end,
)
from ckptfmt.format.shard_io import CRC_FORMAT, Geometry, byte_view, local_box
from ckptfmt.manifest.grid import ChunkSlot, flat_range, is_contiguous_box
from ckptfmt.manifest.model import FileRef
from ckptfmt.storage.files import Files, naming_checkpoint, physical_memory


@naming_checkpoint
def read_file(src: Files, ref: FileRef, tensors: Sequence[str] = ()) -> bytes:
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
    for a, b in gaps(table, len(blob) - index_nbytes(n_slots)):
        check_zeros(memoryview(blob)[a:b], file, a, tensors)
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
    (stored,) = CRC_FORMAT.unpack_from(blob, off + nb - CRC_BYTES)
    actual = crc32c(payload)
    if actual != stored:
        raise ChecksumError(file, f"chunk at offset {off}", stored, actual, tensors)
    chunk = np.frombuffer(payload, dtype=geo.dtype.newbyteorder("<")).reshape(geo.chunk_shape)
    return chunk, actual


def read_region(
    src: Files,
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
    src: Files,
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


@naming_checkpoint
def _read_shard(
    src: Files,
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
    lo, hi = local_box(s.box_lo, origin), local_box(s.box_hi, origin)
    out[tuple(slice(a, b) for a, b in zip(lo, hi))] = chunk[
        tuple(slice(0, b - a) for a, b in zip(lo, hi))
    ]


def _read_shard_fast(
    src: Files,
    geo: Geometry,
    ref: FileRef,
    cell: tuple[int, ...],
    origin: Sequence[int],
    out: np.ndarray,
    tensors: Sequence[str],
) -> bool:
    """Read a shard laid out as ckptfmt writes it directly into ``out``; False if it is not.

    Chunk by chunk from a local file (each chunk's CRC computed while it is in cache); from a
    bucket, the handle's ``read_batch`` bytes of chunks per request."""
    size = ref.size
    with src.open_exact(ref.path, ref.size, tensors) as handle:
        if 0 < size <= handle.read_batch:  # an object in a bucket: one GET of it whole
            handle.prefetch()
        index_blob = b""
        step = geo.chunk_nbytes + CRC_BYTES
        if not geo.shape:
            slots: list[ChunkSlot] = [ChunkSlot(0, (), (), False)]
        else:
            n_idx = index_nbytes(geo.n_slots)
            if size < n_idx:
                raise CorruptShardError(ref.path, "shorter than its index", tensors)
            n_slots, slots = geo.slots(cell)
            index_blob = handle.pread(n_idx, size - n_idx)
            table = decode_index(index_blob, n_slots, size, ref.path, tensors)
            packed = _uniform_stride(table, slots, geo.chunk_nbytes, size - n_idx)
            if packed is None:
                return False  # valid zarr perhaps, but not a packed layout
            step = packed
        data_crc = FileCrc()
        pad_nbytes = step - geo.chunk_nbytes - CRC_BYTES
        per_read = max(1, handle.read_batch // step)
        pos = 0
        for first in range(0, len(slots), per_read):
            batch = slots[first : first + per_read]
            views: list[memoryview] = []
            crc_bufs: list[bytearray] = []
            tmps: list[np.ndarray | None] = []
            pads = bytearray(pad_nbytes * len(batch))  # the zeros after each chunk's CRC
            for k, s in enumerate(batch):
                lo, hi = local_box(s.box_lo, origin), local_box(s.box_hi, origin)
                tmp: np.ndarray | None = None
                if not s.padded and is_contiguous_box(out.shape, lo, hi):
                    start, stop = flat_range(out.shape, lo, hi)
                    payload = byte_view(out.reshape(-1)[start:stop])
                else:
                    tmp = np.empty(geo.chunk_shape, dtype=out.dtype)
                    payload = byte_view(tmp)
                crc_bufs.append(bytearray(CRC_BYTES))
                views += [payload, memoryview(crc_bufs[-1])]
                if pad_nbytes:
                    views.append(memoryview(pads)[k * pad_nbytes : (k + 1) * pad_nbytes])
                tmps.append(tmp)
            try:
                handle.read_into(views, pos)
            except EOFError:
                raise SizeMismatchError(ref.path, ref.size, size, tensors) from None
            if pads.count(0) != len(pads):  # say which chunk's zeros are not
                for k in range(len(batch)):
                    gap = pads[k * pad_nbytes : (k + 1) * pad_nbytes]
                    check_zeros(gap, ref.path, pos + k * step + step - pad_nbytes, tensors)
            pos += len(batch) * step
            per = 3 if pad_nbytes else 2
            for k, s in enumerate(batch):
                payload = views[per * k]
                actual = crc32c(payload)
                (stored,) = CRC_FORMAT.unpack_from(crc_bufs[k], 0)
                if actual != stored:
                    raise ChecksumError(ref.path, f"chunk {s.slot}", stored, actual, tensors)
                data_crc.add(actual, len(payload))
                if tmps[k] is not None:
                    _place(tmps[k], s, origin, out)  # type: ignore[arg-type]
        _check_data_crc(data_crc.crc, ref, tensors)
        return True


def _uniform_stride(
    table: np.ndarray, slots: Sequence[ChunkSlot], payload: int, data_end: int
) -> int | None:
    """The stride of a packed layout (the present chunks in slot order from offset 0, each the
    same number of bytes after the last, one of ``shard.packed_strides``, the data part ending
    with the last), or None for any other placement."""
    nb = payload + CRC_BYTES
    for step in packed_strides(payload):
        if data_end == len(slots) * step and all(
            int(table[s.slot, 0]) == i * step and int(table[s.slot, 1]) == nb
            for i, s in enumerate(slots)
        ):
            return step
    return None


VERIFY_WINDOW = 4 << 20  # bytes read at once by verify_file, whatever a file claims


@naming_checkpoint
def verify_file(
    src: Files,
    geo: Geometry,
    ref: FileRef,
    cell: tuple[int, ...],
    tensors: Sequence[str] = (),
    window: int = VERIFY_WINDOW,
) -> int:
    """Check one stored data file in bounded memory (``verify``): its size against the manifest,
    its index (CRC, placement, every in-bounds slot present), every chunk's CRC32C and the
    file's data CRC, reading at most ``window`` bytes (and the index, at most 1 MiB) at a time;
    an object in a bucket no larger than ``window`` is fetched whole in one GET (the index and
    the chunks then come from it, not from a request each). Returns the bytes read. Raises the
    :class:`DamagedError` that :func:`decode_shard` would."""
    with src.open_exact(ref.path, ref.size, tensors) as handle:
        if 0 < ref.size <= min(handle.read_batch, window):
            handle.prefetch()  # an object that fits the window: one GET, not index then chunks
        buf = np.empty(max(1, min(window, ref.size)), np.uint8)
        crc_buf = bytearray(CRC_BYTES)
        read = 0
        holes: list[tuple[int, int]] = []  # bytes between entries: must be zero
        if not geo.shape:
            spans = [(0, ref.size)]
            if ref.size != geo.dtype.itemsize + CRC_BYTES:
                raise CorruptShardError(ref.path, f"{ref.size} bytes, not one element", tensors)
        else:
            n_idx = index_nbytes(geo.n_slots)
            if ref.size < n_idx:
                raise CorruptShardError(ref.path, "shorter than its index", tensors)
            n_slots, slots = geo.slots(cell)
            index_blob = handle.pread(n_idx, ref.size - n_idx)
            read += len(index_blob)
            if len(index_blob) != n_idx:
                raise SizeMismatchError(ref.path, ref.size, ref.size - n_idx, tensors)
            table = decode_index(index_blob, n_slots, ref.size, ref.path, tensors)
            holes = gaps(table, ref.size - n_idx)
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
        starts = dict(holes)  # start -> end of each gap
        seen: set[int] = set()  # gaps checked inside a window of chunks
        i = 0
        while i < len(spans):
            off, nb = spans[i]
            # chunks stored back to back, or apart only by a gap of zeros shorter than
            # CHUNK_ALIGN (ckptfmt's padding), that fit the window together: one read, the
            # zeros between them checked from it
            j, total = i + 1, nb
            while j < len(spans):
                end = off + total
                stop = padding_end(end, starts)
                if spans[j][0] != stop or total + (stop - end) + spans[j][1] > buf.size:
                    break
                total += (stop - end) + spans[j][1]
                j += 1
            if j > i + 1 or nb <= buf.size:
                window_view = buf[:total]
                try:
                    handle.read_into([memoryview(window_view)], off)  # type: ignore[arg-type]
                except EOFError:
                    raise SizeMismatchError(ref.path, ref.size, off, tensors) from None
                end = off
                for k in range(i, j):
                    k_off, k_nb = spans[k]
                    at = k_off - off
                    if k_off > end:
                        check_zeros(window_view[end - off : at], ref.path, end, tensors)
                        seen.add(end)
                    c = crc32c(window_view[at : at + k_nb - CRC_BYTES])
                    (stored,) = CRC_FORMAT.unpack_from(window_view.data, at + k_nb - CRC_BYTES)
                    _check_chunk_crc(c, stored, k_off, ref, tensors)
                    data_crc.add(c, k_nb - CRC_BYTES)
                    end = k_off + k_nb
                read += total
                i = j
                continue
            payload = nb - CRC_BYTES  # one chunk larger than the window: in pieces
            c = 0
            for at in range(0, payload, buf.size):
                view = buf[: min(buf.size, payload - at)]
                try:
                    handle.read_into([memoryview(view)], off + at)  # type: ignore[arg-type]
                except EOFError:
                    raise SizeMismatchError(ref.path, ref.size, off + at, tensors) from None
                c = crc32c(view, c)
            try:
                handle.read_into([memoryview(crc_buf)], off + payload)
            except EOFError:
                raise SizeMismatchError(ref.path, ref.size, off + payload, tensors) from None
            read += nb
            (stored,) = CRC_FORMAT.unpack_from(crc_buf, 0)
            _check_chunk_crc(c, stored, off, ref, tensors)
            data_crc.add(c, payload)
            i += 1
        for a, b in holes:  # the zeros not read with the chunks (after the last chunk)
            if a in seen:
                continue
            for at in range(a, b, buf.size):
                view = buf[: min(buf.size, b - at)]
                try:
                    handle.read_into([memoryview(view)], at)  # type: ignore[arg-type]
                except EOFError:
                    raise SizeMismatchError(ref.path, ref.size, at, tensors) from None
                check_zeros(view, ref.path, at, tensors)
                read += view.size
        _check_data_crc(data_crc.crc, ref, tensors)
        return read


def _check_chunk_crc(
    actual: int, stored: int, off: int, ref: FileRef, tensors: Sequence[str]
) -> None:
    if actual != stored:
        raise ChecksumError(ref.path, f"chunk at offset {off}", stored, actual, tensors)
