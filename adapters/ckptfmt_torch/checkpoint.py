"""``save`` / ``load`` of a PyTorch state dict, in place, the way torch.distributed.checkpoint
does it; ``restore`` for the core's ``CheckpointManager``.

    ckptfmt_torch.save({"model": model, "optim": optimizer, "step": 100}, "ckpt/step-100")
    ckptfmt_torch.load({"model": model, "optim": optimizer, "step": 0}, "ckpt/step-100")

With ``torch.distributed`` initialised every rank of the default group calls them (collective):
each rank writes its share (replicated tensors are deduplicated, DTensor shards written at their
global offsets) and reads the part it holds. All the protocol is the core's; this module only
converts (``ckptfmt_torch.convert``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ckptfmt import __version__
from ckptfmt.checkpoint import load_own, writer_threads
from ckptfmt.container import ManifestMeta
from ckptfmt.errors import UsageError
from ckptfmt.format import WriteOptions
from ckptfmt.maintenance import NodeDirs
from ckptfmt.manifest import Manifest
from ckptfmt.parallel import (
    CheckpointManager,
    RestoreReport,
    SaveFailedError,
    load_collective,
    resolve_node,
    save_collective,
)
from ckptfmt.plan import ReadOptions
from ckptfmt.storage import (
    ProgressCallback,
    check_destination,
    metering,
    open_committed,
    parse_location,
)
from ckptfmt.transport import Comm, SingleComm
from ckptfmt.tree import Cast, Objects, PerRank, Shard, arrays_of, check_policy, encode_objects
from ckptfmt_torch.comm import TorchComm
from ckptfmt_torch.convert import from_state, is_stateful, to_state, wants_of

_GLOO: dict[int, Comm] = {}  # one gloo communicator per default group, made on first use


def default_comm() -> Comm:
    """Not collective, except the first time under a non-gloo backend (then every rank of the
    default group must call it): the ``Comm`` that ``save``/``load`` use when given none.

    A single process without ``torch.distributed`` gets ``SingleComm``; a gloo default group its
    ``TorchComm``; another backend (NCCL) a gloo group over the same ranks, made once.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return SingleComm()
    world = dist.group.WORLD
    key = id(world)
    if key not in _GLOO:
        backend = str(dist.get_backend())
        group = None if "gloo" in backend else dist.new_group(backend="gloo")
        _GLOO[key] = TorchComm(group)
    return _GLOO[key]


def writer_info() -> dict[str, Any]:
    return {
        "library": "ckptfmt",
        "version": __version__,
        "adapter": "ckptfmt_torch",
        "torch": torch.__version__,
    }


def save(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    write: WriteOptions | None = None,
    progress: ProgressCallback | None = None,
    comm: Comm | None = None,
    node: str | None = None,
    objects: Objects = "refuse",
    base: str | os.PathLike[str] | None = None,
) -> Manifest:
    """Collective (every rank of ``comm``, by default of torch.distributed's default group):
    save ``state_dict`` as one committed checkpoint directory at ``path``, or at an object-store
    URL (``s3://bucket/run/ckpt``: each rank puts its own shard files from memory, rank 0
    commits, as ``ckptfmt.parallel.save_to_bucket``; credentials and endpoint from the
    ``AWS_*`` environment), or into a ``ckptfmt.storage.store.Store``; return its manifest.

    ``state_dict`` maps names to tensors (DTensors: each rank its shard), objects with
    ``state_dict()`` (modules, optimizers, schedulers, ``TrainingState``), ``ckptfmt.PerRank``
    leaves (each rank its own), JSON-able values, ``bytes`` and ``None``, nested in dicts, lists
    and tuples (a Lightning checkpoint dict as it is). ``path`` is one directory every rank sees
    (shared storage); for node-local levels use ``CheckpointManager``. Nothing is pickled unless
    asked: anything else raises :class:`ckptfmt.errors.UnsupportedValueError` naming its key path
    before a byte is written; ``objects="pickle"`` stores it as its pickle instead, which
    ``load`` unpickles only with ``trust_pickle=True``. The tensors are read in place (no
    copy); do not modify them until ``save`` returns.
    ``write``, ``progress``: as for ``ckptfmt.save`` (the same on every rank; each rank's
    events count its own share). ``node``: this rank's node name, as the manager takes it.
    ``base``: a committed checkpoint directory to save incrementally against, as for
    ``ckptfmt.save`` (unchanged shard files hard-linked from it; directories only).
    """
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise UsageError(f"step must be a non-negative int or None, got {step!r}")
    where = parse_location(path)
    if where.kind == "directory":
        check_destination(where.spec)
    elif base is not None:
        raise UsageError(f"base applies to a save into a directory, not to {where}")
    store = where.store()
    write = write if write is not None else WriteOptions(threads=writer_threads())
    if not isinstance(write, WriteOptions):
        raise UsageError(f"write must be a ckptfmt.WriteOptions, got {type(write).__name__}")
    comm = comm or default_comm()
    state = encode_objects(to_state(state_dict, objects=objects), objects)
    try:
        with metering("save", progress) as meter:
            meta = ManifestMeta(writer=writer_info())
            manifest, _ = save_collective(
                comm,
                state,
                store,
                step=step,
                node=resolve_node(node),
                write=write,
                meta=meta,
                base=base,
            )
            meter.finish()
    except SaveFailedError as exc:
        if comm.size == 1 and exc.cause is not None:  # one process: its own error, not the vote's
            raise exc.cause from None
        raise
    return manifest


def load(
    state_dict: MutableMapping[str, Any],
    path: NodeDirs,
    *,
    read: ReadOptions | None = None,
    cast: Cast = "no",
    into: bool = False,
    progress: ProgressCallback | None = None,
    comm: Comm | None = None,
    trust_pickle: bool = False,
) -> Manifest:
    """Collective (as ``save``): load the checkpoint at ``path`` into ``state_dict`` in place and
    return its manifest (``.step``; ``.values(prefix)`` its JSON values).

    Tensors are copied into (a DTensor's local shard gets its box of the saved tensor, whatever
    the layout or number of ranks that saved it), stateful objects get ``load_state_dict``,
    values are replaced, ``PerRank`` leaves get this rank's own value. Every name in
    ``state_dict`` must be in the checkpoint; names only the checkpoint has are added. Every byte
    read is verified. ``read`` (:class:`~ckptfmt.ReadOptions`, the same on every rank): with
    another number of ranks than the save's, per-rank entries (RNG states, data positions) need
    its ``rank_map`` (saved rank -> current rank, or ``"identity"``) or ``per_rank="drop"``,
    which leaves this rank's own ``PerRank`` leaves as they are. ``progress``: as for
    ``ckptfmt.load`` (each rank's events count what it reads and receives).

    ``path``: the checkpoint's directory, which every rank sees, or the URL of a checkpoint in a
    bucket (``s3://bucket/run/ckpt``, read by every rank with ranged GETs of its own boxes;
    the ``AWS_*`` environment says where and as whom); in one process, also a level-1
    checkpoint spread over node directories (a ``{node}`` template or a mapping node ->
    directory, as ``ckptfmt.load`` takes it: a lost node's part rebuilt from the redundancy
    into a temporary directory, the source only read; every tensor read whole, ``into``
    unused). Several ranks read level-1 copies through ``CheckpointManager.restore``.

    All or nothing: names, shapes, dtypes and boxes are checked before anything is written, and
    the data is read into buffers of the load's own and every chunk's CRC32C checked before a
    byte of it is copied into a tensor, so a load that raises (damage included) leaves every
    tensor and object of ``state_dict`` as it was. That costs a second copy of the state in
    memory and in time (``into=True`` saves both); landing in the tensors first would need a
    copy of their old contents to put back, which costs as much. A dtype that
    differs from the saved one is refused unless ``cast`` allows it (``"safe"``: no value
    changes, ``"any"``; ``ckptfmt.tree.casting``); every conversion is reported as a
    ``ckptfmt.errors.CastWarning``.

    ``into=True`` reads straight into the CPU tensors that can take their saved tensor as it is
    (C-contiguous, the saved shape and dtype), so each is written once instead of read into a
    buffer and copied (no second copy of the state in memory); the price is all or nothing: a
    load that fails part-way, or then finds a name or shape that does not match, may already
    have written into some tensors.

    ``trust_pickle=True`` unpickles the objects a save stored with ``objects="pickle"`` (only
    for checkpoints from a source you trust); without it such an entry raises
    :class:`~ckptfmt.errors.PickleRefusedError` naming it, and nothing is unpickled.
    """
    read = read if read is not None else ReadOptions(threads=writer_threads())
    if not isinstance(read, ReadOptions):
        raise UsageError(f"read must be a ckptfmt.ReadOptions, got {type(read).__name__}")
    check_policy(cast)  # a usage error before anything is read
    comm = comm or default_comm()
    state = to_state(state_dict, objects="pickle")  # the objects it holds are replaced
    where = parse_location(path)
    if where.kind == "spread":
        if comm.size != 1:
            raise UsageError(
                "a {node} template or a mapping node -> directory is loaded by one process; "
                "a job's ranks restore level-1 copies with CheckpointManager.restore"
            )
        loaded, manifest = load_own(path, read=read, progress=progress, trust_pickle=trust_pickle)
    else:
        source = None
        if where.kind == "url":  # every rank reads the bucket itself
            source = open_committed(where.spec, check=False)  # one GET; a lost one fails the read
        wants = wants_of(state)
        targets = arrays_of(state) if into else None
        with metering("load", progress) as meter:
            loaded, manifest = load_collective(
                comm,
                where.spec,
                wants,
                read=read,
                into=targets,
                trust_pickle=trust_pickle,
                source=source,
            )
            meter.finish()
    from_state(state_dict, loaded, keep_per_rank=read.per_rank == "drop", cast=cast)
    return manifest


Device = torch.device | str
"""Where ``restore`` puts a tensor only the checkpoint has (``torch.Tensor.to``'s argument)."""


def restore(
    state_dict: MutableMapping[str, Any],
    manager: CheckpointManager,
    *,
    read: ReadOptions | None = None,
    cast: Cast = "no",
    into: bool = False,
    map_location: Device | Callable[[str], Device] | None = None,
    trust_pickle: bool = False,
) -> RestoreReport:
    """Collective: ``manager.restore`` for a PyTorch state dict (in place, as ``load``). Returns
    the manager's :class:`~ckptfmt.RestoreReport`: ``report.step`` the restored step, or None
    (``state_dict`` untouched) when there is no usable checkpoint; ``report.state`` the loaded
    tree.

    As ``load``, all or nothing: the manager loads into buffers of its own (never into the
    tensors), then everything is checked against ``state_dict`` before anything is written;
    ``cast`` is ``load``'s dtype policy and ``read`` its :class:`~ckptfmt.ReadOptions` (another
    number of ranks than the save's). Save with
    ``manager.save(step, ckptfmt_torch.to_state(state_dict))``: ``to_state`` gives views of the
    tensors, which the manager copies into its staging buffers before it returns.

    Tensors are loaded into in place wherever they live (a device tensor gets one
    host-to-device copy of the verified host data). Names only the checkpoint has are added to
    ``state_dict``, as CPU tensors, or on ``map_location``: a device, or a function of the
    '/'-joined name giving one.

    ``into=True`` reads straight into the CPU tensors whose dtype is the saved one (their
    memory, through numpy views), so each is written once on the way in instead of being read
    into a buffer and copied: less memory (no second copy of the state) and less time. The
    price (``CheckpointManager.restore``'s ``into``): the CRCs are checked as the data comes
    in, so a restore whose read finds damage part-way may already have written into some
    tensors (a restore that falls back to an older step writes all of them again; one that
    finds no copy to fall back to raises ``UnrecoverableDamageError``); a shape
    that does not match is refused before anything is read into them. Tensors on a device are
    loaded into host buffers and copied, as without it.

    ``trust_pickle``: as for ``load`` (a state dict holding objects is saved with
    ``manager.save(step, to_state(state_dict, objects="pickle"), objects="pickle")``).
    """
    read = read if read is not None else ReadOptions()
    check_policy(cast)  # a usage error before anything collective
    before = _tensor_names(state_dict) if map_location is not None else set()
    state = to_state(state_dict, objects="pickle")  # the objects it holds are replaced
    if into:
        report = manager.restore(
            state, read=read, strict=False, cast=cast, into=True, trust_pickle=trust_pickle
        )
    else:
        report = manager.restore(
            _detached(state), read=read, apply=False, trust_pickle=trust_pickle
        )
    if report.restored:
        if report.state is None:  # pragma: no cover - restore sets it with a step
            raise UsageError("the manager restored a step but kept no state")
        # checks everything before it writes
        from_state(state_dict, report.state, keep_per_rank=read.per_rank == "drop", cast=cast)
        if map_location is not None:
            _place_new(state_dict, before, map_location, "")
    return report


def _tensor_names(obj: Any, path: str = "") -> set[str]:
    out: set[str] = set()
    if isinstance(obj, Mapping) and not is_stateful(obj):
        for k, v in obj.items():
            out |= _tensor_names(v, f"{path}/{k}" if path else str(k))
    elif isinstance(obj, torch.Tensor):
        out.add(path)
    return out


def _place_new(
    obj: MutableMapping[Any, Any],
    before: set[str],
    where: Device | Callable[[str], Device],
    path: str,
) -> None:
    """Move the tensors of ``obj`` not named in ``before`` (added by the restore) to ``where``."""
    for k, v in list(obj.items()):
        name = f"{path}/{k}" if path else str(k)
        if isinstance(v, torch.Tensor) and name not in before:
            obj[k] = v.to(where(name) if callable(where) else where)
        elif isinstance(v, MutableMapping) and not is_stateful(v):
            _place_new(v, before, where, name)


def _detached(state: Mapping[str, Any]) -> dict[str, Any]:
    """The ckptfmt state the manager is given to restore: the same names, shapes, dtypes and
    ``Shard`` boxes, but none of the tensors' memory, so that nothing reaches a tensor before
    ``from_state`` has checked everything (``apply=False`` already keeps the manager from
    writing; this holds even if it did). Each array is one element seen at every index (a
    writable zero-stride view, no memory); what was loaded is in the report's ``state``."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, Mapping):
            out[k] = _detached(v)
        elif isinstance(v, Shard):
            out[k] = Shard(_sink(v.data), v.offset, v.global_shape)
        elif isinstance(v, PerRank):
            out[k] = PerRank(_sink(v.value) if isinstance(v.value, np.ndarray) else v.value)
        elif isinstance(v, np.ndarray):
            out[k] = _sink(v)
        else:
            out[k] = v
    return out


def _sink(a: np.ndarray) -> np.ndarray:
    one = np.empty(1, a.dtype)
    return np.lib.stride_tricks.as_strided(one, a.shape, (0,) * a.ndim, writeable=True)
