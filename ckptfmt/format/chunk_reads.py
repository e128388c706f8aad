"""Reading some inner chunks of a shard file, each verified (the reader of a reshard plan).

:func:`read_chunks` opens one shard file, checks its size against the manifest, reads and checks
its index (CRC and placement, ``spec/FORMAT.md`` §8), then reads the requested chunks, coalescing
chunks that lie back to back into one ``preadv`` straight into the caller's buffers, and checks
each chunk's CRC32C. When the request covers every in-bounds chunk of the file, the file's data
CRC (§10) is checked as well. Nothing else of the file is read.

:func:`record_reads` counts what is read (files, chunks, bytes, and which chunks of which file),
so that tests and benchmarks can check that a rank read only what it needed.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ckptfmt.checksum import crc32c
from ckptfmt.errors import ChecksumError, CorruptShardError, SizeMismatchError
from ckptfmt.format.shard import (
    CRC_BYTES,
    EMPTY,
    FileCrc,
    check_zeros,
    decode_index,
    gaps,
    index_nbytes,
    padding_end,
)
from ckptfmt.format.shard_io import Geometry
from ckptfmt.manifest.model import FileRef
from ckptfmt.storage.files import Files, naming_checkpoint

_BATCH = 2 << 20  # bytes per coalesced read


@dataclass
class ReadLog:
    """What :func:`read_chunks` read while recording: totals (``bytes`` counts the index and the
    chunks with their CRCs) and each read."""

    files: int = 0
    chunks: int = 0
    bytes: int = 0
    reads: list[tuple[str, str, str, tuple[int, ...]]] = field(default_factory=list)
    """``(thread name, checkpoint root, file, slots)`` of each read."""


_lock = threading.Lock()
_logs: list[ReadLog] = []


@contextlib.contextmanager
def record_reads() -> Iterator[ReadLog]:
    """Record every :func:`read_chunks` of this process (all threads) while in the block."""
    log = ReadLog()
    with _lock:
        _logs.append(log)
    try:
        yield log
    finally:
        with _lock:
            _logs.remove(log)


def _note(root: os.PathLike[str] | str, path: str, slots: Sequence[int], nbytes: int) -> None:
    if not _logs:
        return
    entry = (threading.current_thread().name, str(root), path, tuple(slots))
    with _lock:
        for log in _logs:
            log.files += 1
            log.chunks += len(slots)
            log.bytes += nbytes
            log.reads.append(entry)


@naming_checkpoint
def read_chunks(
    src: Files,
    geo: Geometry,
    ref: FileRef,
    cell: tuple[int, ...],
    slots: Sequence[int],
    targets: Sequence[memoryview],
    whole: bool,
    tensors: Sequence[str] = (),
) -> list[int]:
    """Fill ``targets[i]`` (a writable byte view of one chunk's payload, ``geo.chunk_nbytes``
    bytes) with inner chunk ``slots[i]`` (ascending) of the shard file ``ref`` at grid ``cell``,
    every chunk's CRC32C checked; with ``whole`` (``slots`` are all in-bounds chunks) the file's
    data CRC too. Returns the chunks' CRC32Cs (so that a caller reading a file in several parts
    can check its data CRC once it has every chunk). Raises a
    :class:`~ckptfmt.errors.DamagedError` naming the checkpoint and the file.

    A handle whose ``checked`` attribute is True serves bytes this process has already checked
    against every CRC of the file as it read them from storage (``engine.member_files``: a
    restore's member data, read and checked once for the rebuild): their chunk CRCs are taken
    as stored instead of being computed again; the index's CRC and the file's data CRC against
    the manifest are still checked."""
    size = ref.size
    with src.open_exact(ref.path, ref.size, tensors) as handle:
        nb = geo.chunk_nbytes + CRC_BYTES
        batch = max(_BATCH, handle.read_batch)
        checked = getattr(handle, "checked", False) is True
        if 0 < size <= handle.read_batch and 2 * len(slots) * nb >= size:
            # an object in a bucket read mostly: one GET of it whole, not the index's and then
            # the chunks' (each request a round trip); every check below runs as before, on
            # copies out of memory as small as a local file's reads (each CRC'd while cached)
            handle.prefetch()
            batch = _BATCH
        holes: dict[int, int] = {}  # start -> end of the bytes no entry covers (zeros)
        if not geo.shape:  # 0-d: the element and its CRC, no index
            spans = [(0, nb)]
            index_read = 0
        else:
            n_idx = index_nbytes(geo.n_slots)
            if size < n_idx:
                raise CorruptShardError(ref.path, "shorter than its index", tensors)
            table = decode_index(
                handle.pread(n_idx, size - n_idx), geo.n_slots, size, ref.path, tensors
            )
            index_read = n_idx
            spans = []
            for s in slots:
                off, n = int(table[s, 0]), int(table[s, 1])
                if off == EMPTY:
                    raise CorruptShardError(ref.path, f"inner chunk {s} is missing", tensors)
                if n != nb:
                    raise CorruptShardError(
                        ref.path, f"chunk at {off} has {n} bytes, expected {nb}", tensors
                    )
                spans.append((off, n))
            holes = dict(gaps(table, size - n_idx))
        stored = bytearray(CRC_BYTES * len(slots))  # each chunk's CRC, read beside it
        crc_views = [
            memoryview(stored)[k * CRC_BYTES : (k + 1) * CRC_BYTES] for k in range(len(slots))
        ]
        data_crc = FileCrc()
        got: list[int] = []
        i = 0
        while i < len(spans):
            # chunks stored back to back (or apart only by the zeros ckptfmt pads them with) go
            # in one read, up to a batch that stays in cache while its CRCs are computed (or,
            # from a bucket, one request's worth); the zeros after each chunk read are read
            # beside it and checked (another chunk between two asked for is never merged)
            j = i + 1
            while (
                j < len(spans)
                and padding_end(spans[j - 1][0] + nb, holes) == spans[j][0]
                and (j - i) * nb < batch
            ):
                j += 1
            bufs: list[memoryview] = []
            pads: list[tuple[int, memoryview]] = []
            for k in range(i, j):
                bufs += (targets[k], crc_views[k])
                end = spans[k][0] + nb
                if padding_end(end, holes) > end:
                    pad = memoryview(bytearray(holes[end] - end))
                    bufs.append(pad)
                    pads.append((end, pad))
            try:
                handle.read_into(bufs, spans[i][0])
            except EOFError:
                raise SizeMismatchError(ref.path, ref.size, size, tensors) from None
            for at, pad in pads:
                check_zeros(pad, ref.path, at, tensors)
            want = struct.unpack_from(f"<{j - i}I", stored, i * CRC_BYTES)
            # bytes this process already checked against these CRCs as it read them from
            # storage (a restore's member buffer) are not checked twice; the file's data CRC
            # below still holds their stored CRCs to the manifest's
            actual = list(want) if checked else [crc32c(targets[k]) for k in range(i, j)]
            if actual != list(want):
                k = next(k for k in range(j - i) if actual[k] != want[k])
                raise ChecksumError(ref.path, f"chunk {slots[i + k]}", want[k], actual[k], tensors)
            for k, c in enumerate(actual):
                data_crc.add(c, len(targets[i + k]))
            got += actual
            i = j
        if whole and data_crc.crc != ref.crc32c:
            raise ChecksumError(ref.path, "data (all chunks)", ref.crc32c, data_crc.crc, tensors)
        _note(src.root, ref.path, slots, index_read + len(spans) * nb)
        return got
