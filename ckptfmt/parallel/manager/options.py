"""The options of a :class:`~ckptfmt.parallel.manager.checkpoint_manager.CheckpointManager` that
come as objects (one object per concern instead of a long parameter list): how its files are written
(:class:`~ckptfmt.format.options.WriteOptions`, the same object the one-process save and
``ckptfmt reshard`` take) and what it does when the job ends (:class:`ExitPolicy`). The
manager's other keywords (levels, redundancy, cadence, retention, error handling) are its
everyday settings and stay keywords."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from ckptfmt.errors import UsageError

__all__ = ["ExitPolicy", "OnError", "check_on_error"]

OnError = Literal["warn", "raise"]


@dataclass(frozen=True)
class ExitPolicy:
    """What a manager does when the job ends (the same on every rank).

    ``flush``: at ``close()`` and at interpreter exit, flush the newest level-1 step to level 3
    when level 3 lacks it and the last measured flush rate says it fits in ``budget_s``
    seconds; ``sigterm``: at SIGTERM, do the same flush from the saver thread, whatever the
    main thread is doing (SCR's and torch-elastic's preemption signal), then let the signal
    take its course (the handler that was there before, or the end of the process). One
    handler serves every open manager of the process (``parallel.manager.exit``): each flushes its
    newest step, oldest manager first; a closed manager is no longer in it."""

    flush: bool = True
    budget_s: float = 120.0
    sigterm: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.budget_s, bool) or not isinstance(self.budget_s, (int, float)):
            raise UsageError(f"budget_s must be a number of seconds, got {self.budget_s!r}")
        if self.budget_s < 0:
            raise UsageError(f"budget_s must be >= 0, got {self.budget_s!r}")


def check_on_error(on_error: str) -> OnError:
    if on_error not in get_args(OnError):
        raise UsageError(f"on_error is 'warn' or 'raise', got {on_error!r}")
    return on_error  # type: ignore[return-value]
