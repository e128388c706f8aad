"""SIGTERM arriving while ``close()`` flushes (tests/parallel/test_exit_races.py).

Usage: ``_close_sigterm_worker.py KIND HANDLER OUT_DIR ROOT`` (KIND ``single``: one process;
``mpi``: under mpiexec, MpiComm over COMM_WORLD, rank ``r`` on node ``n{r}``). HANDLER ``flag``:
the user's SIGTERM handler, installed before the manager, records the signal and returns (a
training loop's "stop gracefully" flag); ``none``: SIGTERM's default action.

The manager keeps level 1 in ``ROOT/l1/n{r}`` and level 3 in ``ROOT/l3`` with ``flush_every=100``:
step 1 (8 tensors, 8 shard files per rank) is committed on level 1 only when ``close()`` starts
its flush. When the flush has copied the third shard file of this process (whichever thread
copies it), the process sends itself SIGTERM, the scheduler's warning. With ``flag`` the worker
then writes ``OUT_DIR/closed.rank<r>.json`` (the signals the handler saw, the flush warnings)
once ``close()`` returned.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

import ckptfmt.parallel.levels.layout as layout
from ckptfmt import CheckpointManager, Shard

TENSORS = 8


N = 150_000  # elements of each rank's row of each tensor


def value(rank: int, i: int) -> np.ndarray:
    """Rank ``rank``'s row of tensor ``t{i}`` (tensor ``i`` is ``(ranks, N)``, one row each)."""
    return np.arange(N, dtype=np.float32) + 1000 * i + rank


def main(argv: list[str]) -> int:
    kind, handler, out_s, root_s = argv
    out, root = Path(out_s), Path(root_s)
    comm: Any = None
    rank = 0
    if kind == "mpi":
        from kit.worker import make_comm

        comm = make_comm("mpi")
        rank = comm.rank
    seen: list[int] = []
    if handler == "flag":
        signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    mgr = CheckpointManager(
        local_dir=f"{root}/l1/n{rank}",
        shared_dir=f"{root}/l3",
        node=f"n{rank}",
        flush_every=100,
        comm=comm,
    )
    size = 1 if comm is None else comm.size
    state = {f"t{i}": Shard(value(rank, i)[None], (rank, 0), (size, N)) for i in range(TENSORS)}
    mgr.save(1, state)
    mgr.wait()

    real, copied = layout.copy_verified, [0]

    def copy_verified(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        copied[0] += 1
        if copied[0] == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    layout.copy_verified = copy_verified  # type: ignore[assignment]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr.close()
    doc = {"signals": seen, "warnings": [str(w.message) for w in caught], "copied": copied[0]}
    (out / f"closed.rank{rank}.json").write_text(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
