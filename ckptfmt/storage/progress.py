"""Progress of the operations that move a checkpoint's bytes: save, load, rebuild, reshard,
verify, export, import.

Every one of them takes a ``progress`` callable that receives :class:`Progress` events, the one
shape for all of them::

    def show(p: ckptfmt.Progress) -> None:
        print(f"{p.op} {p.phase}: {p.done}/{p.total} bytes ({100 * p.fraction:.0f}%)")

    ckptfmt.save(state, path, progress=show)

What is counted is the operation's whole work, in bytes: a save its data files and (level 1)
its parity file; a load the chunks this process reads and what it receives from other ranks;
a rebuild every member's data and parity checked, then what is read again, rebuilt and
written; a reshard every new file's data read, the file written, and with redundancy every
member read back and its parity written; a verify every data file read and checked; an export
every tensor's bytes written; an import the save (or the save and the reshard) that writes the
checkpoint. ``done`` never decreases; the last event of an
operation that succeeds has ``final`` set and ``done == total``, and comes once the operation's
work is done (a bar at 100% means finished). ``total`` is fixed before the first byte is
counted, except for a rebuild that finds damage: its check comes first, and the rebuild's work
is added to ``total`` once, when it is known (``phase`` goes from ``"check"`` to
``"rebuild"``); and for an import laid out for several ranks, whose reshard's work is added
once its one-process save is done (``phase`` ``"reshard"``).

The callable is called from the thread doing the work (a saver thread, a reader thread),
never from a thread of its own, at most every ``interval`` seconds (and once at the end), so
it may be slow-ish but should not block. It must not raise: an exception from it is logged
once and the callable dropped; the operation goes on. Counting costs one addition per file
(or per member), nothing per chunk.

The counting points (the shard writer, the parity encoder, the readers) find the operation's
:class:`Meter` with :func:`current_meter`: the entry point opens it with :func:`metering`
around the call, so that layers in between (the collective save) need no extra parameter.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger("ckptfmt")

OPERATIONS = ("save", "load", "rebuild", "reshard", "verify", "export", "import")


@dataclass(frozen=True)
class Progress:
    """One progress event of an operation (module docstring).

    ``op``: ``"save"``, ``"load"``, ``"rebuild"``, ``"reshard"``, ``"verify"``, ``"export"``
    or ``"import"``; ``done``/``total``: bytes
    of work done and to do; ``phase``: what the last counted bytes were (``"write"``,
    ``"parity"``, ``"read"``, ``"check"``, ``"rebuild"``); ``final``: the operation's last
    event (its work is done)."""

    op: str
    done: int
    total: int
    phase: str = ""
    final: bool = False

    @property
    def fraction(self) -> float:
        """``done / total`` (1.0 when there was nothing to do)."""
        return 1.0 if self.total <= 0 else min(1.0, self.done / self.total)


ProgressCallback = Callable[[Progress], None]

DEFAULT_INTERVAL = 0.1  # seconds between two events at most once per interval


class Meter:
    """Counts the bytes of one operation and hands :class:`Progress` events to its callback,
    throttled (module docstring). Thread-safe: reader and writer threads may count at once."""

    def __init__(
        self, op: str, callback: ProgressCallback | None, interval: float = DEFAULT_INTERVAL
    ) -> None:
        self.op = op
        self.done = 0
        self.total = 0
        self.phase = ""
        self.interval = interval
        self._callback = callback
        self._lock = threading.Lock()
        self._last = -float("inf")  # time of the last event
        self._shown = -1  # done of the last event

    @property
    def active(self) -> bool:
        """Whether anyone listens (no callback, or one dropped: counting is skipped)."""
        return self._callback is not None

    def expect(self, nbytes: int) -> None:
        """Add ``nbytes`` of work to the total (before any of it is counted done)."""
        if self._callback is None:
            return
        with self._lock:
            self.total += int(nbytes)

    def add(self, nbytes: int, phase: str = "") -> None:
        """Count ``nbytes`` of work done; an event when the last one is ``interval`` old. The
        event saying ``done == total`` waits for :meth:`finish` (the work may not be over:
        a commit, say)."""
        if self._callback is None:
            return
        with self._lock:
            self.done += int(nbytes)
            if phase:
                self.phase = phase
            now = time.monotonic()
            if now - self._last >= self.interval and self.done < self.total:
                self._emit(now, False)

    def finish(self) -> None:
        """The operation's work is done: the last event (``final``, ``done == total``)."""
        if self._callback is None:
            return
        with self._lock:
            self.done = self.total = max(self.done, self.total)
            self._emit(time.monotonic(), True)

    def _emit(self, now: float, final: bool) -> None:
        callback = self._callback
        if callback is None or (not final and self.done == self._shown):
            return
        self._last, self._shown = now, self.done
        done = self.done if final else min(self.done, self.total)
        try:
            callback(Progress(self.op, done, self.total, self.phase, final))
        except Exception:  # the user's callback: never into the operation
            log.warning(
                "progress callback of %s failed; it is not called again", self.op, exc_info=True
            )
            self._callback = None


_OFF = Meter("", None)
_CURRENT: contextvars.ContextVar[Meter] = contextvars.ContextVar("ckptfmt_meter", default=_OFF)


def current_meter() -> Meter:
    """The meter of the operation this thread runs (an inactive one when nobody listens).
    A counting point calls it in the thread that called the entry point (contextvars do not
    follow work into pool threads): capture it before handing work to a pool."""
    return _CURRENT.get()


@contextmanager
def metering(op: str, callback: ProgressCallback | None) -> Iterator[Meter]:
    """Open the meter of operation ``op`` for this thread (and the code it calls) while the
    block runs; the caller calls :meth:`Meter.finish` when the work is done. With no callback
    the meter is inactive and nothing is counted."""
    if op not in OPERATIONS:
        raise ValueError(f"unknown operation {op!r}")
    meter = Meter(op, callback)
    token = _CURRENT.set(meter if callback is not None else _OFF)
    try:
        yield meter
    finally:
        _CURRENT.reset(token)


__all__ = ["Meter", "Progress", "ProgressCallback", "current_meter", "metering"]
