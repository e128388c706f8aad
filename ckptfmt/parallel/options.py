"""The options of a :class:`~ckptfmt.parallel.manager.CheckpointManager` that come as objects
(one object per concern instead of a long parameter list): how its files are written
(:class:`~ckptfmt.format.options.WriteOptions`, the same object the one-process save and
``ckptfmt reshard`` take) and what it does when the job ends (:class:`ExitPolicy`). The
manager's other keywords (levels, redundancy, cadence, retention, error handling) are its
everyday settings and stay keywords."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

from ckptfmt.errors import UsageError
from ckptfmt.format.options import WriteOptions

__all__ = ["ExitPolicy", "OnError", "check_on_error", "legacy_options"]

OnError = Literal["warn", "raise"]


@dataclass(frozen=True)
class ExitPolicy:
    """What a manager does when the job ends (the same on every rank).

    ``flush``: at ``close()`` and at interpreter exit, flush the newest level-1 step to level 3
    when level 3 lacks it and the last measured flush rate says it fits in ``budget_s``
    seconds; ``sigterm``: install a SIGTERM handler (from the main thread only) that does the
    same flush from the saver thread and then ends the process, whatever the main thread is
    doing (SCR's and torch-elastic's preemption signal)."""

    flush: bool = True
    budget_s: float = 120.0
    sigterm: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.budget_s, bool) or not isinstance(self.budget_s, (int, float)):
            raise UsageError(f"budget_s must be a number of seconds, got {self.budget_s!r}")
        if self.budget_s < 0:
            raise UsageError(f"budget_s must be >= 0, got {self.budget_s!r}")


# the manager's keywords before the options objects, and where each went
_WRITE_KEYWORDS = {
    "fsync": "fsync",
    "chunk_bytes": "chunk_bytes",
    "shard_bytes": "shard_bytes",
    "threads": "threads",
}
_EXIT_KEYWORDS = {
    "exit_flush": "flush",
    "exit_flush_budget_s": "budget_s",
    "handle_sigterm": "sigterm",
}


def legacy_options(
    old: Mapping[str, Any], write: WriteOptions, at_exit: ExitPolicy
) -> tuple[WriteOptions, ExitPolicy]:
    """``write`` and ``at_exit`` with the manager's former keywords ``old`` folded in (with a
    ``DeprecationWarning`` naming the new spelling); an unknown keyword is a ``TypeError``, as
    for any function."""
    unknown = sorted(set(old) - set(_WRITE_KEYWORDS) - set(_EXIT_KEYWORDS))
    if unknown:
        raise TypeError(f"CheckpointManager() got unexpected keyword argument(s) {unknown}")
    w = _folded(old, _WRITE_KEYWORDS, "write=WriteOptions")
    e = _folded(old, _EXIT_KEYWORDS, "at_exit=ExitPolicy")
    return (replace(write, **w) if w else write), (replace(at_exit, **e) if e else at_exit)


def _folded(old: Mapping[str, Any], names: Mapping[str, str], spelling: str) -> dict[str, Any]:
    """The fields of one options object that ``old`` sets (renamed), warned of once."""
    fields = {names[k]: v for k, v in old.items() if k in names}
    if fields:
        args = ", ".join(f"{k}={v!r}" for k, v in fields.items())
        warnings.warn(
            f"CheckpointManager({', '.join(sorted(k for k in old if k in names))}=...) "
            f"is deprecated: pass {spelling}({args})",
            DeprecationWarning,
            stacklevel=4,
        )
    return fields


def check_on_error(on_error: str) -> OnError:
    if on_error not in get_args(OnError):
        raise UsageError(f"on_error is 'warn' or 'raise', got {on_error!r}")
    return on_error  # type: ignore[return-value]
