"""The manager stages only the share of the replicated tensors each rank writes
(``ckptfmt.parallel.collective.share``), and the checkpoint is the same as with a whole copy.

Four thread-ranks on two simulated nodes (``ThreadComm``): with data-parallel replicas each rank
copies about a quarter of them (``SaveReport.staged_bytes``), its own ``Shard`` and ``PerRank``
arrays whole; the files and manifest tensors equal those of a save staged whole; the restore is
bit-exact; a rank may mutate its arrays once ``save`` returned. When the ranks' replicated
tensors differ (one rank holds as a region a tensor the others hold whole) every rank stages
whole and the save commits; a state refused on one rank fails the step on every rank.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit.files import tree

from ckptfmt import CheckpointManager, CheckpointWarning, ExitPolicy, PerRank, Shard
from ckptfmt.container.reader import read_manifest
from ckptfmt.errors import UsageError
from ckptfmt.format.options import WriteOptions
from ckptfmt.parallel.collective import share
from ckptfmt.plan.cache import PlanCache
from ckptfmt.plan.ownership import Holding
from ckptfmt.transport.threads import run_threads

WORLD = 4
GRID = {"chunk_bytes": 4 << 10, "shard_bytes": 16 << 10}
WRITE = WriteOptions(fsync=False, **GRID)


def replicas(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {
        "w": rng.standard_normal((96, 64)).astype(np.float32),
        "b": rng.integers(0, 1 << 20, 5000).astype(np.int64),
        "scale": np.float32(step),  # 0-d: one region, written by one rank
    }


def rank_state(step: int, rank: int) -> dict[str, Any]:
    rows = np.random.default_rng([step, rank]).standard_normal((8, 16)).astype(np.float32)
    return {
        "model": replicas(step),
        "fsdp": Shard(rows, (8 * rank, 0), (8 * WORLD, 16)),
        "rng": PerRank(np.full(3, rank + step, np.uint32)),
        "step": step,
    }


def manager(comm: Any, root: Path, **kw: Any) -> CheckpointManager:
    return CheckpointManager(
        local_dir=f"{root}/l1/{{node}}",
        comm=comm,
        node=f"n{comm.rank // 2}",
        redundancy="xor",
        write=WRITE,
        at_exit=ExitPolicy(flush=False, sigterm=False),
        **kw,
    )


def save_and_report(root: Path, whole: bool, background_copy: bool = False) -> list[int]:
    """Save step 3 on every rank (``whole``: with the share switched off, the old way);
    mutate the state after ``save`` returned; the staged bytes of each rank."""

    def body(comm: Any) -> int:
        mgr = manager(comm, root)
        if whole:
            mgr._stager.agree = lambda *args: None  # type: ignore[method-assign]
        state = rank_state(3, comm.rank)
        handle = mgr.save(3, state, background_copy=background_copy)
        handle.wait_staged()
        for arr in state["model"].values():
            if isinstance(arr, np.ndarray) and arr.ndim:
                arr[...] = 0  # the loop goes on changing its tensors
        state["fsdp"].data[...] = -1
        mgr.wait()
        assert mgr.failed_saves == []
        staged = mgr.last_save.staged_bytes
        mgr.close(flush=False)
        return staged

    return run_threads(WORLD, body)


def files(root: Path) -> dict[str, bytes]:
    """Every file but the manifests (which hold the save id and the time)."""
    return {k: v for k, (v, _) in tree(root).items() if not k.endswith("ckptfmt.json")}


def restored(root: Path, step: int = 3) -> list[dict[str, Any]]:
    def body(comm: Any) -> dict[str, Any]:
        mgr = manager(comm, root)
        got = {"model": {k: np.zeros_like(v) for k, v in replicas(0).items()}}
        got["fsdp"] = Shard(np.zeros((8, 16), np.float32), (8 * comm.rank, 0), (8 * WORLD, 16))
        got["rng"] = PerRank(np.zeros(3, np.uint32))
        got["step"] = 0
        assert mgr.restore(got).step == step
        mgr.close(flush=False)
        return got

    return run_threads(WORLD, body)


@pytest.mark.parametrize("background_copy", [False, True], ids=["copy-now", "background-copy"])
def test_each_rank_stages_its_share_and_the_checkpoint_is_the_same(
    tmp_path: Path, background_copy: bool
) -> None:
    shared = save_and_report(tmp_path / "share", whole=False, background_copy=background_copy)
    whole = save_and_report(tmp_path / "whole", whole=True, background_copy=background_copy)
    rep = sum(a.nbytes for a in replicas(3).values())
    own = 8 * 16 * 4  # the Shard: always whole (a PerRank array is copied as a value)
    assert all(w == rep + own for w in whole), whole
    assert sum(shared) == rep + WORLD * own, shared  # each replica byte staged once
    assert max(shared) < rep / 2 + own, shared  # about a quarter each
    assert files(tmp_path / "share" / "l1") == files(tmp_path / "whole" / "l1")
    for rank, got in enumerate(restored(tmp_path / "share")):
        want = rank_state(3, rank)
        for k, v in want["model"].items():
            assert got["model"][k].tobytes() == np.asarray(v).tobytes(), k
        assert got["fsdp"].data.tobytes() == want["fsdp"].data.tobytes()
        assert got["rng"].value.tobytes() == want["rng"].value.tobytes()
        assert got["step"] == 3


def test_ranks_holding_other_replicas_stage_whole_and_the_save_commits(tmp_path: Path) -> None:
    def body(comm: Any) -> int:
        mgr = manager(comm, tmp_path, async_save=False)
        state = rank_state(3, comm.rank)
        if comm.rank == 1:  # holds all of b, but as a region: the plan is not the DP one
            state["model"]["b"] = Shard(state["model"]["b"], (0,), (5000,))
        mgr.save(3, state)
        assert mgr.failed_saves == [] and mgr.latest().step == 3
        staged = mgr.last_save.staged_bytes
        mgr.close(flush=False)
        return staged

    staged = run_threads(WORLD, body)
    rep = sum(a.nbytes for a in replicas(3).values())
    assert min(staged) >= rep, staged  # nobody staged a share


@pytest.mark.filterwarnings("ignore::UserWarning")  # warnings filters are not per thread
def test_a_state_refused_on_one_rank_fails_the_step_everywhere(tmp_path: Path) -> None:
    def body(comm: Any) -> str:
        mgr = manager(comm, tmp_path, on_error="warn")
        state: dict[str, Any] = rank_state(3, comm.rank)
        if comm.rank == 2:
            state["bad"] = object()
        try:
            mgr.save(3, state)
            mgr.wait()
            outcome = "failed" if mgr.failed_saves else "saved"
        except UsageError:
            outcome = "refused"
        mgr.save(4, rank_state(4, comm.rank))  # the next save works, its share staged
        mgr.wait()
        assert mgr.latest().step == 4 and mgr.last_save.staged_bytes < 40_000
        mgr.close(flush=False)
        return outcome

    assert run_threads(WORLD, body) == ["failed", "failed", "refused", "failed"]


def test_the_share_is_the_plan_of_the_save() -> None:
    holdings = [Holding(("w",), "float32", (96, 64)), Holding(("s",), "float32", ())]
    opts = WriteOptions(chunk_bytes=4 << 10, shard_bytes=16 << 10)
    plan = share.share_plan(PlanCache(), holdings, opts, WORLD)
    boxes = [share.own_boxes(plan, r) for r in range(WORLD)]
    rows = sorted((o[0], s[0]) for b in boxes for o, s in b[("w",)])
    assert sum(n for _, n in rows) == 96 and rows[0][0] == 0  # the whole tensor, once
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(rows))  # no gaps, overlaps
    assert sum(len(b[("s",)]) for b in boxes) == 1
    d = share.digest(holdings, opts, WORLD)
    assert d != share.digest(holdings[:1], opts, WORLD)
    assert d != share.digest(holdings, opts, WORLD + 1)


def test_a_policy_follows_the_jobs_save_number_across_restarts(tmp_path: Path) -> None:
    """The redundancy policy's ``every`` and its flush descriptors count the job's saves as
    recorded on storage, not a process's: 4 runs of 2 saves each, partner every 3rd save and a
    flush every 4th; saves 3 and 6 carry partner copies and 4 and 8 reach level 3, although no
    process makes more than 2 saves."""
    policy = [{"every": 3, "redundancy": "partner"}, {"every": 4, "flush": True}]
    done = 0
    for _run in range(4):

        def body(comm: Any, first: int = done) -> dict[str, Any]:
            mgr = CheckpointManager(
                local_dir=f"{tmp_path}/l1/{{node}}",
                shared_dir=tmp_path / "l3",
                comm=comm,
                node=f"n{comm.rank}",
                redundancy=policy,
                keep_local=10,
                keep_shared=10,
                write=WriteOptions(fsync=False),
                at_exit=ExitPolicy(flush=False, sigterm=False),
            )
            state = {"w": np.zeros(64, np.float32), "step": 0}
            start = mgr.restore(state).step or 0
            assert start == first, (start, first)
            for step in (start + 1, start + 2):
                mgr.save(step, {"w": np.full(64, step, np.float32), "step": step})
            mgr.wait()
            reports = [r.to_json() for r in mgr.save_reports]
            mgr.close(flush=False)
            return {"reports": reports}

        out = run_threads(2, body)
        done += 2
        for r in out[0]["reports"]:
            expect = "partner" if r["step"] % 3 == 0 else None
            assert r["redundancy"] == expect, r
            assert r["flushed"] == (r["step"] % 4 == 0), r
            assert (r["parity_bytes"] > 0) == (expect is not None), r
    shared = [p.name for p in sorted((tmp_path / "l3").glob("step-*"))]
    assert shared == ["step-0000000004", "step-0000000008"]
    for step in range(1, 9):
        m = read_manifest(tmp_path / "l1" / "n0" / f"step-{step:010d}")
        assert ("redundancy" in m.levels.get("1", {})) == (step % 3 == 0), step


def test_a_background_copy_failing_on_one_rank_fails_the_step_everywhere(tmp_path: Path) -> None:
    """``background_copy=True``: the copy runs on the saver threads, after their agreement. A
    ``MemoryError`` while rank 1 copies fails that step on every rank (voted on, phase
    "copy"), the state is free again on every rank, and the next save commits bit for bit."""

    def body(comm: Any) -> dict[str, Any]:
        mgr = manager(comm, tmp_path)
        if comm.rank == 1:
            real = mgr._stager.stage

            def failing(*args: Any, **kwargs: Any) -> Any:
                mgr._stager.stage = real  # type: ignore[method-assign]
                raise MemoryError("injected while copying")

            mgr._stager.stage = failing  # type: ignore[method-assign]
        handle = mgr.save(3, rank_state(3, comm.rank), background_copy=True)
        handle.wait_staged()
        mgr.wait()  # warns (on_error="warn"): recorded by the test, which runs every rank
        failed = [(s, type(e).__name__, dict(e.rank_failures)) for s, e in mgr.failed_saves]
        state = rank_state(4, comm.rank)
        mgr.save(4, state, background_copy=True).wait_staged()
        mgr.wait()
        out = {"failed": failed, "after": len(mgr.failed_saves), "latest": mgr.latest().step}
        mgr.close(flush=False)
        return out

    with pytest.warns(CheckpointWarning, match="checkpoint of step 3 failed"):
        results = run_threads(WORLD, body)
    for res in results:
        [(step, kind, failures)] = res["failed"]
        assert (step, kind) == (3, "SaveFailedError"), res
        assert list(failures) == [1] and failures[1].type == "MemoryError", failures
        assert failures[1].phase == "copy", failures
        assert res["after"] == 1 and res["latest"] == 4, res  # the next save: no new failure
    got = restored(tmp_path, 4)
    for rank, state in enumerate(got):
        want = rank_state(4, rank)
        assert all(np.array_equal(state["model"][k], v) for k, v in want["model"].items())
