"""The ``Comm`` interface: what the parallel protocol needs from a communicator.

Two kinds of traffic go through it: small metadata collectives (JSON documents: declarations,
file lists, votes) and bulk byte transfers between two ranks or from one rank to all (tensor
regions on load, redundancy data). Tensor data is never gathered to one rank.

Every method here is collective over the communicator unless it says otherwise: all ranks call
it, in the same order. Metadata is exchanged as JSON bytes, never pickled (mpi4py's lowercase
methods would pickle). Buffers are contiguous byte buffers (numpy ``uint8`` arrays or views of
them: bfloat16 data travels as its bytes).

Implementations: :class:`SingleComm` (one process, here), ``MpiComm`` (``ckptfmt.transport.mpi``,
the only module that imports mpi4py), and the torch.distributed transport in the PyTorch adapter.
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, Protocol

import numpy as np

from ckptfmt.errors import CollectiveTimeoutError, OutOfStepError, UsageError


def roll_key(what: str, step: int | None, seq: int | None) -> str:
    """The call a roll call is made for, as the ranks compare it."""
    return " ".join(
        [what or "collective"]
        + [f"{k}={v}" for k, v in (("step", step), ("call", seq)) if v is not None]
    )


def roll_token(key: str) -> int:
    """``key`` as a signed 64-bit number (what the transports with deadlines send)."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "little", signed=True)


def check_keys(key: str, keys: Sequence[str]) -> None:
    """Raise :class:`~ckptfmt.errors.OutOfStepError` unless every rank's key is ``key``."""
    if any(k != key for k in keys):
        raise OutOfStepError(dict(enumerate(keys)))


class Comm(abc.ABC):
    """A group of ``size`` ranks; this process is ``rank``."""

    rank: int
    size: int

    # --- primitives ------------------------------------------------------------------------------

    @abc.abstractmethod
    def barrier(self) -> None:
        """Collective: return once every rank has called it."""

    @abc.abstractmethod
    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Collective: every rank's ``data``, indexed by rank, on every rank."""

    @abc.abstractmethod
    def bcast_buffer(self, buf: np.ndarray, root: int) -> None:
        """Collective: fill every rank's ``buf`` (uint8, same size everywhere) with root's."""

    @abc.abstractmethod
    def send(self, buf: np.ndarray, dest: int, tag: int = 0) -> None:
        """Point-to-point (this rank and ``dest`` only): send a uint8 buffer; blocks until sent."""

    @abc.abstractmethod
    def recv(self, buf: np.ndarray, source: int, tag: int = 0) -> None:
        """Point-to-point: fill the uint8 ``buf`` with what ``source`` sends with ``tag``."""

    @abc.abstractmethod
    def sendrecv(
        self, sendbuf: np.ndarray, dest: int, recvbuf: np.ndarray, source: int, tag: int = 0
    ) -> None:
        """Point-to-point, deadlock-free in a ring: send to ``dest`` while receiving from
        ``source``."""

    def start_send(self, buf: np.ndarray, dest: int, tag: int = 0) -> Pending:
        """Point-to-point: start sending ``buf`` (left untouched until the handle's ``wait()``)
        to ``dest``; lets the caller go on while the receiver is not yet there. Messages from one
        rank to another with one tag arrive in the order they were started. This default sends
        now, blocking, and returns a handle with nothing left to wait for; ``MpiComm`` starts the
        send and returns."""
        self.send(buf, dest, tag)
        return _Done()

    def start_exchange(
        self,
        pairs: Sequence[tuple[np.ndarray, int, np.ndarray, int]],
        tag: int = 0,
    ) -> Pending:
        """Point-to-point: start the ``sendrecv`` of each ``(sendbuf, dest, recvbuf, source)``;
        the returned handle's ``wait()`` completes them all. The buffers must stay untouched
        until then. Lets a caller compute on one round's data while the next round moves.

        This default moves nothing before ``wait()``, which then runs the pairs' ``sendrecv`` in
        order (deadlock-free where every rank lists its pairs in the same ring order);
        ``MpiComm`` starts them at once."""
        return _Deferred(self, list(pairs), tag)

    @abc.abstractmethod
    def dup(self) -> Comm:
        """Collective: a new communicator over the same ranks, for background traffic that must
        not interleave with the caller's."""

    def roll_call(
        self, deadline_s: float, what: str = "", step: int | None = None, seq: int | None = None
    ) -> None:
        """Collective: return once every rank has called it for the same call (``what``,
        ``step`` and the caller's call number ``seq``), so that the calls' later messages pair
        up. Raises :class:`~ckptfmt.errors.CollectiveTimeoutError` naming the ranks that did
        not come within ``deadline_s``, and :class:`~ckptfmt.errors.OutOfStepError` on every
        rank when some came from another call. This default gathers the keys (no deadline: the
        transport's own timeout applies); ``MpiComm`` and ``TorchComm`` keep the deadline."""
        del deadline_s
        key = roll_key(what, step, seq)
        check_keys(key, self.allgather_json(key))

    def roll_verdict(
        self, verdict: np.ndarray, key: str, deadline_s: float, what: str, step: int | None
    ) -> None:
        """Collective (every rank that took part in a roll call, after its verdict): raise what
        ``verdict`` says (rank 0's view: 1 = did not arrive, 2 = came from another call)."""
        missing = [r for r in range(self.size) if verdict[r] == 1]
        if missing:
            raise CollectiveTimeoutError(missing, deadline_s, operation=what, step=step)
        if any(verdict[r] == 2 for r in range(self.size)):
            check_keys(key, self.allgather_json(key))  # every rank knows: all gather the keys

    @abc.abstractmethod
    def abort(self, code: int = 1) -> NoReturn:
        """Not collective: end the whole job now (used when a background thread fails, so the
        other ranks do not wait forever)."""

    # --- derived collectives (JSON metadata) -----------------------------------------------------

    def allgather_json(self, obj: Any) -> list[Any]:
        """Collective: every rank's JSON-able ``obj``, indexed by rank."""
        blobs = self.allgather_bytes(json.dumps(obj, allow_nan=False).encode("utf-8"))
        return [json.loads(b.decode("utf-8")) for b in blobs]

    def bcast_json(self, obj: Any, root: int = 0) -> Any:
        """Collective: root's JSON-able ``obj`` on every rank (others pass anything)."""
        data = json.dumps(obj, allow_nan=False).encode("utf-8") if self.rank == root else b""
        sizes = self.allgather_json(len(data))
        buf = (
            np.frombuffer(data, dtype=np.uint8).copy()
            if self.rank == root
            else np.empty(sizes[root], dtype=np.uint8)
        )
        self.bcast_buffer(buf, root)
        return json.loads(buf.tobytes().decode("utf-8"))

    def all_true(self, flag: bool) -> bool:
        """Collective: whether ``flag`` is true on every rank."""
        return all(self.allgather_json(bool(flag)))

    def min_int(self, value: int) -> int:
        """Collective: the smallest ``value`` of all ranks."""
        return int(min(self.allgather_json(int(value))))


class Pending(Protocol):
    """A started send or exchange (:meth:`Comm.start_send`, :meth:`Comm.start_exchange`);
    ``wait()`` completes it."""

    def wait(self) -> None: ...


class _Done:
    def wait(self) -> None:
        pass


class _Deferred:
    def __init__(
        self, comm: Comm, pairs: list[tuple[np.ndarray, int, np.ndarray, int]], tag: int
    ) -> None:
        self.comm, self.pairs, self.tag = comm, pairs, tag

    def wait(self) -> None:
        for sendbuf, dest, recvbuf, source in self.pairs:
            self.comm.sendrecv(sendbuf, dest, recvbuf, source, self.tag)
        self.pairs = []


class SingleComm(Comm):
    """The communicator of a job of one process."""

    def __init__(self) -> None:
        self.rank = 0
        self.size = 1

    def barrier(self) -> None:
        pass

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        return [bytes(data)]

    def bcast_buffer(self, buf: np.ndarray, root: int) -> None:
        _check_peer(root, 1)

    def send(self, buf: np.ndarray, dest: int, tag: int = 0) -> None:
        raise UsageError("a single process has no peer to send to")

    def recv(self, buf: np.ndarray, source: int, tag: int = 0) -> None:
        raise UsageError("a single process has no peer to receive from")

    def sendrecv(
        self, sendbuf: np.ndarray, dest: int, recvbuf: np.ndarray, source: int, tag: int = 0
    ) -> None:
        _check_peer(dest, 1)
        _check_peer(source, 1)
        if sendbuf.nbytes != recvbuf.nbytes:
            raise UsageError(f"sendrecv of {sendbuf.nbytes} bytes into {recvbuf.nbytes}")
        recvbuf.reshape(-1).view(np.uint8)[...] = sendbuf.reshape(-1).view(np.uint8)

    def dup(self) -> SingleComm:
        return SingleComm()

    def abort(self, code: int = 1) -> NoReturn:
        sys.stderr.flush()
        os._exit(code)


def _check_peer(rank: int, size: int) -> None:
    if not 0 <= rank < size:
        raise UsageError(f"rank {rank} is outside the communicator (size {size})")


def start_background(comm: Comm, target: Callable[[], None], name: str) -> threading.Thread:
    """Run ``target`` in a daemon thread; an exception escaping it aborts the whole job.

    Background work talks to the other ranks (collectives on a duplicated communicator); if one
    rank's thread died silently, the others would wait for it forever. Failures that the protocol
    expects (a full disk, say) are caught inside ``target`` and voted on; what reaches here is a
    bug, and ending the job loudly is the only safe answer.
    """

    def run() -> None:
        try:
            target()
        except BaseException:
            sys.stderr.write(
                f"ckptfmt: rank {comm.rank}: background thread {name!r} failed; aborting the job\n"
            )
            traceback.print_exc(file=sys.stderr)
            comm.abort(70)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
