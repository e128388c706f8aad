"""MPI worker of ``tests/redundancy/test_rebuild_rewrite.py``: a restore after a lost node
returns the state from the rebuild in memory; the rebuilt files are written afterwards on the
manager's saver thread, and that write is killed midway.

    mpiexec -n 4 python -m mpi4py _rebuild_rewrite_worker.py <out> <root> crash|again

4 ranks on 2 simulated nodes (``n0``: ranks 0 and 1, ``n1``: ranks 2 and 3), level 1 only, xor
(sets [0, 2] and [1, 3]: losing ``n1`` loses two ranks' data and parity). Each rank's state:
its rows of two tensors (``Shard``), a replicated array every rank saves and loads whole, and a
value.

* ``crash``: save step 1; ``n1``'s directory is moved aside (the lost node; the test compares
  the rebuild with it); restore. Each rank checks the state bit for bit and writes
  ``crash.rank<r>.json``; then the write of the rebuilt files goes on behind, and rank 2 (the
  leader of ``n1``) ends the process with ``os._exit`` at the fault point ``rebuild-writing``:
  its data files are in the staging directory, its parity and the manifest are not.
* ``again``: a fresh job restores (the step must be rebuilt again, bit for bit), waits for the
  write of the rebuilt files and writes ``again.rank<r>.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from kit.worker import make_comm

from ckptfmt import CheckpointManager, Shard, WriteOptions

NODES = 2
CRASH_RANK = 2
CRASH_EXIT = 9
ROWS, COLS = 96, 512  # rows per rank of each sharded tensor


def node_of(rank: int, size: int) -> str:
    return f"n{rank * NODES // size}"


def state_of(rank: int, size: int, fill: bool = True) -> dict[str, Any]:
    """The state saved (``fill``), or a zeroed template of it (what restore fills)."""

    def rows(name: str) -> Shard:
        rng = np.random.default_rng([rank, len(name)])
        data = rng.standard_normal((ROWS, COLS), dtype=np.float32)
        return Shard(data if fill else np.zeros_like(data), (rank * ROWS, 0), (size * ROWS, COLS))

    shared = np.random.default_rng(99).integers(0, 1 << 30, (64, 300), dtype=np.int64)
    return {
        "model": {"w": rows("w"), "shared": shared if fill else np.zeros_like(shared)},
        "opt": {"m": rows("opt.m"), "lr": 0.25 if fill else 0.0},
    }


def digest(state: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for a in (state["model"]["w"].data, state["model"]["shared"], state["opt"]["m"].data):
        h.update(np.ascontiguousarray(a).tobytes())
    h.update(repr(state["opt"]["lr"]).encode())
    return h.hexdigest()


def manager(comm: Any, root: Path, fault: Any = None) -> CheckpointManager:
    return CheckpointManager(
        local_dir=f"{root}/l1/{{node}}",
        comm=comm,
        node=node_of(comm.rank, comm.size),
        redundancy="xor",
        on_error="raise",
        fault=fault,
        write=WriteOptions(shard_bytes=64 << 10, chunk_bytes=16 << 10, fsync=False),
    )


def restore(mgr: CheckpointManager, rank: int, size: int) -> dict[str, Any]:
    state = state_of(rank, size, fill=False)
    rep = mgr.restore(state)
    return {
        "rank": rank,
        "step": rep.step,
        "level": rep.level,
        "tried": rep.tried,
        "rebuilt": rep.rebuilt,
        "bitwise": digest(state) == digest(state_of(rank, size)),
        "report_bitwise": rep.state is not None
        and digest(rep.state) == digest(state_of(rank, size)),
    }


def crash(comm: Any, out: Path, root: Path) -> None:
    rank, size = comm.rank, comm.size
    reported = threading.Event()
    armed = threading.Event()

    def fault(point: str) -> None:
        if armed.is_set() and point == "rebuild-writing" and rank == CRASH_RANK:
            reported.wait(60)  # this rank's results first: the restore did return
            deadline = time.monotonic() + 60  # and every rank's: ending the job kills them all
            while time.monotonic() < deadline and not all(
                (out / f"crash.rank{r}.json").exists() for r in range(size)
            ):
                time.sleep(0.05)
            (out / "crash.crashed").write_text(f"{rank} {point}")
            os._exit(CRASH_EXIT)

    mgr = manager(comm, root, fault)
    mgr.save(1, state_of(rank, size))
    mgr.wait()
    comm.barrier()
    if rank == CRASH_RANK:
        shutil.move(root / "l1" / "n1", root / "aside" / "n1")
    comm.barrier()
    armed.set()
    res = restore(mgr, rank, size)
    tmp = out / f".crash.rank{rank}.json"
    tmp.write_text(json.dumps(res))
    tmp.rename(out / f"crash.rank{rank}.json")  # whole when it appears (rank 2 looks for it)
    reported.set()
    mgr.close(flush=False)  # waits for the write, which rank 2 never finishes
    (out / f"crash.rank{rank}.closed").write_text("")


def again(comm: Any, out: Path, root: Path) -> None:
    rank, size = comm.rank, comm.size
    mgr = manager(comm, root)
    res = restore(mgr, rank, size)
    mgr.wait()
    report = mgr.last_restore
    assert report is not None
    res["rewrite"] = report.rewrite
    mgr.close(flush=False)
    (out / f"again.rank{rank}.json").write_text(json.dumps(res))


def main(argv: list[str]) -> int:
    out, root, phase = Path(argv[0]), Path(argv[1]), argv[2]
    comm = make_comm("mpi")
    {"crash": crash, "again": again}[phase](comm, out, root)
    comm.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
