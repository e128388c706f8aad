"""A storage plugin for ``torch.distributed.checkpoint``: DCP plans, ckptfmt stores.

    import torch.distributed.checkpoint as dcp
    from ckptfmt_torch.dcp import Reader, Writer

    dcp.save(state_dict, storage_writer=Writer("ckpt/step-100"))      # also dcp.async_save
    dcp.load(state_dict, storage_reader=Reader("ckpt/step-100"))

What :class:`Writer` writes is a normal ckptfmt checkpoint: every tensor one zarr array at its
global shape (a DTensor's shards at their offsets), a CRC32C per chunk, the manifest; the core's
plan, files and manifest, in DCP's own planning and writing hooks (``ckptfmt_torch.dcp_save``),
every rank its share, committed atomically, with no collective beyond DCP's. :class:`Reader`
serves DCP's load-time resharding from any ckptfmt checkpoint (written by this writer,
``ckptfmt_torch.save`` or the manager): it describes the manifest to DCP as its ``Metadata``
and reads each box DCP asks for through ckptfmt's verified reads (only the shard files the box
touches, every chunk's CRC checked).

Names: DCP's flattened name of an entry (``model.layer.weight``) comes from a path in the state
dict (``("model", "layer.weight")``); the checkpoint stores it under that path joined by '/'
(``model/layer.weight``), the name ``ckptfmt_torch.save({"model": model})`` gives it too.

DCP serialises every non-tensor object with ``torch.save``. The writer stores a JSON scalar
(int, float, bool, str, None) as a ckptfmt value, as ``ckptfmt_torch.save`` does, a
``ckptfmt.PerRank`` leaf (``TrainingState``'s RNG streams) as a per-rank entry, and any other
object as its ``torch.save`` bytes in a ``uint8`` array (listed in the manifest's ``writer``
under ``dcp_bytes``); ckptfmt's own readers never unpickle them, and the reader hands them to
DCP only once ``torch.load(weights_only=True)`` accepts them, unless ``trust_pickle=True``.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pickle
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ckptfmt.checkpoint import open_checkpoint, writer_threads
from ckptfmt.container import Checkpoint
from ckptfmt.dtypes import by_name
from ckptfmt.errors import (
    PickleRefusedError,
    UnsupportedDtypeError,
    UnsupportedValueError,
    UsageError,
)
from ckptfmt.format import Geometry, WriteOptions, read_region
from ckptfmt.maintenance import NodeDirs
from ckptfmt.manifest import (
    MANIFEST_NAME,
    GroupEntry,
    PerRankValueEntry,
    Region,
    TensorEntry,
    ValueEntry,
)
from ckptfmt.parallel import resolve_node
from ckptfmt.storage import Inside, is_spread, parse_location
from ckptfmt.transport import Comm
from ckptfmt.tree import PerRank, Shard
from ckptfmt_torch import dcp_save
from ckptfmt_torch.checkpoint import writer_info
from ckptfmt_torch.convert import numpy_to_tensor, tensor_to_numpy, torch_numpy_dtype

BYTES_KEY = "dcp_bytes"
"""The manifest ``writer`` key listing the entries that hold an object's ``torch.save`` bytes."""

_SCALARS = (bool, int, float, str, type(None))


class Writer(StorageWriter):
    """DCP's storage writer for a ckptfmt checkpoint at ``path`` (one directory every rank sees;
    ``dcp.save(..., checkpoint_id=...)`` replaces it).

    ``write``: :class:`ckptfmt.WriteOptions` (chunk and shard sizes, threads, fsync,
    ``overwrite``); ``step``: the step recorded in the manifest; ``node``: this rank's node
    name. ``comm`` is accepted for compatibility and not used: the ranks exchange what they
    must through DCP's own gather and scatter of the plans and the write results (the process
    group given to ``dcp.save``), and the writer makes no collective of its own.

    The save runs in DCP's hooks (``ckptfmt_torch.dcp_save``): ``prepare_local_plan`` (every
    rank) declares what this rank's local plan holds (replicated tensors whole, DTensor shards at
    their offsets); ``prepare_global_plan`` (the coordinator) makes ckptfmt's plan, which gives
    every region one writer and spreads replicated tensors evenly over their holders, and makes
    the staging directory; ``write_data`` (every rank) writes this rank's regions; ``finish``
    (the coordinator) writes the manifest and commits the directory atomically. A failure on
    any rank fails the save on every rank and leaves nothing at ``path``.

    One writer makes one save at a time: a save that reaches it (``dcp.async_save`` runs each
    in a thread of its own) while another is in flight waits for that one to be over
    (:class:`ckptfmt_torch.dcp_save.Turns`), so overlapping saves each commit what they were
    given at their own path. A bucket's URL, a ``{node}`` template or a NUL in ``path`` raises
    when the writer is made.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        write: WriteOptions | None = None,
        step: int | None = None,
        comm: Comm | None = None,
        node: str | None = None,
    ) -> None:
        super().__init__()
        if write is not None and not isinstance(write, WriteOptions):
            raise UsageError(f"write must be a ckptfmt.WriteOptions, got {type(write).__name__}")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise UsageError(f"step must be a non-negative int or None, got {step!r}")
        self.path = _directory(path)
        self.write = write
        self.step = step
        self.comm = comm
        self.node = node
        self.is_coordinator = False
        self._saves = 0  # this writer's saves: a plan from another save is refused
        self._local: SavePlan | None = None
        self._job: dcp_save.Job | None = None  # the coordinator's, from plan to finish
        self._error: BaseException | None = None  # this rank's failure in write_data
        self._turns = dcp_save.Turns()  # one save at a time (dcp.async_save runs them at once)

    def _drop_stale(self) -> None:
        """A new save takes the writer: the staging directory of a save DCP failed between
        ``prepare_global_plan`` and ``finish`` (its planner raised; ``finish`` never came) is
        removed."""
        job, self._job = self._job, None
        if job is not None:
            job.draft.abort()

    def _options(self) -> WriteOptions:
        return self.write if self.write is not None else WriteOptions(threads=writer_threads())

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """DCP's first call of a save given a ``checkpoint_id``: waits for a save of this writer
        still in flight (:class:`~ckptfmt_torch.dcp_save.Turns`), then takes the new path."""
        path = None if checkpoint_id is None else _directory(checkpoint_id)
        self._turns.take("reset", self._drop_stale)
        if path is not None:
            self.path = path
        self._local = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Every rank, first in each save (after ``reset``): waits for a save of this writer
        still in flight, as ``reset`` does."""
        self._turns.take("set_up_storage_writer", self._drop_stale)
        self.is_coordinator = is_coordinator
        self._saves += 1
        self._job, self._error = None, None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Every rank: what this rank holds of each tensor, into the plan's ``storage_data``
        (DCP gathers it to the coordinator). Kept: everything this rank holds, before DCP's
        dedup (ckptfmt dedups replicated tensors itself, and its manifest is ordered by rank
        0, which must declare every entry)."""
        if not getattr(plan, "usable", True):
            raise UsageError(_NO_PLAN_CACHING)
        self._local = plan
        mappings = plan.planner_data if isinstance(plan.planner_data, Mapping) else {}
        holdings = []
        for item in plan.items:
            td = item.tensor_data
            if item.type == WriteItemType.BYTE_IO or td is None:
                continue
            name = _name_of(item.index.fqn, mappings)
            dtype = torch_numpy_dtype(td.properties.dtype)
            holdings.append(
                dcp_save.declaration(name, dtype, td.size, td.chunk.offsets, td.chunk.sizes)
            )
        data = dcp_save.declare(holdings, resolve_node(self.node))
        return dataclasses.replace(plan, storage_data=data)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The coordinator: ckptfmt's plan of every rank's declarations, and the staging
        directory; each rank's regions into its plan's ``storage_data`` (DCP scatters them)."""
        local = [p.storage_data for p in plans]
        if not all(getattr(p, "usable", True) for p in plans) or not all(
            isinstance(d, dict) and dcp_save.KEY in d for d in local
        ):
            raise UsageError(_NO_PLAN_CACHING)
        out, self._job = dcp_save.plan_all(local, self.path, self._options(), self._saves)
        return [dataclasses.replace(p, storage_data=d) for p, d in zip(plans, out)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Every rank, on its own: write this rank's regions into the staging directory; its
        file lists (or its failure) go to the coordinator in the write results."""
        data = plan.storage_data if isinstance(plan.storage_data, dict) else {}
        rank = int(data.get(dcp_save.KEY, {}).get("rank", 0))
        items = self._local.items if self._local is not None else plan.items
        state: dict[str, Any] = {}
        objects: set[tuple[str, ...]] = set()
        byte_names: list[str] = []
        failure: BaseException | None = None
        try:
            mappings = getattr(planner, "mappings", None) or {}
            for item in items:
                name = _name_of(item.index.fqn, mappings)
                leaf, is_bytes = _leaf_of(item, planner, "/".join(name), rank)
                if leaf is _SKIPPED:
                    continue
                _put(state, name, leaf)
                if is_bytes:
                    objects.add(name)
                    byte_names.append("/".join(name))
        except Exception as exc:  # told to the coordinator, which fails the save everywhere
            failure, state, objects, byte_names = exc, {}, set(), []
        report, self._error = dcp_save.write_share(
            state, objects, data, self._options(), self._saves, failure
        )
        report["bytes"] = byte_names
        results = [WriteResult(i.index, _item_bytes(i), None) for i in plan.items]
        results.append(WriteResult(MetadataIndex(dcp_save.KEY), 0, {dcp_save.KEY: report}))
        out: Future[list[WriteResult]] = Future()
        out.set_result(results)
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator: the manifest from every rank's write results, then the commit;
        a failure on any rank removes the staging directory and raises (DCP tells every rank)."""
        if self._job is None:
            raise UsageError("finish before prepare_global_plan: not a DCP save of this writer")
        reports = [_report_of(rank_results) for rank_results in results]
        names = sorted({n for x in reports for n in x.get("bytes", ())})
        writer = {**writer_info(), "dcp": True, BYTES_KEY: names}
        job, self._job = self._job, None
        dcp_save.commit_all(job, reports, self._options(), self.step, writer, self._error)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


def _directory(path: str | os.PathLike[str]) -> Path:
    """The writer's directory ``path``, checked where the user hands it in: a URL (the writer
    writes a directory; ``ckptfmt_torch.save`` writes to a bucket), a NUL character or a
    ``{node}`` template raise ckptfmt's error naming it as given, before DCP starts (a ``Path``
    would fold ``s3://b`` into a local ``s3:/b``; the OS's error would be a bare ``ValueError``
    in the middle of the save)."""
    if not isinstance(path, (str, os.PathLike)):
        raise UsageError(f"a Writer's path is a directory, not {type(path).__name__}")
    return parse_location(path).directory()


_SKIPPED = object()  # an object another rank stores: not read here
_NO_PLAN_CACHING = (
    "ckptfmt's Writer needs DCP's plans of this save (its declarations travel in them): DCP's "
    "plan caching (DefaultSavePlanner(enable_plan_caching=True)) is not supported; the Writer "
    "keeps the plan of a layout saved again itself"
)


def _report_of(results: list[WriteResult]) -> dict[str, Any]:
    """A rank's report from its write results (the last carries it)."""
    for r in reversed(results):
        if isinstance(r.storage_data, dict) and dcp_save.KEY in r.storage_data:
            report: dict[str, Any] = r.storage_data[dcp_save.KEY]
            return report
    raise UsageError("a rank's write results carry no ckptfmt report: not this writer's save")


def _name_of(fqn: str, mappings: Mapping[str, Sequence[Any]]) -> tuple[str, ...]:
    """The checkpoint's name of DCP's entry ``fqn``: its path in the state dict."""
    path = mappings.get(fqn)
    return tuple(str(p) for p in path) if path else (fqn,)


def _put(state: dict[str, Any], name: tuple[str, ...], leaf: Any) -> None:
    node = state
    for part in name[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise UnsupportedValueError("/".join(name), "a value and a subtree under one name")
    if name[-1] in node:  # several chunks of one tensor on one rank (a ShardedTensor's)
        raise UnsupportedValueError(
            "/".join(name), "several local chunks of one tensor on one rank are not supported"
        )
    node[name[-1]] = leaf


def _leaf_of(item: WriteItem, planner: SavePlanner, shown: str, rank: int) -> tuple[Any, bool]:
    """The ckptfmt leaf of one write item and whether it holds ``torch.save`` bytes. An
    object other than a per-rank one is rank 0's to store (its value, or its bytes): on
    another rank it is not read (``_SKIPPED``)."""
    if item.type == WriteItemType.BYTE_IO:
        lookup = getattr(planner, "lookup_object", None)
        own = lookup(item.index) if lookup is not None else None
        if isinstance(own, PerRank):  # each rank's own (an RNG stream): a per-rank entry
            value = own.value
            if isinstance(value, torch.Tensor):
                return PerRank(tensor_to_numpy(value, shown)), False
            return own, False
        if rank != 0:
            return _SKIPPED, False
    data = planner.resolve_data(item)
    if item.type == WriteItemType.BYTE_IO:
        raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
        try:
            obj = torch.load(io.BytesIO(raw), weights_only=True)
        except Exception:  # not loadable safely: kept as bytes, refused at load unless trusted
            obj = raw
        if type(obj) in _SCALARS and _finite(obj):
            return obj, False
        return np.frombuffer(raw, np.uint8).copy(), True
    if not isinstance(data, torch.Tensor):
        raise UnsupportedValueError(shown, f"DCP resolved a {type(data).__name__}, not a tensor")
    local = tensor_to_numpy(data, shown)
    td = item.tensor_data
    if td is None:
        return local, False
    global_shape = tuple(int(x) for x in td.size)
    offset = tuple(int(x) for x in td.chunk.offsets)
    if tuple(local.shape) == global_shape:
        return local, False
    return Shard(local, offset, global_shape), False


def _finite(v: Any) -> bool:
    return not isinstance(v, float) or math.isfinite(v)


def _item_bytes(item: WriteItem) -> int:
    td = item.tensor_data
    if td is None:
        return 0
    return math.prod(td.chunk.sizes) * td.properties.dtype.itemsize


class Reader(StorageReader):
    """DCP's storage reader for the ckptfmt checkpoint at ``path`` (any: written by
    :class:`Writer`, ``ckptfmt_torch.save`` or the manager; a level-1 ``{node}`` template or a
    mapping node -> directory, or a bucket's URL too, as ``ckptfmt.open`` takes it).

    ``read_metadata`` describes the manifest as DCP's ``Metadata``: each tensor with its saved
    regions as chunks, JSON values (flattened the way DCP flattens a state dict, so an
    optimizer's ``param_groups`` match) and ``torch.save`` bytes as bytes entries; a per-rank
    entry (``ckptfmt_torch.TrainingState``'s RNG streams) as an object that gives each rank
    its own ``PerRank`` value, which the stateful takes back (a rank the save did not have
    raises: ``ckptfmt_torch.load`` maps per-rank entries to another number of ranks). ``read_data``
    (every rank, no collective) reads each box DCP's planner asks for through
    ``ckptfmt.open(path)[name][box]``: only the shard files the box touches, every chunk's CRC
    verified (a damaged file raises :class:`ckptfmt.errors.DamagedError` naming it). Stored
    bytes reach DCP only if ``torch.load(weights_only=True)`` accepts them (else
    :class:`ckptfmt.errors.PickleRefusedError`), unless ``trust_pickle=True``. In one process,
    a local directory with no checkpoint raises :class:`ckptfmt.errors.NotACheckpointError`
    as the reader is made (or ``reset`` to it); in a job of several ranks the load fails on
    every rank with it inside DCP's ``CheckpointException``.
    """

    def __init__(self, path: NodeDirs, *, trust_pickle: bool = False) -> None:
        super().__init__()
        parse_location(path)  # a NUL, an unsupported URL: ckptfmt's error now, not DCP's later
        self.path = path
        self.trust_pickle = trust_pickle
        self._ckpt: Checkpoint | None = None
        self._inside: Inside | None = None  # the directory, when it is one
        self._rank = _default_rank()
        # DCP's name -> ("tensor" | "bytes", the checkpoint's name) or ("value", the value)
        self._items: dict[str, tuple[str, Any]] = {}
        self._refuse_no_checkpoint()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """DCP's ``load`` calls it first, before its collective, when given a
        ``checkpoint_id`` (then read from there)."""
        if checkpoint_id is not None:
            parse_location(checkpoint_id)
            self.path = checkpoint_id
            self._refuse_no_checkpoint()
        self._ckpt = None
        self._items = {}

    def _refuse_no_checkpoint(self) -> None:
        """In one process only: a local directory with no checkpoint manifest raises ckptfmt's
        :class:`~ckptfmt.errors.NotACheckpointError` naming it now, as the reader is made or
        reset, not inside DCP's load (DCP wraps every error of its steps in its own
        ``CheckpointException``). In a job of several ranks the load finds it, in
        ``read_metadata``, wrapped: that failure DCP gathers and raises on every rank, while a
        rank raising here (where it alone may not see the directory: a node-local one) would
        leave the others waiting in DCP's first collective."""
        dist = torch.distributed
        ranks = (
            dist.get_world_size()
            if dist.is_available() and dist.is_initialized()
            else int(os.environ.get("WORLD_SIZE", "1") or 1)
        )
        path = self.path
        if ranks != 1 or isinstance(path, Mapping) or is_spread(path):
            return
        if parse_location(path).is_bucket or (Path(path) / MANIFEST_NAME).is_file():
            return  # a bucket's commit is read by read_metadata (a request, not made here)
        open_checkpoint(path)  # raises NotACheckpointError naming the path and what is wrong

    def read_metadata(self, *args: Any) -> Metadata:  # type: ignore[override]
        """Every rank: the manifest as DCP's ``Metadata``. Takes no keyword arguments on
        purpose: DCP retries a reader whose ``read_metadata`` takes them for "rank-local"
        metadata after a failed read, and a rank whose retry succeeds then loads without
        collectives while the others load with them; ckptfmt's manifest is every rank's, so a
        failed read fails the load (ckptfmt's error, in DCP's ``CheckpointException``)."""
        ckpt = self._open()
        manifest = ckpt.manifest
        dcp_bytes = set(manifest.writer.get(BYTES_KEY) or ())  # type: ignore[arg-type]
        md: dict[str, Any] = {}
        paths: dict[str, tuple[Any, ...]] = {}
        self._items = {}
        tree: dict[str, Any] = {}
        containers: dict[tuple[str, ...], str] = {}
        for e in manifest.entries:
            name = tuple(e.name)
            if isinstance(e, TensorEntry):
                shown = "/".join(name)
                encoding = getattr(e, "encoding", None)
                if shown in dcp_bytes:
                    _insert(tree, name, _Stored("dcp", shown))
                elif e.per_rank:  # each rank's own row, as the PerRank leaf it was saved from
                    _insert(tree, name, _Stored("per_rank", shown))
                elif encoding in ("bytes", "pickle"):
                    _insert(tree, name, _Stored(str(encoding), shown))
                else:
                    fqn = ".".join(name)
                    md[fqn] = _tensor_metadata(e)
                    self._items[fqn] = ("tensor", shown)
                    paths[fqn] = name
                    _insert(tree, name, _Stored("tensor", shown))
            elif isinstance(e, ValueEntry):
                _insert(tree, name, e.value)
            elif isinstance(e, PerRankValueEntry):
                _insert(tree, name, _PerRankValues(tuple(e.values)))
            elif isinstance(e, GroupEntry):
                if getattr(e, "container", None):
                    containers[name] = str(e.container)
                _insert(tree, name, {})
        for path, value in _dcp_leaves((), _rebuild(tree, (), containers)):
            if isinstance(value, _Stored) and value.kind == "tensor":
                continue
            key = ".".join(str(p) for p in path)
            md[key] = BytesStorageMetadata()
            self._items[key] = ("object", value)
            paths[key] = path
        return Metadata(state_dict_metadata=md, planner_data=paths)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.is_coordinator = is_coordinator
        self._rank = int(kwargs.get("rank", _default_rank()))
        if not self._items:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Every rank, on its own: each requested box read and verified, then handed to the
        planner (tensors copied into its targets, bytes to ``load_bytes``)."""
        ckpt = self._open()
        for item in plan.items:
            fqn = item.storage_index.fqn
            if fqn not in self._items:
                raise UsageError(f"the checkpoint {self.path} has no entry {fqn!r}")
            kind, what = self._items[fqn]
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(self._bytes(ckpt, kind, what, fqn)))
            else:
                self._read_tensor(ckpt, item, planner, what)
        out: Future[None] = Future()
        out.set_result(None)
        return out

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a committed ckptfmt checkpoint's directory."""
        return isinstance(checkpoint_id, (str, os.PathLike)) and (
            (Path(checkpoint_id) / MANIFEST_NAME).is_file()
        )

    def _open(self) -> Checkpoint:
        if self._ckpt is None:
            self._ckpt = open_checkpoint(self.path)
            # a directory's shard files are read straight into the tensors; a spread level-1
            # checkpoint's and a bucket's (a Path would make its URL a directory) through the view
            spread = isinstance(self.path, Mapping) or is_spread(self.path)
            elsewhere = spread or parse_location(self.path).is_bucket  # type: ignore[arg-type]
            self._inside = None if elsewhere else Inside(Path(self.path))  # type: ignore[arg-type]
        return self._ckpt

    def _bytes(self, ckpt: Checkpoint, kind: str, what: Any, fqn: str) -> bytes:
        """The ``torch.save`` bytes DCP's ``load_bytes`` takes for the object at ``fqn``."""
        if kind != "object":
            raise UsageError(f"{fqn!r} is a tensor in the checkpoint, not an object")
        if isinstance(what, _Stored) and what.kind == "dcp":
            raw = np.ascontiguousarray(ckpt[what.name][...]).tobytes()
            if not self.trust_pickle:
                try:
                    torch.load(io.BytesIO(raw), weights_only=True)
                except Exception as exc:
                    raise PickleRefusedError(
                        f"{self.path}: {what.name}",
                        f"torch.load(weights_only=True) refuses it ({_why(exc)}); pass "
                        "Reader(..., trust_pickle=True) only for a checkpoint you trust",
                    ) from None
            return raw
        buf = io.BytesIO()
        torch.save(self._materialize(ckpt, what), buf)  # plain values: safe to torch.load
        return buf.getvalue()

    def _row(self, saved_ranks: int, what: Any) -> int:
        """This rank's row of a per-rank entry (an RNG state): its own, saved by the same rank."""
        if self._rank >= saved_ranks:
            raise UsageError(
                f"{self.path}: a per-rank entry ({what}) was saved by {saved_ranks} rank(s); "
                f"rank {self._rank} has none (ckptfmt_torch.load's read=ReadOptions(rank_map=, "
                "per_rank=) says what becomes of them at another number of ranks)"
            )
        return self._rank

    def _materialize(self, ckpt: Checkpoint, value: Any) -> Any:
        """A value of the checkpoint with what it holds by reference read in."""
        if isinstance(value, _PerRankValues):
            return PerRank(value.values[self._row(len(value.values), value)])
        if isinstance(value, _Stored):
            if value.kind == "per_rank":
                rows = ckpt[value.name]
                row = self._row(rows.shape[0], value.name)
                return PerRank(numpy_to_tensor(np.ascontiguousarray(rows[row])))
            raw = np.ascontiguousarray(ckpt[value.name][...])
            if value.kind == "tensor":
                return numpy_to_tensor(raw)
            if value.kind == "pickle":
                if not self.trust_pickle:
                    raise PickleRefusedError(
                        f"{self.path}: {value.name}",
                        "it holds a pickled object; pass Reader(..., trust_pickle=True) only "
                        "for a checkpoint you trust",
                    )
                return pickle.loads(raw.tobytes())
            return raw.tobytes()
        if isinstance(value, Mapping):
            return {k: self._materialize(ckpt, v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._materialize(ckpt, v) for v in value)
        return value

    def _read_tensor(
        self, ckpt: Checkpoint, item: ReadItem, planner: LoadPlanner, name: str
    ) -> None:
        view = ckpt[name]
        chunk_at = item.storage_index.offset or (0,) * len(item.storage_offsets)
        at = [int(o) + int(s) for o, s in zip(chunk_at, item.storage_offsets)]
        box = tuple(slice(a, a + int(n)) for a, n in zip(at, item.lengths))
        target = planner.resolve_tensor(item).detach()
        if not view.shape:  # a 0-d tensor, which DCP describes as one element
            src = numpy_to_tensor(np.ascontiguousarray(view[...]))
            if target.numel() == 1:
                src = src.reshape(target.shape)
        elif _takes_as_is(target, view.dtype) and tuple(target.shape) == tuple(item.lengths):
            out = tensor_to_numpy(target)
            region = _region_at(view.entry, tuple(at), tuple(out.shape))
            if region is not None and isinstance(self._inside, Inside):
                # a whole saved region: its shard files read into the tensor, CRCs checked
                e = view.entry
                geo = Geometry.of(e.path, e.dtype, e.shape, e.shard_shape, e.chunk_shape)
                read_region(self._inside, geo, region.files, region.offset, out, (name,))
            elif out.size:
                # part of one: the lazy read's own fill (every chunk's CRC checked), without
                # the buffer that indexing the view would allocate
                view.read_into(out, [(b.start, b.stop) for b in box])
            planner.commit_tensor(item, target)
            return
        else:
            src = numpy_to_tensor(np.ascontiguousarray(view[box]))
        if tuple(target.shape) != tuple(src.shape):
            raise UsageError(
                f"{name}: DCP asks for a box of shape {list(target.shape)}, the checkpoint "
                f"gives {list(src.shape)}"
            )
        target.copy_(src)
        planner.commit_tensor(item, target)


def _region_at(e: TensorEntry, offset: tuple[int, ...], shape: tuple[int, ...]) -> Region | None:
    for r in e.regions:
        if tuple(r.offset) == offset and tuple(r.shape) == shape:
            return r
    return None


def _takes_as_is(t: torch.Tensor, dtype: np.dtype) -> bool:
    """Whether ``t`` is C-contiguous CPU memory of the saved dtype, which a read can fill
    directly (one copy instead of two)."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return False
    try:
        return bool(torch_numpy_dtype(t.dtype) == dtype)
    except UnsupportedDtypeError:
        return False


def _tensor_metadata(e: TensorEntry) -> TensorStorageMetadata:
    dtype = numpy_to_tensor(np.empty(0, _numpy_dtype(e))).dtype
    chunks = [
        ChunkStorageMetadata(offsets=torch.Size(r.offset), sizes=torch.Size(r.shape))
        for r in e.regions
    ] or [ChunkStorageMetadata(offsets=torch.Size([0] * len(e.shape)), sizes=torch.Size(e.shape))]
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=dtype), size=torch.Size(e.shape), chunks=chunks
    )


def _numpy_dtype(e: TensorEntry) -> np.dtype:
    return by_name(e.dtype).numpy


def _why(exc: BaseException) -> str:
    """The line of torch's refusal that says what was refused (its message is a page)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = [line for line in lines if "WeightsUnpickler error" in line]
    return (said or lines or [type(exc).__name__])[0].split(" Please use")[0]


def _default_rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _PerRankValues(NamedTuple):
    """A per-rank JSON value: every saved rank's own."""

    values: tuple[Any, ...]


class _Stored(NamedTuple):
    """An entry the reader refers to: a ``"tensor"``, the writer's ``"dcp"`` object bytes, a
    ``"bytes"`` value or a ``"pickle"`` (read only when trusted)."""

    kind: str
    name: str


def _insert(tree: dict[str, Any], name: tuple[str, ...], leaf: Any) -> None:
    node = tree
    for part in name[:-1]:
        node = node.setdefault(part, {})
    if isinstance(leaf, dict):
        node.setdefault(name[-1], {})
    else:
        node[name[-1]] = leaf


def _rebuild(node: Any, name: tuple[str, ...], containers: Mapping[tuple[str, ...], str]) -> Any:
    """The entries under ``name`` as the value they were: lists and tuples rebuilt."""
    if not isinstance(node, dict):
        return node
    out = {k: _rebuild(v, (*name, k), containers) for k, v in node.items()}
    kind = containers.get(name)
    if kind is None:
        return out
    items = [out[str(i)] for i in range(len(out))]
    return tuple(items) if kind == "tuple" else items


def _dcp_leaves(path: tuple[Any, ...], value: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """The leaves of a state as DCP's ``flatten_state_dict`` finds them: mappings by key,
    lists holding mappings, tensors (or such lists) by index, any other value one leaf."""
    if isinstance(value, Mapping):
        out = []
        for k, v in value.items():
            out += _dcp_leaves((*path, str(k)), v)
        return out
    if isinstance(value, list) and not _terminal(value):
        out = []
        for i, v in enumerate(value):
            out += _dcp_leaves((*path, i), v)
        return out
    return [(path, value)]


def _terminal(value: list[Any]) -> bool:
    return not any(
        isinstance(v, Mapping)
        or (isinstance(v, list) and not _terminal(v))
        or (isinstance(v, _Stored) and v.kind == "tensor")
        for v in value
    )
