r"""Writer threads kept from save to save.

A save writes its shard files with a few threads (``WriteOptions.threads`` per node, shared by
the node's ranks). Starting them anew for every save cost about 1 ms of a 30 ms level-1 save
of 256 MiB here (two thread starts, each waiting for the new thread to take the GIL), which
matters when a step is checkpointed every iteration. The pools are kept per process and per
size and are never shut down by ckptfmt; idle threads cost nothing, and the interpreter joins
them at exit. A forked child (a data loader's worker) does not inherit threads, so a pool is
only ever used by the process that made it.

The jobs given to these pools never wait on other jobs of the same pool (each writes its own
files), so several saves in flight at once may share one pool without a deadlock: they take
turns on its threads.

They are :class:`Pool` objects: once the main thread has ended, Python refuses every thread
pool new work (``cannot schedule new futures after interpreter shutdown``), while it still
waits for the threads running, such as a save in flight behind the loop (``dcp.async_save``'s
thread, a manager's saver thread); such a save then writes its remaining files in its own
thread and commits, rather than fail at its next write and lose the checkpoint.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import BrokenExecutor, Future, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_lock = threading.Lock()
_pools: dict[tuple[int, int], ThreadPoolExecutor] = {}


class Pool(ThreadPoolExecutor):
    """A thread pool that runs a job in the calling thread when Python refuses it new work
    because the interpreter is exiting (see the module's docstring); ``map`` goes through
    :meth:`submit` too. Refused after :meth:`shutdown`, as any pool."""

    _closed = False

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        try:
            return super().submit(fn, *args, **kwargs)
        except BrokenExecutor:
            raise
        except RuntimeError:
            if self._closed:  # shut down by its owner, not by the interpreter's exit
                raise
        done: Future[T] = Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # the job's error, told through its future as a pool does
            done.set_exception(exc)
        return done

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._closed = True
        super().shutdown(wait, cancel_futures=cancel_futures)


def writer_pool(workers: int) -> ThreadPoolExecutor:
    """This process's pool of ``workers`` writer threads (made on first use)."""
    key = (os.getpid(), workers)
    with _lock:
        pool = _pools.get(key)
        if pool is None:
            if any(pid != key[0] for pid, _ in _pools):  # a fork's copies: their threads are gone
                _pools.clear()
            pool = _pools[key] = Pool(workers, thread_name_prefix="ckptfmt-write")
        return pool


__all__ = ["Pool", "writer_pool"]
