"""The phases of a save through ``torch.distributed.checkpoint`` (``ckptfmt_torch.dcp.Writer``),
run in DCP's own hooks, with DCP's own collectives carrying what the ranks exchange: the
writer makes no collective of its own.

DCP runs, in this order (``torch/distributed/checkpoint/state_dict_saver.py``):

1. every rank: ``prepare_local_plan`` -> :func:`declare`: what this rank holds of each tensor
   (a whole tensor or a DTensor shard at its offset), from its local plan alone, without its
   data; its node. Carried in the plan's ``storage_data``; DCP gathers the plans to the
   coordinator;
2. the coordinator: ``prepare_global_plan`` -> :func:`plan_all`: the ownership plan of every
   rank's declarations (``plan.cache``: a layout saved again is not planned again), the save
   id, the staging directory made (every rank sees it: one directory); each rank's regions go
   back in its plan's ``storage_data``, which DCP scatters;
3. every rank: ``write_data`` -> :func:`write_share`: writes its regions' shard files through
   the save's draft (``DirectoryStore(path).join(save_id)``: the staging directory), each
   without an fsync, then makes them durable at once (``Draft.sync``: a journaling file system
   commits concurrent fsyncs together); and, from its objects (which only now can be read),
   its per-rank entries and (rank 0) the values and the objects' bytes; it reports its file
   lists and these, or its failure, in its write results, which DCP gathers to the coordinator;
4. the coordinator: ``finish`` -> :func:`commit_all`: the manifest (the same
   ``build_manifest`` as the collective save's), the zarr documents, then the draft's commit
   (the documents, the manifest and every directory fsynced together, the rename); any rank's
   failure removes the staging directory and raises, which DCP gives every rank.

Objects (DCP's ``BYTE_IO`` items) have no size before ``write_data``, so the ownership plan of
step 2 holds the tensors: rank 0 writes each object's bytes (and takes the values from its own
objects, as the collective save takes values from rank 0), each rank its row of a per-rank
tensor, on a grid each computes alone from the shape (``make_plan`` of those declarations,
which depends on nothing else); the coordinator plans them the same way from the reports.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import numpy as np

from ckptfmt.container import utc_now, write_metadata
from ckptfmt.dtypes import of_array
from ckptfmt.errors import CkptError, RankFailure, SaveFailedError, UsageError
from ckptfmt.format import WriteOptions, plan_region, run_jobs
from ckptfmt.manifest import Manifest, display, dump_manifest, encode_value
from ckptfmt.parallel import (
    Declared,
    LocalState,
    build_manifest,
    check_rank0_declares_all,
    check_state,
    gathered_per_rank,
    geometry_of,
    order_and_values,
    region_data,
)
from ckptfmt.plan import Holding, PlanCache, SavePlan, TensorPlan, make_plan
from ckptfmt.storage import DirectoryStore, Draft, Pool, check_destination

PLANS = PlanCache()
"""The process's plans of DCP saves, by layout: a job saving the same state every few steps
(a new ``Writer`` each time, as DCP's examples do) plans it once."""

DIRS_IN_FLIGHT = 8
"""Regions of a rank whose shard directories are made at once when a ``mkdir`` waits (for a
journaling file system's journal, which other writers keep busy)."""

INLINE_S = 1e-3
"""A region planned (its directories made) within this did not wait: the next is planned in
the same thread (:func:`_each`); a shard file written within this and its bytes at
:data:`MEMORY_SPEED` the same."""

MEMORY_SPEED = 1e9
"""Bytes a second a write into the page cache goes at least (tmpfs, or a disk's cache): 2-3
GB/s on the development machine."""

WRITES_IN_FLIGHT = 4
"""Shard files a rank writes at once once a creation waits (:func:`_each`)."""

T = TypeVar("T")
R = TypeVar("R")

KEY = "ckptfmt"
"""The ``storage_data`` key of what the writer carries in DCP's plans and write results."""


def declaration(name: tuple[str, ...], dtype: Any, size: Any, offsets: Any, sizes: Any) -> Holding:
    """What a rank holds of one tensor, from DCP's ``TensorWriteData`` (``dtype``: the numpy
    dtype): the whole tensor, or the chunk at ``offsets``."""
    shape = tuple(int(x) for x in size)
    at, chunk = tuple(int(x) for x in offsets), tuple(int(x) for x in sizes)
    region = None if chunk == shape else (at, chunk)
    return Holding(name, of_array(np.dtype(dtype), display(name)).name, shape, region)


def declare(holdings: list[Holding], node: str) -> dict[str, Any]:
    """Step 1 (every rank, local): the ``storage_data`` of this rank's local plan."""
    return {KEY: {"decl": [h.to_json() for h in holdings], "node": node}}


def plan_all(
    local: list[Any], path: Path, write: WriteOptions, number: int
) -> tuple[list[dict[str, Any]], Job]:
    """Step 2 (the coordinator, local): from every rank's ``storage_data`` (by rank), the plan,
    the save id and the staging directory (made here, before any rank writes: DCP scatters the
    plans after this returns). Returns each rank's ``storage_data`` and what the coordinator
    keeps for :func:`commit_all`. Raises (DCP gives every rank the error) when the plan or the
    destination cannot be made; nothing is left then."""
    decls = [d[KEY]["decl"] for d in local]
    nodes = [d[KEY]["node"] for d in local]
    plan = PLANS.plan(decls, write.chunk_bytes, write.shard_bytes)
    check_destination(path)
    save_id = os.urandom(16).hex()
    final = path.absolute()
    draft = DirectoryStore(final).prepare(save_id, write.overwrite)
    job = Job(final, draft, save_id, utc_now(), plan, nodes)
    out = []
    for rank in range(len(local)):
        mine = [_region_json(t, r.offset, r.shape) for t, r in plan.for_rank(rank)]
        on_node = sum(1 for n in nodes if n == nodes[rank])
        out.append(
            {
                KEY: {
                    "rank": rank,
                    "world": len(local),
                    "number": number,
                    "final": str(final),
                    "save_id": save_id,
                    "regions": mine,
                    "threads": max(1, write.threads // on_node),
                }
            }
        )
    return out, job


@dataclass
class Job:
    """What the coordinator keeps from :func:`plan_all` to :func:`commit_all`."""

    final: Path
    draft: Draft  # the directory store's draft: its staging directory, its commit
    save_id: str
    created: str
    plan: SavePlan
    nodes: list[str]


def _region_json(t: TensorPlan, offset: tuple[int, ...], shape: tuple[int, ...]) -> list[Any]:
    geometry = [list(t.shape), list(t.shard_shape), list(t.chunk_shape)]
    return [list(t.name), t.dtype, *geometry, list(offset), list(shape)]


def _region_of(doc: list[Any]) -> tuple[TensorPlan, tuple[int, ...], tuple[int, ...]]:
    name, dtype, shape, shard, chunk, offset, rshape = doc
    t = TensorPlan(tuple(name), dtype, tuple(shape), tuple(shard), tuple(chunk), ())
    return t, tuple(offset), tuple(rshape)


def late_declarations(
    local: LocalState, rank: int, world: int, objects: set[tuple[str, ...]]
) -> tuple[list[list[Holding]], list[Holding]]:
    """The declarations the plan of step 2 could not hold (known once the objects are read),
    by rank, and this rank's own among them: ``objects`` (on rank 0: each object's bytes,
    whole) and the per-rank tensors (every rank's row declared: every rank holds one, of the
    same shape, which the coordinator checks)."""
    per_rank = {n for n, kind in local.order if kind == "per_rank_tensor"}
    decl: list[list[Holding]] = [[] for _ in range(world)]
    mine: list[Holding] = []
    for h in local.holdings():
        if h.name in per_rank and h.region is not None:
            rest, rows = h.region[0][1:], h.region[1]
            for q in range(world):
                decl[q].append(Holding(h.name, h.dtype, h.shape, ((q, *rest), rows)))
            mine.append(h)
        elif h.name in objects and rank == 0:
            decl[0].append(h)
            mine.append(h)
    return decl, mine


def write_share(
    state: dict[str, Any],
    objects: set[tuple[str, ...]],
    data: dict[str, Any],
    write: WriteOptions,
    number: int,
    failure: BaseException | None,
) -> tuple[dict[str, Any], BaseException | None]:
    """Step 3 (every rank, local): write this rank's regions (``data``: its ``storage_data``
    from step 2) of ``state`` (this rank's tensors and objects, as ckptfmt leaves; ``objects``:
    the names holding an object's bytes) into the staging directory. Returns the report for
    its write results: the file lists, rank 0's order and values, this rank's per-rank values
    and late declarations; or its failure (``failure``: one met before, reading the state),
    with the error itself beside it. Never raises: the coordinator learns every rank's failure
    and fails the save."""
    job = data.get(KEY) if isinstance(data, dict) else None
    if job is None or job["number"] != number:
        return _failed(
            UsageError(
                "the DCP plan this rank got is not this save's (DCP's plan caching, "
                "DefaultSavePlanner(enable_plan_caching=True), is not supported by ckptfmt's "
                "Writer)"
            )
        )
    if failure is not None:
        return _failed(failure)
    rank, world = job["rank"], job["world"]
    try:
        local = check_state(state, rank, world)
        late, late_mine = late_declarations(local, rank, world, objects)
        regions = [_region_of(doc) for doc in job["regions"]]
        if any(late):
            extra = make_plan(late, write.chunk_bytes, write.shard_bytes)
            regions += [(t, r.offset, r.shape) for t, r in extra.for_rank(rank)]
        draft = DirectoryStore(job["final"]).join(job["save_id"])
        workers = job["threads"]
        planned = _each(lambda r: _plan(draft, local, *r), regions, DIRS_IN_FLIGHT, _quick)
        jobs_by_region = [(t, offset, jobs) for (t, offset, _), jobs in zip(regions, planned)]
        all_jobs = [j for _, _, jobs in jobs_by_region for j in jobs]
        # written without an fsync each, then made durable all at once
        if workers > 1:
            files = iter(run_jobs(all_jobs, _pool(workers), fsync=False))
        else:  # one writer, unless the files' creations wait: then several, to overlap them
            files = iter(_each(lambda j: j.run(False), all_jobs, WRITES_IN_FLIGHT, _budget))
        if write.fsync:
            draft.sync()
        refs: dict[str, list[Any]] = {}
        for t, offset, jobs in jobs_by_region:
            refs.setdefault("/".join(t.name), []).append(
                [list(offset), [[f.path, f.size, f.crc32c] for f in (next(files) for _ in jobs)]]
            )
        per_rank = [
            [list(n), *encode_value(v, display(n))] for n, v in local.per_rank_values.items()
        ]
        report = {
            "refs": refs,
            "per_rank": per_rank,
            "late": [h.to_json() for h in late_mine],
            "order_values": order_and_values(local) if rank == 0 else None,
            "decl": [h.to_json() for h in local.holdings()],
        }
        return report, None
    except Exception as exc:  # the coordinator fails the save on every rank
        return _failed(exc)


def _each(
    fn: Callable[[T], R], items: Sequence[T], workers: int, budget: Callable[[T], float]
) -> list[R]:
    """``fn`` of each of ``items``, in order: in this thread while each returns within its
    ``budget`` (seconds: on tmpfs, where nothing waits, a pool's hand-offs would cost more than
    they save), the rest on ``workers`` threads from the first that waits (a journaling file
    system's ``mkdir`` and file creation wait for its journal, which other writers keep busy:
    several at once overlap their waits)."""
    out: list[R] = []
    for i, item in enumerate(items):
        start = time.perf_counter()
        out.append(fn(item))
        rest = items[i + 1 :]
        if len(rest) > 1 and time.perf_counter() - start > budget(item):
            out += _pool(workers).map(fn, rest)
            break
    return out


def _quick(_: Any) -> float:
    return INLINE_S


def _budget(job: Any) -> float:
    """The time a shard file's write takes when nothing waits: :data:`INLINE_S`, and its bytes
    at :data:`MEMORY_SPEED`."""
    return INLINE_S + int(job.nbytes()) / MEMORY_SPEED


_POOLS: dict[int, tuple[int, Pool]] = {}
_POOLS_LOCK = threading.Lock()


def _pool(workers: int) -> Pool:
    """The process's pool of ``workers`` threads for the saves' writes, started once (starting
    threads for each save cost a tiny state more than its writes): remade in a child process
    after a fork. Its tasks (a region planned, a shard file written) never wait on the pool."""
    with _POOLS_LOCK:
        held = _POOLS.get(workers)
        if held is None or held[0] != os.getpid():
            pool = Pool(workers, thread_name_prefix="ckptfmt-dcp")
            _POOLS[workers] = held = (os.getpid(), pool)
        return held[1]


def _plan(
    draft: Draft, local: LocalState, t: TensorPlan, offset: tuple[int, ...], shape: tuple[int, ...]
) -> list[Any]:
    """The shard jobs of one of this rank's regions, into ``draft`` (their directories made)."""
    return plan_region(draft, geometry_of(t), region_data(local, t, offset, shape), offset)


def _failed(exc: BaseException) -> tuple[dict[str, Any], BaseException]:
    """A failed rank's report (JSON: DCP pickles the write results it gathers) and error."""
    return {"failure": RankFailure.of(exc, "write").to_json()}, exc


def commit_all(
    job: Job,
    reports: list[dict[str, Any]],
    write: WriteOptions,
    step: int | None,
    writer: dict[str, Any],
    own_error: BaseException | None,
) -> Manifest:
    """Step 4 (the coordinator, local): the manifest from every rank's report (by rank), then
    the commit; on any rank's failure (or one here) the staging directory is removed and the
    save's error raised: :class:`SaveFailedError` naming every failing rank's error, or, in a
    job of one process, that process's own error (``own_error``)."""
    failures = {
        r: RankFailure.from_json(x["failure"]) for r, x in enumerate(reports) if "failure" in x
    }
    if failures:
        job.draft.abort()
        if len(reports) == 1 and own_error is not None:
            raise own_error
        raise SaveFailedError(failures, own_error, operation="save", step=step)
    try:
        manifest = _manifest(job, reports, write, step, writer)
        # the documents unsynced: made durable with the manifest and the tree, all at once
        write_metadata(job.draft, manifest, fsync=False)
        job.draft.stage_manifest(dump_manifest(manifest), fsync=write.fsync)
        job.draft.discard(job.draft.publish(fsync=write.fsync))
    except BaseException:
        job.draft.abort()
        raise
    return manifest


def _manifest(
    job: Job,
    reports: list[dict[str, Any]],
    write: WriteOptions,
    step: int | None,
    writer: dict[str, Any],
) -> Manifest:
    world = len(reports)
    late: list[list[dict[str, Any]]] = [[] for _ in range(world)]
    for rank, x in enumerate(reports):
        late[rank] = x["late"]
    tensors = list(job.plan.tensors)
    if any(late):
        tensors += make_plan(
            [[Holding.from_json(d) for d in decl] for decl in late],
            write.chunk_bytes,
            write.shard_bytes,
        ).tensors
    plan = SavePlan(tuple(tensors), world)
    info = [
        {"decl": x["decl"], "per_rank": x["per_rank"], "node": job.nodes[r]}
        for r, x in enumerate(reports)
    ]
    check_rank0_declares_all(plan, info)
    written = {
        (path, tuple(offset))
        for x in reports
        for path, regions in x["refs"].items()
        for offset, _ in regions
    }
    planned = {("/".join(t.name), tuple(r.offset)) for t in plan.tensors for r in t.regions}
    if written != planned:  # a rank wrote on another grid than the plan's: never committed
        raise CkptError(
            f"{job.final}: the regions written are not those planned "
            f"({len(planned - written)} missing, {len(written - planned)} not planned)"
        )
    declared = Declared(
        info,
        plan,
        reports[0]["order_values"],
        gathered_per_rank(info),
        job.save_id,
        job.created,
        step,
    )
    return build_manifest(declared, [x["refs"] for x in reports], writer, {})


TURN_POLL_S = 0.01
"""How often a save waiting for its turn on a writer looks whether the save before it is over."""

_DCP = "torch.distributed.checkpoint"


class Turns:
    """One save at a time on one ``Writer``, in the order they reach it: a save that reaches the
    writer (``reset`` or ``set_up_storage_writer``, in the thread DCP runs it in) while another
    is in flight waits until that one is over. ``dcp.async_save`` runs each save in a thread of
    its own, so two calls with one writer run at once; the writer's per-save state (its path,
    its plan, the coordinator's staging directory) holds one save.

    A save is over when DCP's call of it has returned, whatever happened: its thread is no
    longer inside the outermost DCP frame that held it (a failure in DCP's planner, between the
    writer's hooks, is never told to the writer), or that thread has ended (``async_save``'s).
    Waiting for that rather than for the writer's ``finish`` also keeps the saves' collectives
    apart on every rank (DCP's last one, the result's broadcast, follows ``finish``; a rank
    other than the coordinator never calls ``finish``). Hooks called outside a DCP save
    (no DCP frame on the stack) never wait. The frame is known by its id and code, not held:
    holding it would keep the save's state (DCP's staged copy) alive after the save. An id is
    reused once its frame is freed, so the next save on the same thread may show the same key;
    DCP calls each hook (``reset``, ``set_up_storage_writer``) once per save, so a hook the
    holder has already called is a new save's, whatever its key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: tuple[threading.Thread, _FrameKey | None] | None = None
        self._called: set[str] = set()  # the hooks the holding save has called

    def __getstate__(self) -> dict[str, Any]:
        # a writer sent to another process (DCP's process-based async save) holds no save
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def take(self, hook: str, on_new: Callable[[], None]) -> None:
        """Called by the writer's first hooks of a save (any rank, its own), ``hook`` naming
        which: returns at once within the save that holds the writer; else, once the save in
        flight is over, makes this save the holder and calls ``on_new`` (the writer drops what
        a save that ended without ``finish`` left: its staging directory)."""
        me, key = threading.current_thread(), _save_frame()
        while True:
            with self._lock:
                owner = self._owner
                same = owner is not None and owner[0] is me and key is not None
                if same and owner is not None and owner[1] == key and hook not in self._called:
                    self._called.add(hook)
                    return  # this save already holds the writer
                if owner is None or _over(owner, me):
                    self._owner, self._called = (me, key), {hook}
                    on_new()
                    return
            time.sleep(TURN_POLL_S)


_FrameKey = tuple[int, Any]  # a frame's id and its code object


def _save_frame() -> _FrameKey | None:
    """The outermost frame of DCP's on this thread's stack (``dcp.save``'s own, or the async
    executor's), which lives exactly as long as the save; None outside a DCP save."""
    found: FrameType | None = None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if str(frame.f_globals.get("__name__", "")).startswith(_DCP):
            found = frame
        frame = frame.f_back
    return None if found is None else (id(found), found.f_code)


def _over(owner: tuple[threading.Thread, _FrameKey | None], me: threading.Thread) -> bool:
    """Whether the save that holds the writer (its thread and DCP frame) is over, seen from a
    new save on thread ``me``: a thread runs one save at a time."""
    thread, key = owner
    if thread is me or key is None or not thread.is_alive():
        return True
    running = sys._current_frames().get(thread.ident) if thread.ident is not None else None
    while running is not None:
        if (id(running), running.f_code) == key:
            return False
        running = running.f_back
    return True
