"""Running the ops of :mod:`ckptfmt.redundancy.stripes` over member buffers in memory.

Members whose buffers are local are computed on directly; an op between a local and a remote
member becomes a message over ``transport`` (a :class:`ckptfmt.transport.comm.Comm`). Every rank
runs the same op list in the same order. Sends are started and left to finish (``start_send``)
while the rank goes on; only receives block, and a rank posts the send of an op after running
only earlier ops, so by induction over the list every receive is met and nothing deadlocks.
Starting sends lets a rank that feeds several stripes' decoders go on to the next before the
first takes its chunk in (with one lost node of 8 on the 2-core machine it changed nothing
measurable: the rebuild waits on the survivors' checked reads and the lost node's writes).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ckptfmt.errors import UsageError
from ckptfmt.redundancy.gf256 import mul_xor_into as mul_xor_into  # re-exported
from ckptfmt.redundancy.stripes import WHOLE, Op

TAG = 0x52  # one tag for all rebuild traffic: ops between two ranks arrive in order


class Sending(Protocol):
    def wait(self) -> None: ...


class Transport(Protocol):
    def start_send(self, buf: np.ndarray, dest: int, tag: int = 0) -> Sending: ...

    def recv(self, buf: np.ndarray, source: int, tag: int = 0) -> None: ...


@dataclass
class MemberBuffers:
    """One member's data (zero-padded to the set's padded length; partner: its own length) and
    its parity file's bytes."""

    data: np.ndarray
    parity: np.ndarray
    tmp: dict[int, np.ndarray] = field(default_factory=dict)  # decoding scratch chunks


def view(buf: MemberBuffers, kind: str, index: int, chunk: int, whole: int) -> np.ndarray:
    """The bytes an op names: chunk ``index`` of the member's data or parity, or (``WHOLE``)
    the first ``whole`` bytes."""
    if kind == "tmp":
        if index not in buf.tmp:
            buf.tmp[index] = np.zeros(chunk, np.uint8)
        return buf.tmp[index]
    arr = buf.data if kind == "data" else buf.parity
    if index == WHOLE:
        return arr[:whole]
    return arr[index * chunk : (index + 1) * chunk]


_scratch = threading.local()


def scratch(nbytes: int, purpose: str = "recv") -> np.ndarray:
    """A reused uint8 buffer of at least ``nbytes`` for this thread (fresh pages fault in slowly
    here, so buffers live across saves); returns its first ``nbytes``. Growing keeps the
    contents."""
    pool: dict[str, np.ndarray] = _scratch.__dict__.setdefault("pool", {})
    buf = pool.get(purpose)
    if buf is None or buf.size < nbytes:
        grown = np.empty(max(nbytes, 1), np.uint8)
        if buf is not None:  # keep what is in it: a caller may grow a buffer it filled
            grown[: buf.size] = buf
        buf = pool[purpose] = grown
    return buf[:nbytes]


def run_ops(
    ops: Sequence[Op],
    members: Sequence[int],
    sizes: Sequence[int],
    chunk: int,
    local: Mapping[int, MemberBuffers],
    transport: Transport | None = None,
) -> int:
    """Run ``ops`` for one set (members by position; ``members[pos]`` is the rank) over the
    ``local`` buffers; return the bytes received from other ranks. Collective over the set's
    ranks when some members are not local."""
    n = len(members)
    received = 0
    _take_tmp_chunks(ops, chunk, local)
    sending: list[Sending] = []  # sends go on while this rank moves on to its next ops
    written: set[tuple[int, str, int]] = set()
    for op in ops:
        key = (op.dst, op.dst_kind, op.dst_index)
        first = key not in written  # the destination still holds the zeros it starts with
        written.add(key)
        received += _run_op(op, n, members, sizes, chunk, local, transport, sending, first)
    for s in sending:
        s.wait()
    return received


def _take_tmp_chunks(ops: Sequence[Op], chunk: int, local: Mapping[int, MemberBuffers]) -> None:
    """Give every ``"tmp"`` chunk the ops decode into on this rank a zeroed slice of one region
    of this thread's reused scratch. A fresh ``np.zeros`` chunk per key faulted its pages in
    again at every rebuild (with 4 ranks on 2 simulated nodes, XOR: 0.36 s of a 0.65 s restore
    of 60 MiB per rank). Safe to reuse at the next call: every send of a chunk is waited for
    before ``run_ops`` returns."""
    keys = sorted(
        {(op.dst, op.dst_index) for op in ops if op.dst_kind == "tmp" and op.dst in local}
    )
    keys = [(member, index) for member, index in keys if index not in local[member].tmp]
    if not keys:
        return
    region = scratch(len(keys) * chunk, "tmp")
    region[:] = 0
    for k, (member, index) in enumerate(keys):
        local[member].tmp[index] = region[k * chunk : (k + 1) * chunk]


def _run_op(
    op: Op,
    n: int,
    members: Sequence[int],
    sizes: Sequence[int],
    chunk: int,
    local: Mapping[int, MemberBuffers],
    transport: Transport | None,
    sending: list[Sending],
    first: bool = False,
) -> int:
    """One op on this rank: compute it, start sending its source, or receive into it.
    ``first``: no earlier op of the list wrote its destination, which still holds zeros (what
    the ops write into is zeroed before they run: lost pieces by the caller, ``"tmp"`` chunks
    here), so a received chunk taken whole (coefficient 1) lands there as it is: no scratch
    and no XOR pass over it (a lost member's data, from its stripes' decoders)."""
    src_here, dst_here = op.src in local, op.dst in local
    if not (src_here or dst_here):
        return 0
    # partner: whole data of member j is sizes[j] bytes; its copy (parity) is of j - 1
    whole = sizes[op.src] if op.src_kind == "data" else sizes[(op.src - 1) % n]
    if src_here:
        src = view(local[op.src], op.src_kind, op.src_index, chunk, whole)
    if dst_here:
        dst = view(local[op.dst], op.dst_kind, op.dst_index, chunk, whole)
    if src_here and dst_here:
        mul_xor_into(dst, op.coef, src)
        if op.src_kind == "tmp":
            del local[op.src].tmp[op.src_index]  # used once
    elif src_here:
        if transport is None:
            raise UsageError("a rebuild op needs a remote member but there is no transport")
        sending.append(transport.start_send(src, members[op.dst], TAG))
        if op.src_kind == "tmp":  # the send keeps the buffer until it is done
            del local[op.src].tmp[op.src_index]  # used once
    else:
        if transport is None:
            raise UsageError("a rebuild op needs a remote member but there is no transport")
        if first and op.coef == 1:
            transport.recv(dst, members[op.src], TAG)
            return int(dst.size)
        tmp = scratch(dst.size)
        transport.recv(tmp, members[op.src], TAG)
        mul_xor_into(dst, op.coef, tmp)
        return int(tmp.size)
    return 0
