"""A save plans once, and its collectives are counted.

The manager's staging and its save use one plan per layout (``ckptfmt.plan.cache``): the
stager's plan of the replicated tensors is the save's plan for data parallelism, and a layout
saved again (every step) is not planned again; a changed layout gets its own plan and saves
correctly. Every rank's collectives are counted on a :class:`~kit.counting.CountingComm` (a
real ``ThreadComm`` underneath): a ``save_collective`` makes exactly its five votes, a manager
save a fixed small number, the same for every save of a layout. Bytes and pickled objects,
which the save declares whole among the replicated tensors, are in the stager's share too: a
manager save of such a state on several ranks commits and restores bit for bit (it failed
before, the staging and the save having planned two different partitions). The counts hold
under ``mpiexec -n 2`` with ``MpiComm`` too (``tests/workers/_count_worker.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit import REPO
from kit.counting import CountingComm
from kit.launch import assert_ok, run_mpi, with_kit_path

import ckptfmt
from ckptfmt import CheckpointManager, ExitPolicy, PerRank, Shard, WriteOptions
from ckptfmt.parallel.collective.save import save_collective
from ckptfmt.plan.cache import PlanCache, layout_key
from ckptfmt.plan.ownership import Holding, make_plan
from ckptfmt.transport.threads import run_threads

WORLD = 2
WRITE = WriteOptions(fsync=False, chunk_bytes=4 << 10, shard_bytes=16 << 10)
VOTES = 5  # declare, stage, write, manifest, commit: one allgather each


def state_of(step: int, rank: int, wide: int = 64) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    rows = np.random.default_rng([step, rank]).standard_normal((4, 8)).astype(np.float32)
    return {
        "w": rng.standard_normal((96, wide)).astype(np.float32),
        "b": rng.integers(0, 1 << 20, 3000).astype(np.int64),
        "fsdp": Shard(rows, (4 * rank, 0), (4 * WORLD, 8)),
        "rng": PerRank(np.full(3, rank + step, np.uint32)),
        "step": step,
    }


def test_the_cache_keys_a_plan_by_everything_it_depends_on() -> None:
    a = [Holding(("w",), "float32", (96, 64)).to_json()]
    b = [Holding(("w",), "float32", (96, 64), ((0, 0), (48, 64))).to_json()]
    cache = PlanCache(keep=2)
    first = cache.plan([a, a], 4096, 16384)
    assert first == make_plan([[Holding.from_json(a[0])]] * 2, 4096, 16384)
    assert cache.plan([a, a], 4096, 16384) is first and (cache.made, cache.reused) == (1, 1)
    keys = {
        layout_key([a, a], 4096, 16384),
        layout_key([a, a, a], 4096, 16384),  # another number of ranks
        layout_key([a, b], 4096, 16384),  # a rank holding a region
        layout_key([a, a], 8192, 16384),  # another grid
        layout_key([a, a], 4096, 32768),
        layout_key([[{**a[0], "shape": [96, 65]}]] * 2, 4096, 16384),  # another shape
        layout_key([[{**a[0], "dtype": "float64"}]] * 2, 4096, 16384),  # another dtype
    }
    assert len(keys) == 7
    for decl in ([a, a, a], [a, b]):  # the oldest goes once more than `keep` are kept
        cache.plan(decl, 4096, 16384)
    assert cache.made == 3
    assert cache.plan([a, a], 4096, 16384) == first and cache.made == 4


def test_save_collective_makes_its_votes_and_plans_a_layout_once(tmp_path: Path) -> None:
    def body(comm: Any) -> list[int]:
        c, plans = CountingComm(comm), PlanCache()
        counts = []
        for step, wide in ((1, 64), (2, 64), (3, 48)):  # step 3: another layout
            state, path = state_of(step, c.rank, wide), tmp_path / f"step-{step}"
            before = c.tally.collectives()
            save_collective(c, state, path, step=step, node="n0", write=WRITE, plans=plans)
            counts.append(c.tally.collectives() - before)
        assert (plans.made, plans.reused) == (2, 1)
        assert c.tally.calls["bcast_buffer"] == 0
        return counts

    assert run_threads(WORLD, body) == [[VOTES] * 3] * WORLD
    got = ckptfmt.load(tmp_path / "step-3")
    want = state_of(3, 0, 48)
    assert got["w"].tobytes() == want["w"].tobytes() and got["step"] == 3
    rows = np.concatenate([state_of(3, r, 48)["fsdp"].data for r in range(WORLD)])
    assert got["fsdp"].tobytes() == rows.tobytes()


def manager(comm: Any, root: Path) -> CheckpointManager:
    return CheckpointManager(
        local_dir=f"{root}/l1/{{node}}",
        comm=comm,
        node=f"n{comm.rank}",
        write=WRITE,
        at_exit=ExitPolicy(flush=False, sigterm=False),
    )


@pytest.mark.parametrize("background_copy", [False, True], ids=["copy-now", "background-copy"])
def test_a_manager_save_plans_once_and_makes_the_same_collectives_each_time(
    tmp_path: Path, background_copy: bool
) -> None:
    def body(comm: Any) -> tuple[list[int], tuple[int, int]]:
        c = CountingComm(comm)
        mgr = manager(c, tmp_path)
        counts = []
        for step, wide in ((1, 64), (2, 64), (3, 64), (4, 48)):  # step 4: another layout
            state = state_of(step, c.rank, wide)
            before = c.tally.collectives()
            mgr.save(step, state, background_copy=background_copy)
            mgr.wait()
            counts.append(c.tally.collectives() - before)
        assert mgr.failed_saves == []
        got = {"w": np.zeros((96, 48), np.float32), "b": np.zeros(3000, np.int64)}
        got["fsdp"] = Shard(np.zeros((4, 8), np.float32), (4 * c.rank, 0), (4 * WORLD, 8))
        got["rng"], got["step"] = PerRank(np.zeros(3, np.uint32)), 0
        assert mgr.restore(got).step == 4
        want = state_of(4, c.rank, 48)
        for k in ("w", "b"):
            assert got[k].tobytes() == want[k].tobytes(), k
        assert got["fsdp"].data.tobytes() == want["fsdp"].data.tobytes()
        assert got["rng"].value.tobytes() == want["rng"].value.tobytes() and got["step"] == 4
        plans = mgr._stager.plans
        mgr.close(flush=False)
        return counts, (plans.made, plans.reused)

    for counts, made_reused in run_threads(WORLD, body):
        # the staging's roll call and agreement (an allgather), the saver's roll call (a
        # background copy's agreement is the saver's: none more), the save's five votes, the
        # retention's allgather: the same for every save
        assert counts == [8 if background_copy else 9] * 4, counts
        # per layout: the share's plan and the save's (a Shard among the tensors: two
        # layouts), each made once; every later save of the layout finds the save's
        assert made_reused == (4, 2), made_reused


def test_a_pure_replica_state_is_planned_once_for_the_staging_and_the_save(
    tmp_path: Path,
) -> None:
    def body(comm: Any) -> tuple[int, int]:
        mgr = manager(comm, tmp_path)
        for step in (1, 2, 3):
            mgr.save(step, {"w": np.full((96, 64), step, np.float32), "n": step})
            mgr.wait()
        plans = mgr._stager.plans
        mgr.close(flush=False)
        return plans.made, plans.reused

    # the staging made the plan; the first save found it, and so did every later one
    assert run_threads(WORLD, body) == [(1, 3)] * WORLD


def test_bytes_and_objects_are_in_the_share_and_the_save_commits(tmp_path: Path) -> None:
    def body(comm: Any) -> list[Any]:
        mgr = CheckpointManager(
            local_dir=f"{tmp_path}/l1/{{node}}",
            comm=comm,
            node=f"n{comm.rank // 2}",
            write=WRITE,
            at_exit=ExitPolicy(flush=False, sigterm=False),
        )
        state = {
            "w": np.arange(96 * 64, dtype=np.float32).reshape(96, 64),
            "raw": bytes(range(256)) * 160,  # whole, among the replicas: 40 KiB
            "obj": {1, 2, 3},  # pickled
        }
        mgr.save(1, state, objects="pickle")
        mgr.wait()
        assert mgr.failed_saves == []
        staged = mgr.last_save.staged_bytes
        got = {"w": np.zeros((96, 64), np.float32), "raw": b"", "obj": None}
        assert mgr.restore(got, trust_pickle=True).step == 1
        mgr.close(flush=False)
        return [staged, got["w"].tobytes() == state["w"].tobytes(), got["raw"], got["obj"]]

    for staged, same, raw, obj in run_threads(4, body):
        assert same and raw == bytes(range(256)) * 160 and obj == {1, 2, 3}
        assert staged < 96 * 64 * 4  # each rank staged its share of the array


@pytest.mark.mpi
def test_counts_under_mpiexec(tmp_path: Path) -> None:
    """The same counts with ``MpiComm`` under ``mpiexec -n 2`` (each rank its own node; its
    roll calls keep their deadline): five votes per ``save_collective``, nine collectives per
    manager save, each layout planned once, the restore bit-exact (bytes in the state too)."""
    result = run_mpi(
        2,
        REPO / "tests" / "workers" / "_count_worker.py",
        str(tmp_path),
        timeout=240,
        env=with_kit_path(os.environ),
    )
    assert_ok(result)
    for rank in range(2):
        report = json.loads((tmp_path / f"count-{rank}.json").read_text())
        assert report["save_collective"] == [VOTES] * 3, report
        assert report["save_collective_plans"] == [2, 1], report
        assert report["manager"] == [9] * 4 and report["failed"] == [], report
        assert report["manager_plans"] == [4, 2], report
        assert report["restored_step"] == 4 and report["bit_exact"], report
