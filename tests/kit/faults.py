"""Damage on purpose: bit flips in a file in place, or in bytes in memory."""

from __future__ import annotations

from pathlib import Path


def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    """Flip one bit of a file in place; a negative offset counts from the end."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def flip(path: Path, byte: int = 3, mask: int = 0x20) -> None:
    """XOR ``mask`` into byte ``byte`` of a file in place (by default a bit near its start,
    inside the first chunk of a data file and inside a manifest's text)."""
    data = bytearray(path.read_bytes())
    data[byte] ^= mask
    path.write_bytes(bytes(data))


def flipped(data: bytes, bit: int) -> bytes:
    """``data`` with bit ``bit`` (counted over the whole buffer, low bit of byte 0 first)
    flipped."""
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)
