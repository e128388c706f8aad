"""Collective load of one checkpoint by any number of ranks: every rank gets what it wants,
reading only the inner chunks it needs from its own directory and receiving the rest.

Every rank calls :func:`load_collective` with the directory it can see (its node's level-1 copy,
or the shared level-3 copy) and what it wants of each tensor (the whole tensor, or a box). The
job may have another size than the one that saved (``spec/reshard.md``):

1. Each rank reads and checks the manifest and finds out which saved nodes' files its directory
   holds (given by ``node`` for a level-1 copy; else one file per saved node is looked up). The
   ranks exchange that, their wanted boxes and their options (one all-gather). A rank whose
   directory holds no checkpoint at all (a node new to the job) gets the manifest from the first
   rank that has one and all its data over the Comm.
2. Every rank computes the same plan (``ckptfmt.plan``): for each tensor the inner chunks each
   rank needs, and who reads them (``reshard.route``): a rank reads its own chunks where its
   directory holds the file, and one rank that holds it reads and sends them where it does not
   (with ``replicas="bcast"``, a file every rank needs whole is read by one rank and
   broadcast). If some needed file is held by no current rank, every rank raises
   :class:`UnreachableNodesError` naming the saved nodes (the caller then tries the level-3
   copy). Per-rank entries follow the rules of
   ``reshard.per_rank`` (an explicit error, or a warning when dropping was asked for).
3. Each rank reads its chunks (verified; concurrently, a few threads per host).
4. Broadcasts and sends in one global order, the same on every rank (so no rank waits for a
   transfer that another rank has not reached).
5. Damage found by any rank is voted on at the end, so no rank is left waiting; then every
   rank raises :class:`LoadFailedError`.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ckptfmt.container.reader import check_documents, geometry, read_manifest_bytes
from ckptfmt.errors import (
    DamagedError,
    NotACheckpointError,
    PerRankWarning,
    RankFailure,
    UsageError,
)
from ckptfmt.errors import LoadFailedError as LoadFailedError  # re-exported
from ckptfmt.errors import UnreachableNodesError as UnreachableNodesError  # re-exported
from ckptfmt.format.chunk_reads import read_chunks
from ckptfmt.format.shard_io import Geometry
from ckptfmt.manifest.codec import MANIFEST_NAME, parse_manifest
from ckptfmt.manifest.grid import flat_range, is_contiguous_box
from ckptfmt.manifest.limits import display
from ckptfmt.manifest.model import (
    GroupEntry,
    Manifest,
    PerRankValueEntry,
    TensorEntry,
    ValueEntry,
)
from ckptfmt.parallel.boundary import Boundary
from ckptfmt.plan import per_rank as rules
from ckptfmt.plan.options import ReadOptions
from ckptfmt.plan.reads import Box, FileRead, Layout, check_box
from ckptfmt.plan.route import Delivery, FileTask, TensorRoute, route
from ckptfmt.storage.files import Inside
from ckptfmt.storage.progress import current_meter
from ckptfmt.transport.comm import Comm
from ckptfmt.tree.state import unflatten

_TAGS = 32000  # MPI guarantees tags up to 32767; the ones above are reserved (MpiComm)


def _visible_nodes(src: Inside, m: Manifest, node: str | None) -> list[str]:
    """The saved nodes whose data files this rank's directory holds: ``node``'s alone when the
    caller says the directory is that node's level-1 copy; otherwise the nodes of which one
    data file is there (one look-up per node, nothing read)."""
    probes: dict[str, tuple[str, int]] = {}
    for t in m.tensors():
        for r in t.regions:
            if r.files:
                probes.setdefault(m.ranks[r.rank].node, (r.files[0].path, r.files[0].size))
    if node is not None and node in probes:
        return [node]
    # no node given, or a node the save does not know (a spare that replaced a failed host
    # under a new name holds what the rebuild wrote for the saved node it replaces): which
    # saved nodes' files are here is looked up
    out = []
    for n, (path, size) in probes.items():
        try:
            src.check_size(path, size)
        except DamagedError as exc:
            if not isinstance(exc, FileNotFoundError):
                out.append(n)  # there, but damaged: reading it will say so
            continue
        out.append(n)
    return out


def load_collective(
    comm: Comm,
    path: str | os.PathLike[str],
    wants: Mapping[str, Box | None] | None = None,
    expect_step: int | None = None,
    *,
    node: str | None = None,
    read: ReadOptions = ReadOptions(),
    seq: int | None = None,
    into: Mapping[str, np.ndarray] | None = None,
) -> tuple[dict[str, Any], Manifest]:
    """Collective: load the checkpoint every rank sees at ``path`` (its own copy), with any
    number of ranks.

    ``wants`` maps tensor names ('/'-joined) to a box ``(offset, shape)`` or None (the whole
    tensor); tensors not named are loaded whole. ``node``: the directory is this node's level-1
    copy (it holds the files of the saved ranks of ``node``); without it, which saved nodes'
    files the directory holds is looked up (one file per node). ``read``
    (:class:`~ckptfmt.plan.options.ReadOptions`, the same on every rank) says how per-rank
    entries follow a change in the number of ranks, whether a file every rank needs is read
    once and broadcast, and how many threads read per host. Returns the nested state (boxes
    as arrays of the box's shape, per-rank entries as this rank's own item) and the manifest.
    ``into`` ('/'-joined name -> array): destinations to read straight into, each used when it
    is C-contiguous, writeable and of exactly the box's shape and the saved dtype (else a fresh
    array is allocated, as without it): a tensor is then written once on the way in, and the
    returned state holds the caller's array. A load that fails part-way may have written into
    them (what the caller accepts by passing them).
    The chunks this rank reads and what it receives are counted on the caller's progress meter
    (``ckptfmt.storage.progress.metering``), if it opened one; the caller finishes it.
    """
    root = Path(path).absolute()
    src = Inside(root)
    manifest, info = _open(comm, root, src, wants, expect_step, node, read, seq)
    loaded, mine = _read_everything(comm, src, manifest, info, read, seq, into)
    return _assemble(manifest, loaded, mine, wants), manifest


def _open(
    comm: Comm,
    root: Path,
    src: Inside,
    wants: Mapping[str, Box | None] | None,
    expect_step: int | None,
    node: str | None,
    read: ReadOptions,
    seq: int | None,
) -> tuple[Manifest, list[dict[str, Any]]]:
    """Collective (an allgather, and a broadcast of the manifest when some rank has no copy):
    each rank opens its copy and says what it wants and sees; any failure, a copy of another
    save or step, or ranks in another call or with other options fail every rank alike.
    Returns the manifest and every rank's declaration."""
    error: dict[str, Any] | None = None
    absent: str | None = None  # no checkpoint here at all (a node new to the job, say)
    data = b""
    manifest: Manifest | None = None
    visible: list[str] = []
    try:
        data = read_manifest_bytes(root)
        manifest = parse_manifest(data, str(root / MANIFEST_NAME))
        check_documents(src, manifest)  # this node's zarr.json copies too (FORMAT.md §10)
        if expect_step is not None and manifest.step != expect_step:
            error = RankFailure(
                "",
                f"{root} holds step {manifest.step}, not {expect_step} (a misplaced copy)",
                "load-open",
                kind="damage",
            ).to_json()
        else:
            visible = _visible_nodes(src, manifest, node)
    except NotACheckpointError as exc:
        absent = f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # any failure is voted on below, never a rank leaving
        error = RankFailure.of(exc, "load-open").to_json()
    info = comm.allgather_json(
        {
            "key": ["load", expect_step, seq],
            "error": error,
            "absent": absent,
            "wants": {
                k: (None if v is None else [list(v[0]), list(v[1])])
                for k, v in (wants or {}).items()
            },
            "save_id": manifest.save_id if manifest else None,
            "manifest_bytes": len(data),
            "visible": visible,
            "host": socket.gethostname(),
            "options": [rules.rank_map_json(read.rank_map), read.per_rank, read.replicas],
        }
    )
    present = [r for r, i in enumerate(info) if i["absent"] is None]
    failures: dict[int, RankFailure | str] = {
        r: RankFailure.from_json(i["error"]) for r, i in enumerate(info) if i["error"]
    }
    for r, i in enumerate(info):
        if i["key"] != info[0]["key"]:
            failures[r] = RankFailure(
                "OutOfStepError",
                f"is in {i['key']}, rank 0 in {info[0]['key']}",
                "load-open",
                kind="collective",
            )
    if not present:
        failures = {r: _absent(i["absent"]) for r, i in enumerate(info)}
    if not failures and len({info[r]["save_id"] for r in present}) != 1:
        failures = {r: _absent(f"has save {info[r]['save_id']}") for r in present}
    if failures:
        raise LoadFailedError(failures, operation="load", step=expect_step)
    if len(present) < comm.size:
        # ranks without a copy take the manifest of the first rank that has one (its data
        # reaches them over the Comm like any other rank's that cannot open a file)
        buf = (
            np.frombuffer(data, np.uint8).copy()
            if comm.rank == present[0]
            else np.empty(info[present[0]]["manifest_bytes"], np.uint8)
        )
        comm.bcast_buffer(buf, present[0])
        if manifest is None:
            manifest = parse_manifest(buf.tobytes(), f"rank {present[0]}'s {MANIFEST_NAME}")
    assert manifest is not None
    if any(i["options"] != info[0]["options"] for i in info):
        raise UsageError("every rank must pass the same rank_map, per_rank and replicas options")
    return manifest, info


def _absent(message: str) -> RankFailure:
    """A rank's copy is absent or of another save: damage, to every rank (another copy or an
    older step may do)."""
    return RankFailure("", message, "load-open", kind="damage")


def _read_everything(
    comm: Comm,
    src: Inside,
    manifest: Manifest,
    info: list[dict[str, Any]],
    read: ReadOptions,
    seq: int | None,
    into: Mapping[str, np.ndarray] | None,
) -> tuple[dict[str, np.ndarray], int | None]:
    """Collective (the boundary's votes and the transfers): resolve the per-rank entries, plan
    who reads what, allocate (voted on before any exchange), read this rank's chunks and move
    the pieces between ranks (voted on). Returns every tensor this rank gets ('/'-joined name
    -> array) and the saved rank whose per-rank items it takes (None: none)."""
    # a per-rank tensor that every rank names in ``wants`` is loaded as plain boxes
    named = set.intersection(*(set(i["wants"]) for i in info))
    resolution = rules.resolve(
        [display(e.name) for e in manifest.entries if _is_per_rank(e, named)],
        manifest.world_size,
        comm.size,
        read.rank_map,
        read.per_rank,
    )
    if resolution.warning:
        warnings.warn(resolution.warning, PerRankWarning, stacklevel=3)
    sees = [
        {w for w, ri in enumerate(manifest.ranks) if ri.node in set(i["visible"])} for i in info
    ]
    plans = _plan(manifest, info, resolution.sources, sees, read.replicas == "bcast")
    same_host = sum(1 for i in info if i["host"] == info[comm.rank]["host"])
    b = Boundary(comm, "load", manifest.step, error=LoadFailedError, seq=seq)
    errors: list[BaseException] = []
    with b.guard("load-allocate"):
        bufs = _allocate(comm.rank, src, plans, errors, threading.Lock(), into or {})
        current_meter().expect(bufs.work(comm.rank, plans))
    b.vote("load-allocate")
    with b.guard("load-read"):
        _read(bufs, max(1, read.threads // same_host))
    _transfer(comm, plans, bufs)
    if errors:
        b.fail(errors[0], "load-read")
    b.vote("load-read")
    return bufs.outs, resolution.sources[comm.rank]


def _assemble(
    manifest: Manifest,
    loaded: dict[str, np.ndarray],
    mine: int | None,
    wants: Mapping[str, Box | None] | None,
) -> dict[str, Any]:
    """The nested state of this rank, in the manifest's order: boxes and whole tensors,
    values, groups, and its own per-rank items (from saved rank ``mine``)."""
    leaves: list[tuple[tuple[str, ...], Any]] = []
    for e in manifest.entries:
        if isinstance(e, TensorEntry):
            if not e.per_rank or display(e.name) in (wants or {}):
                leaves.append((e.name, loaded[display(e.name)]))
            elif mine is not None:
                leaves.append((e.name, loaded[display(e.name)].reshape(e.shape[1:])))
        elif isinstance(e, ValueEntry):
            leaves.append((e.name, e.value))
        elif isinstance(e, GroupEntry):
            leaves.append((e.name, {}))
        elif mine is not None:
            leaves.append((e.name, e.values[mine]))
    return unflatten(leaves)


def _is_per_rank(e: object, named: set[str]) -> bool:
    """Whether ``e`` is loaded as each rank's own item (and so follows the per-rank rules): a
    per-rank value, or a per-rank tensor that not every rank asks a box of."""
    if isinstance(e, PerRankValueEntry):
        return True
    return isinstance(e, TensorEntry) and e.per_rank and display(e.name) not in named


class _Plan:
    """One tensor's part of the load: its geometry, every rank's box and the route."""

    def __init__(self, t: TensorEntry, boxes: list[Box], r: TensorRoute) -> None:
        self.t, self.boxes, self.route = t, boxes, r
        self.name = display(t.name)
        self.geo: Geometry = geometry(t)


def _plan(
    m: Manifest,
    info: list[dict[str, Any]],
    sources: Sequence[int | None],
    sees: list[set[int]],
    broadcast: bool,
) -> list[_Plan]:
    """Every rank's boxes and the route of every tensor (the same on every rank); raises the
    same error on every rank for a box outside its tensor or files no rank sees."""
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
        r = route(Layout.of(t), boxes, sees, load, geo.chunk_nbytes, same_size, broadcast)
        unseen.update(r.unseen)
        out.append(_Plan(t, boxes, r))
    if unseen:
        writers = sorted(unseen)
        nodes = sorted({m.ranks[w].node for w in writers})
        raise UnreachableNodesError(nodes, writers)
    return out


@dataclass
class _Buffers:
    """Every buffer one rank's part of the load needs, allocated before any read or message."""

    outs: dict[str, np.ndarray] = field(default_factory=dict)
    bcast: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    send: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    recv: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    jobs: list[Callable[[], None]] = field(default_factory=list)
    job_bytes: list[int] = field(default_factory=list)  # each job's chunk bytes (progress)

    def work(self, me: int, plans: list[_Plan]) -> int:
        """This rank's bytes of work, for a progress total: its reads and what it receives."""
        received = sum(b.nbytes for b in self.recv.values())
        received += sum(b.nbytes for (_, root), b in self.bcast.items() if root != me)
        return sum(self.job_bytes) + received


def _allocate(
    me: int,
    src: Inside,
    plans: list[_Plan],
    errors: list[BaseException],
    lock: threading.Lock,
    into: Mapping[str, np.ndarray],
) -> _Buffers:
    """Step 3a (local): allocate this rank's destination arrays and every buffer of the
    transfers, and prepare its read jobs. Done before anything moves, so that an allocation
    failure is a failure voted on, not a rank missing from an exchange its peers wait in."""
    bufs = _Buffers()
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
            if s == me:
                flat = np.empty(sum(dl.nelems for _, dl in items), dtype=p.geo.dtype)
                bufs.send[(pi, d)] = flat
                pos = 0
                for t, dl in items:
                    packs[(id(t), d)] = flat[pos : pos + dl.nelems]
                    pos += dl.nelems
            elif d == me:
                bufs.recv[(pi, s)] = np.empty(sum(dl.nelems for _, dl in items), p.geo.dtype)
        for t in p.route.tasks_of(me):
            bufs.jobs.append(
                functools.partial(
                    _read_task,
                    src,
                    p,
                    t,
                    out,
                    slices.get(id(t)),
                    [(dl, packs[(id(t), dl.dest)]) for dl in t.deliveries],
                    errors,
                    lock,
                )
            )
            bufs.job_bytes.append(len(t.slots) * p.geo.chunk_nbytes)
    return bufs


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


def _read(bufs: _Buffers, threads: int) -> None:
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


def _transfer(comm: Comm, plans: list[_Plan], bufs: _Buffers) -> None:
    """Step 4 (every rank, in the same global order): the broadcasts and messages. Runs on
    every rank even when its reads failed (its peers wait for its messages; what it sends is
    then discarded, since the vote after it fails)."""
    me = comm.rank
    tag = 0
    meter = current_meter()
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
        for s, d, items in p.route.messages():
            if me == s:
                comm.send(bufs.send[(pi, d)].reshape(-1).view(np.uint8), d, tag)
            elif me == d:
                flat = bufs.recv[(pi, s)]
                comm.recv(flat.view(np.uint8), s, tag)
                _unpack(flat, [dl for _, dl in items], out, origin)
                meter.add(flat.nbytes, "receive")
            tag = (tag + 1) % _TAGS


def _chunk(geo: Geometry, raw: np.ndarray | memoryview) -> np.ndarray:
    return np.frombuffer(raw, dtype=geo.dtype).reshape(geo.chunk_shape)


def _read_task(
    src: Inside,
    p: _Plan,
    task: FileTask,
    out: np.ndarray,
    bcast: np.ndarray | None,
    deliveries: list[tuple[Delivery, np.ndarray]],
    errors: list[BaseException],
    lock: threading.Lock,
) -> None:
    """Read one file task's chunks (verified) and put each piece where it goes: this rank's
    own into ``out``, the others' into their send buffers or the broadcast buffer."""
    geo, nb = p.geo, p.geo.chunk_nbytes
    origin = p.boxes[task.reader][0]
    own = {pc.slot: pc for pc in (task.own.pieces if task.own else ())}
    out_bytes = out.reshape(-1).view(np.uint8)
    targets: list[memoryview] = []
    direct: set[int] = set()
    n_scratch = 0
    if bcast is None:
        for s in task.slots:
            pc = own.get(s)
            if pc is not None and pc.shape == geo.chunk_shape:
                lo = tuple(a - o for a, o in zip(pc.lo, origin))
                hi = tuple(a + n for a, n in zip(lo, pc.shape))
                if is_contiguous_box(out.shape, lo, hi):
                    start, _ = flat_range(out.shape, lo, hi)
                    start *= geo.dtype.itemsize
                    targets.append(memoryview(out_bytes[start : start + nb]))  # type: ignore[arg-type]
                    direct.add(s)
                    continue
            targets.append(memoryview(b""))  # filled below
            n_scratch += 1
        scratch = np.empty(n_scratch * nb, np.uint8)
        k = 0
        for i, s in enumerate(task.slots):
            if s not in direct:
                targets[i] = memoryview(scratch[k * nb : (k + 1) * nb])  # type: ignore[arg-type]
                k += 1
    else:
        targets = [
            memoryview(bcast[i * nb : (i + 1) * nb])  # type: ignore[arg-type]
            for i in range(len(task.slots))
        ]
    t = p.t
    ref = t.regions[task.file.region].files[task.file.file]
    try:
        read_chunks(src, geo, ref, task.file.cell, task.slots, targets, task.whole, (p.name,))
    except Exception as exc:  # damage, or anything else: voted on by the caller
        with lock:
            errors.append(exc)
        return
    chunks = {s: _chunk(geo, targets[i]) for i, s in enumerate(task.slots)}
    for s, pc in own.items():
        if s not in direct:
            out[pc.dst(origin)] = chunks[s][pc.src()]
    for dl, flat in deliveries:
        pos = 0
        for pc in dl.pieces:
            flat[pos : pos + pc.nelems] = chunks[pc.slot][pc.src()].reshape(-1)
            pos += pc.nelems


def _place_broadcast(
    p: _Plan,
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
