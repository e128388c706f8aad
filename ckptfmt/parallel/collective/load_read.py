"""The reads and transfers of a collective load (``load_collective``, steps 2 to 4): the plan of
who reads which inner chunks for whom, every buffer allocated before anything moves, this rank's
reads (verified, on a few threads), then the broadcasts and messages in one global order."""

from __future__ import annotations

import contextlib
import functools
import math
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptfmt.container.reader import geometry
from ckptfmt.errors import UnreachableNodesError
from ckptfmt.format.chunk_reads import read_chunks
from ckptfmt.format.shard_io import Geometry
from ckptfmt.manifest.grid import flat_range, is_contiguous_box
from ckptfmt.manifest.limits import display
from ckptfmt.manifest.model import Manifest, TensorEntry
from ckptfmt.plan.reads import Box, FileRead, Layout, Piece, check_box
from ckptfmt.plan.route import Delivery, FileTask, TensorRoute, route
from ckptfmt.storage.files import Files
from ckptfmt.storage.progress import current_meter
from ckptfmt.transport.comm import Comm

_TAGS = 32000  # MPI guarantees tags up to 32767; the ones above are reserved (MpiComm)


class LoadPlan:
    """One tensor's part of the load: its geometry, every rank's box and the route."""

    def __init__(self, t: TensorEntry, boxes: list[Box], r: TensorRoute) -> None:
        self.t, self.boxes, self.route = t, boxes, r
        self.name = display(t.name)
        self.geo: Geometry = geometry(t)


def plan_load(
    m: Manifest,
    info: list[dict[str, Any]],
    sources: Sequence[int | None],
    sees: list[set[int]],
    broadcast: bool,
    share: Sequence[str] | None = None,
) -> list[LoadPlan]:
    """Every rank's boxes and the route of every tensor (the same on every rank); raises the
    same error on every rank for a box outside its tensor or files no rank sees. ``share``:
    each rank's node, whose ranks share their reads of replicas (``route``)."""
    load = [0] * len(info)
    out = []
    unseen: set[int] = set()
    for t in m.tensors():
        name = display(t.name)
        whole: Box = ((0,) * len(t.shape), t.shape)
        boxes: list[Box] = []
        for rank, i in enumerate(info):
            w = i["wants"].get(name)
            if t.per_rank and w is None:  # its own row (a box named explicitly is a box)
                row = sources[rank]
                rest = t.shape[1:]
                boxes.append(
                    ((row, *(0,) * len(rest)), (1, *rest))
                    if row is not None
                    else ((0,) * len(t.shape), (0, *rest))
                )
                continue
            box: Box = whole if w is None else (tuple(w[0]), tuple(w[1]))
            check_box(t.shape, box, f"rank {rank}'s box of {name!r}")
            boxes.append(box)
        geo = geometry(t)
        same_size = m.world_size == len(info)
        r = route(Layout.of(t), boxes, sees, load, geo.chunk_nbytes, same_size, broadcast, share)
        unseen.update(r.unseen)
        out.append(LoadPlan(t, boxes, r))
    if unseen:
        writers = sorted(unseen)
        nodes = sorted({m.ranks[w].node for w in writers})
        raise UnreachableNodesError(nodes, writers)
    return out


@dataclass
class Buffers:
    """Every buffer one rank's part of the load needs, allocated before any read or message."""

    outs: dict[str, np.ndarray] = field(default_factory=dict)
    bcast: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    # (plan, peer) -> the packed pieces of a message; (plan, source, dest) -> its parts
    send: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    recv: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    parts: dict[tuple[int, int, int], Parts] = field(default_factory=dict)
    jobs: list[Callable[[], None]] = field(default_factory=list)
    job_bytes: list[int] = field(default_factory=list)  # each job's chunk bytes (progress)

    def work(self, me: int, plans: list[LoadPlan]) -> int:
        """This rank's bytes of work, for a progress total: its reads and what it receives."""
        received = sum(b.nbytes for b in self.recv.values())
        received += sum(
            n * parts.itemsize
            for (_, _, d), parts in self.parts.items()
            if d == me
            for _, _, n in parts.runs
        )
        received += sum(b.nbytes for (_, root), b in self.bcast.items() if root != me)
        return sum(self.job_bytes) + received


def allocate(
    me: int,
    src: Files,
    plans: list[LoadPlan],
    errors: list[BaseException],
    lock: threading.Lock,
    into: Mapping[str, np.ndarray],
    threads: int = 1,
) -> Buffers:
    """Step 3a (local): allocate this rank's destination arrays and every buffer of the
    transfers, and prepare its read jobs (``threads``: how many run at once). Done before
    anything moves, so that an allocation failure is a failure voted on, not a rank missing
    from an exchange its peers wait in, nor one met after some data has landed in the caller's
    arrays: the scratch of the chunks that cannot be read straight into their destination is
    allocated here too, one buffer per thread, reused from job to job."""
    bufs = Buffers()
    pool = ScratchPool()
    scratch: list[int] = []  # the scratch bytes of each job that needs some
    for pi, p in enumerate(plans):
        out = _destination(into.get(p.name), p.boxes[me][1], p.geo.dtype)
        bufs.outs[p.name] = out
        slices: dict[int, np.ndarray] = {}  # id(task) -> its part of the broadcast buffer
        for root in p.route.bcast_roots():
            tasks = p.route.bcast_tasks(root)
            buf = np.empty(sum(len(t.slots) for t in tasks) * p.geo.chunk_nbytes, np.uint8)
            bufs.bcast[(pi, root)] = buf
            if root == me:
                pos = 0
                for t in tasks:
                    n = len(t.slots) * p.geo.chunk_nbytes
                    slices[id(t)] = buf[pos : pos + n]
                    pos += n
        packs: dict[tuple[int, int], np.ndarray] = {}  # (id(task), dest) -> its part of a send
        for s, d, items in p.route.messages():
            parts = bufs.parts[(pi, s, d)] = _parts(p, s, d, items)
            packed = parts.packed
            if s == me and packed:
                flat = np.empty(sum(dl.nelems for _, dl in packed), dtype=p.geo.dtype)
                bufs.send[(pi, d)] = flat
                pos = 0
                for t, dl in packed:
                    packs[(id(t), d)] = flat[pos : pos + dl.nelems]
                    pos += dl.nelems
            elif d == me and packed:
                bufs.recv[(pi, s)] = np.empty(sum(dl.nelems for _, dl in packed), p.geo.dtype)
        for t in p.route.tasks_of(me):
            bcast = slices.get(id(t))
            own = _own_targets(p, t, out) if bcast is None else None
            if own is not None and own.scratch:
                scratch.append(own.scratch * p.geo.chunk_nbytes)
            bufs.jobs.append(
                functools.partial(
                    _read_task,
                    src,
                    p,
                    t,
                    out,
                    bcast,
                    own,
                    [
                        (dl, packs[(id(t), dl.dest)])
                        for dl in t.deliveries
                        if (id(t), dl.dest) in packs
                    ],
                    errors,
                    lock,
                    pool,
                )
            )
            bufs.job_bytes.append(len(t.slots) * p.geo.chunk_nbytes)
    if scratch:
        pool.allocate(min(threads, len(scratch)), max(scratch))
    return bufs


class ScratchPool:
    """Buffers for the chunks a read job cannot put straight into their destination,
    allocated before the load's allocation vote (``allocate``): as many as jobs run at once,
    each as large as the largest job's need, so a job always finds one free."""

    def __init__(self) -> None:
        self._free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()

    def allocate(self, count: int, nbytes: int) -> None:
        """Allocate ``count`` buffers of ``nbytes`` (once every job is known)."""
        for _ in range(count):
            self._free.put(memoryview(np.empty(nbytes, np.uint8)))  # type: ignore[arg-type]

    @contextlib.contextmanager
    def buffer(self) -> Iterator[memoryview]:
        """One buffer, the job's while in the block."""
        view = self._free.get()
        try:
            yield view
        finally:
            self._free.put(view)


def _destination(given: Any, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    """The caller's array when it can take the box as it is, else a fresh one."""
    if (
        isinstance(given, np.ndarray)
        and given.shape == tuple(shape)
        and given.dtype == dtype
        and given.flags.c_contiguous
        and given.flags.writeable
    ):
        return given
    return np.empty(shape, dtype=dtype)


def files_read(plans: list[LoadPlan]) -> set[str]:
    """The paths of the shard files some rank reads (the same on every rank)."""
    out: set[str] = set()
    for p in plans:
        for t in p.route.tasks:
            out.add(p.t.regions[t.file.region].files[t.file.file].path)
    return out


def add_presence_checks(
    bufs: Buffers,
    checks: list[Callable[[], None]],
    errors: list[BaseException],
    lock: threading.Lock,
) -> None:
    """Put ``checks`` (``Files.presence_checks``) first among this rank's read jobs, so that
    their requests run beside the reads; what they find is damage, voted on with the reads'."""

    def run(check: Callable[[], None]) -> None:
        try:
            check()
        except Exception as exc:  # damage, or the store's failure: voted on by the caller
            with lock:
                errors.append(exc)

    bufs.jobs[:0] = [functools.partial(run, c) for c in checks]
    bufs.job_bytes[:0] = [0] * len(checks)


def read_local(bufs: Buffers, threads: int) -> None:
    """Step 3b (local): this rank's reads; damage is collected by the jobs, anything else
    raises (the caller's boundary records it). Each job is counted on the load's progress
    meter, in this thread, as it ends."""
    meter = current_meter()
    if threads > 1 and len(bufs.jobs) > 1:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            for future, n in zip([pool.submit(job) for job in bufs.jobs], bufs.job_bytes):
                future.result()
                meter.add(n, "read")
    else:
        for job, n in zip(bufs.jobs, bufs.job_bytes):
            job()
            meter.add(n, "read")


def transfer(comm: Comm, plans: list[LoadPlan], bufs: Buffers) -> None:
    """Step 4 (every rank, in the same global order): the broadcasts and messages. Runs on
    every rank even when its reads failed (its peers wait for its messages; what it sends is
    then discarded, since the vote after it fails).

    Tensor by tensor: the broadcasts, then the messages. Where the Comm starts a send without
    waiting for it (``MpiComm``), a rank starts all its sends of the tensor, then receives in
    order, then waits for its sends: the tensor's messages move at once, not one after the
    other (each a rendezvous of two ranks: a chain of them costs a wake-up of a waiting rank
    per message). Elsewhere one message at a time, in order. Either way no rank waits on a
    message a peer has not reached: every rank reaches each tensor's sends."""
    me = comm.rank
    tag = 0
    meter = current_meter()
    starts = type(comm).start_send is not Comm.start_send  # the default blocks
    for pi, p in enumerate(plans):
        out = bufs.outs[p.name]
        origin = p.boxes[me][0]
        for root in p.route.bcast_roots():
            tasks = p.route.bcast_tasks(root)
            buf = bufs.bcast[(pi, root)]
            comm.bcast_buffer(buf, root)
            if root != me:
                _place_broadcast(p, tasks, buf, out, origin, me)
                meter.add(buf.nbytes, "receive")
        flat_out = out.reshape(-1)
        ops: list[tuple[bool, np.ndarray, int, int, Parts | None]] = []  # in the global order:
        # (a send?, its bytes, peer, tag, the parts to unpack after a receive of packed pieces)
        for s, d, _ in p.route.messages():
            parts = bufs.parts[(pi, s, d)]
            if parts.packed:
                if me == s:
                    ops.append((True, bufs.send[(pi, d)].reshape(-1).view(np.uint8), d, tag, None))
                elif me == d:
                    ops.append((False, bufs.recv[(pi, s)].view(np.uint8), s, tag, parts))
                tag = (tag + 1) % _TAGS
            for at_s, at_d, n in parts.runs:  # straight from the reader's rows into the peer's
                if me == s:
                    ops.append((True, flat_out[at_s : at_s + n].view(np.uint8), d, tag, None))
                elif me == d:
                    ops.append((False, flat_out[at_d : at_d + n].view(np.uint8), s, tag, None))
                tag = (tag + 1) % _TAGS
        pending = [comm.start_send(b, peer, t) for send, b, peer, t, _ in ops if send and starts]
        for send, b, peer, t, packed in ops:
            if send:
                if not starts:
                    comm.send(b, peer, t)
                continue
            comm.recv(b, peer, t)
            if packed is not None:
                _unpack(b.view(p.geo.dtype), [dl for _, dl in packed.packed], out, origin)
            meter.add(b.nbytes, "receive")
        for h in pending:
            h.wait()


@dataclass
class Parts:
    """What one message (a reader to one peer, one tensor) is made of, the same on every rank:
    the pieces packed into one buffer, and the runs sent straight from the reader's array into
    the peer's ``(reader's element offset, peer's, elements)``: the chunks of a file that both
    want alike (replicas of one node) and hold as whole rows (``FileRead.rows_into``), so no
    copy is made on either side."""

    itemsize: int
    packed: list[tuple[FileTask, Delivery]]
    runs: list[tuple[int, int, int]]


def _parts(p: LoadPlan, s: int, d: int, items: list[tuple[FileTask, Delivery]]) -> Parts:
    """The parts of the message from ``s`` to ``d`` (local, the same on every rank)."""
    packed: list[tuple[FileTask, Delivery]] = []
    runs: list[tuple[int, int, int]] = []
    per_chunk = math.prod(p.geo.chunk_shape)
    for t, dl in items:
        own = t.own
        if own is not None and (own.lo, own.hi) == (dl.read.lo, dl.read.hi):
            at_s = own.rows_into(*p.boxes[s])
            at_d = dl.read.rows_into(*p.boxes[d])
            if at_s is not None and at_d is not None:
                n = own.n_chunks * per_chunk
                if runs and runs[-1][0] + runs[-1][2] == at_s and runs[-1][1] + runs[-1][2] == at_d:
                    runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)  # one run: one message
                else:
                    runs.append((at_s, at_d, n))
                continue
        packed.append((t, dl))
    return Parts(p.geo.dtype.itemsize, packed, runs)


def _chunk(geo: Geometry, raw: np.ndarray | memoryview) -> np.ndarray:
    return np.frombuffer(raw, dtype=geo.dtype).reshape(geo.chunk_shape)


def _read_task(
    src: Files,
    p: LoadPlan,
    task: FileTask,
    out: np.ndarray,
    bcast: np.ndarray | None,
    own: OwnTargets | None,
    deliveries: list[tuple[Delivery, np.ndarray]],
    errors: list[BaseException],
    lock: threading.Lock,
    pool: ScratchPool,
) -> None:
    """Read one file task's chunks (verified) and put each piece where it goes: this rank's
    own into ``out`` (``own``: whole chunks that are contiguous there are read straight into
    it, the others into a buffer of ``pool``), the others' into their send buffers or the
    broadcast buffer."""
    if own is not None and own.scratch:
        with pool.buffer() as scratch:
            _read_and_place(
                src, p, task, out, own.targets(scratch), own.rest, deliveries, errors, lock
            )
        return
    if own is not None:
        targets, rest = own.targets(), own.rest
    else:
        nb = p.geo.chunk_nbytes
        view = memoryview(bcast)  # type: ignore[arg-type]
        targets = [view[i * nb : (i + 1) * nb] for i in range(len(task.slots))]
        rest = list(task.own.pieces) if task.own else []  # the root's own, out of the broadcast
    _read_and_place(src, p, task, out, targets, rest, deliveries, errors, lock)


def _read_and_place(
    src: Files,
    p: LoadPlan,
    task: FileTask,
    out: np.ndarray,
    targets: list[memoryview],
    rest: list[Piece],
    deliveries: list[tuple[Delivery, np.ndarray]],
    errors: list[BaseException],
    lock: threading.Lock,
) -> None:
    """``_read_task`` once every chunk has a place to be read to (``targets``)."""
    ref = p.t.regions[task.file.region].files[task.file.file]
    try:
        read_chunks(src, p.geo, ref, task.file.cell, task.slots, targets, task.whole, (p.name,))
    except Exception as exc:  # damage, or anything else: voted on by the caller
        with lock:
            errors.append(exc)
        return
    if not rest and not deliveries:
        return
    at = {s: i for i, s in enumerate(task.slots)}
    origin = p.boxes[task.reader][0]
    for pc in rest:
        out[pc.dst(origin)] = _chunk(p.geo, targets[at[pc.slot]])[pc.src()]
    for dl, flat in deliveries:
        pos = 0
        for pc in dl.pieces:
            flat[pos : pos + pc.nelems] = _chunk(p.geo, targets[at[pc.slot]])[pc.src()].reshape(-1)
            pos += pc.nelems


_NO_SCRATCH = memoryview(b"")


@dataclass
class OwnTargets:
    """Where a rank's own read task reads each chunk to: ``direct`` (slot -> the chunk's bytes
    in the destination, for whole chunks that are one contiguous run of it), the rest into
    ``scratch`` chunks of a pool's buffer; ``rest``: the own pieces then copied out of it."""

    slots: Sequence[int]
    nbytes: int
    direct: dict[int, memoryview]
    rest: list[Piece]

    @property
    def scratch(self) -> int:
        """How many chunks go to scratch."""
        return len(self.slots) - len(self.direct)

    def targets(self, scratch: memoryview = _NO_SCRATCH) -> list[memoryview]:
        """Each chunk's place, in ``slots`` order (``scratch``: at least ``self.scratch``
        chunks' bytes; none needed when every chunk goes straight to its destination)."""
        nb, k, out = self.nbytes, 0, []
        for s in self.slots:
            view = self.direct.get(s)
            if view is None:
                view = scratch[k * nb : (k + 1) * nb]
                k += 1
            out.append(view)
        return out


def _own_targets(p: LoadPlan, task: FileTask, out: np.ndarray) -> OwnTargets:
    """Where each chunk of ``task`` is read to (``OwnTargets``): a rank's own whole chunks that
    are one contiguous run of ``out`` straight there, every other chunk into scratch."""
    geo, nb = p.geo, p.geo.chunk_nbytes
    origin = p.boxes[task.reader][0]
    out_bytes = memoryview(out.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    direct: dict[int, memoryview] = {}
    rest: list[Piece] = []
    own = task.own
    first = own.rows_into(origin, out.shape) if own is not None else None
    if own is not None and first is not None:  # row blocks: back to back, no pieces made
        at = first * geo.dtype.itemsize
        for k, s in enumerate(own.slots):
            direct[s] = out_bytes[at + k * nb : at + (k + 1) * nb]
    elif own is not None:
        for pc in own.pieces:
            if pc.shape == geo.chunk_shape:
                lo = tuple(a - o for a, o in zip(pc.lo, origin))
                hi = tuple(a + n for a, n in zip(lo, pc.shape))
                if is_contiguous_box(out.shape, lo, hi):
                    start = flat_range(out.shape, lo, hi)[0] * geo.dtype.itemsize
                    direct[pc.slot] = out_bytes[start : start + nb]
                    continue
            rest.append(pc)
    return OwnTargets(task.slots, nb, direct, rest)


def _place_broadcast(
    p: LoadPlan,
    tasks: list[FileTask],
    buf: np.ndarray,
    out: np.ndarray,
    origin: tuple[int, ...],
    me: int,
) -> None:
    """Copy this rank's pieces out of a broadcast of whole chunks."""
    nb = p.geo.chunk_nbytes
    mine: dict[tuple[int, int], FileRead] = {fr.key: fr for fr in p.route.reads[me]}
    pos = 0
    for t in tasks:
        fr = mine.get(t.file.key)
        if fr is not None:
            index = {s: i for i, s in enumerate(t.slots)}
            for pc in fr.pieces:
                at = pos + index[pc.slot] * nb
                out[pc.dst(origin)] = _chunk(p.geo, buf[at : at + nb])[pc.src()]
        pos += len(t.slots) * nb


def _unpack(
    flat: np.ndarray, deliveries: list[Delivery], out: np.ndarray, origin: tuple[int, ...]
) -> None:
    """Place received pieces (packed in delivery order) into ``out``."""
    pos = 0
    for dl in deliveries:
        for pc in dl.pieces:
            out[pc.dst(origin)] = flat[pos : pos + pc.nelems].reshape(pc.shape)
            pos += pc.nelems
