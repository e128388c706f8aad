"""Crashes injected into a worker process at a chosen point of a save."""

from __future__ import annotations

import os
import signal
from typing import Any

from ckptfmt.storage import commit


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
