"""Crashes injected into a worker process at a chosen point of a save."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

from ckptfmt.storage import commit

WORKER = "tests/workers/_tools_kill_worker.py"


def kill_in_save(n: int) -> None:
    """SIGKILL this process when the ``n``-th checkpoint directory is about to be renamed into
    place (its staging directory whole beside it): a crash in the middle of a save, or of a
    manager's flush."""
    real, count = commit.publish, [0]

    def publish(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        if count[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    commit.publish = publish  # type: ignore[assignment]


def kill_cli(
    n: int, watch: str | os.PathLike[str], *args: str | os.PathLike[str], exchange: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``ckptfmt *args`` in a process of its own that SIGKILLs itself right after the
    ``n``-th rename or directory exchange in the directory ``watch`` (``n`` = 0: runs to the
    end; ``n`` < 0: right before the ``-n``-th); ``exchange=False``: as on a file system
    without ``RENAME_EXCHANGE`` (``tests/workers/_tools_kill_worker.py``). Returns the
    finished process (``returncode`` -9 when killed); ``steps(result)`` counts the steps it
    saw."""
    from kit import REPO
    from kit.launch import with_kit_path

    cmd = [sys.executable, WORKER, str(n), os.fspath(watch), "1" if exchange else "0", "--"]
    return subprocess.run(
        [*cmd, *map(os.fspath, args)],
        cwd=REPO,
        env=with_kit_path(dict(os.environ)),
        capture_output=True,
        text=True,
        timeout=300,
    )


def steps(result: subprocess.CompletedProcess[str]) -> int:
    """How many renames and exchanges a :func:`kill_cli` run that was not killed made."""
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("steps: "), result.stderr[-2000:]
    return int(last.split()[1])
