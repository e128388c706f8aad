"""Counting the collectives of saves under ``mpiexec -n 2`` (``MpiComm``, every rank its own
simulated node), for ``tests/parallel/test_plan_once.py``: ``_count_worker.py ROOT``.

Each rank's ``MpiComm`` is wrapped in ``kit.counting.CountingComm`` (the real one underneath).
Three ``save_collective`` calls (two of one layout, then another), then a manager's saves (three
of one layout, then another) and a restore checked bit for bit. Each rank writes
``ROOT/count-<rank>.json``: the collectives of each save, the plan cache's tallies, whether the
restore was bit-exact.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from kit.counting import CountingComm

from ckptfmt import CheckpointManager, ExitPolicy, PerRank, Shard, WriteOptions
from ckptfmt.parallel.collective.save import save_collective
from ckptfmt.plan.cache import PlanCache
from ckptfmt.transport.mpi import MpiComm

WRITE = WriteOptions(fsync=False, chunk_bytes=4 << 10, shard_bytes=16 << 10)


def state(step: int, rank: int, size: int, wide: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    rows = np.random.default_rng([step, rank]).standard_normal((4, 8)).astype(np.float32)
    return {
        "w": rng.standard_normal((96, wide)).astype(np.float32),
        "fsdp": Shard(rows, (4 * rank, 0), (4 * size, 8)),
        "rng": PerRank(np.full(3, rank + step, np.uint32)),
        "raw": bytes(range(256)) * 40,
        "step": step,
    }


def main() -> None:
    root = Path(sys.argv[1])
    comm = CountingComm(MpiComm())
    rank, size = comm.rank, comm.size
    report: dict[str, Any] = {"save_collective": [], "manager": []}
    plans = PlanCache()
    for step, wide in ((1, 64), (2, 64), (3, 48)):
        before = comm.tally.collectives()
        path = root / "plain" / f"n{rank}" / f"step-{step}"  # node-local: a group each
        save_collective(
            comm, state(step, rank, size, wide), path, step=step, node=f"n{rank}", write=WRITE,
            plans=plans, group=f"n{rank}",
        )  # fmt: skip
        report["save_collective"].append(comm.tally.collectives() - before)
    report["save_collective_plans"] = [plans.made, plans.reused]
    mgr = CheckpointManager(
        local_dir=f"{root}/l1/{{node}}",
        comm=comm,
        node=f"n{rank}",
        write=WRITE,
        at_exit=ExitPolicy(flush=False, sigterm=False),
    )
    for step, wide in ((1, 64), (2, 64), (3, 64), (4, 48)):
        before = comm.tally.collectives()
        mgr.save(step, state(step, rank, size, wide), objects="pickle")
        mgr.wait()
        report["manager"].append(comm.tally.collectives() - before)
    report["failed"] = [str(f) for f in mgr.failed_saves]
    report["manager_plans"] = [mgr._stager.plans.made, mgr._stager.plans.reused]
    got: dict[str, Any] = {
        "w": np.zeros((96, 48), np.float32),
        "fsdp": Shard(np.zeros((4, 8), np.float32), (4 * rank, 0), (4 * size, 8)),
        "rng": PerRank(np.zeros(3, np.uint32)),
        "raw": b"",
        "step": 0,
    }
    report["restored_step"] = mgr.restore(got).step
    want = state(4, rank, size, 48)
    report["bit_exact"] = (
        got["w"].tobytes() == want["w"].tobytes()
        and got["fsdp"].data.tobytes() == want["fsdp"].data.tobytes()
        and got["rng"].value.tobytes() == want["rng"].value.tobytes()
        and got["raw"] == want["raw"]
        and got["step"] == 4
    )
    mgr.close(flush=False)
    (root / f"count-{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
