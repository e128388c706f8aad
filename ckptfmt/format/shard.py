"""Byte layout of one shard file, as zarr v3's ``sharding_indexed`` codec defines it with the inner
codecs ``[bytes(little), crc32c]``, index codecs ``[bytes(little), crc32c]``, index at the end:

    chunk_0 bytes | crc32c(chunk_0) | chunk_1 bytes | crc | ... | index | crc32c(index)

The index holds, for every inner-chunk slot in C order, ``(offset, nbytes)`` as little-endian
uint64, where ``nbytes`` counts the chunk's bytes *and* its 4-byte CRC; an absent chunk is
``(2**64-1, 2**64-1)``. CRCs are little-endian uint32. Readers accept any placement zarr allows;
bytes of the data part that no entry covers (gaps) must be zero (``spec/FORMAT.md`` §8).

ckptfmt writes the present chunks in slot order from offset 0, each ``chunk_stride`` bytes after the
last: a chunk of 4 KiB or more is followed by its CRC and zeros up to the next multiple of 64 bytes,
so that the kernel's copy of every chunk into the page cache starts on a cache line of the file.
Back to back, each chunk starts 4 bytes further along than the last, most of them off any 16-byte
boundary, and the copy is slower: the ``writev`` loop measured 12% faster aligned
(``bench/bench_write_kernels.py``: 256 MiB of 1 MiB chunks on tmpfs, 2 threads, CRC32C included:
21.6 ms against 24.3, the same as page-aligned; in a whole level-1 save about 3%), for at most 63
bytes per chunk (60 per 1 MiB chunk). Smaller chunks stay back to back, as every chunk was before
2026-12: readers take both placements on their fast path.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence

import numpy as np

from ckptfmt.checksum import combine, crc32c
from ckptfmt.errors import ChecksumError, CorruptShardError

CRC_BYTES = 4
EMPTY = 2**64 - 1
INDEX_ENTRY_BYTES = 16
CHUNK_ALIGN = 64  # a chunk of ALIGN_FROM bytes or more starts at a multiple of this
ALIGN_FROM = 4096
ZEROS = bytes(CHUNK_ALIGN)


def chunk_stride(payload: int) -> int:
    """Bytes from the start of one inner chunk to the next in a shard file ckptfmt writes: the
    chunk's ``payload`` bytes, its CRC, and (from ``ALIGN_FROM`` bytes on) zeros up to a
    multiple of ``CHUNK_ALIGN``."""
    stored = payload + CRC_BYTES
    if payload < ALIGN_FROM:
        return stored
    return -(-stored // CHUNK_ALIGN) * CHUNK_ALIGN


def packed_strides(payload: int) -> tuple[int, ...]:
    """The uniform strides a reader's fast path takes (chunks in slot order from offset 0, each
    this many bytes after the last): ckptfmt's (:func:`chunk_stride`) and back to back (what
    ckptfmt wrote before, and what other writers write)."""
    mine = chunk_stride(payload)
    return (mine,) if mine == payload + CRC_BYTES else (mine, payload + CRC_BYTES)


def check_zeros(
    data: bytes | bytearray | memoryview | np.ndarray, file: str, at: int, tensors: Sequence[str]
) -> None:
    """Raise :class:`CorruptShardError` unless ``data`` (bytes of a shard file's data part that
    no index entry covers, read from offset ``at``) is all zeros: a flipped bit there changes no
    chunk, but it is damage to the file (and to the parity over it) all the same."""
    raw = bytes(memoryview(data).cast("B"))  # type: ignore[arg-type]
    if raw.count(0) != len(raw):
        first = at + next(i for i, b in enumerate(raw) if b)
        raise CorruptShardError(file, f"bytes between chunks are not zero (at {first})", tensors)


def padding_end(end: int, holes: dict[int, int]) -> int:
    """Where the zeros after a chunk ending at ``end`` stop: the end of the gap of ``holes``
    (start -> end, :func:`gaps`) that starts there when it is shorter than ``CHUNK_ALIGN`` (what
    ckptfmt pads with), else ``end`` itself. Readers read such zeros with the chunk and merge
    reads of chunks only across them."""
    stop = holes.get(end, end)
    return stop if stop - end < CHUNK_ALIGN else end


def gaps(table: np.ndarray, data_end: int) -> list[tuple[int, int]]:
    """The ranges ``[a, b)`` of a shard file's data part (``[0, data_end)``) that no present
    entry of the index ``table`` covers (a checked table: entries inside, none overlapping)."""
    spans = sorted((int(off), int(off) + int(nb)) for off, nb in table.tolist() if off != EMPTY)
    out, at = [], 0
    for a, b in spans:
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if data_end > at:
        out.append((at, data_end))
    return out


def index_nbytes(n_slots: int) -> int:
    """Size of the index and its CRC at the end of a shard file."""
    return n_slots * INDEX_ENTRY_BYTES + CRC_BYTES


def encode_index(n_slots: int, placed: list[tuple[int, int, int]]) -> bytes:
    """Index bytes (with CRC) for chunks placed as ``(slot, offset, nbytes)``."""
    table = np.full((n_slots, 2), EMPTY, dtype="<u8")
    for slot, offset, nbytes in placed:
        table[slot] = (offset, nbytes)
    raw = table.tobytes()
    return raw + struct.pack("<I", crc32c(raw))


def decode_index(
    blob: bytes | memoryview,
    n_slots: int,
    file_size: int,
    file: str,
    tensors: Sequence[str] = (),
) -> np.ndarray:
    """Parse and check an index read from the end of a shard file; return an ``(n, 2)`` table.

    Every present entry must lie inside the data part of the file and not overlap another.
    """
    raw = memoryview(blob)[: n_slots * INDEX_ENTRY_BYTES]
    (stored,) = struct.unpack("<I", bytes(memoryview(blob)[-CRC_BYTES:]))
    actual = crc32c(raw)
    if actual != stored:
        raise ChecksumError(file, "shard index", stored, actual, tensors)
    table = np.frombuffer(raw, dtype="<u8").reshape(n_slots, 2)
    data_end = file_size - index_nbytes(n_slots)
    spans = []
    for slot in range(n_slots):
        off, nb = int(table[slot, 0]), int(table[slot, 1])
        if off == EMPTY and nb == EMPTY:
            continue
        if nb < CRC_BYTES or off + nb > data_end:
            raise CorruptShardError(file, f"index entry {slot} points outside the data", tensors)
        spans.append((off, off + nb))
    spans.sort()
    for (_, a1), (b0, _) in itertools.pairwise(spans):
        if b0 < a1:
            raise CorruptShardError(file, "index entries overlap", tensors)
    return table


class FileCrc:
    """Running CRC32C and length of a file assembled from pieces whose CRCs are known."""

    def __init__(self) -> None:
        self.crc = 0
        self.size = 0

    def add(self, piece_crc: int, length: int) -> None:
        self.crc = combine(self.crc, piece_crc, length)
        self.size += length

    def add_bytes(self, data: bytes | memoryview) -> None:
        self.add(crc32c(data), len(data))
