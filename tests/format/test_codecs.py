"""CRC32C and its combine, the grid choice, the shard index: properties and known answers."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfmt.checksum import combine, crc32c
from ckptfmt.errors import ChecksumError, CorruptShardError
from ckptfmt.format.shard import (
    EMPTY,
    FileCrc,
    decode_index,
    encode_index,
    index_nbytes,
)
from ckptfmt.manifest.grid import (
    cells,
    choose_grid,
    flat_range,
    grid_shape,
    is_contiguous_box,
    shard_key,
    shard_slots,
)

# --- CRC32C --------------------------------------------------------------------------------------


def test_crc32c_known_answers() -> None:
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0
    assert crc32c(b"\x00" * 32) == 0x8A9136AA  # RFC 3720 B.4
    assert crc32c(b"\xff" * 32) == 0x62A8AB43
    assert crc32c(bytes(range(32))) == 0x46DD794E
    assert crc32c(b"56789", crc32c(b"1234")) == 0xE3069283


@settings(max_examples=300, deadline=None)
@given(a=st.binary(max_size=300), b=st.binary(max_size=300))
def test_combine_equals_crc_of_concatenation(a: bytes, b: bytes) -> None:
    assert combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)


@settings(max_examples=50, deadline=None)
@given(a=st.binary(max_size=64), n=st.integers(0, 1 << 20), fill=st.integers(0, 255))
def test_combine_long_second_part(a: bytes, n: int, fill: int) -> None:
    b = bytes([fill]) * n
    assert combine(crc32c(a), crc32c(b), n) == crc32c(a + b)


@pytest.mark.parametrize("n", [1, 3, 4096, 131072, 1 << 20])
def test_combine_of_a_length_used_often_equals_crc_of_concatenation(n: int) -> None:
    """A length combined many times (a file's chunks) goes through its byte tables after the
    first few uses: every use, before and after, gives the CRC of the concatenation."""
    rng = np.random.default_rng(n)
    parts = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for _ in range(3)]
    f = FileCrc()
    for i in range(40):
        head = rng.integers(0, 256, 5, dtype=np.uint8).tobytes()
        p = parts[i % 3]
        assert combine(crc32c(head), crc32c(p), n) == crc32c(head + p)
        f.add(crc32c(p), n)
    assert f.crc == crc32c(b"".join(parts[i % 3] for i in range(40)))


@settings(max_examples=100, deadline=None)
@given(parts=st.lists(st.binary(max_size=100), max_size=8))
def test_file_crc_over_pieces(parts: list[bytes]) -> None:
    f = FileCrc()
    for p in parts:
        f.add_bytes(p)
    assert f.crc == crc32c(b"".join(parts))
    assert f.size == sum(map(len, parts))


def test_crc32c_accepts_array_memory() -> None:
    arr = np.arange(100, dtype=np.float32)
    assert crc32c(memoryview(arr).cast("B")) == crc32c(arr.tobytes())


# --- grid ----------------------------------------------------------------------------------------


def split_axis(shape: tuple[int, ...], block: tuple[int, ...]) -> int | None:
    """The axis j such that the block is one element thick before j and whole after j (a
    C-contiguous run of the array), or None."""
    for j in range(len(shape)):
        if all(b == 1 for b in block[:j]) and tuple(block[j + 1 :]) == tuple(shape[j + 1 :]):
            return j
    return None


@settings(max_examples=300, deadline=None)
@given(
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=5).map(tuple),
    itemsize=st.sampled_from([1, 2, 4, 8, 16]),
    chunk=st.integers(1, 4096),
    factor=st.integers(1, 64),
)
def test_choose_grid_invariants(
    shape: tuple[int, ...], itemsize: int, chunk: int, factor: int
) -> None:
    shard_target = chunk * factor
    shard, inner = choose_grid(shape, itemsize, chunk, shard_target)
    nd = len(shape)
    assert len(shard) == len(inner) == nd
    assert all(c >= 1 for c in inner) and all(h >= 1 for h in shard)
    assert all(h % c == 0 for h, c in zip(shard, inner)), (shard, inner)
    j = split_axis(shape, inner)
    assert j is not None, (shape, inner)
    # the shard is split on the same axis
    assert all(h == 1 for h in shard[:j]) and shard[j + 1 :] == shape[j + 1 :], (shape, shard)
    assert inner[j] <= shape[j]
    chunk_nbytes = math.prod(inner) * itemsize
    row = math.prod(shape[j + 1 :]) * itemsize  # bytes of one step along the split axis
    # inner chunks stay within the target unless one step along the split axis exceeds it
    assert chunk_nbytes <= chunk or (inner[j] == 1 and row > chunk), (shape, inner)
    # and they are not needlessly small: one more step would exceed the target or the array
    assert inner[j] == shape[j] or (inner[j] + 1) * row > chunk, (shape, inner)
    # shards hold whole chunks up to the shard target (at least one chunk), never more chunks
    # than the axis has
    per_shard = shard[j] // inner[j]
    assert per_shard == 1 or per_shard * chunk_nbytes <= shard_target
    assert per_shard <= -(-shape[j] // inner[j])
    assert is_contiguous_box(shape, (0,) * nd, inner)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 0, 7)])
def test_choose_grid_empty(shape: tuple[int, ...]) -> None:
    shard, inner = choose_grid(shape, 4, 16, 64)
    assert all(x >= 1 for x in shard + inner) and len(shard) == len(shape)


def test_choose_grid_zero_d() -> None:
    assert choose_grid((), 8, 16, 64) == ((), ())


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=4).map(tuple), data=st.data())
def test_shard_slots_cover_each_element_once(shape: tuple[int, ...], data: st.DataObject) -> None:
    inner = tuple(data.draw(st.integers(1, d + 2)) for d in shape)
    shard = tuple(c * data.draw(st.integers(1, 3)) for c in inner)
    seen = np.zeros(shape, dtype=np.int64)
    for cell in cells((0,) * len(shape), grid_shape(shape, shard)):
        n_slots, slots = shard_slots(shape, shard, inner, cell)
        assert n_slots == math.prod(h // c for h, c in zip(shard, inner))
        assert len({s.slot for s in slots}) == len(slots)
        for s in slots:
            assert all(0 <= a < b <= d for a, b, d in zip(s.box_lo, s.box_hi, shape))
            full = tuple(a + c for a, c in zip(s.box_lo, inner))
            assert s.padded == (tuple(s.box_hi) != full)
            seen[tuple(slice(a, b) for a, b in zip(s.box_lo, s.box_hi))] += 1
    assert (seen == 1).all()


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=4).map(tuple), data=st.data())
def test_flat_range_of_contiguous_boxes(shape: tuple[int, ...], data: st.DataObject) -> None:
    lo = tuple(data.draw(st.integers(0, d - 1)) for d in shape)
    hi = tuple(data.draw(st.integers(a + 1, d)) for a, d in zip(lo, shape))
    arr = np.arange(math.prod(shape)).reshape(shape)
    box = arr[tuple(slice(a, b) for a, b in zip(lo, hi))]
    flat = box.reshape(-1)
    contiguous = bool(np.all(np.diff(flat) == 1)) if flat.size > 1 else True
    assert is_contiguous_box(shape, lo, hi) == contiguous
    if contiguous:
        start, stop = flat_range(shape, lo, hi)
        assert (start, stop) == (int(flat[0]), int(flat[-1]) + 1)


def test_shard_key() -> None:
    assert shard_key("a/b", (0, 12)) == "a/b/c/0/12"
    assert shard_key("a", ()) == "a/c"


# --- shard index ---------------------------------------------------------------------------------


@st.composite
def placements(draw: st.DrawFn) -> tuple[int, list[tuple[int, int, int]], int]:
    n_slots = draw(st.integers(1, 40))
    present = draw(st.lists(st.integers(0, n_slots - 1), unique=True, max_size=n_slots))
    placed, offset = [], draw(st.integers(0, 8))
    for slot in draw(st.permutations(present)):
        nbytes = draw(st.integers(4, 64))
        placed.append((slot, offset, nbytes))
        offset += nbytes + draw(st.integers(0, 8))
    return n_slots, placed, offset


@settings(max_examples=300, deadline=None)
@given(p=placements(), slack=st.integers(0, 16))
def test_index_roundtrip(p: tuple[int, list[tuple[int, int, int]], int], slack: int) -> None:
    n_slots, placed, data_end = p
    blob = encode_index(n_slots, placed)
    assert len(blob) == index_nbytes(n_slots) == n_slots * 16 + 4
    assert struct.unpack("<I", blob[-4:])[0] == crc32c(blob[:-4])
    table = decode_index(blob, n_slots, data_end + slack + len(blob), "f")
    want = np.full((n_slots, 2), EMPTY, dtype=np.uint64)
    for slot, off, nb in placed:
        want[slot] = (off, nb)
    assert table.shape == (n_slots, 2)
    assert (table == want).all()


def index_with(entries: list[tuple[int, int]]) -> bytes:
    raw = b"".join(struct.pack("<QQ", o, n) for o, n in entries)
    return raw + struct.pack("<I", crc32c(raw))


@pytest.mark.parametrize(
    "entries,data_end",
    [
        ([(0, 20), (10, 20)], 100),  # overlap
        ([(0, 20), (0, 20)], 100),  # same chunk twice
        ([(40, 20), (0, 50)], 100),  # overlap, out of order
        ([(90, 20)], 100),  # past the data
        ([(0, 101)], 100),  # longer than the data
        ([(0, 3)], 100),  # shorter than a CRC
        ([(0, 0)], 100),  # empty
        ([(EMPTY, 20)], 100),  # half-empty entry
        ([(10, EMPTY)], 100),
        ([(EMPTY - 4, 8)], 100),  # wraps around in 64-bit arithmetic
        ([(2**63, 2**63)], 100),
    ],
)
def test_index_rejects_bad_entries(entries: list[tuple[int, int]], data_end: int) -> None:
    blob = index_with(entries)
    with pytest.raises(CorruptShardError) as info:
        decode_index(blob, len(entries), data_end + len(blob), "x/c/0")
    assert info.value.path == "x/c/0"


@settings(max_examples=200, deadline=None)
@given(p=placements(), data=st.data())
def test_index_bit_flip_is_a_checksum_error(
    p: tuple[int, list[tuple[int, int, int]], int], data: st.DataObject
) -> None:
    n_slots, placed, data_end = p
    blob = bytearray(encode_index(n_slots, placed))
    i = data.draw(st.integers(0, len(blob) - 1))
    blob[i] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises(ChecksumError):
        decode_index(bytes(blob), n_slots, data_end + len(blob), "f")
