"""A training loop whose levels fill up (issue: a full level must lose no checkpoint silently).

Run with ``L1 L3 OUT MODE SEED [SEED ...]`` where ``L1`` and ``L3`` are small file systems (the
test mounts tmpfs there): for each seed, a ``CheckpointManager(keep_local=3, keep_shared=3)``
saves steps 10..120 of random sizes (one that fits nowhere, the last one small), the loop catching
``CkptError`` around each ``save`` as a user's would, then ``close``; a fresh manager restores.
Prints one JSON line per seed (rank 0): what the loop was told, what each level holds, the
restored step and whether its data is bit-exact. Runs in one process or under ``mpiexec``
(``python -m mpi4py``; every rank on one node).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from ckptfmt import CheckpointManager, CkptError, ExitPolicy, FlushWarning, WriteOptions
from ckptfmt.transport.comm import Comm, SingleComm

UNIT = 100 << 10  # sizes are in 100 KiB units: 3..15 fit, 45 fits nowhere
STEPS = list(range(10, 130, 10))


def make_comm() -> Comm:
    if int(os.environ.get("PMI_SIZE", "1")) > 1:
        from ckptfmt.transport.mpi import MpiComm

        return MpiComm()
    return SingleComm()


def sizes_of(seed: int) -> dict[int, int]:
    rng = random.Random(seed)
    sizes = {s: rng.randint(3, 15) for s in STEPS}
    sizes[STEPS[rng.randrange(1, len(STEPS) - 1)]] = 45
    sizes[STEPS[-1]] = 1
    return sizes


def state_of(step: int, units: int) -> dict[str, Any]:
    """The state saved at ``step``: its bytes depend on the step, so a restore is checked bit
    for bit against the one step it claims to be."""
    rng = np.random.default_rng(step)
    return {"w": rng.integers(0, 2**31, units * UNIT // 4, dtype=np.int32), "step": step}


def run(comm: Comm, l1: Path, l3: Path, mode: str, seed: int) -> dict[str, Any]:
    if comm.rank == 0:
        for root in (l1, l3):
            for child in root.iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()
    comm.barrier()
    sizes = sizes_of(seed)
    kw: dict[str, Any] = {
        "local_dir": str(l1),
        "shared_dir": str(l3),
        "comm": comm,
        "keep_local": 3,
        "keep_shared": 3,
        "write": WriteOptions(chunk_bytes=64 << 10, shard_bytes=256 << 10, fsync=False),
        "at_exit": ExitPolicy(sigterm=False),
    }
    raised: dict[int, int | None] = {}  # the call's step -> the step the raised error named
    flush_warned: list[int] = []
    returned: list[int] = []
    mgr = CheckpointManager(on_error=mode, **kw)  # type: ignore[arg-type]
    for step in STEPS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                mgr.save(step, state_of(step, sizes[step]))
                returned.append(step)
            except CkptError as exc:
                raised[step] = getattr(exc, "step", None)
        flush_warned += [w.message.step for w in caught if isinstance(w.message, FlushWarning)]
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        try:
            mgr.close()
        except CkptError as exc:
            raised[-1] = getattr(exc, "step", None)
    failed = [s for s, _ in mgr.failed_saves]
    reports = mgr.save_reports
    committed = [r.step for r in reports if r.level is not None]
    reached = {
        "l1": [r.step for r in reports if r.level == 1],
        "l3": [r.step for r in reports if r.level == 3 or r.flushed],
    }
    errors = {s: str(e)[:400] for s, e in mgr.failed_saves}
    told_saved = [s for s in STEPS if s not in failed]
    held = {
        "l1": sorted(p.name for p in l1.glob("step-*")),
        "l3": sorted(p.name for p in l3.glob("step-*")),
    }
    fresh = CheckpointManager(**kw)
    report = fresh.restore()
    restored = report.step
    exact = None
    if restored is not None:
        want = state_of(restored, sizes[restored])
        got = report.state
        assert got is not None
        exact = bool(np.array_equal(got["w"], want["w"]) and got["step"] == restored)
    fresh.close(flush=False)
    return {
        "seed": seed,
        "ranks": comm.size,
        "mode": mode,
        "sizes": sizes,
        "returned": returned,
        "raised": raised,
        "failed": failed,
        "committed": committed,
        "reached": reached,
        "errors": errors,
        "flush_warned": flush_warned,
        "told_saved": told_saved,
        "held": held,
        "restored": restored,
        "level": report.level,
        "exact": exact,
    }


def main() -> None:
    l1, l3, out, mode = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    comm = make_comm()
    lines = [json.dumps(run(comm, l1, l3, mode, int(seed))) for seed in sys.argv[5:]]
    if comm.rank == 0:
        with out.open("a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
