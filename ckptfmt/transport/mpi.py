"""``MpiComm``: the ``Comm`` interface over mpi4py (the only module of the core that imports it).

Only the buffer-based (uppercase) mpi4py methods are used: nothing is pickled. Background
threads call MPI concurrently with the training loop, on a duplicated communicator; that needs
``MPI_THREAD_MULTIPLE``, which mpi4py requests by default and this module checks.

Waiting. MPICH's blocking calls spin on a core for as long as they wait. A background save's
thread that spins takes a core from the training loop (data loading, the optimizer), and where
ranks share cores it takes it from the ranks that still write. So every operation is started
non-blocking and completed by :func:`polite_wait`: test in a busy loop for ``SPIN_S``, then
alternate a sleep (growing from ``FIRST_SLEEP_S`` to ``MAX_SLEEP_S``) with a burst of tests
(``BURST_S``). The bursts matter: without MPICH's single-copy path (CMA, which needs ptrace
rights that many systems withhold), a large message between ranks on one machine moves only a
few KiB per progress call, so a wait that only slept between single tests took 2.2 s for a ring
of 4 MiB messages that MPI's blocking calls moved in 62 ms; with bursts it took 58 ms (with CMA:
9.7 ms against 9.1). Measured on the 2-core development machine with 8 ranks: one rank writing
32 MiB to tmpfs while the 7 others waited in a barrier took 83 ms when they spun and 30 ms when
they slept. ``wait="block"`` uses MPI's blocking calls (lowest latency where every rank has
cores of its own).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np

from ckptfmt.errors import CollectiveTimeoutError, UsageError
from ckptfmt.transport.comm import Comm, Pending, roll_key, roll_token

SPIN_S = 1e-4  # busy testing before the first sleep: a peer already there costs no sleep
FIRST_SLEEP_S = 50e-6
MAX_SLEEP_S = 2.5e-4  # the most a completed wait can lag behind (what a vote may add)
BURST_S = 1e-4  # busy testing after each sleep: a transfer under way keeps moving
ROLL_TAG = 32767  # reserved for MpiComm.roll_call (other traffic keeps to tags below 32000)
VERDICT_TAG = 32766


def polite_wait(
    requests: list[Any], max_sleep_s: float = MAX_SLEEP_S, deadline_s: float | None = None
) -> bool:
    """Complete ``requests`` (mpi4py ``Request`` objects): test them busily for ``SPIN_S``, then
    alternate a sleep (doubling from :data:`FIRST_SLEEP_S` to ``max_sleep_s``) with ``BURST_S``
    of tests. With ``deadline_s``, give up after that long and return False (the requests are
    then still pending: the caller cancels them); True once they are complete."""
    from mpi4py import MPI

    if not requests:
        return True

    def done() -> bool:
        return bool(requests[0].Test() if len(requests) == 1 else MPI.Request.Testall(requests))

    clock = time.perf_counter
    give_up = None if deadline_s is None else clock() + deadline_s
    pause, until = FIRST_SLEEP_S, clock() + SPIN_S
    while True:
        while True:
            if done():
                return True
            if clock() > until:
                break
        if give_up is not None and clock() > give_up:
            return False
        time.sleep(pause)
        pause = min(pause * 2, max_sleep_s)
        until = clock() + BURST_S


class _Requests:
    def __init__(self, comm: MpiComm, requests: list[Any], *keep: Any) -> None:
        self.comm, self.requests = comm, requests
        self.keep = keep  # buffers that must outlive the requests

    def wait(self) -> None:
        if self.requests:
            self.comm._complete(*self.requests)
        self.requests = []
        self.keep = ()


class MpiComm(Comm):
    """``Comm`` over an mpi4py communicator (``MPI.COMM_WORLD`` by default).

    ``wait``: ``"polite"`` (default; see the module docstring) or ``"block"``."""

    def __init__(self, comm: Any = None, wait: str = "polite") -> None:
        from mpi4py import MPI

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise UsageError(
                "ckptfmt needs MPI_THREAD_MULTIPLE (background saves talk MPI from a thread); "
                "do not lower mpi4py.rc.thread_level"
            )
        if wait not in ("polite", "block"):
            raise UsageError(f"MpiComm(wait=...) must be 'polite' or 'block', not {wait!r}")
        self._mpi = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = int(self.comm.Get_rank())
        self.size = int(self.comm.Get_size())
        self.wait = wait

    def _complete(self, *requests: Any) -> None:
        if self.wait == "block":
            self._mpi.Request.Waitall(list(requests))
        else:
            polite_wait(list(requests))

    def barrier(self) -> None:
        self._complete(self.comm.Ibarrier())

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        sizes = np.empty(self.size, dtype=np.int64)
        self._complete(self.comm.Iallgather(np.array([len(data)], dtype=np.int64), sizes))
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        send = np.frombuffer(data, dtype=np.uint8) if data else np.empty(0, np.uint8)
        self._complete(
            self.comm.Iallgatherv(send, [out, sizes.tolist(), displs.tolist(), self._mpi.BYTE])
        )
        return [out[d : d + s].tobytes() for d, s in zip(displs.tolist(), sizes.tolist())]

    def bcast_buffer(self, buf: np.ndarray, root: int) -> None:
        if buf.size:
            self._complete(self.comm.Ibcast([buf, self._mpi.BYTE], root=root))

    def send(self, buf: np.ndarray, dest: int, tag: int = 0) -> None:
        self._complete(self.comm.Isend([buf, self._mpi.BYTE], dest=dest, tag=tag))

    def recv(self, buf: np.ndarray, source: int, tag: int = 0) -> None:
        self._complete(self.comm.Irecv([buf, self._mpi.BYTE], source=source, tag=tag))

    def sendrecv(
        self, sendbuf: np.ndarray, dest: int, recvbuf: np.ndarray, source: int, tag: int = 0
    ) -> None:
        recv = self.comm.Irecv([recvbuf, self._mpi.BYTE], source=source, tag=tag)
        send = self.comm.Isend([sendbuf, self._mpi.BYTE], dest=dest, tag=tag)
        self._complete(recv, send)

    def start_send(self, buf: np.ndarray, dest: int, tag: int = 0) -> Pending:
        return _Requests(self, [self.comm.Isend([buf, self._mpi.BYTE], dest=dest, tag=tag)], buf)

    def start_exchange(
        self,
        pairs: Sequence[tuple[np.ndarray, int, np.ndarray, int]],
        tag: int = 0,
    ) -> Pending:
        requests = []
        for sendbuf, dest, recvbuf, source in pairs:
            requests.append(self.comm.Irecv([recvbuf, self._mpi.BYTE], source=source, tag=tag))
            requests.append(self.comm.Isend([sendbuf, self._mpi.BYTE], dest=dest, tag=tag))
        return _Requests(self, requests, pairs)

    def dup(self) -> MpiComm:
        return MpiComm(self.comm.Dup(), self.wait)

    def roll_call(
        self, deadline_s: float, what: str = "", step: int | None = None, seq: int | None = None
    ) -> None:
        """Collective: return once every rank has called it for the same call; raise
        :class:`CollectiveTimeoutError` on every rank still there if some rank has not within
        ``deadline_s`` (naming those ranks), so that a rank left alone in a collective (the
        others never called it, or died) is told instead of waiting forever, and
        :class:`~ckptfmt.errors.OutOfStepError` on every rank if some came from another call
        (``what``, ``step``, ``seq``: ``Comm.roll_call``).

        Rank 0 receives a token (the call's key hashed to 64 bits) from every rank, waiting at
        most ``deadline_s``, then sends each rank that arrived the verdict (one byte per rank:
        1 = did not arrive, 2 = another call). The other ranks wait for the verdict at most
        twice the deadline (rank 0 itself may be the one missing). Tags :data:`ROLL_TAG` and
        :data:`VERDICT_TAG` are reserved for it."""
        MPI = self._mpi
        key = roll_key(what, step, seq)
        token = np.array([roll_token(key)], np.int64)
        verdict = np.zeros(self.size, np.uint8)
        if self.rank != 0:
            send = self.comm.Isend([token, MPI.BYTE], dest=0, tag=ROLL_TAG)
            recv = self.comm.Irecv([verdict, MPI.BYTE], source=0, tag=VERDICT_TAG)
            if not polite_wait([recv], deadline_s=2 * deadline_s):
                recv.Cancel()
                send.Cancel()
                raise CollectiveTimeoutError([0], deadline_s, operation=what, step=step)
            polite_wait([send])
        else:
            tokens = [np.zeros(1, np.int64) for _ in range(self.size)]
            recvs = {
                r: self.comm.Irecv([tokens[r], MPI.BYTE], source=r, tag=ROLL_TAG)
                for r in range(1, self.size)
            }
            polite_wait(list(recvs.values()), deadline_s=deadline_s)
            for r, req in recvs.items():
                if not req.Test():
                    req.Cancel()
                    req.Wait()  # a cancelled receive completes at once
                    verdict[r] = 1
                elif tokens[r][0] != token[0]:
                    verdict[r] = 2
            sends = [
                self.comm.Isend([verdict, MPI.BYTE], dest=r, tag=VERDICT_TAG)
                for r in recvs
                if verdict[r] != 1
            ]
            polite_wait(sends, deadline_s=deadline_s)
        self.roll_verdict(verdict, key, deadline_s, what, step)

    def abort(self, code: int = 1) -> NoReturn:
        self.comm.Abort(code)
        raise SystemExit(code)  # not reached
