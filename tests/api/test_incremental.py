"""Incremental saves (``ckptfmt.save(..., base=...)``): a shard file whose content did not change
is hard-linked from the base, every other one written; each step is a complete checkpoint that
loads bit for bit, verifies, and is read by zarr-python and TensorStore with every other step of
its chain deleted. Change detection never trusts the CRC32C alone (a forged CRC collision is
written), a crash in the middle of an incremental save leaves the base whole, and a link the
file system refuses is a write."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit.files import leftovers
from kit.zarr_reader import zarr_read

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.checksum import crc32c
from ckptfmt.errors import NotACheckpointError, SaveFailedError
from ckptfmt.format.incremental import CONTENT_HASH
from ckptfmt.parallel.collective.save import save_collective
from ckptfmt.storage import commit
from ckptfmt.transport.comm import SingleComm

# small shards (4 KiB, chunks of 1 KiB) so that a few hundred KiB make many files
W = WriteOptions(fsync=False, chunk_bytes=1024, shard_bytes=4096, threads=2, content_hash=True)


def _state(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "frozen": {"embed": rng.standard_normal((512, 64), dtype=np.float32)},
        "table": rng.integers(0, 1 << 30, size=(4096, 16), dtype=np.int64),
        "adapter": rng.standard_normal((64, 16), dtype=np.float32),
        "scalar": np.float64(0.5),
        "lr": 1e-3,
    }


def _copy(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: _copy(v) if isinstance(v, dict) else (v.copy() if isinstance(v, np.ndarray) else v)
        for k, v in state.items()
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (np.ndarray, np.generic)):
        return a.dtype == np.asarray(b).dtype and np.array_equal(a, b)
    return bool(a == b)


def _inodes(root: Path) -> dict[str, int]:
    """Every data file of a checkpoint by path: its inode."""
    m = ckptfmt.open(root).manifest
    return {f.path: (root / f.path).stat().st_ino for _, f in m.files()}


def _step(state: dict[str, Any], k: int, rng: np.random.Generator) -> None:
    """Training between two saves: the adapter and a few table rows change, the rest is frozen."""
    state["adapter"] += np.float32(1)
    rows = rng.choice(state["table"].shape[0], size=3, replace=False)
    state["table"][rows] += k + 1
    state["scalar"] = np.float64(k)


def test_a_chain_restores_bit_exact_at_every_step_with_its_bases_deleted(tmp_path: Path) -> None:
    state, rng = _state(), np.random.default_rng(1)
    expected, steps = [], []
    prev: Path | None = None
    for k in range(10):
        path = tmp_path / f"step-{k}"
        ckptfmt.save(state, path, step=k, write=W, base=prev)
        expected.append(_copy(state))
        steps.append(path)
        if prev is not None:  # the frozen tensor's files are the base's own inodes
            new, old = _inodes(path), _inodes(prev)
            frozen = [p for p in new if p.startswith("frozen/")]
            assert frozen and all(new[p] == old[p] for p in frozen)
            assert all(new[p] != old[p] for p in new if p.startswith("adapter/"))
        prev = path
        _step(state, k, rng)
    # delete from the oldest on: every step still alive loads and verifies on its own
    for k in range(10):
        for j in range(k, 10):
            assert _equal(ckptfmt.load(steps[j]), expected[j]), (k, j)
        assert ckptfmt.verify(steps[k]).healthy
        shutil.rmtree(steps[k])
    # the other way round: the newest deleted first leaves the older ones whole
    prev = None
    chain = []
    for k in range(4):
        path = tmp_path / f"again-{k}"
        ckptfmt.save(expected[k], path, write=W, base=prev)
        chain.append(path)
        prev = path
    for k in reversed(range(4)):
        shutil.rmtree(chain[k])
        for j in range(k):
            assert _equal(ckptfmt.load(chain[j]), expected[j])


def test_only_the_shards_holding_changed_rows_are_written(tmp_path: Path) -> None:
    state = _state()
    ckptfmt.save(state, tmp_path / "a", write=W)
    table = state["table"]
    rows_per_shard = 4096 // (16 * 8)  # 4 KiB shards of int64 rows of 16
    changed_rows = [5, 700, 701, 3000]
    for r in changed_rows:
        table[r, 3] ^= 1
    report: dict[str, Any] = {}
    save_collective(
        SingleComm(),
        state,
        tmp_path / "b",
        step=None,
        node="n",
        write=W,
        base=tmp_path / "a",
        report=report,
    )
    old, new = _inodes(tmp_path / "a"), _inodes(tmp_path / "b")
    written = sorted(p for p in new if new[p] != old[p])
    # the scalar's file is unchanged too (same value): only the table's changed shards
    assert written == sorted({f"table/c/{r // rows_per_shard}/0" for r in changed_rows})
    size = (tmp_path / "b" / written[0]).stat().st_size
    assert report["written_bytes"] == len(written) * size
    assert report["linked_files"] == len(new) - len(written)
    assert _equal(ckptfmt.load(tmp_path / "b"), state)


def _forge_same_crc32c(payload: bytes, at: int) -> bytes:
    """``payload`` with byte ``at`` changed and its last 4 bytes chosen so that its CRC32C is
    unchanged (CRC32C is affine over GF(2): solve 32 linear equations for the 32 tail bits)."""
    n = len(payload)
    zero = crc32c(bytes(n))

    def lin(delta: bytes) -> int:  # the linear part of the CRC of a difference
        return crc32c(delta) ^ zero

    head = bytearray(n)
    head[at] = 0x5A
    target = lin(bytes(head))
    columns = []
    for bit in range(32):
        e = bytearray(n)
        e[n - 4 + bit // 8] = 1 << (bit % 8)
        columns.append(lin(bytes(e)))
    # Gaussian elimination: find bits x with XOR of columns[x] == target
    rows = [(columns[b], 1 << b) for b in range(32)]
    basis: list[tuple[int, int]] = []
    for v, mask in rows:
        for bv, bm in basis:
            if v ^ bv < v:
                v, mask = v ^ bv, mask ^ bm
        if v:
            basis.append((v, mask))
            basis.sort(reverse=True)
    rest, choice = target, 0
    for bv, bm in basis:
        if rest ^ bv < rest:
            rest, choice = rest ^ bv, choice ^ bm
    assert rest == 0
    delta = bytearray(head)
    for bit in range(32):
        if choice >> bit & 1:
            delta[n - 4 + bit // 8] ^= 1 << (bit % 8)
    out = bytes(a ^ b for a, b in zip(payload, delta))
    assert out != payload and crc32c(out) == crc32c(payload)
    return out


def test_a_change_the_crc32c_cannot_see_is_written(tmp_path: Path) -> None:
    """Unchanged is never decided on the CRC32C alone: a change forged to keep every chunk's
    CRC32C (and so the manifest's file CRC) is seen by the content hash and written."""
    data = np.random.default_rng(3).integers(0, 256, size=4096, dtype=np.uint8)
    state = {"w": data}
    ckptfmt.save(state, tmp_path / "a", write=W)
    forged = np.frombuffer(_forge_same_crc32c(data[:1024].tobytes(), 100), np.uint8)
    changed = data.copy()
    changed[:1024] = forged
    ckptfmt.save({"w": changed}, tmp_path / "b", write=W, base=tmp_path / "a")
    a, b = ckptfmt.open(tmp_path / "a").manifest, ckptfmt.open(tmp_path / "b").manifest
    assert [f.crc32c for _, f in a.files()] == [f.crc32c for _, f in b.files()]
    assert _inodes(tmp_path / "a") != _inodes(tmp_path / "b")
    assert np.array_equal(ckptfmt.load(tmp_path / "b")["w"], changed)


def test_plain_zarr_readers_open_an_incremental_step_alone(tmp_path: Path) -> None:
    state = _state()
    ckptfmt.save(state, tmp_path / "a", write=W)
    _step(state, 0, np.random.default_rng(2))
    ckptfmt.save(state, tmp_path / "b", write=W, base=tmp_path / "a")
    shutil.rmtree(tmp_path / "a")
    seen = zarr_read(tmp_path, tmp_path / "b")
    for name in ("frozen/embed", "table", "adapter"):
        arr = state["frozen"]["embed"] if name == "frozen/embed" else state[name]
        import hashlib

        assert seen[name]["sha256"] == hashlib.sha256(arr.tobytes()).hexdigest(), name
    ts = pytest.importorskip("tensorstore")
    for name, arr in (("table", state["table"]), ("frozen/embed", state["frozen"]["embed"])):
        spec = {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": str(tmp_path / "b" / name)},
        }
        got = ts.open(spec, open=True, read=True).result().read().result()
        assert np.array_equal(got, arr)


def test_a_base_without_hashes_links_nothing_and_a_missing_base_is_refused(
    tmp_path: Path,
) -> None:
    state = _state()
    plain = WriteOptions(fsync=False, chunk_bytes=1024, shard_bytes=4096)
    m = ckptfmt.save(state, tmp_path / "plain", write=plain)
    assert CONTENT_HASH not in m.writer  # no hash is computed when nobody asks for one
    ckptfmt.save(state, tmp_path / "b", write=plain, base=tmp_path / "plain")
    old, new = _inodes(tmp_path / "plain"), _inodes(tmp_path / "b")
    assert not set(old.values()) & set(new.values())
    assert _equal(ckptfmt.load(tmp_path / "b"), state)
    with pytest.raises(NotACheckpointError):
        ckptfmt.save(state, tmp_path / "c", write=W, base=tmp_path / "nowhere")
    assert not (tmp_path / "c").exists()


def test_a_link_across_file_systems_is_a_write(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs a second file system (/dev/shm)")
    base = Path(__import__("tempfile").mkdtemp(dir=shm)) / "a"
    try:
        state = _state()
        ckptfmt.save(state, base, write=W)
        report: dict[str, Any] = {}
        with caplog.at_level(logging.WARNING, logger="ckptfmt"):
            save_collective(
                SingleComm(),
                state,
                tmp_path / "b",
                step=None,
                node="n",
                write=W,
                base=base,
                report=report,
            )
        files = len(_inodes(tmp_path / "b"))
        assert f"{files} unchanged file(s) written, not linked" in caplog.text
        assert report["linked_files"] == 0 and report["unlinkable"] == files
        assert "Invalid cross-device link" in report["unlinkable_example"]
        assert _equal(ckptfmt.load(tmp_path / "b"), state)
    finally:
        shutil.rmtree(base.parent, ignore_errors=True)


def test_a_failed_incremental_save_leaves_the_base_whole(tmp_path: Path) -> None:
    state = _state()
    ckptfmt.save(state, tmp_path / "a", write=W)
    before = {p: (tmp_path / "a" / p).read_bytes() for p in _inodes(tmp_path / "a")}
    changed = _copy(state)
    _step(changed, 0, np.random.default_rng(4))

    def boom(point: str) -> None:
        if point == "written":  # every link and file of the new step made
            raise OSError("disk on fire")

    with pytest.raises(SaveFailedError):
        save_collective(
            SingleComm(),
            changed,
            tmp_path / "b",
            step=1,
            node="n",
            write=W,
            base=tmp_path / "a",
            fault=boom,
        )
    assert not (tmp_path / "b").exists() and leftovers(tmp_path) == []
    assert {p: (tmp_path / "a" / p).read_bytes() for p in before} == before
    assert all((tmp_path / "a" / p).stat().st_nlink == 1 for p in before)
    assert _equal(ckptfmt.load(tmp_path / "a"), state)


KILLED = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    import numpy as np
    from ckptfmt import WriteOptions
    from ckptfmt.parallel.collective.save import save_collective
    from ckptfmt.transport.comm import SingleComm

    state = dict(np.load(sys.argv[1]))

    def die(point):
        if point == sys.argv[4]:
            os.kill(os.getpid(), signal.SIGKILL)

    W = WriteOptions(fsync=False, chunk_bytes=1024, shard_bytes=4096, content_hash=True)
    save_collective(SingleComm(), state, Path(sys.argv[2]), step=1, node="n", write=W,
                    base=Path(sys.argv[3]), fault=die)
    """
)


@pytest.mark.parametrize("point", ["written", "manifest", "committing"])
def test_a_process_killed_in_an_incremental_save_leaves_the_base_whole(
    tmp_path: Path, point: str
) -> None:
    state = {k: v for k, v in _state().items() if isinstance(v, np.ndarray)}
    ckptfmt.save(state, tmp_path / "a", write=W)
    before = ckptfmt.load(tmp_path / "a")
    changed = _copy(state)
    changed["adapter"] += 1
    np.savez(tmp_path / "state.npz", **changed)
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    proc = subprocess.run(
        [sys.executable, script, tmp_path / "state.npz", tmp_path / "b", tmp_path / "a", point],
        timeout=120,
        capture_output=True,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert not commit.is_committed(tmp_path / "b")
    assert leftovers(tmp_path)  # the staging directory, holding links to the base's files
    assert _equal(ckptfmt.load(tmp_path / "a"), before)
    commit.clean_leftovers(tmp_path)  # what the manager's start (gc of a level) does
    assert leftovers(tmp_path) == []
    assert ckptfmt.verify(tmp_path / "a").healthy
    assert _equal(ckptfmt.load(tmp_path / "a"), before)


def test_zarr_documents_are_linked_only_when_the_base_holds_the_same_bytes(
    tmp_path: Path,
) -> None:
    state = _state()
    ckptfmt.save(state, tmp_path / "a", write=W)
    damaged = tmp_path / "a" / "adapter" / "zarr.json"
    damaged.write_bytes(damaged.read_bytes().replace(b'"float32"', b'"float64"'))
    ckptfmt.save(state, tmp_path / "b", write=W, base=tmp_path / "a")
    a, b = tmp_path / "a", tmp_path / "b"
    assert (b / "table/zarr.json").stat().st_ino == (a / "table/zarr.json").stat().st_ino
    assert (b / "zarr.json").stat().st_ino == (a / "zarr.json").stat().st_ino
    assert (b / "adapter/zarr.json").stat().st_ino != damaged.stat().st_ino
    assert b'"float32"' in (b / "adapter/zarr.json").read_bytes()
    assert ckptfmt.verify(b).healthy and not ckptfmt.verify(a).healthy
    assert _equal(ckptfmt.load(b), state)


def test_without_isal_the_hash_is_blake2b_and_bases_of_another_hash_link_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state()
    ckptfmt.save(state, tmp_path / "crc", write=W)
    monkeypatch.setattr("ckptfmt.redundancy.isal.crc64_available", lambda: False)
    m = ckptfmt.save(state, tmp_path / "a", write=W, base=tmp_path / "crc")
    assert m.writer[CONTENT_HASH]["algorithm"] == "blake2b-64"
    assert not set(_inodes(tmp_path / "crc").values()) & set(_inodes(tmp_path / "a").values())
    _step(state, 0, np.random.default_rng(6))
    ckptfmt.save(state, tmp_path / "b", write=W, base=tmp_path / "a")
    old, new = _inodes(tmp_path / "a"), _inodes(tmp_path / "b")
    assert all(new[p] == old[p] for p in new if p.startswith("frozen/"))
    assert all(new[p] != old[p] for p in new if p.startswith("adapter/"))
    shutil.rmtree(tmp_path / "a")
    assert _equal(ckptfmt.load(tmp_path / "b"), state)
