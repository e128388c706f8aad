"""An incremental manager under ``mpiexec -n 2`` (every rank its own simulated node): level 1
with xor redundancy across the two nodes, level 3 a shared directory, saves in the background.
Each save changes a few rows of a sharded weight; a large replicated table stays frozen. The
last save (step 5) changes no data at all: its set's parity files are the previous step's.

Run with ``ROOT``. Prints one JSON line per rank: every save's report (bytes written and
linked per level), then, after a fresh manager restored, the step and whether it is bit-exact.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ckptfmt import CheckpointManager, ExitPolicy, Shard, WriteOptions
from ckptfmt.transport.mpi import MpiComm

ROWS, COLS = 512, 64


def whole(k: int) -> dict[str, np.ndarray]:
    frozen = np.random.default_rng(1).standard_normal((2048, 64), dtype=np.float32)
    w = np.random.default_rng(2).standard_normal((ROWS, COLS), dtype=np.float32)
    for j in range(1, k + 1):
        w[(j * 97) % ROWS] += j
        w[(j * 31) % ROWS] -= j
    return {"frozen": frozen, "w": w}


def state(rank: int, size: int, k: int) -> dict[str, Any]:
    g = whole(k)
    rows = ROWS // size
    part = g["w"][rank * rows : (rank + 1) * rows].copy()
    return {"frozen": g["frozen"], "w": Shard(part, (rank * rows, 0), (ROWS, COLS)), "k": k}


def manager(comm: MpiComm, root: Path) -> CheckpointManager:
    return CheckpointManager(
        f"{root}/l1/{{node}}",
        root / "l3",
        comm=comm,
        node=f"n{comm.rank}",
        redundancy={"scheme": "xor", "set_size": 2},
        keep_local=2,
        keep_shared=2,
        incremental=True,
        write=WriteOptions(fsync=False, chunk_bytes=8 << 10, shard_bytes=32 << 10, threads=1),
        at_exit=ExitPolicy(flush=False, sigterm=False),
    )


def main() -> None:
    root = Path(sys.argv[1])
    comm = MpiComm()
    reports: list[Any] = []
    m = manager(comm, root)
    for k in range(6):
        m.save(k, {**state(comm.rank, comm.size, min(k, 4)), "k": k}).result()
        assert m.last_save is not None
        reports.append(m.last_save.to_json())
    m.close(flush=False)
    m = manager(comm, root)
    target = state(comm.rank, comm.size, 0)
    got = m.restore(target)
    want = whole(4)
    rows = ROWS // comm.size
    exact = bool(
        np.array_equal(target["frozen"], want["frozen"])
        and np.array_equal(target["w"].data, want["w"][comm.rank * rows : (comm.rank + 1) * rows])
    )
    m.close(flush=False)
    # one file per rank: two ranks printing to one pipe can interleave their lines
    out = Path(root) / f"report-{comm.rank}.json"
    out.write_text(
        json.dumps(
            {
                "rank": comm.rank,
                "reports": reports,
                "step": got.step,
                "level": got.level,
                "exact": exact,
            }
        )
    )


if __name__ == "__main__":
    main()
