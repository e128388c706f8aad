"""A ``Comm`` whose ranks are threads of this process: the collective code of several simulated
ranks and nodes run in one process, without MPI (tests, golden fixtures, experiments).

``run_threads(n, fn)`` calls ``fn(comm)`` on ``n`` threads, each with its own :class:`ThreadComm`
(rank 0..n-1), and returns their results in rank order; an exception on any rank is re-raised
(the first by rank) after every thread has ended. Collectives meet at a ``threading.Barrier``
with a timeout, so a rank that fails or stops early makes the others fail too (a
``BrokenBarrierError``), never hang. Point-to-point messages are copied into per-(source, dest,
tag) queues: ``send`` never blocks, which MPI allows (a standard-mode send may be buffered).

Used by the test suite and by ``spec/fixtures/redundancy_fixtures.py`` to run the real
``save_collective`` of several simulated nodes.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import numpy as np

from ckptfmt.transport.comm import Comm

__all__ = ["ThreadComm", "run_threads"]

TIMEOUT_S = 60.0
T = TypeVar("T")


class _World:
    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=TIMEOUT_S)
        self.slots: list[Any] = [None] * size
        self.lock = threading.Lock()
        self.queues: dict[tuple[int, int, int], queue.Queue[np.ndarray]] = {}
        self.children: list[_World] = []

    def mailbox(self, src: int, dst: int, tag: int) -> queue.Queue[np.ndarray]:
        with self.lock:
            return self.queues.setdefault((src, dst, tag), queue.Queue())


class ThreadComm(Comm):
    """Rank ``rank`` of a world of threads (module docstring)."""

    def __init__(self, world: _World, rank: int) -> None:
        self._world = world
        self.rank = rank
        self.size = world.size
        self._dups = 0

    def _sync(self) -> None:
        self._world.barrier.wait()

    def barrier(self) -> None:
        self._sync()

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        self._world.slots[self.rank] = bytes(data)
        self._sync()
        out = list(self._world.slots)
        self._sync()  # nobody overwrites a slot before everyone has read it
        return out

    def bcast_buffer(self, buf: np.ndarray, root: int) -> None:
        if self.rank == root:
            self._world.slots[root] = np.array(buf, copy=True)
        self._sync()
        if self.rank != root:
            buf.reshape(-1).view(np.uint8)[...] = self._world.slots[root].reshape(-1).view(np.uint8)
        self._sync()

    def send(self, buf: np.ndarray, dest: int, tag: int = 0) -> None:
        data = np.array(buf, copy=True).reshape(-1).view(np.uint8)
        self._world.mailbox(self.rank, dest, tag).put(data)

    def recv(self, buf: np.ndarray, source: int, tag: int = 0) -> None:
        data = self._world.mailbox(source, self.rank, tag).get(timeout=TIMEOUT_S)
        out = buf.reshape(-1).view(np.uint8)
        if data.size != out.size:
            raise RuntimeError(f"recv of {data.size} bytes into {out.size}")
        out[...] = data

    def sendrecv(
        self, sendbuf: np.ndarray, dest: int, recvbuf: np.ndarray, source: int, tag: int = 0
    ) -> None:
        self.send(sendbuf, dest, tag)
        self.recv(recvbuf, source, tag)

    def dup(self) -> ThreadComm:
        self._sync()
        with self._world.lock:
            while len(self._world.children) <= self._dups:
                self._world.children.append(_World(self.size))
            child = self._world.children[self._dups]
        self._dups += 1
        return ThreadComm(child, self.rank)

    def abort(self, code: int = 1) -> NoReturn:
        self._world.barrier.abort()
        raise RuntimeError(f"rank {self.rank} aborted the job (code {code})")


def run_threads(n: int, fn: Callable[[ThreadComm], T]) -> list[T]:
    """``fn(comm)`` on ``n`` thread ranks; their results by rank (module docstring)."""
    world = _World(n)
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def body(rank: int) -> None:
        try:
            results[rank] = fn(ThreadComm(world, rank))
        except BaseException as exc:
            errors[rank] = exc
            world.barrier.abort()  # the others stop waiting for this rank

    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}") for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # the rank that failed first is the interesting one; the others saw a broken barrier
    first = next(
        (e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)),
        next((e for e in errors if e is not None), None),
    )
    if first is not None:
        raise first
    return results
