"""Run a benchmark script on its own ranks under torchrun and collect what rank 0 wrote.

The torch benchmarks are one file each: started plainly, ``main`` relaunches the same file with
the same arguments under ``torch.distributed.run`` plus ``--part FILE``, and the rank 0 of
that launch writes its measurements to ``FILE`` as JSON (``RANK`` in the environment tells a
rank from the launcher)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

WARM_MALLOC = {  # keep freed memory in the heap (bench/README.md, "Memory")
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
}


def launch(
    script: str,
    argv: list[str],
    ranks: int,
    timeout: int,
    part: Path,
    env: dict[str, str],
) -> tuple[dict[str, Any] | None, float, tuple[float, float, float]]:
    """Run ``script argv --part part`` on ``ranks`` torchrun ranks within ``timeout`` seconds,
    with ``env`` over this process's environment; return rank 0's JSON (None when the launch
    failed, said on stderr), the launch's wall seconds and the load average at its start."""
    part.unlink(missing_ok=True)
    cmd = [
        "timeout", "-k", "5", str(timeout), sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nproc-per-node", str(ranks), script, *argv, "--part", str(part),
    ]  # fmt: skip
    t0 = time.perf_counter()
    load_start = os.getloadavg()
    done = subprocess.run(cmd, cwd=REPO, env={**os.environ, **env})
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        print(f"torchrun failed with exit status {done.returncode}", file=sys.stderr)
        return None, wall, load_start
    data = json.loads(part.read_text())
    part.unlink()
    return data, wall, load_start
