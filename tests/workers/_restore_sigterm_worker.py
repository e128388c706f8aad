"""A SIGTERM flush running while ``restore()`` cleans level 3 (tests/parallel/test_exit_races.py).

Usage: ``_restore_sigterm_worker.py OUT_DIR ROOT``. One process; the manager keeps level 1 in
``ROOT/l1`` and level 3 in ``ROOT/l3``, ``flush_every=100``: step 1 (8 tensors, 8 shard files) is
on level 1 only. The user's SIGTERM handler is installed after the manager (on top of ckptfmt's:
it records the signal and returns, so the main thread goes on while ckptfmt's watcher flushes).

The main thread calls ``restore()``. When the restore is about to remove the leftovers of crashed
writes on level 3 (``commit.clean_leftovers``, its first step after waiting for the saves in
flight), the process sends itself SIGTERM and lets that clean-up run only once the SIGTERM flush
has copied its first shard file into its staging directory on level 3; the flush goes on once the
clean-up is over. Then ``close()``. ``OUT_DIR/result.json``: the signals seen, the restored step,
the flush warnings told and ``failed_flushes``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np

import ckptfmt.parallel.levels.layout as layout
from ckptfmt import CheckpointManager
from ckptfmt.storage import commit

TENSORS, N = 8, 150_000


def value(i: int) -> np.ndarray:
    return np.arange(N, dtype=np.float32) + 1000 * i


def main(argv: list[str]) -> int:
    out, root = Path(argv[0]), Path(argv[1])
    l3 = (root / "l3").absolute()
    mgr = CheckpointManager(local_dir=f"{root}/l1", shared_dir=str(l3), flush_every=100)
    seen: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    state = {f"t{i}": value(i) for i in range(TENSORS)}
    mgr.save(1, state)
    mgr.wait()

    copying, cleaned = threading.Event(), threading.Event()
    real_copy, real_clean = layout.copy_verified, commit.clean_leftovers

    def copy_verified(*args: Any, **kwargs: Any) -> None:
        real_copy(*args, **kwargs)
        if not copying.is_set():  # the SIGTERM flush's first file is in its staging directory
            copying.set()
            cleaned.wait(30)

    def clean_leftovers(where: Path, *args: Any, **kwargs: Any) -> Any:
        main = threading.current_thread() is threading.main_thread()
        if main and Path(where).absolute() == l3 and not cleaned.is_set():
            os.kill(os.getpid(), signal.SIGTERM)
            copying.wait(30)
            try:
                return real_clean(where, *args, **kwargs)
            finally:
                cleaned.set()
        return real_clean(where, *args, **kwargs)

    layout.copy_verified = copy_verified  # type: ignore[assignment]
    commit.clean_leftovers = clean_leftovers  # type: ignore[assignment]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = mgr.restore()
        mgr.close()
    doc = {
        "signals": seen,
        "restored": report.step,
        "raced": copying.is_set() and cleaned.is_set(),
        "warnings": [str(w.message) for w in caught],
        "failed_flushes": [s for s, _ in mgr.failed_flushes],
    }
    (out / "result.json").write_text(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
