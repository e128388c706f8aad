"""Acting on SIGTERM at once, whatever the main thread is doing.

A scheduler sends SIGTERM some time before it kills a job; the managers use that time to flush
their newest checkpoints to level 3. A Python signal handler runs only in the main thread,
between bytecodes: if the signal is delivered to another thread (an MPI progress thread, the
saver) while the main thread sleeps in ``time.sleep`` or waits in a C call, the handler runs only
when that returns (20 s later in the case that was reported). So the C-level handler's wake-up
file descriptor (``signal.set_wakeup_fd``) is watched by a thread of ours, which starts the flush
at once; the Python handler does the same when it runs first. Whichever comes first acts; the
other waits for it. Then the previous handler runs (from the main thread), or, when there was
none and the main thread has not got to it, the process ends as SIGTERM would end it (status
143).

There is one watch per process (``ckptfmt.parallel.manager.exit`` installs it for every open manager
together): ``on_term`` is the flush of all of them. It acts on one SIGTERM; :meth:`remove` takes it
away again, giving SIGTERM back what it had before, so that a process with no open manager
handles SIGTERM as if ckptfmt were not there.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ckptfmt")

__all__ = ["SigtermWatch"]


class SigtermWatch:
    """Install with :meth:`install` and take away with :meth:`remove` (both from the main thread
    only: Python's rule for ``signal.signal``). ``on_term`` is called at most once, from the
    watcher thread, the main thread's handler or :meth:`remove`, whichever sees SIGTERM first,
    and never after :meth:`remove`.

    A handler installed after this one (by the user, by a framework) is not touched: the watcher
    still starts ``on_term`` at once but then leaves the process to that handler (which runs from
    the main thread, and may call this one, the handler it replaced, to chain: that call returns
    once ``on_term`` is done). When such a handler is on top at :meth:`remove`, this one stays
    beneath it as a pure pass-through to the handler that was there before it."""

    def __init__(self, on_term: Callable[[], None]) -> None:
        self.on_term = on_term
        self.previous: Any = None
        # re-entrant: the main thread's handler may run while the main thread holds it. Reading
        # the wake-up fd and claiming on_term happen together under it, so that remove() never
        # misses a SIGTERM that the watcher has read but not yet acted on.
        self._lock = threading.RLock()
        self._running = False  # a SIGTERM was seen: on_term runs or ran
        self._removed = False  # on_term will never run
        self._read_seen = False  # a SIGTERM was read from the wake-up fd
        self._done = threading.Event()
        self._read_fd: int | None = None
        self._write_fd: int | None = None

    @property
    def spent(self) -> bool:
        """True once a SIGTERM was seen or the watch was removed: it calls ``on_term`` no more."""
        with self._lock:
            return self._running or self._removed

    def install(self) -> None:
        """Main thread: put the handler in place (keeping the one it replaces as ``previous``)
        and, when nobody else watches the wake-up fd, start the watcher thread."""
        self.previous = signal.signal(signal.SIGTERM, self._handler)
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        try:
            old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:  # not the main thread of the main interpreter
            os.close(r)
            os.close(w)
            return
        if old != -1:  # someone else (asyncio, say) watches the wake-up fd: keep theirs
            signal.set_wakeup_fd(old)
            os.close(r)
            os.close(w)
            return
        self._read_fd, self._write_fd = r, w
        threading.Thread(target=self._watch, args=(r,), name="ckptfmt-sigterm", daemon=True).start()

    def remove(self) -> None:
        """Main thread: ``on_term`` will not run after this. A SIGTERM already in the wake-up fd
        that the watcher has not read yet is acted on here first. Unless a SIGTERM was seen
        (then this waits for ``on_term`` to end, and leaves the handler to finish what it
        started), the handler this one replaced is put back when this one is still on top; the
        wake-up fd is released and the watcher thread ends."""
        if self._take() == "mine":
            self._run()
        with self._lock:
            seen = self._running
            if not seen:
                self._removed = True
                self._done.set()
        if seen:
            self._done.wait()
        elif self._on_top():
            previous = self.previous
            if previous is not None:  # None: a handler not set from Python, which cannot be
                signal.signal(signal.SIGTERM, previous)  # put back: stay as a pass-through
        w, self._write_fd = self._write_fd, None
        if w is not None:
            old = signal.set_wakeup_fd(-1)
            if old != w:  # someone set theirs since: keep it
                signal.set_wakeup_fd(old)
            os.close(w)  # the watcher reads the end of the pipe and stops

    def _on_top(self) -> bool:
        return bool(signal.getsignal(signal.SIGTERM) == self._handler)

    def _claim(self) -> bool:
        """Under the lock: True when on_term is the caller's to run (nobody runs or ran it and
        the watch is in place)."""
        if self._running or self._removed:
            return False
        self._running = True
        return True

    def _take(self) -> str:
        """Read what the wake-up fd holds (the lock held: see ``__init__``): ``"mine"`` when it
        held the first SIGTERM and on_term is the caller's to run, ``"seen"`` when it held the
        first SIGTERM and on_term runs, ran, or never will, ``"end"`` once the pipe is closed,
        ``""`` otherwise."""
        with self._lock:
            fd = self._read_fd
            if fd is None:
                return "end"
            try:
                data = os.read(fd, 512)
            except BlockingIOError:
                return ""
            except OSError:
                data = b""
            if not data:  # remove() closed the other end
                self._read_fd = None
                os.close(fd)
                return "end"
            if signal.SIGTERM not in data or self._read_seen:
                return ""
            self._read_seen = True
            return "mine" if self._claim() else "seen"

    def _run(self) -> None:
        try:
            self.on_term()
        except Exception as exc:
            log.warning("flush at SIGTERM failed: %s", exc)
        finally:
            self._done.set()

    def _ends_process(self) -> bool:
        """True when nothing else will end the process as SIGTERM asks: this handler is still on
        top (the main thread has not run it, and nobody installed one over it) and there was no
        handler before it (the default action)."""
        return self._on_top() and self.previous in (signal.SIG_DFL, None)

    def _watch(self, read_fd: int) -> None:
        """The watcher thread: reads the wake-up fd until :meth:`remove` closes its other end
        (after the first SIGTERM too, so that the C handler's writes never meet a closed
        pipe)."""
        while True:
            try:
                select.select([read_fd], [], [])
            except (OSError, ValueError):  # closed
                return
            got = self._take()
            if got == "end":
                return
            if got == "mine":
                self._run()
            if got in ("mine", "seen"):
                self._done.wait()
                if self._ends_process():
                    # no handler of the user's to run: end as SIGTERM would (the main thread
                    # may not run Python code again for a long time)
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(128 + signal.SIGTERM)
                # else the handler on top runs from the main thread

    def _handler(self, signum: int, frame: Any) -> None:
        with self._lock:
            mine = self._claim()
        if mine:
            self._run()
        else:
            self._done.wait()
        previous = self.previous
        if callable(previous):
            if self._on_top():  # one SIGTERM: the next goes straight to the previous handler
                signal.signal(signal.SIGTERM, previous)
            previous(signum, frame)
        elif previous == signal.SIG_IGN:
            if self._on_top():
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
        else:  # the default action (or a handler not set from Python): end as SIGTERM would
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signum)
