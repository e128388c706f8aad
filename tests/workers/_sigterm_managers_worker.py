"""Several managers in one process, some closed, then SIGTERM
(tests/parallel/test_sigterm_managers.py).

Usage: ``_sigterm_managers_worker.py KIND OUT_DIR ROOT OP [OP ...]`` (KIND ``single``: one
process, no communicator; ``mpi``: under mpiexec, MpiComm over COMM_WORLD, rank ``r`` on node
``n{r}``). Manager ``X`` keeps level 1 in ``ROOT/X/l1`` (``ROOT/X/l1/n{r}`` under MPI) and level
3 in ``ROOT/X/l3``, ``flush_every=100`` (no save is flushed before the signal). The ops, in order:

- ``open:X``: make manager X on the main thread; ``open-thread:X``: make it on another thread
  (which ends once it is made).
- ``save:X:N``: save step N of X, ``{"w": full((64, 64), value(X, N))}``, and wait for it.
- ``close:X``: ``close(flush=False)``: X's newest step stays off level 3, so that a flush of a
  closed manager at SIGTERM would show.
- ``handler``: install the user's SIGTERM handler here (before or after the managers): it
  appends one line to ``OUT_DIR/handler.rank<r>.txt`` (JSON: the steps committed on each
  manager's level 3 when it ran) and raises ``SystemExit(7)``.
- ``disposition``: write ``OUT_DIR/disposition.rank<r>.json``: what SIGTERM's handler is here
  (``"default"``, ``"user"`` or ``"other"``) and the wake-up fd (-1: none).

Then (after a barrier under MPI) ``OUT_DIR/killing.rank<r>`` is written and the process sends
itself SIGTERM from the main thread and sleeps 20 s; a process that gets past writes
``OUT_DIR/survived.rank<r>``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from ckptfmt import CheckpointManager


def value(name: str, step: int) -> float:
    """What every element of X's step N holds (distinct for each manager and step)."""
    return float(100 * (ord(name) - ord("A") + 1) + step)


def committed(l3: Path) -> list[str]:
    return sorted(p.parent.name for p in l3.glob("step-*/ckptfmt.json"))


def main(argv: list[str]) -> int:
    kind, out_s, root_s, *ops = argv
    out, root = Path(out_s), Path(root_s)
    comm: Any = None
    rank, node = 0, ""
    if kind == "mpi":
        from kit.worker import make_comm

        comm = make_comm("mpi")
        rank, node = comm.rank, f"/n{comm.rank}"
    managers: dict[str, CheckpointManager] = {}

    def open_manager(name: str) -> None:
        extra: dict[str, Any] = {} if comm is None else {"comm": comm, "node": node[1:]}
        managers[name] = CheckpointManager(
            local_dir=f"{root}/{name}/l1{node}",
            shared_dir=f"{root}/{name}/l3",
            flush_every=100,
            **extra,
        )

    def user_handler(signum: int, frame: Any) -> None:
        seen = {name: committed(root / name / "l3") for name in sorted(managers)}
        with open(out / f"handler.rank{rank}.txt", "a") as f:
            f.write(json.dumps(seen) + "\n")
        raise SystemExit(7)

    for op in ops:
        verb, _, rest = op.partition(":")
        if verb == "open":
            open_manager(rest)
        elif verb == "open-thread":
            thread = threading.Thread(target=open_manager, args=(rest,))
            thread.start()
            thread.join()
        elif verb == "save":
            name, step = rest.split(":")
            mgr = managers[name]
            mgr.save(int(step), {"w": np.full((64, 64), value(name, int(step)), np.float32)})
            mgr.wait()
        elif verb == "close":
            managers[rest].close(flush=False)
        elif verb == "handler":
            signal.signal(signal.SIGTERM, user_handler)
        elif verb == "disposition":
            now = signal.getsignal(signal.SIGTERM)
            fd = signal.set_wakeup_fd(-1)
            signal.set_wakeup_fd(fd)
            what = (
                "default" if now == signal.SIG_DFL else "user" if now == user_handler else "other"
            )
            (out / f"disposition.rank{rank}.json").write_text(
                json.dumps({"handler": what, "wakeup_fd": fd})
            )
        else:
            raise SystemExit(f"unknown op {op!r}")
    if comm is not None:
        comm.barrier()
    (out / f"killing.rank{rank}").write_text("")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(20)
    (out / f"survived.rank{rank}").write_text("")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
