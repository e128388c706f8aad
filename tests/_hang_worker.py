"""Under mpiexec / torchrun, 2 ranks: ``save`` called on rank 0 only (tests/test_faults.py).

Usage: ``_hang_worker.py KIND OUT_DIR ROOT``. Rank 0 saves step 5 and waits; rank 1 never calls
``save``: it sleeps, then leaves (``mpi``: after rank 0 has reported; ``torch``: at once after
the sleep, so rank 0's transport sees its peer gone). Rank 0 must be told, within the
manager's deadline (MpiComm) or as soon as the transport fails (TorchComm), naming the step and
(MpiComm) the rank that did not arrive; ``wait()`` must never report success for a save that
did not happen, and the manager must refuse further collective calls.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
from _worker_common import make_comm

from ckptfmt import CheckpointManager
from ckptfmt.errors import CkptError, CollectiveTimeoutError


def main(argv: list[str]) -> int:
    kind, out, root = argv
    comm = make_comm(kind)
    mgr = CheckpointManager(
        local_dir=f"{root}/l1/{{node}}",
        comm=comm,
        node=f"n{comm.rank}",
        on_error="warn",
        deadline_s=3.0,
    )
    res: dict[str, object] = {"rank": comm.rank}
    if comm.rank == 0:
        started = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mgr.save(5, {"a": np.ones(1000)})
            mgr.wait()
        res["seconds"] = time.perf_counter() - started
        res["warnings"] = [str(w.message) for w in caught]
        res["failed"] = [
            [s, type(e).__name__, str(e), list(getattr(e, "missing", ()))]
            for s, e in mgr.failed_saves
        ]
        res["latest"] = mgr.latest()
        try:
            mgr.save(6, {"a": np.ones(1000)})
            res["next"] = "accepted"
        except CkptError as exc:
            res["next"] = type(exc).__name__
        res["timeout_class"] = CollectiveTimeoutError.__name__
        Path(out, "rank0.json").write_text(json.dumps(res))
    else:
        time.sleep(6 if kind == "mpi" else 4)
    sys.stdout.flush()
    if kind == "mpi":
        comm.barrier()  # rank 0 has written its result (its manager is broken; MPI is not)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
