"""A collective save whose commit renamed a node's step into place but could not fsync that
node's directory (``EIO``: :class:`~ckptfmt.errors.NotDurableError`) is a failed save on every
node, never a step committed on some nodes only: the node whose rename was done rolls it back
with the others, and the previous step stays the newest, whole. Two simulated nodes, one rank a
thread each, the directory fsync of one node failing once, after its rename."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptfmt import CheckpointManager, ExitPolicy, Shard, WriteOptions
from ckptfmt.errors import CkptError
from ckptfmt.storage import commit
from ckptfmt.storage.steps import step_dir_name
from ckptfmt.transport.threads import run_threads

NODES = ["n0", "n1"]


def _state(rank: int, step: int) -> dict[str, Any]:
    rows = np.random.default_rng(10 * step + rank).standard_normal((32, 16)).astype(np.float32)
    return {"w": Shard(rows, (32 * rank, 0), (64, 16)), "step": step}


def _manager(root: Path, comm: Any) -> CheckpointManager:
    return CheckpointManager(
        local_dir=str(root / "{node}"),
        comm=comm,
        node=NODES[comm.rank],
        write=WriteOptions(fsync=True),
        async_save=False,
        on_error="raise",
        at_exit=ExitPolicy(flush=False, sigterm=False),
    )


def test_a_commit_not_durable_on_one_node_is_rolled_back_on_every_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "l1"
    real, failed = commit.fsync_dir, []

    def fsync_dir(path: Path) -> None:
        # n1's directory, once step 2 was renamed into it: the device answers EIO, once
        if Path(path) == root / "n1" and (root / "n1" / step_dir_name(2)).exists() and not failed:
            failed.append(path)
            raise OSError(errno.EIO, "Input/output error", str(path))
        real(path)

    errors: dict[int, str] = {}

    def job(comm: Any) -> None:
        with _manager(root, comm) as mgr:
            mgr.save(1, _state(comm.rank, 1))
            monkeypatch.setattr(commit, "fsync_dir", fsync_dir)
            try:
                mgr.save(2, _state(comm.rank, 2))
            except CkptError as exc:
                errors[comm.rank] = str(exc)

    run_threads(2, job)
    monkeypatch.undo()
    assert failed, "the fault was not injected"
    assert sorted(errors) == [0, 1], errors
    assert all("could not be synced" in m and "n1" in m for m in errors.values()), errors
    for node in NODES:  # step 2 on no node, step 1 on every node
        assert not (root / node / step_dir_name(2)).exists(), node
        assert commit.is_committed(root / node / step_dir_name(1)), node

    got: dict[int, Any] = {}

    def restore(comm: Any) -> None:
        with _manager(root, comm) as mgr:
            state = {"w": Shard(np.zeros((32, 16), np.float32), (32 * comm.rank, 0), (64, 16))}
            state["step"] = -1
            report = mgr.restore(state)
            got[comm.rank] = (report.step, report.rebuilt, state)

    run_threads(2, restore)
    for rank in (0, 1):
        step, rebuilt, state = got[rank]
        assert (step, rebuilt, state["step"]) == (1, [], 1)
        assert state["w"].data.tobytes() == _state(rank, 1)["w"].data.tobytes()
