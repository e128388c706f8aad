"""Byte layout of one shard file, as zarr v3's ``sharding_indexed`` codec defines it with the inner
codecs ``[bytes(little), crc32c]``, index codecs ``[bytes(little), crc32c]``, index at the end:

    chunk_0 bytes | crc32c(chunk_0) | chunk_1 bytes | crc | ... | index | crc32c(index)

The index holds, for every inner-chunk slot in C order, ``(offset, nbytes)`` as little-endian
uint64, where ``nbytes`` counts the chunk's bytes *and* its 4-byte CRC; an absent chunk is
``(2**64-1, 2**64-1)``. CRCs are little-endian uint32. ckptfmt writes the present chunks in slot
order, back to back, from offset 0; readers accept any placement zarr allows.
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
