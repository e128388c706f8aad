"""The end of a job: the managers' flush at interpreter exit and at SIGTERM, for every open
manager of the process together.

One registry per process (:data:`EXITS`) holds the open managers' hooks in the order they were
made; a manager is added when it starts and taken out when it is closed. It owns one SIGTERM
watch (``ckptfmt.parallel.manager.sigterm``) and one ``atexit`` hook, and so it is the same whether
a process makes one manager or many (the Lightning plugin and the Keras callback make several):

- At interpreter exit every open manager is closed, oldest first (``close`` waits for the save in
  flight and flushes the newest level-1 checkpoint within its exit policy's budget; collective on
  the manager's communicator). That runs before ``concurrent.futures`` shuts the process's
  thread pools (from then on they take no work: a save still in flight, whose writer threads are
  such a pool, would fail), and as an ``atexit`` hook where that cannot be arranged.
  Constructing a manager is collective, so the order is the same on every rank, and managers
  that share a communicator close in the same order everywhere.
- At SIGTERM (a scheduler's warning, on any thread) every open manager whose policy asks for it
  flushes its newest checkpoint, one after another, oldest first. Each flush runs on that
  manager's saver thread, after its save in flight, on the saver threads' communicator, since the
  training thread may be anywhere, in the middle of its own collectives; every rank gets the
  signal and queues the same flushes in the same order (for each: a roll call, an all-true, the
  flush). One after another rather than all at once: each manager's budget is checked against its
  own measured flush rate, which holds only when it has the storage to itself, and the flushes
  go to the same level 3 through the same links, so running them together would make none of
  them faster to finish while risking that none is whole when the job is killed; in turn, the
  oldest manager's checkpoint is whole first, the time taken is at most the sum of the budgets,
  and the order is the same on every rank. A manager that is closed (or broken) does nothing.
  Then the handler that was there before runs (from the main thread), or the process ends as
  SIGTERM would (status 143).
- The watch is installed when the first manager whose policy asks for it starts on the main
  thread (Python lets only the main thread install a signal handler), and removed when the last
  such manager is closed on the main thread: SIGTERM's handler and the wake-up fd are then what
  they were before, so that a process with no open manager handles SIGTERM as if ckptfmt were not
  there. A manager made on another thread is registered all the same (closed at exit, flushed at
  SIGTERM) but cannot install the watch: SIGTERM is acted on for it only once a manager is made
  on the main thread, or one was already (a warning says so). A last manager closed on another
  thread leaves the watch in place with nothing to flush: a pass-through to what was before it
  (the process still ends with status 143 when there was no handler) until a manager is next made
  and closed on the main thread.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable

from ckptfmt.errors import CkptError
from ckptfmt.parallel.manager.options import ExitPolicy
from ckptfmt.parallel.manager.outcomes import Calls, Outcomes
from ckptfmt.parallel.manager.retention import Retention
from ckptfmt.parallel.manager.save_job import Saver
from ckptfmt.parallel.manager.sigterm import SigtermWatch

log = logging.getLogger("ckptfmt")

__all__ = ["EXITS", "ExitHooks", "ExitRegistry"]


class ExitHooks:
    """One manager's part in the end of the job: ``close`` at interpreter exit and (when
    ``policy.sigterm``) the flush at SIGTERM, run by :data:`EXITS` from :meth:`install` (when the
    manager starts) until :meth:`uninstall` (when it is closed)."""

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
        # re-entrant: the main thread's SIGTERM handler may run inside uninstall()
        self._lock = threading.RLock()
        self._gone = False

    def install(self) -> None:
        """Local: add this manager to the process's registry (which installs the SIGTERM watch
        when it can and has none yet)."""
        EXITS.register(self)

    def uninstall(self) -> None:
        """Local: take this manager out of the registry: nothing of it runs at SIGTERM or at exit
        any more (a flush already queued by a SIGTERM still runs before the saver stops)."""
        with self._lock:
            self._gone = True
        EXITS.unregister(self)

    def _flush_job(self, done: threading.Event | None = None) -> Callable[[], None]:
        """The flush of the newest checkpoint as a job for the saver thread, on the saver
        threads' communicator, with the one call number every flush at the end of a job carries
        (-1): close's and SIGTERM's are the same call, so whichever a rank runs first pairs
        with the other ranks' first, and the second finds the step flushed and does nothing."""

        def job() -> None:
            try:
                self._retention.flush_newest(
                    self._calls, self.policy.budget_s, self._saver.bg, seq=-1
                )
            finally:
                if done is not None:
                    done.set()

        return job

    def flush_at_close(self) -> None:
        """``close``'s flush (every rank, in close): queued on the saver thread after the saves in
        flight, and waited for. Never on the calling thread: a SIGTERM during it queues its own
        flush behind this one, instead of copying the same step into the same staging directory
        beside it (the main thread's copy, resumed after a SIGTERM handler that returns, would
        then commit over the whole one a step missing the files copied before the signal)."""
        self._saver.put(self._flush_job())
        self._saver.idle.wait()

    def at_sigterm(self) -> None:
        """The scheduler's warning (any thread): flush the newest checkpoint within the budget,
        on the saver thread (see the module's docstring), and wait for it; failures are logged."""
        done = threading.Event()
        job = self._flush_job(done)

        with self._lock:  # queued before close() stops the saver, or not at all
            if self._gone or self._calls.closed or self._calls.broken is not None:
                return
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


class ExitRegistry:
    """The process's open managers' exit hooks, in the order the managers were made, with the one
    SIGTERM watch and the one ``atexit`` hook that run them (see the module's docstring). Its
    methods are local and may be called from any thread."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        # replaced, never changed in place: at SIGTERM it is read without the lock (the handler
        # may interrupt the main thread while that holds it)
        self._hooks: tuple[ExitHooks, ...] = ()
        self._watch: SigtermWatch | None = None
        self._exiting = False
        self._before_pools = False  # at_exit is hooked ahead of the thread pools' shutdown

    def register(self, hooks: ExitHooks) -> None:
        """Add ``hooks`` (last in the order); install the SIGTERM watch if it asks for one, none
        is in place and this is the main thread; move the ``atexit`` hook to the end of the
        ``atexit`` list, so that it runs before the hooks registered until now (the transport
        finalized by one of those, MPI say, is still there when the managers close)."""
        with self._lock:
            self._hooks = (*self._hooks, hooks)
            if not self._exiting:
                atexit.unregister(self.at_exit)
                atexit.register(self.at_exit)
                if not self._before_pools:
                    self._before_pools = _before_thread_pools(self.at_exit)
            if (
                hooks.policy.sigterm
                and not self._exiting
                and (self._watch is None or self._watch.spent)
            ):
                if threading.current_thread() is threading.main_thread():
                    if self._watch is not None:  # acted on a SIGTERM already: a fresh one
                        self._watch.remove()
                    self._watch = SigtermWatch(self.at_sigterm)
                    self._watch.install()
                else:
                    log.warning(
                        "a CheckpointManager made off the main thread cannot install the "
                        "SIGTERM handler: SIGTERM flushes it only once a manager is made on "
                        "the main thread"
                    )

    def unregister(self, hooks: ExitHooks) -> None:
        """Take ``hooks`` out; when no open manager asks for the SIGTERM watch any more and this
        is the main thread, remove it (SIGTERM is handled as before the first manager), and with
        no open manager at all, the ``atexit`` hook."""
        with self._lock:
            self._hooks = tuple(h for h in self._hooks if h is not hooks)
            if not self._hooks and not self._exiting:
                atexit.unregister(self.at_exit)
            if (
                self._watch is not None
                and not any(h.policy.sigterm for h in self._hooks)
                and threading.current_thread() is threading.main_thread()
            ):
                self._watch.remove()
                self._watch = None

    def at_sigterm(self) -> None:
        """The watch's action, once per SIGTERM (any thread): every open manager's flush, one
        after another, oldest first (see the module's docstring); one that fails is logged and
        the next goes on."""
        for hooks in self._hooks:
            if not hooks.policy.sigterm:
                continue
            try:
                hooks.at_sigterm()
            except Exception as exc:
                log.warning("flush at SIGTERM failed: %s", exc)

    def at_exit(self) -> None:
        """Interpreter exit (the ``atexit`` hook, on the main thread): remove the SIGTERM watch
        (acting first on a SIGTERM it has not read yet, or waiting for the flush one started: a
        handler installed over ckptfmt's may have ended the interpreter while the flushes ran, and
        a close must never flush beside them), then close every open manager, oldest first."""
        with self._lock:
            self._exiting = True  # atexit's list is not changed while atexit runs it
            watch, self._watch = self._watch, None
        if watch is not None:
            watch.remove()
        for hooks in self._hooks:
            hooks.at_exit()


def _before_thread_pools(hook: Callable[[], None]) -> bool:
    """Have ``hook`` run at interpreter exit before ``concurrent.futures`` marks every thread
    pool shut: CPython's ``threading._register_atexit`` (which ``concurrent.futures`` uses
    itself) runs its hooks last registered first, before the ``atexit`` ones. Once for the
    process (it has no way back: ``hook`` does nothing when no manager is open). False where
    there is no such hook or the interpreter is exiting already."""
    import concurrent.futures.thread  # noqa: F401  (its hook registered first, so run after ours)

    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return False
    try:
        register(hook)
    except RuntimeError:  # "can't register atexit after shutdown"
        return False
    return True


EXITS = ExitRegistry()
"""The process's one registry: every manager's exit hooks go through it."""
