"""Acting on SIGTERM at once, whatever the main thread is doing.

A scheduler sends SIGTERM some time before it kills a job; the manager uses that time to flush
the newest checkpoint to level 3. A Python signal handler runs only in the main thread, between
bytecodes: if the signal is delivered to another thread (an MPI progress thread, the saver) while
the main thread sleeps in ``time.sleep`` or waits in a C call, the handler runs only when that
returns (20 s later in the case that was reported). So the C-level handler's wake-up file
descriptor (``signal.set_wakeup_fd``) is watched by a thread of ours, which starts the flush at
once; the Python handler does the same when it runs first. Whichever comes first acts; the other
waits for it. Then the previous handler runs (from the main thread), or, when there was none and
the main thread has not got to it, the process ends as SIGTERM would end it (status 143).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ckptfmt")


class SigtermWatch:
    """Install with :meth:`install` (main thread only); ``on_term`` is called once, from the
    watcher thread or the main thread's handler, whichever sees SIGTERM first."""

    def __init__(self, on_term: Callable[[], None]) -> None:
        self.on_term = on_term
        self.previous: Any = None
        self._lock = threading.Lock()
        self._started = False
        self._done = threading.Event()
        self._read_fd: int | None = None

    def install(self) -> None:
        self.previous = signal.signal(signal.SIGTERM, self._handler)
        r, w = os.pipe()
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
        self._read_fd = r
        threading.Thread(target=self._watch, name="ckptfmt-sigterm", daemon=True).start()

    def _run_once(self) -> bool:
        """Run ``on_term`` if nobody has; True if this call ran it."""
        with self._lock:
            if self._started:
                first = False
            else:
                self._started = first = True
        if not first:
            self._done.wait()
            return False
        try:
            self.on_term()
        except Exception as exc:
            log.warning("flush at SIGTERM failed: %s", exc)
        finally:
            self._done.set()
        return True

    def _watch(self) -> None:
        assert self._read_fd is not None
        while True:
            try:
                data = os.read(self._read_fd, 64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM in data:
                self._run_once()
                if not callable(self.previous) or self.previous in (signal.SIG_DFL, None):
                    # no handler of the user's to run: end as SIGTERM would (the main thread
                    # may not run Python code again for a long time)
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(128 + signal.SIGTERM)
                return  # the user's handler runs from the main thread's handler below

    def _handler(self, signum: int, frame: Any) -> None:
        self._run_once()
        previous = self.previous
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        else:
            signal.raise_signal(signum)
