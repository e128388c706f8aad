"""Saves at every call with a slow level under ``mpiexec -n 2``: ``when_busy="skip"``, two saves
in flight. The level's write is slowed down at the ``"written"`` point (longer on rank 1, so
the ranks' savers are out of phase) well past the loop's step, so most saves find no slot free
or are given up before their copy began (``SaveHandle.abandon``, what ``FencedSaver`` does at
its fence) and are skipped, on every rank alike.

Run with ``ROOT MODE`` (``MODE``: ``now``, copied at the call, or ``background``, copied by the
saver thread). Writes ``ROOT/result-RANK.json`` (files: two ranks' printed lines may
interleave): each save's outcome by step (``"committed"``,
``"skipped"`` or the error), how long the loop was kept at each save (the call, plus the wait
for its copy before the state changes), ``saves_skipped``, the skipped reports' reasons, and
after a fresh manager restored the newest step: that step and whether it is bit-exact.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from ckptfmt import CheckpointManager, ExitPolicy, Shard, WriteOptions
from ckptfmt.errors import SaveSkippedError
from ckptfmt.transport.mpi import MpiComm

ROWS, COLS = 64, 32
SAVES = 10
STEP_S = 0.1  # the loop's compute between two saves
WRITE_S = (0.5, 0.7)  # each rank's level, slowed down at "written"


def whole(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {
        "w": rng.standard_normal((ROWS, COLS), dtype=np.float32),
        "t": rng.integers(0, 1 << 30, (ROWS, COLS), dtype=np.int64),
    }


def state(rank: int, size: int, step: int) -> dict[str, Any]:
    g = whole(step)
    rows = ROWS // size
    part = g["t"][rank * rows : (rank + 1) * rows].copy()
    return {"w": g["w"], "t": Shard(part, (rank * rows, 0), (ROWS, COLS)), "step": step}


def manager(comm: MpiComm, root: Path, fault: Any = None) -> CheckpointManager:
    return CheckpointManager(
        shared_dir=root / "l3",
        comm=comm,
        node=f"n{comm.rank}",
        keep_shared=4,
        saves_in_flight=2,
        when_busy="skip",
        write=WriteOptions(fsync=False, threads=1),
        at_exit=ExitPolicy(flush=False, sigterm=False),
        deadline_s=60.0,
        fault=fault,
    )


def outcome(handle: Any) -> str:
    exc = handle.committed.exception()
    if exc is None:
        return "committed"
    return "skipped" if isinstance(exc, SaveSkippedError) else f"{type(exc).__name__}: {exc}"


def main() -> None:
    root, mode = Path(sys.argv[1]), sys.argv[2]
    comm = MpiComm()

    def slow(point: str) -> None:
        if point == "written":
            time.sleep(WRITE_S[comm.rank])

    mgr = manager(comm, root, slow)
    handles = []
    blocked = []
    pending = None
    for step in range(SAVES):
        entered = time.perf_counter()
        if pending is not None and not pending.abandon():
            pending.wait_staged()  # before the state changes: its copy must be done
        st = state(comm.rank, comm.size, step)
        handle = mgr.save(step, st, background_copy=mode == "background")
        blocked.append(time.perf_counter() - entered)
        handles.append(handle)
        pending = handle if mode == "background" else None
        time.sleep(STEP_S)  # forward and backward
    mgr.wait()
    result = {
        "rank": comm.rank,
        "outcomes": {h.step: outcome(h) for h in handles},
        "blocked": blocked,
        "saves_skipped": mgr.saves_skipped,
        "skipped_steps": mgr.skipped_steps,
        "reasons": [r.error for r in mgr.save_reports if r.skipped],
        "failed": [str(e) for _, e in mgr.failed_saves],
    }
    mgr.close(flush=False)

    fresh = manager(comm, root)
    target = state(comm.rank, comm.size, 0)
    target["t"].data[...] = 0
    target["w"] = np.zeros_like(target["w"])
    report = fresh.restore(target)
    want = state(comm.rank, comm.size, report.step) if report.step is not None else None
    result["restored"] = report.step
    result["exact"] = want is not None and (
        np.array_equal(target["w"], want["w"])
        and np.array_equal(target["t"].data, want["t"].data)
        and target["step"] == want["step"]
    )
    fresh.close(flush=False)
    (root / f"result-{comm.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
