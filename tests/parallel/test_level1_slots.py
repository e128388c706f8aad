"""Level 1's recycled step directories (``storage/slots.py``, ``spec/PROTOCOL.md`` §1): a step
that retention drops becomes a spare slot, the next save overwrites its files in place, and
neither a slot nor a torn rewrite of one is ever read as a step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit import REPO
from kit.cli import run_cli
from kit.launch import assert_ok, describe, run_mpi, with_kit_path

import ckptfmt
from ckptfmt import CheckpointManager, ExitPolicy, WriteOptions
from ckptfmt.container.reader import read_manifest
from ckptfmt.manifest.codec import MANIFEST_NAME
from ckptfmt.storage.slots import SLOTS_DIR, kept_paths
from ckptfmt.storage.steps import list_step_dirs

WORKER = REPO / "tests" / "workers" / "_slots_worker.py"
SMALL = WriteOptions(chunk_bytes=1 << 14, shard_bytes=1 << 16, fsync=False)


def manager(root: Path, **kw: Any) -> CheckpointManager:
    return CheckpointManager(
        local_dir=str(root),
        keep_local=2,
        async_save=False,
        on_error="raise",
        write=SMALL,
        at_exit=ExitPolicy(flush=False, sigterm=False),
        **kw,
    )


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:010d}"


def data_inodes(path: Path) -> dict[str, int]:
    """The inode of every data file of a step directory (not its metadata documents)."""
    return {
        p.relative_to(path).as_posix(): p.stat().st_ino
        for p in path.rglob("*")
        if p.is_file() and p.name not in ("zarr.json", MANIFEST_NAME)
    }


def state(step: int, shape: tuple[int, ...] = (40, 1000)) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {"w": rng.random(shape, dtype=np.float32), "opt": {"m": rng.random(30_000)}}


def assert_loads(root: Path, step: int, want: dict[str, Any]) -> None:
    """``step`` under ``root`` loads bit for bit as ``want`` and holds nothing else."""
    got = ckptfmt.load(step_dir(root, step))
    flat_got, flat_want = _flat(got), _flat(want)
    assert flat_got.keys() == flat_want.keys()
    for k, v in flat_want.items():
        assert flat_got[k].dtype == v.dtype and flat_got[k].tobytes() == v.tobytes(), k
    files, nodes = kept_paths(read_manifest(step_dir(root, step)))
    for p in step_dir(root, step).rglob("*"):
        rel = p.relative_to(step_dir(root, step)).as_posix()
        if p.is_file() and rel != MANIFEST_NAME:
            rel_dir = p.parent.relative_to(step_dir(root, step)).as_posix()
            assert rel in files or (p.name == "zarr.json" and rel_dir.strip(".") in nodes), rel
        if p.is_dir():
            assert any(p.iterdir()), f"empty directory {rel}"


def _flat(tree: Any, prefix: str = "") -> dict[str, np.ndarray]:
    if isinstance(tree, dict):
        out: dict[str, np.ndarray] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}/{k}"))
        return out
    return {prefix: np.asarray(tree)}


def test_slots_are_rewritten_in_place(tmp_path: Path) -> None:
    """With keep_local=2, step s is written into the files of step s - 3 (recycled after step
    s - 1 was saved): the same inodes; the two newest steps stay committed at every save, and
    the slot is no step to any reader."""
    root = tmp_path / "l1"
    mgr = manager(root)
    inodes: dict[int, dict[str, int]] = {}
    states = {}
    for step in range(1, 8):
        states[step] = state(step)
        mgr.save(step, states[step])
        inodes[step] = data_inodes(step_dir(root, step))
        assert sorted(mgr.steps())[-2:] == [s for s in (step - 1, step) if s >= 1]
        assert len(mgr.steps()) == min(step, 2)
        assert mgr.latest() == (step, step_dir(root, step))
        if step >= 4:
            assert inodes[step] == inodes[step - 3], f"step {step} did not reuse a slot"
            assert len(inodes[step]) > 5
        if step >= 3:
            held = list((root / SLOTS_DIR).iterdir())
            assert len(held) == 1 and not (held[0] / MANIFEST_NAME).exists()
    for step in (6, 7):
        assert_loads(root, step, states[step])
    assert [s for s, _ in list_step_dirs(root, loose=True)] == [6, 7]
    report = mgr.restore()
    assert report.step == 7
    assert (root / SLOTS_DIR).is_dir()
    mgr.close()
    # the spare slot only served the next save: closing gives its room back, steps untouched
    assert sorted(p.name for p in root.iterdir()) == ["step-0000000006", "step-0000000007"]
    assert run_cli("verify", step_dir(root, 6)).exit_code == 0
    assert run_cli("verify", step_dir(root, 7)).exit_code == 0


def test_switched_off(tmp_path: Path) -> None:
    """``recycle_level1=False``: dropped steps are deleted, nothing is kept aside."""
    root = tmp_path / "l1"
    mgr = manager(root, recycle_level1=False)
    for step in range(1, 6):
        mgr.save(step, state(step))
    mgr.close()
    assert sorted(p.name for p in root.iterdir()) == ["step-0000000004", "step-0000000005"]


def test_incremental_does_not_recycle(tmp_path: Path) -> None:
    """An incremental manager links unchanged files; it keeps no slots."""
    root = tmp_path / "l1"
    mgr = manager(root, incremental=True)
    for step in range(1, 6):
        mgr.save(step, state(1))
    mgr.close()
    assert not (root / SLOTS_DIR).exists()


def test_differing_layouts_across_steps(tmp_path: Path) -> None:
    """Steps whose tensors change shape, rank (a file where a directory was, and back), dtype,
    come and go: each is saved into the previous slot and loads bit-exact, holding only its
    own files; ``ckptfmt verify`` passes."""
    root = tmp_path / "l1"
    mgr = manager(root)
    rng = np.random.default_rng(7)
    layouts: list[dict[str, Any]] = [
        {"w": rng.random((40, 1000), dtype=np.float32), "v": rng.random(9000)},
        {"w": rng.random((40, 1000), dtype=np.float32), "v": rng.random(9000)},
        {"w": rng.random((40, 1000), dtype=np.float32), "v": rng.random(9000)},
        {"w": rng.random((80, 1500), dtype=np.float32), "v": rng.random((30, 300))},
        {"w": rng.random((10, 100), dtype=np.float32), "v": rng.random(70_000), "x": b"abc"},
        {"w": rng.integers(0, 9, (40, 1000), dtype=np.int16), "g": {"v": rng.random(5)}},
        {"w": rng.random(123_457, dtype=np.float32), "v": rng.random(9000)},
        {"w": rng.random((40, 1000), dtype=np.float32), "v": rng.random(9000)},
    ]
    recycled = 0
    for step, st in enumerate(layouts, start=1):
        before = {p.stat().st_ino for p in (root / SLOTS_DIR).rglob("*") if p.is_file()}
        mgr.save(step, st)
        after = set(data_inodes(step_dir(root, step)).values())
        recycled += bool(before & after)
        assert_loads(root, step, st)
        assert run_cli("verify", step_dir(root, step)).exit_code == 0
    assert recycled >= 4  # the steps from the fourth on took a slot
    mgr.close()


def test_a_hard_link_is_never_written_through(tmp_path: Path) -> None:
    """A file of a recycled step that has another link (an incremental save's, or one made by
    hand) is replaced, not overwritten: the other link keeps its bytes."""
    root = tmp_path / "l1"
    mgr = manager(root)
    mgr.save(1, state(1))
    victim = next(p for p in step_dir(root, 1).rglob("*") if p.is_file() and "/c/" in str(p))
    outside = tmp_path / "elsewhere"
    os.link(victim, outside)
    kept = outside.read_bytes()
    for step in range(2, 5):
        mgr.save(step, state(step))
    assert outside.read_bytes() == kept
    assert_loads(root, 4, state(4))
    mgr.close()


def _torn(record: dict[str, Any]) -> None:
    """The killed save left a staging directory without a manifest, whose files are part new
    (the first file written whole, the second half) and part the recycled step's."""
    staging = Path(record["staging"])
    assert staging.is_dir() and staging.name.startswith(".step-")
    assert not (staging / MANIFEST_NAME).exists()
    assert len(record["written"]) == 2


def _verify_kept(root: Path, template: bool) -> None:
    for step in (4, 5):
        where = f"{root}/{{node}}/step-{step:010d}" if template else step_dir(root / "n0", step)
        result = run_cli("verify", where)
        assert result.exit_code == 0, result.output


def test_killed_mid_rewrite_restores_the_previous_step(tmp_path: Path) -> None:
    """One process, SIGKILLed inside the writer while step 6 overwrites a slot (half a file
    rewritten): no reader takes the torn slot for a step; a fresh manager restores step 5 bit
    for bit, removes the leftover, and both kept steps verify."""
    env = with_kit_path(dict(os.environ))
    save = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path), "save", "6"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert save.returncode == -signal.SIGKILL, describe(save)
    record = json.loads((tmp_path / "killed-0.json").read_text())
    _torn(record)
    assert ckptfmt.latest(tmp_path / "n0") == (5, step_dir(tmp_path / "n0", 5))
    assert [s for s, _ in list_step_dirs(tmp_path / "n0", loose=True)] == [4, 5]
    restore = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path), "restore", "6"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert restore.returncode == 0, describe(restore)
    assert json.loads((tmp_path / "restored-0.json").read_text()) == {
        "step": 5,
        "level": 1,
        "same": True,
    }
    assert not Path(record["staging"]).exists()  # the leftover is gone
    _verify_kept(tmp_path, template=False)


@pytest.mark.mpi
def test_killed_mid_rewrite_under_mpi(tmp_path: Path) -> None:
    """Two ranks on two simulated nodes; rank 1 is SIGKILLed while rewriting its node's slot
    (the job dies with it): a fresh job restores step 5 bit for bit on both ranks, and the
    kept steps verify node by node."""
    save = run_mpi(2, WORKER, str(tmp_path), "save", "6", "mpi", timeout=180)
    assert save.returncode != 0, describe(save)
    _torn(json.loads((tmp_path / "killed-1.json").read_text()))
    for node in ("n0", "n1"):
        assert ckptfmt.latest(tmp_path / node) == (5, step_dir(tmp_path / node, 5))
    assert_ok(run_mpi(2, WORKER, str(tmp_path), "restore", "6", "mpi", timeout=180))
    for rank in (0, 1):
        assert json.loads((tmp_path / f"restored-{rank}.json").read_text()) == {
            "step": 5,
            "level": 1,
            "same": True,
        }
    _verify_kept(tmp_path, template=True)
