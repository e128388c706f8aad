"""The collective save and load of one checkpoint by every rank (``spec/PROTOCOL.md`` §2).

``save_collective`` (every rank calls it, with its own state and its own destination path):

1. each rank checks its state and declares what it holds; ``allgather`` of the declarations;
2. every rank computes the same plan (``plan.make_plan``): who writes which regions;
3. ranks writing to the same directory form a group (one per node for node-local storage, one
   for shared storage); each group's leader (its lowest rank) creates the staging directory;
   barrier;
4. each rank writes its regions' shard files into its group's staging directory;
5. vote: if any rank failed, every leader removes its staging directory and every rank raises;
6. ``allgather`` of every rank's file list; every rank builds the same manifest;
7. each leader writes the zarr metadata documents and the manifest into its staging directory
   and commits it (fsync, rename, fsync parent); a last vote says whether every group committed.

So every group's directory holds the whole manifest and metadata and the files its own ranks
wrote. ``load_collective`` reads them back: a rank reads the regions written in its own group
itself and receives the others from their writers over the ``Comm`` (on node-local storage no
rank can see another node's directory).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ckptfmt.container.metadata import ManifestMeta, utc_now, write_metadata, writer_info
from ckptfmt.dtypes import DType, by_name, of_array
from ckptfmt.engine.encode import (
    SetLayout,
    data_buffer,
    encode_collective,
    make_record,
    member_sets,
    plan_set,
    reserve_buffers,
)
from ckptfmt.errors import (
    CkptError,
    LimitExceededError,
    StorageError,
    StorageFullError,
    UsageError,
    level_name,
)
from ckptfmt.errors import SaveFailedError as SaveFailedError  # re-exported
from ckptfmt.format.options import WriteOptions
from ckptfmt.format.shard_io import Geometry, plan_region, region_file_nbytes, run_jobs
from ckptfmt.manifest.codec import dump_manifest
from ckptfmt.manifest.limits import MAX_DIM, MAX_NDIM, MAX_TENSOR_BYTES, display
from ckptfmt.manifest.model import (
    Entry,
    FileRef,
    GroupEntry,
    Manifest,
    PerRankValueEntry,
    RankInfo,
    Region,
    TensorEntry,
    ValueEntry,
)
from ckptfmt.manifest.values import decode_value, encode_value
from ckptfmt.parallel.boundary import Boundary
from ckptfmt.plan.ownership import Holding, SavePlan, TensorPlan, make_plan
from ckptfmt.redundancy.config import Redundancy
from ckptfmt.storage import commit
from ckptfmt.transport.comm import Comm
from ckptfmt.tree.state import PerRank, Pieces, Shard, flatten, is_tensor

Name = tuple[str, ...]
FaultHook = Callable[[str], None]


def as_storable(array: Any, name: str) -> tuple[np.ndarray, DType]:
    """An array as the writer needs it (C-contiguous, little-endian) and its logical dtype;
    copies only when the input is not already so."""
    arr = np.asarray(array)
    dtype = of_array(arr.dtype, name)
    if arr.ndim > MAX_NDIM:
        raise LimitExceededError(f"number of dimensions of {name!r}", arr.ndim, MAX_NDIM)
    if any(d > MAX_DIM for d in arr.shape) or arr.nbytes > MAX_TENSOR_BYTES:
        raise LimitExceededError(f"size of {name!r}", arr.nbytes, MAX_TENSOR_BYTES)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(dtype.numpy)
    return (arr if arr.flags.c_contiguous else arr.copy(order="C")), dtype


@dataclass
class LocalState:
    """One rank's checked state: tensors (with the region held), values and empty groups, in
    the order given."""

    order: list[tuple[Name, str]]  # (name, "tensor" | "value" | "group" | "per_rank_*")
    tensors: dict[Name, tuple[np.ndarray | Pieces, DType, tuple[int, ...], tuple[int, ...] | None]]
    values: dict[Name, Any]
    per_rank_values: dict[Name, Any] = field(default_factory=dict)

    def holdings(self) -> list[Holding]:
        out = []
        for name, (arr, dtype, shape, offset) in self.tensors.items():
            region = None if offset is None else (offset, arr.shape)
            out.append(Holding(name, dtype.name, shape, region))
        return out


def check_state(state: Mapping[str, Any], rank: int = 0, size: int = 1) -> LocalState:
    """Check every leaf before anything touches the disk. ``rank`` of ``size`` places this rank's
    :class:`PerRank` arrays as row ``rank`` of their per-rank tensors."""
    local = LocalState([], {}, {})
    for name, leaf in flatten(state):
        shown = display(name)
        if isinstance(leaf, PerRank):
            if is_tensor(leaf.value) and not isinstance(leaf.value, Shard):
                arr, dtype = as_storable(leaf.value, shown)
                at = (rank,) + (0,) * arr.ndim
                local.tensors[name] = (arr[None], dtype, (size, *arr.shape), at)
                local.order.append((name, "per_rank_tensor"))
            else:
                encode_value(leaf.value, shown)  # raises for what JSON cannot hold
                local.per_rank_values[name] = leaf.value
                local.order.append((name, "per_rank_value"))
        elif is_tensor(leaf):
            if isinstance(leaf, Shard):
                arr, dtype = as_storable(leaf.data, shown)
                local.tensors[name] = (arr, dtype, leaf.global_shape, leaf.offset)
            elif isinstance(leaf, Pieces):  # the manager's staging copy (checked before)
                dtype = of_array(leaf.dtype, shown)
                local.tensors[name] = (leaf, dtype, leaf.shape, None)
            else:
                arr, dtype = as_storable(leaf, shown)
                local.tensors[name] = (arr, dtype, arr.shape, None)
            local.order.append((name, "tensor"))
        elif isinstance(leaf, dict) and not leaf:
            local.order.append((name, "group"))
        else:
            encode_value(leaf, shown)  # raises for what JSON cannot hold
            local.values[name] = leaf
            local.order.append((name, "value"))
    return local


def check_leaf(shown: str, leaf: Any) -> None:
    """Check one leaf of a state as :func:`check_state` does, copying nothing: raises the
    :class:`UsageError` a save of it would (an unsupported value type, a dtype the format
    cannot hold, a value JSON cannot hold, too many dimensions). Lets a caller that walks the
    state anyway (the manager's staging copy) refuse misuse at the call."""
    value = leaf.value if isinstance(leaf, PerRank) else leaf
    if is_tensor(value):
        arr = value.data if isinstance(value, Shard) else value
        if not hasattr(arr, "dtype") or not hasattr(arr, "shape"):
            arr = np.asarray(arr)
        of_array(np.dtype(arr.dtype), shown)
        if len(arr.shape) > MAX_NDIM:
            raise LimitExceededError(f"number of dimensions of {shown!r}", len(arr.shape), MAX_NDIM)
    elif not (isinstance(leaf, dict) and not leaf):
        encode_value(value, shown)  # raises for what JSON cannot hold


def _region_data(
    local: LocalState, t: TensorPlan, offset: tuple[int, ...], shape: tuple[int, ...]
) -> np.ndarray:
    """This rank's data for a planned region, C-contiguous (a view when possible)."""
    arr, _, _, held_at = local.tensors[t.name]
    if isinstance(arr, Pieces):
        piece = arr.region(offset, shape)
        if piece is None:  # the staging agreed on another plan: voted on, never written
            raise CkptError(
                f"tensor {display(t.name)!r}: the staged copy holds no data for the region at "
                f"{list(offset)} of shape {list(shape)} this rank is to write"
            )
        return piece if piece.flags.c_contiguous else np.ascontiguousarray(piece)
    base = (0,) * len(shape) if held_at is None else held_at
    view = (
        arr[tuple(slice(o - b, o - b + s) for o, b, s in zip(offset, base, shape))]
        if shape
        else arr
    )
    return view if view.flags.c_contiguous else np.ascontiguousarray(view)


def groups_of(keys: list[str]) -> list[int]:
    """For each rank, the leader (lowest rank) of the ranks whose group keys are equal (the ranks
    that see the same directory)."""
    first: dict[str, int] = {}
    return [first.setdefault(k, r) for r, k in enumerate(keys)]


def save_collective(
    comm: Comm,
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    step: int | None,
    node: str,
    write: WriteOptions = WriteOptions(),
    meta: ManifestMeta = ManifestMeta(),
    group: str | None = None,
    fault: FaultHook | None = None,
    redundancy: Redundancy | None = None,
    seq: int | None = None,
    failure: BaseException | None = None,
) -> tuple[Manifest, SavePlan]:
    """Collective: every rank of ``comm`` calls it, once per checkpoint, with its own ``state``
    and the final directory it writes to (``path``: this rank's node-local copy, or the shared
    one). Returns the manifest (the same on every rank) and the plan.

    Ranks with the same ``group`` key see the same directory (default: the absolute path, right
    on one machine; on a cluster, node-local paths are equal strings on different nodes, so the
    caller passes the node for level 1 and one key for the shared level).

    With ``redundancy`` (level-1 saves), once every rank's data files are written the ranks
    encode it across the nodes (``ckptfmt/engine/encode.py``), each writing its parity file into its
    own staging directory, and the manifest records it under ``levels["1"]["redundancy"]``.

    Values (non-tensor leaves) are taken from rank 0; every rank must have the same names.

    Errors: any exception on any rank, in any phase, is voted on (``parallel/boundary.py``): every
    rank raises :class:`SaveFailedError` naming each failing rank's error, every staging
    directory is removed, and nothing is committed anywhere (a step already renamed into place
    on some node is rolled back). ``failure``: this rank failed before the save (staging the
    state); it takes part in the first vote only, which fails the save everywhere. ``seq``: the
    caller's call number, checked by every vote like the step.
    """
    run = _Save(comm, state, Path(path).absolute(), step, node, write, meta, fault, seq, failure)
    run.declare(group)
    run.plan(redundancy)
    run.stage()
    refs, parity = run.write()
    manifest = run.manifest(refs, parity)
    publish_commit(run.b, run.is_leader, run.staging, run.final, run.save_id, write.fsync, run.hook)
    return manifest, run.plan_


@dataclass
class _Declared:
    """What every rank knows once the declarations are gathered and the plan is made, the same
    on every rank: what the manifest is built from."""

    info: list[dict[str, Any]]
    plan: SavePlan
    order_values: dict[str, Any]
    per_rank_values: dict[Name, list[Any]]
    save_id: str
    created: str
    step: int | None


class _Save:
    """One rank's side of one :func:`save_collective`, phase by phase. Each phase is local work
    under the boundary's guard (``parallel/boundary.py``) and a vote; every rank calls the
    phases in this order: :meth:`declare`, :meth:`plan`, :meth:`stage`, :meth:`write` (with
    the encode when there is redundancy), :meth:`manifest`, then ``publish_commit``."""

    def __init__(
        self,
        comm: Comm,
        state: Mapping[str, Any],
        final: Path,
        step: int | None,
        node: str,
        write: WriteOptions,
        meta: ManifestMeta,
        fault: FaultHook | None,
        seq: int | None,
        failure: BaseException | None,
    ) -> None:
        self.comm, self.state, self.final, self.node = comm, state, final, node
        self.step, self.write_options, self.meta = step, write, meta
        self.hook: FaultHook = fault or (lambda _point: None)
        self.b = Boundary(comm, "save", step, seq=seq, failure=failure)
        self.local = LocalState([], {}, {})
        self.layout: SetLayout | None = None
        self.member: np.ndarray | None = None
        self.redundancy: Redundancy | None = None

    def declare(self, group: str | None) -> None:
        """Collective: check this rank's state and gather every rank's declarations (what it
        holds, its per-rank values, its directory and group, its node); rank 0's save id and
        time are everyone's. Ranks with the same ``group`` key share a directory and a leader
        (its lowest rank), which makes the staging directory and commits it."""
        b, comm = self.b, self.comm
        decl: list[Any] = []
        per_rank: list[Any] = []
        with b.guard("declare"):
            if not b.failed:
                self.local = check_state(self.state, comm.rank, comm.size)
                decl = [h.to_json() for h in self.local.holdings()]
                per_rank = [
                    [list(n), *encode_value(v, display(n))]
                    for n, v in self.local.per_rank_values.items()
                ]
            self.hook("declared")
        self.info = b.vote(
            "declare",
            {
                "decl": decl,
                "per_rank": per_rank,
                "path": str(self.final),
                "group": group if group is not None else str(self.final),
                "node": self.node,
                "save_id": self.meta.save_id or os.urandom(16).hex(),
                "created": self.meta.created or utc_now(),
            },
        )
        leaders = groups_of([i["group"] for i in self.info])
        self.is_leader = leaders[comm.rank] == comm.rank
        self.save_id: str = self.info[0]["save_id"]  # rank 0's proposal, the same everywhere
        self.staging = commit.staging_dir(self.final, self.save_id)
        self.mine_staging = self.staging if self.is_leader else None
        self.nodes = [i["node"] for i in self.info]

    def plan(self, redundancy: Redundancy | None) -> None:
        """Collective (a broadcast of rank 0's entry order and values): every rank makes the
        same plan from the declarations, so a usage error found here fails every rank alike
        (voted on with the staging)."""
        b, comm, write = self.b, self.comm, self.write_options
        self.redundancy = redundancy
        per_rank_values: dict[Name, list[Any]] = {}
        with b.guard("plan"):
            per_rank_values = _gathered_per_rank(self.info)
            self.plan_ = make_plan(
                [[Holding.from_json(d) for d in i["decl"]] for i in self.info],
                write.chunk_bytes,
                write.shard_bytes,
            )
            _check_rank0_declares_all(self.plan_, self.info)
        order_values = comm.bcast_json(
            _order_and_values(self.local) if comm.rank == 0 and not b.failed else None, root=0
        )
        if not b.failed:
            self.declared = _Declared(
                self.info,
                self.plan_,
                order_values,
                per_rank_values,
                self.save_id,
                self.info[0]["created"],
                self.step,
            )

    def stage(self) -> None:
        """Collective (a vote): the leaders make their staging directories and write the zarr
        documents into them (they depend on the plan alone, so that only the manifest and the
        rename remain once every rank has written); with redundancy, every rank reserves its
        buffers. Every leader has a staging directory, or nobody goes on (none is left)."""
        b = self.b
        with b.guard("stage"), level_directory(self.final, self.meta.levels):
            if not b.failed:
                self.skeleton = _build_manifest(self.declared, None, {}, {})
                if self.redundancy is not None:  # the same on every rank
                    sizes = _planned_member_bytes(self.plan_, self.comm.size)
                    self.layout = plan_set(self.redundancy, self.nodes, sizes, self.comm.rank)
                    reserve_buffers(self.layout)
                    self.member = data_buffer(self.layout)
                if self.is_leader:
                    commit.prepare(self.final, self.save_id, self.write_options.overwrite)
                    write_metadata(self.staging, self.skeleton, self.write_options.fsync)
        b.vote("stage", cleanup=self.mine_staging)

    def write(self) -> tuple[list[Any], list[Any]]:
        """Collective (the encode's exchanges, then a vote that gathers every rank's file list
        and parity record): this rank writes its regions' shard files into its group's staging
        directory, with a node's thread budget shared by the ranks on it; with redundancy the
        ranks encode across the nodes, each writing its parity file."""
        b, comm, write = self.b, self.comm, self.write_options
        refs: dict[str, list[list[Any]]] = {}
        levels = self.meta.levels
        with (
            b.guard("write"),
            _storage_context(self.final, levels, self.plan_, comm.rank, comm.size),
        ):
            self.hook("staged")
            jobs_by_region = []
            made: set[Path] = set()
            for t, r in self.plan_.for_rank(comm.rank):
                data = _region_data(self.local, t, r.offset, r.shape)
                jobs = plan_region(self.staging, _geometry(t), data, r.offset, made)
                jobs_by_region.append((t, r, jobs))
            all_jobs = [j for _, _, jobs in jobs_by_region for j in jobs]
            into = _member_slices(self.skeleton, comm.rank, jobs_by_region, self.member)
            on_node = sum(1 for i in self.info if i["node"] == self.node)
            workers = max(1, write.threads // on_node)
            with ThreadPoolExecutor(max_workers=workers) as pool:
                files = iter(run_jobs(all_jobs, pool if workers > 1 else None, write.fsync, into))
            for t, r, jobs in jobs_by_region:
                refs.setdefault("/".join(t.name), []).append(
                    [
                        list(r.offset),
                        [[f.path, f.size, f.crc32c] for f in (next(files) for _ in jobs)],
                    ]
                )
            self.hook("written")
        parity: dict[str, Any] | None = None
        if self.layout is not None and self.member is not None:  # the vote carries the parity
            with b.guard("encode"):
                parity = encode_collective(
                    comm, self.layout, self.member, self.staging, write.fsync, failed=b.failed
                )
                self.hook("encoded")
        gathered = b.vote("write", {"refs": refs, "parity": parity}, cleanup=self.mine_staging)
        return [g["refs"] for g in gathered], [g["parity"] for g in gathered]

    def manifest(self, refs: list[Any], parity: list[Any]) -> Manifest:
        """Collective (a vote): every rank builds the same manifest from the gathered file
        lists (and the redundancy record from the parity records); the leaders stage it. Every
        node's manifest is staged before any node's step becomes visible."""
        b = self.b
        manifest = self.skeleton
        with b.guard("manifest"):
            writer = self.meta.writer or writer_info()
            manifest = _build_manifest(self.declared, refs, writer, self.meta.levels or {})
            if self.redundancy is not None:
                sets = member_sets(self.redundancy, self.nodes)
                record = make_record(self.redundancy, manifest, sets, parity)
                new_levels = dict(manifest.levels)
                new_levels["1"] = {**dict(new_levels.get("1", {})), "redundancy": record.to_json()}
                manifest = dataclasses.replace(manifest, levels=new_levels)
            self.hook("manifest")
            data = dump_manifest(manifest)  # on every rank: a manifest too big fails them all
            if self.is_leader:
                commit.stage_manifest(self.staging, data, self.write_options.fsync)
        b.vote("manifest", cleanup=self.mine_staging)
        return manifest


@contextmanager
def _storage_context(
    final: Path, levels: dict[str, Any] | None, plan: SavePlan, rank: int, size: int
) -> Iterator[None]:
    """A full disk while writing is reported with what the save knows and a file write does
    not: the level, the checkpoint's directory and the bytes this rank's save needed."""
    try:
        yield
    except StorageFullError as exc:
        needed = _planned_member_bytes(plan, size)[rank]
        level = level_name(next(iter(levels or {}), None))
        raise exc.with_context(level=level, needed=needed, path=str(final.parent)) from exc


@contextmanager
def level_directory(final: Path, levels: Mapping[str, Any] | int | None) -> Iterator[None]:
    """Making (or writing into) a checkpoint's directory under the root of a level the user
    gave: a file in the way, a read-only file system, a permission denied is raised as a
    :class:`StorageError` naming the path and the level, instead of a bare ``OSError``; a full
    file system as a :class:`StorageFullError` naming them too. ``levels``: the save's levels
    (their first key is the level written), or the level itself."""
    first = levels if isinstance(levels, int) or levels is None else next(iter(levels), None)
    level = level_name(first)
    try:
        yield
    except StorageFullError as exc:
        raise exc.with_context(level=level, path=str(final.parent)) from exc
    except CkptError:
        raise
    except OSError as exc:
        raise StorageError.of(exc, level=level) from exc


def publish_commit(
    b: Boundary,
    is_leader: bool,
    staging: Path,
    final: Path,
    save_id: str,
    fsync: bool,
    hook: FaultHook,
) -> None:
    """Collective (every rank, after the vote that every node's manifest is staged): each
    group's leader renames its staged step into place; a last vote; if any node failed to, the
    nodes that did roll it back (their previous copy of the step, if any, comes back), so a step
    is committed on every node or on none. (A rank that dies between its rename and this vote
    leaves a step committed on some nodes: a torn commit of a save whose every data and parity
    file was written, which the restore rebuilds.)"""
    old: Path | None = None
    published = False
    with b.guard("commit"):
        if is_leader:
            hook("committing")
            old = commit.publish(staging, final, save_id, fsync)
            published = True
        hook("committed")

    def roll_back() -> None:
        if published:
            commit.unpublish(staging, final, old, fsync)
        elif is_leader:
            commit.abort(staging)

    b.vote("commit", cleanup=roll_back)
    commit.discard(old)


def _gathered_per_rank(info: list[dict[str, Any]]) -> dict[Name, list[Any]]:
    """Every rank's per-rank values by name; every rank must hold the same names in the same
    order (raises the same :class:`UsageError` on every rank otherwise)."""
    names0 = [n for n, *_ in info[0]["per_rank"]]
    for rank, i in enumerate(info):
        if [n for n, *_ in i["per_rank"]] != names0:
            raise UsageError(
                f"rank {rank}'s per-rank values are not those of rank 0 (same names, same order)"
            )
    return {tuple(n): [i["per_rank"][k][1:] for i in info] for k, n in enumerate(names0)}


def _check_rank0_declares_all(plan: SavePlan, info: list[dict[str, Any]]) -> None:
    """Rank 0 orders the manifest: it must know every tensor (the same verdict everywhere)."""
    held_by_0 = {tuple(d["name"]) for d in info[0]["decl"]}
    missing = [t.name for t in plan.tensors if t.name not in held_by_0]
    if missing:
        shown = ", ".join("/".join(n) for n in missing[:5])
        raise UsageError(f"rank 0 does not declare tensor(s) {shown}")


def _geometry(t: TensorPlan) -> Geometry:
    return Geometry("/".join(t.name), by_name(t.dtype).numpy, t.shape, t.shard_shape, t.chunk_shape)


def _planned_member_bytes(plan: SavePlan, world_size: int) -> list[int]:
    """Every rank's member data size (its files' bytes) as the plan fixes it."""
    sizes = [0] * world_size
    for t in plan.tensors:
        geo = _geometry(t)
        for r in t.regions:
            sizes[r.writer] += sum(region_file_nbytes(geo, r.offset, r.shape))
    return sizes


def _member_slices(
    skeleton: Manifest,
    rank: int,
    jobs_by_region: list[tuple[TensorPlan, Any, list[Any]]],
    member: np.ndarray | None,
) -> list[np.ndarray | None] | None:
    """Where in ``member`` (this rank's member data: its files in manifest order, the order of
    ``redundancy.record.member_files``) each job's file goes, in the order of the jobs."""
    if member is None:
        return None
    jobs_at = {("/".join(t.name), tuple(r.offset)): jobs for t, r, jobs in jobs_by_region}
    slot: dict[int, np.ndarray] = {}
    at = 0
    for t in skeleton.tensors():
        for r in t.regions:
            if r.rank != rank:
                continue
            for job in jobs_at[(t.path, tuple(r.offset))]:
                size = job.nbytes()
                slot[id(job)] = member[at : at + size]
                at += size
    return [slot[id(j)] for _, _, jobs in jobs_by_region for j in jobs]


def _order_and_values(local: LocalState) -> dict[str, Any]:
    """Rank 0's entry order and JSON values, as broadcast to every rank."""
    return {
        "order": [[list(n), kind] for n, kind in local.order],
        "values": [[list(n), encode_value(v, display(n))] for n, v in local.values.items()],
    }


def _build_manifest(
    d: _Declared, all_refs: list[Any] | None, writer: dict[str, Any], levels: dict[str, Any]
) -> Manifest:
    """The same manifest on every rank: tensors from the plan and the gathered file lists
    (``None``: a skeleton without files, enough for the zarr documents), values and order from
    rank 0."""
    plan, order_values, per_rank_values = d.plan, d.order_values, d.per_rank_values
    values = {
        tuple(n): decode_value(copy.deepcopy(v), nf, display(n))  # decode_value fills in place
        for n, (v, nf) in order_values["values"]
    }
    files_at: dict[tuple[str, tuple[int, ...]], tuple[FileRef, ...]] = {}
    for rank_refs in all_refs or []:
        for path, regions in rank_refs.items():
            for offset, files in regions:
                files_at[(path, tuple(offset))] = tuple(FileRef(p, s, c) for p, s, c in files)
    plans = {t.name: t for t in plan.tensors}
    entries: list[Entry] = []
    for n, kind in order_values["order"]:
        name = tuple(n)
        if kind == "group":
            entries.append(GroupEntry(name))
        elif kind == "value":
            entries.append(ValueEntry(name, values[name]))
        elif kind == "per_rank_value":
            shown = display(name)
            entries.append(
                PerRankValueEntry(
                    name,
                    tuple(
                        decode_value(copy.deepcopy(v), nf, shown) for v, nf in per_rank_values[name]
                    ),
                )
            )
        else:
            t = plans[name]
            path = "/".join(name)
            regions = tuple(
                Region(r.offset, r.shape, r.writer, files_at.get((path, r.offset), ()))
                for r in t.regions
            )
            entries.append(
                TensorEntry(
                    name,
                    path,
                    t.dtype,
                    t.shape,
                    t.shard_shape,
                    t.chunk_shape,
                    regions,
                    per_rank=kind == "per_rank_tensor",
                )
            )
    missing = set(plans) - {e.name for e in entries if isinstance(e, TensorEntry)}
    if missing:
        raise UsageError(f"tensors held by other ranks but not by rank 0: {sorted(missing)}")
    return Manifest(
        save_id=d.save_id,
        step=d.step,
        created=d.created,
        world_size=len(d.info),
        ranks=tuple(RankInfo(r, i["node"]) for r, i in enumerate(d.info)),
        entries=tuple(entries),
        levels=levels,
        writer=writer,
    )
