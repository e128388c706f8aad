"""Under mpiexec, 2 ranks: SIGTERM delivered to a thread other than the main one while the main
thread sleeps (tests/faults/test_rank_failures.py). The flush must start at once (the wake-up fd
watcher), not when the sleep ends; then the process ends.

Usage: ``_sigterm_worker.py OUT_DIR ROOT``.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
from kit.worker import make_comm

from ckptfmt import CheckpointManager


def main(argv: list[str]) -> int:
    out, root = argv
    comm = make_comm("mpi")
    mgr = CheckpointManager(
        local_dir=f"{root}/l1/{{node}}",
        shared_dir=f"{root}/l3",
        comm=comm,
        node=f"n{comm.rank}",
        flush_every=1000,
        redundancy="xor",
    )
    for step in (1, 2):
        mgr.save(step, {"w": np.full((256, 256), step, np.float32)})
    mgr.wait()
    comm.barrier()

    def send() -> None:  # a signal to this (non-main) thread: the main thread is not woken
        time.sleep(0.3)
        Path(out, f"rank{comm.rank}.sent").write_text(str(time.time()))
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

    threading.Thread(target=send).start()
    time.sleep(30)
    Path(out, f"rank{comm.rank}.survived").write_text("")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
