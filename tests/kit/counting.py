"""Counting the collectives a save makes: a ``Comm`` that passes every call to a real one and
tallies it, and a wrapper of ``torch.distributed``'s collectives that does the same.

:class:`CountingComm` counts each collective primitive called on it (``barrier``,
``allgather_bytes``, ``bcast_buffer``, ``roll_call``) and each point-to-point call; the derived
collectives of ``Comm`` (``allgather_json``, ``bcast_json``, ...) reach the real communicator
through those, so ``bcast_json`` counts as the two collectives it is. ``dup`` wraps the real
communicator's duplicate with the same tally (a manager's saver thread runs on one), so one
tally holds every collective of the rank, whichever thread made it.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

import numpy as np

from ckptfmt.transport.comm import Comm, Pending

COLLECTIVES = ("barrier", "allgather_bytes", "bcast_buffer", "roll_call")


class Tally:
    """Calls by name, shared by a communicator and its duplicates (thread-safe)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, name: str) -> None:
        with self._lock:
            self.calls[name] += 1

    def collectives(self) -> int:
        """The collective calls so far."""
        with self._lock:
            return sum(self.calls[n] for n in COLLECTIVES)


class CountingComm(Comm):
    """``inner`` (a real communicator), every call counted in :attr:`tally`."""

    def __init__(self, inner: Comm, tally: Tally | None = None) -> None:
        self.inner = inner
        self.rank = inner.rank
        self.size = inner.size
        self.tally = tally or Tally()

    def barrier(self) -> None:
        self.tally.add("barrier")
        self.inner.barrier()

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        self.tally.add("allgather_bytes")
        return self.inner.allgather_bytes(data)

    def bcast_buffer(self, buf: np.ndarray, root: int) -> None:
        self.tally.add("bcast_buffer")
        self.inner.bcast_buffer(buf, root)

    def roll_call(
        self, deadline_s: float, what: str = "", step: int | None = None, seq: int | None = None
    ) -> None:
        self.tally.add("roll_call")
        self.inner.roll_call(deadline_s, what, step, seq)

    def send(self, buf: np.ndarray, dest: int, tag: int = 0) -> None:
        self.tally.add("send")
        self.inner.send(buf, dest, tag)

    def recv(self, buf: np.ndarray, source: int, tag: int = 0) -> None:
        self.tally.add("recv")
        self.inner.recv(buf, source, tag)

    def sendrecv(
        self, sendbuf: np.ndarray, dest: int, recvbuf: np.ndarray, source: int, tag: int = 0
    ) -> None:
        self.tally.add("sendrecv")
        self.inner.sendrecv(sendbuf, dest, recvbuf, source, tag)

    def start_send(self, buf: np.ndarray, dest: int, tag: int = 0) -> Pending:
        self.tally.add("start_send")
        return self.inner.start_send(buf, dest, tag)

    def start_exchange(
        self, pairs: Sequence[tuple[np.ndarray, int, np.ndarray, int]], tag: int = 0
    ) -> Pending:
        self.tally.add("start_exchange")
        return self.inner.start_exchange(pairs, tag)

    def dup(self) -> CountingComm:
        self.tally.add("dup")
        return CountingComm(self.inner.dup(), self.tally)

    def abort(self, code: int = 1) -> NoReturn:
        self.inner.abort(code)


TORCH_COLLECTIVES = (
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "monitored_barrier",
)


@contextmanager
def counting_torch_collectives() -> Iterator[Counter[str]]:
    """Within the block, every call of a ``torch.distributed`` collective (by the module's
    name: DCP and ckptfmt's ``TorchComm`` call them so) is counted into the yielded counter and
    then made as usual. Nested calls (``all_gather_object`` calls ``all_gather``) count once,
    as the outermost."""
    import torch.distributed as dist

    counts: Counter[str] = Counter()
    depth = threading.local()
    saved: dict[str, Any] = {}

    def wrap(name: str, real: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            level = getattr(depth, "n", 0)
            if level == 0:
                counts[name] += 1
            depth.n = level + 1
            try:
                return real(*args, **kwargs)
            finally:
                depth.n = level

        return counted

    for name in TORCH_COLLECTIVES:
        real = getattr(dist, name, None)
        if real is not None:
            saved[name] = real
            setattr(dist, name, wrap(name, real))
    try:
        yield counts
    finally:
        for name, real in saved.items():
            setattr(dist, name, real)
