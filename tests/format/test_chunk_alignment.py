"""Inner chunks of 4 KiB or more start at multiples of 64 bytes in the shard files ckptfmt
writes (``format/shard.py``: ``chunk_stride``; ``spec/FORMAT.md`` §8): each chunk's CRC is
followed by zeros up to the next chunk. These tests hold the layout (offsets, zeros, sizes known
before writing), that zarr-python and TensorStore read it as they read any zarr v3 shard, that
ckptfmt's readers still read files of the back-to-back layout on their fast path, and that a
bit flipped in the zeros is damage found by every reader and by ``verify``, and rebuilt from
parity bit-exact on level 1."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit.arrays import raw_bytes
from kit.faults import flip_bit
from kit.files import tree
from kit.zarr_reader import zarr_read

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.container.metadata import ManifestMeta
from ckptfmt.errors import CkptError, CorruptShardError
from ckptfmt.format.chunk_reads import read_chunks
from ckptfmt.format.shard import (
    CHUNK_ALIGN,
    CRC_BYTES,
    chunk_stride,
    decode_index,
    encode_index,
    index_nbytes,
)
from ckptfmt.format.shard_io import Geometry, shard_file_nbytes
from ckptfmt.format.shard_read import _read_shard_fast, decode_shard, read_file
from ckptfmt.maintenance.repair import rebuild
from ckptfmt.parallel.collective.save import save_collective
from ckptfmt.redundancy.config import Redundancy
from ckptfmt.storage.files import Inside
from ckptfmt.transport.threads import run_threads

WRITE = WriteOptions(fsync=False, chunk_bytes=5000, shard_bytes=40000)


def state() -> dict[str, Any]:
    rng = np.random.default_rng(64)
    return {
        "w": rng.standard_normal((97, 53)).astype(np.float32),  # edge chunks padded
        "b": rng.integers(-100, 100, 30001).astype(np.int8),
        "small": rng.standard_normal(40).astype(np.float32),  # one chunk under 4 KiB
    }


def geometries(root: Path) -> dict[str, tuple[Geometry, Any]]:
    m = ckptfmt.open(root).manifest
    return {
        t.path: (Geometry.of(t.path, t.dtype, t.shape, t.shard_shape, t.chunk_shape), t)
        for t in m.tensors()
    }


def files_of(root: Path) -> list[tuple[Geometry, Any, tuple[int, ...]]]:
    """(geometry, file ref, grid cell) of every data file."""
    out = []
    for geo, t in geometries(root).values():
        for r in t.regions:
            lo = geo.cell_of(r.offset)
            hi = tuple(-(-(o + s) // h) for o, s, h in zip(r.offset, r.shape, geo.shard_shape))
            for ref, rel in zip(r.files, np.ndindex(*(b - a for a, b in zip(lo, hi)))):
                out.append((geo, ref, tuple(a + c for a, c in zip(lo, rel))))
    return out


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    root = tmp_path / "c"
    ckptfmt.save(state(), root, write=WRITE)
    return root


def test_chunks_start_at_multiples_of_64_with_zeros_between(saved: Path) -> None:
    padded = 0
    for geo, ref, cell in files_of(saved):
        blob = (saved / ref.path).read_bytes()
        assert len(blob) == ref.size == shard_file_nbytes(geo, cell)  # known before writing
        n_slots, slots = geo.slots(cell)
        table = decode_index(blob[-index_nbytes(n_slots) :], n_slots, len(blob), ref.path)
        stride = chunk_stride(geo.chunk_nbytes)
        for k, s in enumerate(slots):
            off, nb = int(table[s.slot, 0]), int(table[s.slot, 1])
            assert (off, nb) == (k * stride, geo.chunk_nbytes + CRC_BYTES)
            if geo.chunk_nbytes >= 4096:
                assert off % CHUNK_ALIGN == 0
                gap = blob[off + nb : off + stride]
                assert len(gap) == stride - nb > 0 and not any(gap)
                padded += 1
            else:
                assert stride == nb  # small chunks stay back to back
        assert len(slots) * stride + index_nbytes(n_slots) == len(blob)
    assert padded > 10


def test_ckptfmt_zarr_python_and_tensorstore_read_it(saved: Path, tmp_path: Path) -> None:
    want = state()
    src = Inside(saved)
    for geo, ref, cell in files_of(saved):  # ckptfmt's own layout reads on the fast path
        origin = tuple(c * h for c, h in zip(cell, geo.shard_shape))
        extent = tuple(min(h, s - o) for h, s, o in zip(geo.shard_shape, geo.shape, origin))
        assert _read_shard_fast(src, geo, ref, cell, origin, np.empty(extent, geo.dtype), ())
    got = ckptfmt.load(saved)
    for name, arr in want.items():
        assert raw_bytes(np.asarray(got[name])) == raw_bytes(arr), name
    assert ckptfmt.verify(saved).healthy
    zarr = zarr_read(tmp_path, saved)
    for name, arr in want.items():
        assert zarr[name]["sha256"] == hashlib.sha256(raw_bytes(arr)).hexdigest(), name
    ts = pytest.importorskip("tensorstore")
    for name, arr in want.items():
        store = ts.open(
            {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(saved / name)}},
            read=True,
        ).result()
        assert raw_bytes(np.asarray(store.read().result())) == raw_bytes(arr), name


def _repack_back_to_back(root: Path) -> None:
    """Rewrite every data file with its chunks back to back (the placement of ckptfmt's writer
    before the padding, and of other writers), the same chunks and CRCs."""
    for geo, ref, cell in files_of(root):
        path = root / ref.path
        blob = path.read_bytes()
        n_slots, slots = geo.slots(cell)
        table = decode_index(blob[-index_nbytes(n_slots) :], n_slots, len(blob), ref.path)
        nb = geo.chunk_nbytes + CRC_BYTES
        parts, placed = [], []
        for k, s in enumerate(slots):
            off = int(table[s.slot, 0])
            parts.append(blob[off : off + nb])
            placed.append((s.slot, k * nb, nb))
        path.write_bytes(b"".join(parts) + encode_index(n_slots, placed))


def test_the_back_to_back_layout_reads_on_the_fast_path(saved: Path) -> None:
    _repack_back_to_back(saved)
    src = Inside(saved)
    for geo, ref, cell in files_of(saved):
        size = (saved / ref.path).stat().st_size
        assert size < ref.size or geo.chunk_nbytes < 4096
        origin = tuple(c * h for c, h in zip(cell, geo.shard_shape))
        extent = tuple(min(h, s - o) for h, s, o in zip(geo.shard_shape, geo.shape, origin))
        out = np.empty(extent, geo.dtype)
        back_to_back = type(ref)(ref.path, size, ref.crc32c)  # what its manifest would say
        assert _read_shard_fast(src, geo, back_to_back, cell, origin, out, ())  # not the slow path
        box = tuple(slice(o, o + n) for o, n in zip(origin, out.shape))
        assert raw_bytes(out) == raw_bytes(state()[geo.path][box])


def _a_gap(root: Path) -> tuple[Path, int]:
    """A padded file and the offset of a zero byte between two of its chunks."""
    for geo, ref, cell in files_of(root):
        here = (root / ref.path).is_file()  # a level-1 node holds its own ranks' files
        if here and geo.chunk_nbytes >= 4096 and len(geo.slots(cell)[1]) >= 2:
            return root / ref.path, geo.chunk_nbytes + CRC_BYTES + 7
    raise AssertionError("no padded file with two chunks")


def _the_last_gap(root: Path) -> tuple[Path, int]:
    """A padded file and the offset of the zero byte just before its index."""
    for geo, ref, _ in files_of(root):
        if geo.chunk_nbytes >= 4096:
            return root / ref.path, ref.size - index_nbytes(geo.n_slots) - 1
    raise AssertionError("no padded file")


@pytest.mark.parametrize("where", [_a_gap, _the_last_gap])
def test_a_flip_in_the_zeros_is_damage_to_every_reader(saved: Path, where: Any) -> None:
    path, at = where(saved)
    flip_bit(path, at, 5)
    rel = path.relative_to(saved).as_posix()
    with pytest.raises(CkptError, match="not zero"):
        ckptfmt.load(saved)
    report = ckptfmt.verify(saved)
    assert not report.healthy and rel in str(report.problems) and "not zero" in str(report.problems)
    geo, ref, cell = next(f for f in files_of(saved) if f[1].path == rel)
    src = Inside(saved)
    with pytest.raises(CorruptShardError, match="not zero"):  # the generic decoder too
        decode_shard(read_file(src, ref), geo, cell, ref)
    _, slots = geo.slots(cell)
    targets = [memoryview(bytearray(geo.chunk_nbytes)) for _ in slots]
    with pytest.raises(CorruptShardError, match="not zero"):  # the reshard's chunk reader
        read_chunks(src, geo, ref, cell, [s.slot for s in slots], targets, whole=True)


def test_level1_rebuilds_a_flip_in_the_zeros_bit_exact(tmp_path: Path) -> None:
    base = tmp_path / "l1"
    nodes = ["n0", "n1"]
    red = Redundancy.of({"scheme": "xor", "set_size": 2})

    def body(comm: Any) -> None:
        rows = 64
        rng = np.random.default_rng(comm.rank)
        mine = rng.standard_normal((rows, 300)).astype(np.float32)
        save_collective(
            comm,
            {"w": ckptfmt.Shard(mine, (comm.rank * rows, 0), (2 * rows, 300))},
            base / nodes[comm.rank],
            step=3,
            node=nodes[comm.rank],
            redundancy=red,
            write=WriteOptions(fsync=False, chunk_bytes=6000, shard_bytes=24000, threads=1),
            meta=ManifestMeta(levels={"1": {}}),
        )

    run_threads(2, body)
    template = str(base / "{node}")
    healthy = {k: v[0] for k, v in tree(base).items()}
    path, at = _a_gap(base / "n1")
    flip_bit(path, at, 0)
    assert not ckptfmt.verify(template).healthy
    rebuild(template, write=WriteOptions(fsync=False))
    assert {k: v[0] for k, v in tree(base).items()} == healthy
    assert ckptfmt.verify(template).healthy


def _one_file(root: Path, name: str) -> tuple[Geometry, Any, tuple[int, ...]]:
    return next(f for f in files_of(root) if f[0].path == name)


def test_a_partial_read_skipping_small_chunks(tmp_path: Path) -> None:
    """Chunks of under 64 bytes lie back to back: a read of slots 0 and 2 must not take the
    chunk between them for padding."""
    root = tmp_path / "c"
    x = np.arange(64, dtype=np.float32)
    ckptfmt.save({"x": x}, root, write=WriteOptions(fsync=False, chunk_bytes=16, shard_bytes=128))
    geo, ref, cell = _one_file(root, "x")
    targets = [memoryview(bytearray(geo.chunk_nbytes)) for _ in range(2)]
    read_chunks(Inside(root), geo, ref, cell, [0, 2], targets, whole=False)
    assert bytes(targets[0]) == x[0:4].tobytes() and bytes(targets[1]) == x[8:12].tobytes()


@pytest.mark.parametrize("small", [False, True])
def test_chunks_out_of_slot_order_are_valid(saved: Path, tmp_path: Path, small: bool) -> None:
    """Any placement zarr allows reads, and verifies: two chunks' places swapped in the file
    (small chunks lie back to back: the one moved before its slot is no gap)."""
    if small:
        saved = tmp_path / "small"
        x = np.arange(64, dtype=np.float32)
        ckptfmt.save({"w": x}, saved, write=WriteOptions(fsync=False, chunk_bytes=16))
        want = x
    geo, ref, cell = next(f for f in files_of(saved) if len(f[0].slots(f[2])[1]) >= 3)
    if not small:
        want = state()[geo.path]
    path = saved / ref.path
    blob = bytearray(path.read_bytes())
    n_slots, slots = geo.slots(cell)
    table = decode_index(bytes(blob[-index_nbytes(n_slots) :]), n_slots, len(blob), ref.path)
    a, b = slots[1].slot, slots[2].slot
    (oa, nb), (ob, _) = (int(x) for x in table[a]), (int(x) for x in table[b])
    blob[oa : oa + nb], blob[ob : ob + nb] = blob[ob : ob + nb], blob[oa : oa + nb]
    placed = [(s.slot, int(table[s.slot, 0]), nb) for s in slots]
    placed = [(s, {oa: ob, ob: oa}.get(o, o), n) for s, o, n in placed]
    path.write_bytes(bytes(blob[: -index_nbytes(n_slots)]) + encode_index(n_slots, placed))
    assert ckptfmt.verify(saved).healthy
    got = ckptfmt.load(saved)
    assert raw_bytes(np.asarray(got[geo.path])) == raw_bytes(want)
    targets = [memoryview(bytearray(geo.chunk_nbytes)) for _ in slots]
    read_chunks(Inside(saved), geo, ref, cell, [s.slot for s in slots], targets, whole=True)


def test_every_gap_of_a_large_file_is_checked_by_the_chunk_reader(tmp_path: Path) -> None:
    """The zeros after every chunk, batch boundaries of the coalesced reads included."""
    root = tmp_path / "c"
    row = (1 << 20) + 2  # chunks of a row: two per coalesced read of the chunk reader (2 MiB)
    w = np.random.default_rng(3).integers(0, 255, (5, row), dtype=np.uint8)
    write = WriteOptions(fsync=False, chunk_bytes=row, shard_bytes=5 * row)
    ckptfmt.save({"w": w}, root, write=write)
    geo, ref, cell = _one_file(root, "w")
    _, slots = geo.slots(cell)
    stride = chunk_stride(geo.chunk_nbytes)
    assert len(slots) >= 5 and stride - geo.chunk_nbytes - CRC_BYTES > 0
    for k in range(len(slots)):
        at = k * stride + geo.chunk_nbytes + CRC_BYTES  # the first zero after chunk k
        flip_bit(root / ref.path, at, 2)
        targets = [memoryview(bytearray(geo.chunk_nbytes)) for _ in slots]
        with pytest.raises(CorruptShardError, match=f"at {at}"):
            read_chunks(Inside(root), geo, ref, cell, [s.slot for s in slots], targets, True)
        flip_bit(root / ref.path, at, 2)


def test_padding_up_to_63_bytes(tmp_path: Path) -> None:
    """A payload of 4157 bytes: its stride is 4224, 63 zeros after the CRC."""
    assert chunk_stride(4157) == 4224 and chunk_stride(4096) == 4160 and chunk_stride(4095) == 4099
    root = tmp_path / "c"
    b = np.random.default_rng(5).integers(0, 255, 4157 * 3, dtype=np.uint8)
    ckptfmt.save({"b": b}, root, write=WriteOptions(fsync=False, chunk_bytes=4157))
    geo, ref, _ = _one_file(root, "b")
    assert geo.chunk_nbytes == 4157 and ref.size == 3 * 4224 + index_nbytes(geo.n_slots)
    assert raw_bytes(np.asarray(ckptfmt.load(root)["b"])) == raw_bytes(b)
