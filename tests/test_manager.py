"""CheckpointManager in one process (the many-rank behaviour is in test_parallel.py)."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit.managers import node_manager as manager

import ckptfmt
from ckptfmt import CheckpointWarning, ExitPolicy
from ckptfmt.parallel.protocol import SaveFailedError
from ckptfmt.storage.steps import step_dir_name


def state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((64, 33)).astype(np.float32), "step": seed, "h": [seed]}


def test_async_save_snapshots_the_state_at_save_time(tmp_path: Path) -> None:
    mgr = manager(tmp_path, flush_every=2)
    s = state(1)
    expected = s["w"].copy()
    mgr.save(1, s)
    s["w"] += 100  # the training loop goes on at once
    mgr.save(2, s)
    mgr.wait()
    assert mgr.latest() == (2, tmp_path / "l1" / "n0" / step_dir_name(2))  # level 1 first
    one = ckptfmt.load(tmp_path / "l1" / "n0" / step_dir_name(1))
    assert one["w"].tobytes() == expected.tobytes()
    assert ckptfmt.verify(tmp_path / "l3" / step_dir_name(2)).healthy  # the 2nd save flushed
    assert not (tmp_path / "l3" / step_dir_name(1)).exists()
    mgr.delete(2, levels=[1])
    newest = mgr.latest()  # a StepRef: where this rank sees the newest step, else level 3
    assert newest is not None and newest == (2, tmp_path / "l3" / step_dir_name(2))
    assert (newest.step, newest.path) == tuple(newest)
    mgr.close()


def test_restore_fills_the_given_state_in_place(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    mgr.save(7, state(7))
    mgr.close()
    fresh = manager(tmp_path)
    target = state(0)
    buffer = target["w"]
    assert fresh.restore(target).step == 7
    assert target["w"] is buffer  # arrays are copied into, not replaced
    assert target["w"].tobytes() == state(7)["w"].tobytes()
    assert target["step"] == 7 and target["h"] == [7]
    assert fresh.last_restore is not None and fresh.last_restore.level == 1
    fresh.close()


def test_a_failed_save_warns_at_the_next_call_and_keeps_older_checkpoints(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    mgr.save(1, state(1))
    mgr.wait()
    blocker = tmp_path / "l1" / "n0" / step_dir_name(2)
    blocker.write_text("not a directory")  # the next save cannot create its step directory
    mgr.save(2, state(2))
    with pytest.warns(CheckpointWarning, match="step 2"):
        mgr.wait()
    assert mgr.failed_saves and mgr.failed_saves[0][0] == 2
    assert ckptfmt.load(tmp_path / "l1" / "n0" / step_dir_name(1))["step"] == 1
    blocker.unlink()
    mgr.close()


def test_on_error_raise_raises_at_the_next_call(tmp_path: Path) -> None:
    mgr = manager(tmp_path, on_error="raise")
    (tmp_path / "l1" / "n0").mkdir(parents=True)
    (tmp_path / "l1" / "n0" / step_dir_name(3)).write_text("x")
    mgr.save(3, state(3))
    with pytest.raises(SaveFailedError):
        mgr.save(4, state(4))  # the next call reports the failure of step 3
    mgr.close()


def test_a_copy_under_the_wrong_step_name_is_refused(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    mgr.save(1, state(1))
    mgr.save(2, state(2))
    mgr.close()
    root = tmp_path / "l1" / "n0"
    shutil.copytree(root / step_dir_name(1), root / step_dir_name(9))  # misplaced
    fresh = manager(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert fresh.restore().step == 2
    assert fresh.last_restore is not None
    assert any("step 9" in reason and "not 9" in reason for reason in fresh.last_restore.tried)
    fresh.close()


def test_close_flushes_the_newest_checkpoint(tmp_path: Path) -> None:
    mgr = manager(tmp_path, flush_every=100, at_exit=ExitPolicy(sigterm=False))
    mgr.save(5, state(5))
    mgr.close()
    assert ckptfmt.load(tmp_path / "l3" / step_dir_name(5))["step"] == 5
    with pytest.raises(ckptfmt.errors.UsageError):
        mgr.save(6, state(6))  # closed


def test_a_save_restored_at_another_size_is_not_flushed_as_this_jobs(tmp_path: Path) -> None:
    """4 ranks save to level 1 only; 2 ranks restore it and close with a flush: level 3 must not
    get a copy holding only the files of the ranks that happen to be here (it would not
    verify); the flush is not attempted and, called directly, refused."""
    from ckptfmt import ExitPolicy, WriteOptions
    from ckptfmt.container.reader import read_manifest
    from ckptfmt.parallel.levels import flush_collective
    from ckptfmt.parallel.manager import CheckpointManager as Manager
    from ckptfmt.transport.threads import run_threads

    root = tmp_path

    def save(comm: Any) -> None:
        m = Manager(
            f"{root}/l1/{{node}}",
            f"{root}/l3",
            comm=comm,
            node=f"n{comm.rank % 2}",
            flush_every=100,
            async_save=False,
            write=WriteOptions(fsync=False),
            at_exit=ExitPolicy(flush=False, sigterm=False),
        )
        m.save(7, {"w": np.arange(4000, dtype=np.float32), "d": np.full(7000, 3, np.float32)})
        m.close(flush=False)

    def restore(comm: Any) -> tuple[Any, ...]:
        m = Manager(
            f"{root}/l1/{{node}}",
            f"{root}/l3",
            comm=comm,
            node=f"n{comm.rank}",
            async_save=False,
            write=WriteOptions(fsync=False),
            at_exit=ExitPolicy(sigterm=False),
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = m.restore().step
            m.close(flush=True)
        manifest = read_manifest(root / "l1" / f"n{comm.rank}" / "step-0000000007")
        try:
            flush_collective(comm, manifest, root / "l1" / f"n{comm.rank}", root / "l3")
            refused = ""
        except SaveFailedError as exc:
            refused = str(exc)
        return step, [str(w.message) for w in caught], refused

    run_threads(4, save)
    results = run_threads(2, restore)
    for step, caught, refused in results:
        assert step == 7 and caught == []
        assert "cannot flush a save of 4 ranks with 2" in refused
    assert not (root / "l3" / "step-0000000007").exists()
