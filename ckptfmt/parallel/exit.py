"""The end of a job: the manager's flush at interpreter exit and at SIGTERM.

At interpreter exit the manager is closed (``close`` waits for the save in flight and flushes
the newest level-1 checkpoint within the exit policy's budget; collective on the manager's
communicator). At SIGTERM (a scheduler's warning, on any thread: ``ckptfmt.parallel.sigterm``)
the same flush runs on the saver thread, after the save in flight, on the saver threads'
communicator, since the training thread may be anywhere, in the middle of its own collectives;
every rank gets the signal and queues the same flush (a roll call, an all-true, the flush).
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable

from ckptfmt.errors import CkptError
from ckptfmt.parallel.options import ExitPolicy
from ckptfmt.parallel.outcomes import Calls, Outcomes
from ckptfmt.parallel.retention import Retention
from ckptfmt.parallel.save_job import Saver
from ckptfmt.parallel.sigterm import SigtermWatch

log = logging.getLogger("ckptfmt")

__all__ = ["ExitHooks"]


class ExitHooks:
    """The manager's hooks at the end of the job: ``close`` at interpreter exit, and (when
    ``policy.sigterm`` and installed from the main thread) the flush at SIGTERM."""

    def __init__(
        self,
        policy: ExitPolicy,
        close: Callable[[], None],
        *,
        saver: Saver,
        retention: Retention,
        calls: Calls,
        outcomes: Outcomes,
    ) -> None:
        self.policy = policy
        self._close = close
        self._saver, self._retention = saver, retention
        self._calls, self._outcomes = calls, outcomes
        self._sigterm: SigtermWatch | None = None

    def install(self) -> None:
        """Local: register the exit hook, and the SIGTERM watch from the main thread."""
        if self.policy.sigterm and threading.current_thread() is threading.main_thread():
            self._sigterm = SigtermWatch(self.at_sigterm)
            self._sigterm.install()
        atexit.register(self.at_exit)

    def at_sigterm(self) -> None:
        """The scheduler's warning (any thread): flush the newest checkpoint within the budget,
        on the saver thread (see the module's docstring); failures are logged."""
        if self._calls.closed or self._calls.broken is not None:
            return
        done = threading.Event()

        def job() -> None:
            try:
                self._retention.flush_newest(
                    self._calls, self.policy.budget_s, self._saver.bg, seq=-1
                )
            finally:
                done.set()

        self._saver.put(job)
        done.wait()
        self._saver.idle.wait()
        self._outcomes.log_quietly("at SIGTERM")

    def at_exit(self) -> None:
        """Interpreter exit: close the manager (a no-op when it is closed already)."""
        try:
            self._close()
        except CkptError as exc:
            log.warning("at exit: %s", exc)
