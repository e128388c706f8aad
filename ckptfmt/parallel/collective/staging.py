"""Staging for asynchronous saves: reusable host buffers and the handles a save returns.

A background save first copies the caller's state into host buffers ("staging"), so that the
training loop may go on changing its tensors while the copy is written. Two things here make
that cheap and explicit:

- :class:`BufferPool`: staging buffers kept for reuse, keyed by shape and dtype. A save takes
  buffers, its background job gives them back when the checkpoint no longer needs them, and the
  next save (of this manager or of any other manager sharing the pool: by default every
  manager of the process shares :func:`default_pool`) gets the same memory again: no page
  faults, no allocation, after the first save. New buffers are pre-touched (written once) when
  they are made, so the first save's copy is not slowed by page faults either.
- :class:`SaveHandle`: what ``CheckpointManager.save`` returns. ``staged`` completes when the
  caller may mutate the saved tensors again; ``committed`` when the checkpoint is committed on
  its level (result: the step) or failed (exception: the save's error, e.g.
  :class:`~ckptfmt.errors.SaveFailedError`). The shape of ``torch.distributed.checkpoint``'s
  ``AsyncSaveResponse`` and torch-checkpointing's ``(stage_future, write_future)``: a handle
  unpacks into the two futures (``staged, committed = mgr.save(step, state)``).

How the staging copy is made (``CheckpointManager.save``):

- default: copied before ``save`` returns (``staged`` is already done);
- ``background_copy=True``: copied by the saver thread; ``save`` returns after checking the
  state and ``staged`` completes when the copy is done. The loop may run what does not write the
  saved tensors (a forward and backward pass) meanwhile and waits on ``staged`` before its
  optimizer step: the copy overlaps the step's compute (on a GPU node the host is idle then).
- ``donate=True``: no copy; the writer reads the caller's arrays, and ``staged`` completes only
  when the whole save is done with them (at the end of the background job).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any

import numpy as np

from ckptfmt.errors import SaveSkippedError, UsageError

_Key = tuple[tuple[int, ...], str]


class BufferPool:
    """Host staging buffers for reuse: :meth:`take` a C-contiguous array of a shape and dtype
    (a free one kept from an earlier save, else a new pre-touched one), :meth:`give` it back
    when nothing reads it any more. Thread-safe (buffers come back from saver threads).

    Free buffers are kept until :meth:`clear` (or ``max_free_bytes`` is exceeded: then the
    buffers given back beyond it are dropped). A pool serves any number of managers; two saves
    in flight at once never get the same buffer, since only free buffers are handed out.
    """

    def __init__(self, max_free_bytes: int | None = None) -> None:
        if max_free_bytes is not None and max_free_bytes < 0:
            raise UsageError(f"max_free_bytes must be >= 0 or None, got {max_free_bytes!r}")
        self.max_free_bytes = max_free_bytes
        self._free: dict[_Key, list[np.ndarray]] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()
        self.allocated_bytes = 0  # bytes of buffers this pool has made
        self.reused = 0  # takes served from free buffers
        self.made = 0  # takes that made a new buffer

    @staticmethod
    def _key(shape: tuple[int, ...], dtype: np.dtype) -> _Key:
        return (tuple(int(n) for n in shape), np.dtype(dtype).str)

    def take(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A C-contiguous buffer of ``shape`` and ``dtype`` for the caller alone until given back
        (its contents are whatever the last user left)."""
        dt = np.dtype(dtype)
        key = self._key(shape, dt)
        with self._lock:
            free = self._free.get(key)
            if free:
                buf = free.pop()
                self._free_bytes -= buf.nbytes
                self.reused += 1
                return buf
        buf = np.empty(key[0], dtype=dt)
        if buf.nbytes:
            buf.reshape(-1).view(np.uint8).fill(0)  # pre-touch: the pages exist from now on
        with self._lock:
            self.allocated_bytes += buf.nbytes
            self.made += 1
        return buf

    def give(self, buffers: Iterable[np.ndarray]) -> None:
        """Return buffers taken from this pool (each once); they may be handed out again."""
        with self._lock:
            for buf in buffers:
                limit = self.max_free_bytes
                if limit is not None and self._free_bytes + buf.nbytes > limit:
                    continue  # over the budget: dropped (freed when unreferenced)
                self._free.setdefault(self._key(buf.shape, buf.dtype), []).append(buf)
                self._free_bytes += buf.nbytes

    def free_addresses(self) -> list[int]:
        """The data addresses of the free buffers (what the next saves will reuse)."""
        with self._lock:
            return [b.ctypes.data for bufs in self._free.values() for b in bufs]

    @property
    def free_bytes(self) -> int:
        """Bytes of the buffers kept free for reuse."""
        return self._free_bytes

    def clear(self) -> None:
        """Drop every free buffer (their memory goes back once nothing else holds them)."""
        with self._lock:
            self._free.clear()
            self._free_bytes = 0


_DEFAULT_POOL = BufferPool()


def default_pool() -> BufferPool:
    """The process's shared pool, used by every ``CheckpointManager`` given no ``pool``."""
    return _DEFAULT_POOL


def copy_mode(donate: bool, background_copy: bool) -> str:
    """``"now"``, ``"background"`` or ``"none"`` (donated) from ``save``'s two flags."""
    if donate and background_copy:
        raise UsageError(
            "donate=True skips the staging copy and background_copy=True makes it later: "
            "give one of them"
        )
    return "none" if donate else "background" if background_copy else "now"


class SaveHandle:
    """The outcome of one ``CheckpointManager.save``, future-like.

    ``staged``: a ``Future`` done when the state given to ``save`` may be mutated again (result
    None). ``committed``: a ``Future`` whose result is the step once the checkpoint is committed
    (and its flush to level 3, when due, tried: a failed flush is no failed save, see
    ``CheckpointManager.failed_flushes``), or whose exception is the save's
    error (:class:`~ckptfmt.errors.SaveFailedError` when the ranks voted the save failed;
    :class:`~ckptfmt.errors.ManagerBrokenError` when the communicator failed). ``staged`` is
    always done when ``committed`` is. The failure is also reported by the manager's next call,
    as without a handle (``on_error``).

    A save taken but not made (``ManagerSettings.when_busy="skip"``) ends with
    :class:`~ckptfmt.errors.SaveSkippedError` in ``committed`` (:meth:`skipped` says so); it is
    no failure and is not reported again at the next call.

    ``staged, committed = handle`` unpacks it into the two futures.
    """

    def __init__(self, step: int) -> None:
        self.step = step
        self.staged: Future[None] = Future()
        self.committed: Future[int] = Future()
        self.staged.set_running_or_notify_cancel()
        self.committed.set_running_or_notify_cancel()
        self._give_up: Callable[[], bool] | None = None  # set where the save can be abandoned

    def __iter__(self) -> Iterator[Future[Any]]:
        return iter((self.staged, self.committed))

    def __repr__(self) -> str:
        state = "committed" if self.committed.done() else "staged" if self.staged.done() else ""
        return f"SaveHandle(step={self.step}{', ' + state if state else ''})"

    def done(self) -> bool:
        """Whether the save is over (committed or failed)."""
        return self.committed.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: as long as it takes) for the save to be over;
        returns whether it is. Never raises the save's error (see :meth:`result`)."""
        try:
            self.committed.exception(timeout)
        except TimeoutError:
            return False
        return True

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Wait until the saved state may be mutated again; returns whether it may."""
        try:
            self.staged.result(timeout)
        except TimeoutError:
            return False
        return True

    def result(self, timeout: float | None = None) -> int:
        """The committed step; raises the save's error, or ``TimeoutError`` after ``timeout``."""
        return self.committed.result(timeout)

    def skipped(self) -> bool:
        """Whether the save is over and was skipped (taken but not made, on every rank)."""
        return self.committed.done() and isinstance(self.committed.exception(), SaveSkippedError)

    def abandon(self) -> bool:
        """Local: give the save up on this rank if nothing of the state has been read for it
        yet (its copy has not begun: it waits behind a save in flight), so that the loop may
        change the state at once instead of waiting for the copy. True: the state is the
        caller's again (``staged`` is done) and the save is skipped on every rank
        (``committed`` ends with :class:`~ckptfmt.errors.SaveSkippedError`; the ranks decide
        it together in the save's first collective step). False: the copy has begun, is done,
        or this save cannot be given up (a manager with ``when_busy="wait"``, or a copy made at
        the call): wait on ``staged`` as usual. The training loop's thread only."""
        give_up = self._give_up
        if give_up is None or self.staged.done() or not give_up():
            return False
        self.set_staged()
        return True

    def can_abandon(self, give_up: Callable[[], bool]) -> None:
        """Let :meth:`abandon` give this save up by ``give_up()`` (True when it did: nothing of
        the state will be read; False when the copy has begun). Set by the manager, or by an
        adapter whose handle stands for the manager's (``give_up`` then abandons that one)."""
        self._give_up = give_up

    # --- set by the manager ----------------------------------------------------------------------

    def set_staged(self) -> None:
        if not self.staged.done():
            self.staged.set_result(None)

    def set_committed(self, error: BaseException | None) -> None:
        """Finish the handle (``staged`` too): the step, or ``error``."""
        self.set_staged()
        if self.committed.done():
            return
        if error is None:
            self.committed.set_result(self.step)
        else:
            self.committed.set_exception(error)
