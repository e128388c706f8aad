"""Under mpiexec / torchrun, 2 ranks: collective calls the ranks do not make together
(tests/faults/test_rank_failures.py).

Usage: ``_hang_worker.py KIND SCENARIO OUT_DIR ROOT``.

* ``one-rank``: rank 0 saves step 5 and waits; rank 1 never calls ``save``: it sleeps past the
  manager's deadline (3 s), then leaves. Rank 0 must be told within the deadline, naming the
  step and the rank that did not arrive; ``wait()`` must never report success for a save that
  did not happen, and the manager must refuse further collective calls.
* ``one-rank-bg``: the same with ``background_copy=True``: ``save`` returns at once (the
  agreement is the saver thread's), and the failure is told by ``wait()`` within the deadline.
* ``other-step``: rank 0 saves step 5 while rank 1 saves step 6 (the same call number): both
  must be told, naming both calls, with nothing committed, and refuse further calls.
* ``restore-vs-save``: rank 0 calls ``restore()`` while rank 1 saves step 5: rank 0's restore
  raises, rank 1's save fails; neither pairs its messages with the other's.

Each rank writes ``rank{r}.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
from kit.worker import end_torch_job, make_comm

from ckptfmt import CheckpointManager
from ckptfmt.errors import CkptError


def main(argv: list[str]) -> int:
    kind, scenario, out, root = argv
    comm = make_comm(kind)
    mgr = CheckpointManager(
        local_dir=f"{root}/l1/{{node}}",
        comm=comm,
        node=f"n{comm.rank}",
        on_error="warn",
        deadline_s=3.0,
    )
    res: dict[str, object] = {"rank": comm.rank}
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if scenario.startswith("one-rank") and comm.rank == 1:
            time.sleep(6)
            finish(kind, scenario, comm)
            return 0
        if scenario == "restore-vs-save" and comm.rank == 0:
            try:
                res["restored"] = mgr.restore().step
            except CkptError as exc:
                res["raised"] = [type(exc).__name__, str(exc)]
        else:
            step = 6 if scenario == "other-step" and comm.rank == 1 else 5
            handle = mgr.save(step, {"a": np.ones(1000)}, background_copy=scenario.endswith("bg"))
            res["returned_s"] = time.perf_counter() - started
            handle.wait_staged()
            mgr.wait()
    res["seconds"] = time.perf_counter() - started
    res["warnings"] = [str(w.message) for w in caught]
    res["failed"] = [
        [s, type(e).__name__, str(e), list(getattr(e, "missing", ()))] for s, e in mgr.failed_saves
    ]
    newest = mgr.latest()
    res["latest"] = None if newest is None else newest.step
    res["on_disk"] = sorted(p.name for p in Path(root).rglob("step-*"))
    try:
        mgr.save(7, {"a": np.ones(1000)})
        res["next"] = "accepted"
    except CkptError as exc:
        res["next"] = type(exc).__name__
    Path(out, f"rank{comm.rank}.json").write_text(json.dumps(res))
    finish(kind, scenario, comm)
    return 0


def finish(kind: str, scenario: str, comm: object) -> None:
    """Leave together where the transport still can (MPI: always, its managers are broken,
    not MPI; a normal exit follows, ``kit/worker.py`` says why; gloo: unless a roll call
    timed out, which closes the connection to that peer)."""
    sys.stdout.flush()
    if kind == "mpi":
        comm.barrier()  # type: ignore[attr-defined]
        return
    if not scenario.startswith("one-rank"):
        end_torch_job()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
