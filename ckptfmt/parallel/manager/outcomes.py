"""What a :class:`~ckptfmt.parallel.manager.checkpoint_manager.CheckpointManager` reports, and the
state of its collective calls.

:class:`Outcomes` keeps each save's :class:`SaveReport`, the failures not yet told, and the
notices (a save that fell back to level 3); they are told at the manager's next call, as a
:class:`CheckpointWarning` or raised (``on_error``). :class:`Calls` counts the manager's
collective calls (the votes' sequence numbers), runs each call's roll call, and remembers that
the communicator broke, after which no collective call is safe. Both are local: nothing here
talks to another rank except :meth:`Calls.roll_call`.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable

from ckptfmt.errors import (
    CheckpointWarning,
    CkptError,
    CollectiveTimeoutError,
    FlushWarning,
    ManagerBrokenError,
    OutOfStepError,
    UsageError,
)
from ckptfmt.parallel.manager.options import OnError
from ckptfmt.parallel.manager.telemetry import SaveReport
from ckptfmt.transport.comm import Comm

log = logging.getLogger("ckptfmt")

__all__ = ["Calls", "CheckpointWarning", "FlushWarning", "Outcomes"]


class Outcomes:
    """The saves' reports and the failures and notices to tell at the next call. Written by
    the saver thread, told by the training thread (:meth:`tell`), also while saves are in
    flight (``saves_in_flight``): the pending failures are taken under a lock, and each
    save's handle finds its own failure by :meth:`mark`, whatever was told meanwhile.

    A failed save and a failed flush are told differently: a save that failed left no new
    checkpoint (``failed_saves``, a :class:`CheckpointWarning` or raised, ``on_error``); a flush
    that failed left its step safe on level 1 (``failed_flushes``, a :class:`FlushWarning`
    once per step, never raised: the save it follows is committed)."""

    def __init__(self, on_error: OnError, on_save: Callable[[SaveReport], None] | None) -> None:
        self.on_error = on_error
        self.on_save = on_save
        self.notices: list[str] = []  # told at the next call: not failures (a fallback)
        self.last_save: SaveReport | None = None  # the newest save whose outcome is known
        self.save_reports: list[SaveReport] = []  # the newest 100, oldest first
        self.failed_saves: list[tuple[int, CkptError]] = []  # told failures, oldest first
        self.pending: list[tuple[int, CkptError]] = []  # failures not told yet (step -1: none)
        self.failed_flushes: list[tuple[int, CkptError]] = []  # each step once, oldest first
        self._flush_notices: list[tuple[int, CkptError]] = []  # failed flushes not told yet
        # with several saves in flight the loop takes pending failures while a save runs:
        # each failure is also kept here, in order, for the handle of the save it belongs to
        self._lock = threading.Lock()
        self._kept: list[tuple[int, CkptError]] = []

    def fail(self, step: int, exc: CkptError) -> None:
        """Keep the failure of ``step`` for the next call."""
        with self._lock:
            self.pending.append((step, exc))
            self._kept.append((step, exc))

    def mark(self) -> int:
        """Where the failures kept from now on begin (a save's start, for
        :meth:`failure_since`)."""
        return len(self._kept)

    def flush_failed(self, step: int, exc: CkptError) -> None:
        """The flush of ``step`` (committed on level 1) to level 3 failed: keep it for the next
        call, once per step (a step whose flush fails again at exit is not told twice)."""
        if any(s == step for s, _ in self.failed_flushes):
            return
        self.failed_flushes.append((step, exc))
        self._flush_notices.append((step, exc))

    def failure_since(self, mark: int, step: int) -> CkptError | None:
        """The first failure of ``step`` (or of no step in particular) kept after ``mark``
        (:meth:`mark` when the save began): what its handle reports."""
        mine = [e for s, e in self._kept[mark:] if s in (step, -1)]
        return mine[0] if mine else None

    def forget(self, step: int) -> None:
        """Drop the failures kept for ``step`` (they were raised at the call instead)."""
        with self._lock:
            self.pending = [(s, e) for s, e in self.pending if s != step]

    def record_save(self, report: SaveReport) -> None:
        """Keep ``report`` and hand it to ``on_save`` (from the saver thread; a failing
        callback is logged, never raised into the save)."""
        self.last_save = report
        self.save_reports = [*self.save_reports[-99:], report]
        if self.on_save is not None:
            try:
                self.on_save(report)
            except Exception as exc:
                log.warning("on_save callback failed: %s", exc)

    def take(self) -> list[tuple[int, CkptError]]:
        """The failures kept so far, no longer pending (told later by :meth:`tell`)."""
        with self._lock:
            pending, self.pending = self.pending, []
        return pending

    def give_back(self, taken: list[tuple[int, CkptError]]) -> None:
        """Make ``taken`` (from :meth:`take`) pending again, before any kept since."""
        with self._lock:
            self.pending[:0] = taken

    def tell(self, taken: list[tuple[int, CkptError]] | None = None, then: str = "") -> None:
        """Warn of the notices and the failed flushes; then record every failed save kept
        (``taken`` before, then those still pending) in ``failed_saves`` and warn of each, or,
        with ``on_error="raise"``, raise the oldest with the others named in its notes.
        ``then``: what the call that tells them did anyway (``"step 40 was saved"``), added to
        each warning and to the raised error's notes, so that a loop told of an earlier
        step's failure knows that this call's own checkpoint was taken."""
        notices, self.notices = self.notices, []
        for notice in notices:
            warnings.warn(notice, CheckpointWarning, stacklevel=3)
        flushes, self._flush_notices = self._flush_notices, []
        for step, exc in flushes:
            warnings.warn(FlushWarning(step, exc), stacklevel=3)
        failed = [*(taken or []), *self.take()]
        self.failed_saves.extend(failed)
        after = f" ({then})" if then else ""
        if self.on_error == "raise" and failed:
            step, exc = failed[0]
            if then:
                exc.add_note(f"ckptfmt: told at a later call: {then}")
            others = sorted({s for s, _ in failed[1:] if s >= 0})
            if others:
                exc.add_note(f"ckptfmt: the saves of steps {others} failed too (failed_saves)")
            raise exc
        for step, exc in failed:
            what = f"checkpoint of step {step} failed" if step >= 0 else "checkpoints failed"
            warnings.warn(f"{what}: {exc}{after}", CheckpointWarning, stacklevel=3)

    def log_quietly(self, when: str) -> None:
        """Log the failures kept, raising nothing (a signal handler's thread)."""
        for step, exc in self.pending:
            log.warning("%s: step %s: %s", when, step, exc)
        for step, exc in self._flush_notices:
            log.warning("%s: flush of step %s to level 3 failed: %s", when, step, exc)


class Calls:
    """The manager's collective calls on ``comm``: their count (each call's sequence number,
    checked by every roll call and vote), whether the manager is closed, and the failure that
    broke the communicator, if one did."""

    def __init__(self, comm: Comm, deadline_s: float) -> None:
        self.comm = comm
        self.deadline_s = deadline_s
        self.count = 0
        self.broken: CkptError | None = None
        self.closed = False

    def next(self) -> int:
        """Count one more collective call; its sequence number."""
        self.count += 1
        return self.count

    def check_open(self) -> None:
        """Local: raise unless the manager can make a collective call."""
        if self.closed:
            raise UsageError("this CheckpointManager is closed")
        if self.broken is not None:
            raise ManagerBrokenError(
                f"this CheckpointManager cannot make collective calls any more: {self.broken}"
            ) from self.broken

    def roll_call(
        self, what: str, step: int | None, comm: Comm | None = None, seq: int | None = None
    ) -> None:
        """Collective (every rank of ``comm``, default the manager's communicator, at the start
        of each collective call): every rank is in the same call (``what``, ``step``, the call
        number ``seq``, default the current count) within the deadline, or every rank still
        there raises what the roll call raises, and the manager makes no collective call any
        more (its ranks are out of step)."""
        try:
            (comm or self.comm).roll_call(
                self.deadline_s, what, step, self.count if seq is None else seq
            )
        except (CollectiveTimeoutError, OutOfStepError) as exc:
            self.broken = exc
            raise

    def break_on(self, exc: BaseException) -> CkptError:
        """The communicator failed with ``exc``: no collective is safe any more. The failure,
        as a ``CkptError``, is kept and returned."""
        broken = (
            exc
            if isinstance(exc, CkptError)
            else ManagerBrokenError(f"{type(exc).__name__}: {exc}")
        )
        self.broken = broken
        return broken
