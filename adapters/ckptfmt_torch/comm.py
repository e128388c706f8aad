"""``TorchComm``: the ``Comm`` interface over torch.distributed (gloo, CPU tensors).

For jobs launched with ``torchrun`` instead of ``mpiexec``. Everything travels as CPU ``uint8``
tensors that share memory with the caller's numpy buffers (``torch.from_numpy``), so receivers
are filled in place and nothing is pickled (no ``all_gather_object`` / ``broadcast_object_list``).

Ranks are ranks *in this communicator's group* (``group_src`` / ``group_dst``), as everywhere in
``Comm``; for the default group they equal the global ranks. The group's backend must handle CPU
tensors: gloo (an NCCL-only group is refused; pass ``dist.new_group(backend="gloo")``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from datetime import timedelta
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist

from ckptfmt.errors import CollectiveTimeoutError, UsageError
from ckptfmt.transport import Comm, roll_key, roll_token

ROLL_TAG = 32767  # reserved for TorchComm.roll_call (other traffic keeps to small tags)
VERDICT_TAG = 32766


class TorchComm(Comm):
    """``Comm`` over a torch.distributed process group (the default group if ``group`` is None).

    Construct it on every rank of the group after ``dist.init_process_group(...)``; constructing
    it is local (no communication).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise UsageError(
                "TorchComm needs torch.distributed initialised: call "
                "torch.distributed.init_process_group('gloo') first"
            )
        resolved = dist.group.WORLD if group is None else group
        if resolved is None:
            raise UsageError("torch.distributed has no default process group")
        self.group: dist.ProcessGroup = resolved
        self.rank = int(dist.get_rank(self.group))
        if self.rank < 0:
            raise UsageError("this process is not a member of the TorchComm's group")
        self.size = int(dist.get_world_size(self.group))
        self.ranks: list[int] = list(dist.get_process_group_ranks(self.group))
        backend = str(dist.get_backend(self.group))
        if "gloo" not in backend:
            raise UsageError(
                f"TorchComm sends CPU tensors and needs a gloo group, not {backend!r}: pass "
                "group=torch.distributed.new_group(backend='gloo')"
            )

    # --- collectives: every rank of the group calls them, in the same order ---------------------

    def barrier(self) -> None:
        """Collective: return once every rank of the group has called it."""
        dist.barrier(group=self.group)

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Collective: every rank's ``data`` (any lengths, empty included), indexed by rank.

        Two all_gathers: the lengths, then every rank's bytes padded to the longest (gloo's
        all_gather needs tensors of one size). Meant for metadata, not bulk data.
        """
        length = torch.tensor([len(data)], dtype=torch.int64)
        gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(gathered, length, group=self.group)
        lengths = [int(t.item()) for t in gathered]
        width = max(lengths)
        if width == 0:  # every rank knows it: all skip the second all_gather
            return [b""] * self.size
        mine = np.zeros(width, dtype=np.uint8)
        mine[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        out = np.empty((self.size, width), dtype=np.uint8)
        rows = list(torch.from_numpy(out).unbind(0))  # contiguous views, filled in place
        dist.all_gather(rows, torch.from_numpy(mine), group=self.group)
        return [out[r, :n].tobytes() for r, n in enumerate(lengths)]

    def bcast_buffer(self, buf: np.ndarray, root: int) -> None:
        """Collective: fill every rank's ``buf`` (same byte size everywhere) with root's, in
        place."""
        self._check_peer(root)
        if buf.nbytes:
            dist.broadcast(_as_tensor(buf, out=True), group=self.group, group_src=root)

    def dup(self) -> TorchComm:
        """Collective: a new gloo group over the same ranks, for background traffic.

        torch.distributed makes every process of the *default* group call ``new_group``, in
        the same order; for a TorchComm over the default group (the usual case) that is exactly
        its ranks. For a TorchComm over a subgroup, the processes outside it must call
        ``dist.new_group`` with the same ranks at the same point.
        """
        world = dist.group.WORLD
        ranks = None if self.group is world else self.ranks
        return TorchComm(dist.new_group(ranks=ranks, backend="gloo"))

    def roll_call(
        self, deadline_s: float, what: str = "", step: int | None = None, seq: int | None = None
    ) -> None:
        """Collective: return once every rank has called it for the same call, within
        ``deadline_s`` (well under gloo's process-group timeout, 30 minutes by default); raise
        :class:`~ckptfmt.errors.CollectiveTimeoutError` naming the ranks that did not come, or
        :class:`~ckptfmt.errors.OutOfStepError` when some came from another call
        (``Comm.roll_call``).

        The same exchange as ``MpiComm.roll_call``, over gloo's point-to-point operations with
        timeouts: rank 0 receives every rank's token (the call's key hashed to 64 bits) waiting
        at most ``deadline_s`` in all, then sends the ranks that came the verdict; they wait for
        it at most twice the deadline. A receive that timed out makes gloo close the connection
        to that peer, so a rank that comes late is told at once (its send fails) rather than
        left waiting: either way the manager stops making collective calls. Tags
        :data:`ROLL_TAG` and :data:`VERDICT_TAG` are reserved for it."""
        key = roll_key(what, step, seq)
        if self.size == 1:
            return
        token = torch.tensor([roll_token(key)], dtype=torch.int64)
        verdict = torch.zeros(self.size, dtype=torch.uint8)
        if self.rank != 0:
            try:
                send = dist.isend(token, group=self.group, group_dst=0, tag=ROLL_TAG)
                recv = dist.irecv(verdict, group=self.group, group_src=0, tag=VERDICT_TAG)
                _wait(recv, 2 * deadline_s)
                _wait(send, deadline_s)
            except RuntimeError as exc:  # timed out, or rank 0 closed the connection
                raise CollectiveTimeoutError([0], deadline_s, operation=what, step=step) from exc
        else:
            tokens = {r: torch.zeros(1, dtype=torch.int64) for r in range(1, self.size)}
            recvs = {
                r: dist.irecv(t, group=self.group, group_src=r, tag=ROLL_TAG)
                for r, t in tokens.items()
            }
            give_up = time.monotonic() + deadline_s
            for r, work in recvs.items():
                try:
                    _wait(work, max(1e-3, give_up - time.monotonic()))
                except RuntimeError:
                    verdict[r] = 1
                else:
                    verdict[r] = 2 if int(tokens[r][0]) != int(token[0]) else 0
            sends = [
                dist.isend(verdict, group=self.group, group_dst=r, tag=VERDICT_TAG)
                for r in recvs
                if verdict[r] != 1
            ]
            for work in sends:
                with contextlib.suppress(RuntimeError):  # that rank left after it came
                    _wait(work, deadline_s)
        self.roll_verdict(verdict.numpy(), key, deadline_s, what, step)

    # --- point-to-point: only the two ranks involved call them ----------------------------------

    def send(self, buf: np.ndarray, dest: int, tag: int = 0) -> None:
        """Point-to-point (this rank and ``dest``): send ``buf``'s bytes; blocks until sent."""
        self._check_peer(dest)
        dist.send(_as_tensor(buf, out=False), group=self.group, group_dst=dest, tag=tag)

    def recv(self, buf: np.ndarray, source: int, tag: int = 0) -> None:
        """Point-to-point (this rank and ``source``): fill ``buf`` in place with what ``source``
        sends with ``tag``."""
        self._check_peer(source)
        dist.recv(_as_tensor(buf, out=True), group=self.group, group_src=source, tag=tag)

    def sendrecv(
        self, sendbuf: np.ndarray, dest: int, recvbuf: np.ndarray, source: int, tag: int = 0
    ) -> None:
        """Point-to-point: send to ``dest`` while receiving from ``source`` (both posted before
        either is waited on, so a ring cannot deadlock)."""
        self._check_peer(dest)
        self._check_peer(source)
        send_t = _as_tensor(sendbuf, out=False)
        recv_t = _as_tensor(recvbuf, out=True)
        if dest == self.rank and source == self.rank:  # gloo has no self-send
            if send_t.numel() != recv_t.numel():
                raise UsageError(
                    f"sendrecv to self: {send_t.numel()} bytes sent, {recv_t.numel()} expected"
                )
            recv_t.copy_(send_t)
            return
        works = [
            dist.isend(send_t, group=self.group, group_dst=dest, tag=tag),
            dist.irecv(recv_t, group=self.group, group_src=source, tag=tag),
        ]
        for work in works:
            if work is not None:
                work.wait()

    # --- not collective ---------------------------------------------------------------------------

    def abort(self, code: int = 1) -> NoReturn:
        """Not collective: end this process now with ``code``.

        torch.distributed has no job-wide abort; the launcher (torchrun) sees a worker fail and
        stops the others, which is what ends ranks left waiting in a collective.
        """
        sys.stderr.write(f"ckptfmt: rank {self.rank}: aborting the job (exit status {code})\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(code)

    def _check_peer(self, rank: int) -> None:
        if not 0 <= rank < self.size:
            raise UsageError(f"rank {rank} is outside the communicator (size {self.size})")


def _wait(work: dist.Work | None, seconds: float) -> None:
    """Complete a gloo operation within ``seconds`` (raises ``RuntimeError`` if it does not)."""
    if work is not None:
        work.wait(timeout=timedelta(seconds=seconds))


def _as_tensor(buf: np.ndarray, *, out: bool) -> torch.Tensor:
    """A uint8 CPU tensor sharing ``buf``'s bytes (any dtype: bfloat16 travels as its bytes).

    A read-only send buffer is copied (torch tensors cannot be read-only); a receive buffer
    (``out``) must be writable, since it is filled in place.
    """
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
        raise UsageError("communication buffers must be C-contiguous numpy arrays")
    flat = buf.reshape(-1).view(np.uint8)
    if not flat.flags.writeable:
        if out:
            raise UsageError("a receive buffer must be writable")
        flat = flat.copy()
    return torch.from_numpy(flat)
