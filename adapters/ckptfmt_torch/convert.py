"""PyTorch objects <-> ckptfmt state: the only conversion this adapter does.

:func:`to_state` turns a PyTorch state dict (tensors, DTensors, objects with ``state_dict()`` /
``load_state_dict()``, JSON-able values, nested dicts) into a ckptfmt state: numpy arrays that
share memory with the tensors (no copy: bfloat16 and float8 travel as integer views re-labelled
with ``ml_dtypes``), ``ckptfmt.Shard`` leaves for a DTensor's local shard at its global offset,
and JSON values. :func:`from_state` puts a loaded ckptfmt state back: copied into the tensors in
place, values replaced, ``load_state_dict`` called on the stateful objects, the way
``torch.distributed.checkpoint.load`` does it.

Lists and tuples are converted item by item (tensors inside them included) and load back as
the same types; ``bytes`` and ``None`` are kept. Nothing is pickled unless asked: any other
object raises :class:`ckptfmt.errors.UnsupportedValueError` naming its key path here, before
anything is written, unless ``objects="pickle"`` lets it through to be stored as its pickle.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, MutableMapping
from functools import cache
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ckptfmt.errors import UnsupportedDtypeError, UnsupportedValueError, UsageError
from ckptfmt.manifest import encode_value
from ckptfmt.tree import Cast, Conversion, Objects, PerRank, Shard, plan_casts, report_casts
from ckptfmt_torch import _compat

Box = tuple[tuple[int, ...], tuple[int, ...]]

# dtypes numpy knows under the same name (torch's .numpy() gives them directly)
_DIRECT = {
    torch.bool: np.dtype(np.bool_),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.uint8: np.dtype(np.uint8),
    torch.uint16: np.dtype(np.uint16),
    torch.uint32: np.dtype(np.uint32),
    torch.uint64: np.dtype(np.uint64),
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
}
# dtypes numpy lacks: reinterpreted as an integer of the same width, re-labelled by ml_dtypes
# (whose types are made on first use: importing ml_dtypes costs about half a second)
_BITS = {
    torch.bfloat16: (torch.int16, "bfloat16"),
    torch.float8_e4m3fn: (torch.uint8, "float8_e4m3fn"),
    torch.float8_e5m2: (torch.uint8, "float8_e5m2"),
}
_TORCH_OF_NUMPY = {np_dt: t for t, np_dt in _DIRECT.items()}
_TORCH_OF_ML_NAME = {name: (bits, t) for t, (bits, name) in _BITS.items()}


@cache
def _ml_numpy(name: str) -> np.dtype:
    """The numpy dtype ``ml_dtypes`` gives the type ``name`` (imported here, when first met)."""
    import ml_dtypes

    dtype: np.dtype = np.dtype(getattr(ml_dtypes, name))
    return dtype


def _via_bits(dtype: torch.dtype) -> tuple[torch.dtype, np.dtype] | None:
    """``(integer dtype of the same width, numpy dtype)`` of a torch dtype numpy lacks."""
    found = _BITS.get(dtype)
    return None if found is None else (found[0], _ml_numpy(found[1]))


@runtime_checkable
class Stateful(Protocol):
    """The convention of ``torch.distributed.checkpoint``: modules, optimizers, schedulers,
    gradient scalers and this adapter's helpers all have these two methods."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


_PLAIN = (torch.Tensor, np.ndarray, dict, list, tuple, str, bytes, int, float, type(None))


def is_stateful(obj: Any) -> bool:
    # the plain types first: a Protocol's isinstance looks its methods up, which a load's
    # walk over hundreds of tensors paid for each of them
    if type(obj) in _PLAIN or isinstance(obj, torch.Tensor):
        return False
    return isinstance(obj, Stateful)


# --- tensors <-> numpy ----------------------------------------------------------------------------


def tensor_to_numpy(t: torch.Tensor, name: str = "") -> np.ndarray:
    """A numpy array with ``t``'s logical dtype that shares ``t``'s memory (CPU tensors: no copy,
    strides kept; a tensor on another device is copied to the host first, which is the staging
    any save of device memory needs)."""
    if t.layout != torch.strided or t.is_quantized:
        raise UnsupportedValueError(name, f"{t.layout} / quantized tensors are not supported")
    if t.is_meta:
        raise UnsupportedValueError(name, "a meta tensor has no data to save")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj() or t.is_neg():  # lazy views whose memory holds other numbers
        t = t.resolve_conj().resolve_neg()
    if t.dtype in _DIRECT:
        return t.numpy()
    via = _via_bits(t.dtype)
    if via is not None:
        return t.view(via[0]).numpy().view(via[1])
    raise UnsupportedDtypeError(t.dtype, name or None)


def numpy_to_tensor(a: np.ndarray) -> torch.Tensor:
    """A CPU tensor sharing ``a``'s memory (a read-only or non-native array is copied first)."""
    a = np.asarray(a)
    if not a.flags.writeable or a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("="), copy=True)
    if a.dtype in _TORCH_OF_NUMPY:
        return torch.from_numpy(a)
    if a.dtype.name in _TORCH_OF_ML_NAME and a.dtype == _ml_numpy(a.dtype.name):
        bits, target = _TORCH_OF_ML_NAME[a.dtype.name]
        np_bits = np.int16 if bits == torch.int16 else np.uint8
        return torch.from_numpy(a.view(np_bits)).view(target)
    raise UnsupportedDtypeError(a.dtype)


def copy_into(dst: torch.Tensor, src: np.ndarray, name: str = "", cast: Cast = "no") -> None:
    """Copy a loaded array into a tensor in place: bit-exact when the dtypes agree; otherwise
    only as the policy ``cast`` allows (``ckptfmt.tree.casting``: ``"safe"``, ``"any"``), converted
    as ``Tensor.copy_`` converts. A refused dtype or a wrong shape raises before any write."""
    src = np.asarray(src)
    if tuple(dst.shape) != src.shape:
        raise UsageError(
            f"{name or 'tensor'}: the checkpoint holds shape {list(src.shape)}, the tensor "
            f"loaded into has {list(dst.shape)}"
        )
    plan_casts([(name or "tensor", src.dtype, torch_numpy_dtype(dst.dtype))], cast)
    with torch.no_grad():
        if dst.device.type == "cpu" and (
            _DIRECT.get(dst.dtype) == src.dtype
            or (dst.dtype in _BITS and src.dtype.name == _BITS[dst.dtype][1])
        ):
            view = tensor_to_numpy(dst, name)
            if not _same_memory(view, src):  # a restore that read straight into the tensor
                np.copyto(view, src, casting="no")
        else:
            dst.copy_(numpy_to_tensor(np.ascontiguousarray(src)))


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` are the same bytes seen the same way (copying is a no-op)."""
    return (
        a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        and a.strides == b.strides
        and a.shape == b.shape
        and a.dtype == b.dtype
    )


def torch_numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy (``ml_dtypes``) dtype of a torch dtype; :class:`UnsupportedDtypeError` if none."""
    if dtype in _DIRECT:
        return np.dtype(_DIRECT[dtype])
    via = _via_bits(dtype)
    if via is not None:
        return via[1]
    raise UnsupportedDtypeError(dtype)


# --- DTensor: the local shard and where it lies -------------------------------------------------


@cache
def _dtensor_types() -> tuple[Any, Any, Any] | None:
    """``(DTensor, Shard, Replicate)``, public since torch 2.4 (imported on first use, not with
    the adapter); ``None`` in a build without ``torch.distributed``, where no DTensor exists."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor import Shard as ShardPlacement

    return DTensor, ShardPlacement, Replicate


def is_dtensor(obj: Any) -> bool:
    """Whether ``obj`` is a DTensor. A DTensor exists only once ``torch.distributed.tensor`` is
    imported, so a process that never imported it (a plain restart: about a second of imports
    saved) is answered without importing it."""
    dtensor_module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(dtensor_module, "DTensor", None)
    return dtensor is not None and isinstance(obj, dtensor)


def dtensor_box(t: Any, name: str = "") -> tuple[Box, tuple[int, ...]]:
    """``((global_offset, local_shape), global_shape)`` of this rank's shard of a DTensor.

    Only even/uneven contiguous ``Shard`` and ``Replicate`` placements give a box; ``Partial``
    (not yet reduced) and strided shards (FSDP on top of tensor parallelism) are refused.
    """
    types = _dtensor_types()
    if types is None or not isinstance(t, types[0]):
        raise UnsupportedValueError(name, f"a {type(t).__name__}, not a DTensor")
    _, shard_placement, replicate = types
    for p in t.placements:
        if type(p) not in (shard_placement, replicate):  # exact: _StridedShard subclasses Shard
            raise UnsupportedValueError(name, f"DTensor placement {p!r} is not supported")
    global_shape = tuple(int(x) for x in t.shape)
    local_shape, offset = _compat.local_shape_and_offset(t.shape, t.device_mesh, t.placements)
    if tuple(t.to_local().shape) != local_shape:
        raise UnsupportedValueError(
            name,
            f"local shard of shape {list(t.to_local().shape)} where the placements give "
            f"{list(local_shape)}",
        )
    return (tuple(int(x) for x in offset), local_shape), global_shape


def dtensor_to_leaf(t: Any, name: str = "") -> Any:
    """A DTensor as a ckptfmt leaf: a plain array when this rank holds all of it (replicated),
    else ``Shard(local, global_offset, global_shape)``."""
    (offset, local_shape), global_shape = dtensor_box(t, name)
    local = tensor_to_numpy(t.to_local(), name)
    if local_shape == global_shape:
        return local
    return Shard(local, offset, global_shape)


# --- whole state dicts ----------------------------------------------------------------------------


def _key(k: Any, path: str) -> str:
    if isinstance(k, str):
        return k
    if isinstance(k, int) and not isinstance(k, bool):
        return str(k)  # optimizer state is keyed by parameter index
    raise UnsupportedValueError(path, f"key {k!r} is neither a string nor an int")


def _join(path: str, key: str) -> str:
    return f"{path}/{key}" if path else key


def to_state(
    obj: Mapping[str, Any], path: str = "", *, objects: Objects = "refuse"
) -> dict[str, Any]:
    """Collective only where a stateful's ``state_dict()`` is (``get_state_dict`` of FSDP).

    The ckptfmt state of a PyTorch state dict: tensors as numpy views, DTensors as ``Shard``
    leaves (or arrays when replicated), stateful objects by their ``state_dict()``, int keys as
    their decimal strings, ``PerRank`` leaves kept (their tensor converted), lists and tuples
    item by item, ``bytes`` kept, values checked to be JSON-able. ``objects``: any other object
    is refused (``"refuse"``: :class:`UnsupportedValueError` naming its key path) or kept as it
    is (``"pickle"``: the save stores its pickle; pass the same ``objects=`` to the save).
    """
    if not isinstance(obj, Mapping):
        raise UsageError("a state dict is a mapping of names to tensors, values or statefuls")
    if objects not in ("refuse", "pickle"):
        raise UsageError(f"objects must be 'refuse' or 'pickle', got {objects!r}")
    return _state(obj, path, objects)


def _state(obj: Mapping[str, Any], path: str, objects: Objects) -> dict[str, Any]:
    return {_key(k, path): _leaf(v, _join(path, _key(k, path)), objects) for k, v in obj.items()}


def _leaf(v: Any, path: str, objects: Objects) -> Any:
    if is_dtensor(v):
        return dtensor_to_leaf(v, path)
    if isinstance(v, torch.Tensor):
        return tensor_to_numpy(v, path)
    if isinstance(v, PerRank):
        inner = v.value
        if isinstance(inner, torch.Tensor):
            return PerRank(tensor_to_numpy(inner, path))
        if not isinstance(inner, np.ndarray):
            encode_value(inner, path)
        return PerRank(inner)
    if isinstance(v, (Shard, np.ndarray, np.generic)) and not isinstance(v, (np.str_, np.bytes_)):
        return v
    if is_stateful(v):
        return _state(v.state_dict(), path, objects)
    if isinstance(v, Mapping):
        return _state(v, path, objects)
    if isinstance(v, (list, tuple)):
        items = [_leaf(x, _join(path, str(i)), objects) for i, x in enumerate(v)]
        return tuple(items) if isinstance(v, tuple) else items
    if v is None or isinstance(v, (bytes, str, bool, int, float)):
        if isinstance(v, str):
            encode_value(v, path)  # a lone surrogate, refused here
        return v
    if objects == "pickle" or isinstance(v, np.generic):
        return v
    raise UnsupportedValueError(
        path,
        f"{type(v).__name__} is neither a tensor, bytes, a list, tuple or mapping nor JSON-able "
        "(objects='pickle' stores it as a pickled blob, loaded only with trust_pickle=True)",
    )


def wants_of(state: Mapping[str, Any]) -> dict[str, Box]:
    """For a collective load: the region each ``Shard`` leaf of a ckptfmt state asks for."""
    out: dict[str, Box] = {}

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for k, v in node.items():
            name = _join(prefix, k)
            if isinstance(v, Shard):
                out[name] = (v.offset, tuple(v.data.shape))
            elif isinstance(v, Mapping):
                walk(v, name)

    walk(state, "")
    return out


def from_state(
    target: MutableMapping[Any, Any],
    loaded: Mapping[str, Any],
    path: str = "",
    *,
    keep_per_rank: bool = False,
    cast: Cast = "no",
) -> list[Conversion]:
    """Put a loaded ckptfmt state back into a PyTorch state dict, in place; return the dtype
    conversions made (also reported as a ``ckptfmt.errors.CastWarning``).

    Everything is checked before anything is written (:func:`check_state`): a missing name, a
    shape, a dtype that ``cast`` does not allow (``ckptfmt.tree.casting``: refused by default), a
    module's name the checkpoint adds, an optimizer's parameter groups — so a load that fails
    leaves every tensor, module and optimizer as it was. Then tensors (and a DTensor's local
    shard) are copied into; a stateful object gets ``load_state_dict`` with its own
    ``state_dict()`` filled from the checkpoint; other values are replaced (tuples stay tuples
    where the target had them). Names only the checkpoint has are added (a fresh optimizer's
    empty state takes its entries that way). ``keep_per_rank``: ``PerRank`` leaves the load left
    out (dropped, as asked, for another number of ranks) keep their values; a stateful that
    lists a name in ``ckptfmt_optional`` (``TrainingState``: its RNG streams and sampler
    position) is given its state dict without it and decides (it warns).
    """
    sds: dict[int, dict[str, Any]] = {}
    casts = check_state(target, loaded, path, keep_per_rank=keep_per_rank, cast=cast, sds=sds)
    _apply(target, loaded, path, keep_per_rank, cast, sds)
    report_casts(casts)
    return casts


def check_state(
    target: Mapping[Any, Any],
    loaded: Any,
    path: str = "",
    *,
    keep_per_rank: bool = False,
    cast: Cast = "no",
    sds: dict[int, dict[str, Any]] | None = None,
) -> list[Conversion]:
    """Everything :func:`from_state` would find wrong, found without writing anything: raises
    a :class:`UsageError` naming every missing name and wrong shape (or, when only dtypes are
    wrong, a :class:`ckptfmt.errors.DtypeMismatchError` naming them all); returns the dtype
    conversions the load will make. ``sds`` collects the statefuls' ``state_dict()`` so that
    the load fills the very dicts that were checked."""
    problems: list[str] = []
    pairs: list[tuple[str, Any, Any]] = []
    _check(target, loaded, path, keep_per_rank, problems, pairs, {} if sds is None else sds, ())
    if problems:
        shown = "; ".join(problems[:10])
        more = f"; ... {len(problems) - 10} more" if len(problems) > 10 else ""
        raise UsageError(f"nothing was loaded: {shown}{more}")
    return plan_casts(pairs, cast)


def _check(
    target: Mapping[Any, Any],
    loaded: Any,
    path: str,
    keep_per_rank: bool,
    problems: list[str],
    pairs: list[tuple[str, Any, Any]],
    sds: dict[int, dict[str, Any]],
    optional: tuple[str, ...],
) -> None:
    if not isinstance(loaded, Mapping):
        problems.append(f"{path or 'the state'}: the checkpoint holds a value, not a mapping")
        return
    for k in list(target):
        key = _key(k, path)
        name = _join(path, key)
        if key not in loaded:
            if (keep_per_rank and _only_per_rank(target[k])) or key in optional:
                continue
            problems.append(f"the checkpoint has no entry {name!r}")
            continue
        _check_leaf(target[k], loaded[key], name, keep_per_rank, problems, pairs, sds)


def _check_leaf(
    t: Any,
    value: Any,
    name: str,
    keep_per_rank: bool,
    problems: list[str],
    pairs: list[tuple[str, Any, Any]],
    sds: dict[int, dict[str, Any]],
) -> None:
    def tensor(shape: tuple[int, ...], dtype: np.dtype, reshape: bool = False) -> None:
        if not isinstance(value, np.ndarray):
            problems.append(f"{name}: the checkpoint holds a {type(value).__name__}, not a tensor")
            return
        fits = value.size == int(np.prod(shape)) if reshape else value.shape == shape
        if not fits:
            problems.append(
                f"{name}: the checkpoint holds shape {list(value.shape)}, the destination has "
                f"{list(shape)}"
            )
            return
        pairs.append((name, value.dtype, dtype))

    if is_dtensor(t):
        local = t.to_local()
        tensor(tuple(local.shape), torch_numpy_dtype(local.dtype))
    elif isinstance(t, torch.Tensor):
        tensor(tuple(t.shape), torch_numpy_dtype(t.dtype))
    elif isinstance(t, PerRank):
        _check_leaf(t.value, value, name, keep_per_rank, problems, pairs, sds)
    elif isinstance(t, Shard):
        tensor(tuple(t.data.shape), t.data.dtype, reshape=True)
    elif isinstance(t, np.ndarray) and isinstance(value, np.ndarray) and t.shape == value.shape:
        pairs.append((name, value.dtype, t.dtype))
    elif is_stateful(t):
        sd = sds.setdefault(id(t), t.state_dict())
        optional = tuple(getattr(t, "ckptfmt_optional", ()))
        _check(sd, value, name, keep_per_rank, problems, pairs, sds, optional)
        if isinstance(value, Mapping):
            if isinstance(t, torch.nn.Module):
                known = {_key(k, name) for k in sd}
                extra = sorted(k for k in value if k not in known)
                if extra:  # load_state_dict(strict=True) would refuse them after the copies
                    problems.append(
                        f"{name}: the checkpoint has {len(extra)} entr(ies) the module does not: "
                        f"{', '.join(_join(name, k) for k in extra[:8])}"
                    )
            elif isinstance(t, torch.optim.Optimizer):
                _check_optimizer(t, value, name, problems, pairs)
    elif isinstance(t, Mapping) and isinstance(value, Mapping):
        _check(t, value, name, keep_per_rank, problems, pairs, sds, ())
    elif _same_length(t, value):
        for i, (a, b) in enumerate(zip(t, value)):
            _check_leaf(a, b, _join(name, str(i)), keep_per_rank, problems, pairs, sds)
    elif _holds_tensors(t):
        problems.append(
            f"{name}: the checkpoint holds {type(value).__name__} "
            f"{'of ' + str(len(value)) + ' items ' if isinstance(value, (list, tuple)) else ''}"
            f"where the state dict has a {type(t).__name__} of {len(t)} holding tensors"
        )


def _check_optimizer(
    opt: torch.optim.Optimizer,
    value: Mapping[str, Any],
    name: str,
    problems: list[str],
    pairs: list[tuple[str, Any, Any]],
) -> None:
    """What ``Optimizer.load_state_dict`` would refuse or cast, found first: the parameter
    groups' sizes, and state tensors of another dtype than their parameter (torch casts them
    to the parameter's dtype)."""
    groups = value.get("param_groups")
    if not isinstance(groups, list):
        return
    own = [len(g["params"]) for g in opt.param_groups]
    saved = [len(g.get("params", [])) if isinstance(g, Mapping) else -1 for g in groups]
    if own != saved:
        problems.append(
            f"{name}: the checkpoint's parameter groups have {saved} parameters, the optimizer's "
            f"{own}"
        )
        return
    params = [p for g in opt.param_groups for p in g["params"]]
    ids = [p for g in groups for p in g.get("params", [])]
    by_id = dict(zip(ids, params))
    state = value.get("state")
    if not isinstance(state, Mapping):
        return
    for key, entry in state.items():
        p = by_id.get(int(key)) if str(key).isdigit() else None
        if p is None or not isinstance(entry, Mapping) or not p.is_floating_point():
            continue
        for slot, arr in entry.items():
            floating = isinstance(arr, np.ndarray) and (
                arr.dtype.kind == "f" or arr.dtype.name in _TORCH_OF_ML_NAME
            )
            if slot != "step" and floating:
                pairs.append((f"{name}/state/{key}/{slot}", arr.dtype, torch_numpy_dtype(p.dtype)))


def _apply(
    target: MutableMapping[Any, Any],
    loaded: Mapping[str, Any],
    path: str,
    keep_per_rank: bool,
    cast: Cast,
    sds: dict[int, dict[str, Any]],
) -> None:
    for k in list(target):
        key = _key(k, path)
        if key not in loaded:
            continue  # checked: dropped per-rank state, or optional for its stateful
        target[k] = _put(target[k], loaded[key], _join(path, key), keep_per_rank, cast, sds)
    int_keys = bool(target) and all(isinstance(k, int) for k in target)
    known = {_key(k, path) for k in target}
    for key, value in loaded.items():
        if key not in known:
            new: Any = int(key) if int_keys and key.isdigit() else key
            target[new] = materialize(value)


def _only_per_rank(t: Any) -> bool:
    if isinstance(t, PerRank):
        return True
    return isinstance(t, Mapping) and bool(t) and all(_only_per_rank(v) for v in t.values())


def _put(
    t: Any,
    value: Any,
    name: str,
    keep_per_rank: bool,
    cast: Cast,
    sds: dict[int, dict[str, Any]],
) -> Any:
    """``t`` updated from ``value`` (the same object when updated in place)."""
    if is_dtensor(t):
        copy_into(t.to_local(), value, name, cast)
        return t
    if isinstance(t, torch.Tensor):
        copy_into(t, value, name, cast)
        return t
    if isinstance(t, PerRank):  # the loaded value is this rank's own
        return PerRank(_put(t.value, value, name, keep_per_rank, cast, sds))
    if isinstance(t, Shard):
        np.copyto(t.data, np.asarray(value).reshape(t.data.shape), casting="unsafe")
        return t
    if isinstance(t, np.ndarray) and isinstance(value, np.ndarray) and t.shape == value.shape:
        np.copyto(t, value, casting="unsafe")  # the policy was checked
        return t
    if is_stateful(t):
        sd = sds.pop(id(t), None)
        if sd is None:
            sd = t.state_dict()
        _apply(sd, value, name, keep_per_rank, cast, sds)
        for k in getattr(t, "ckptfmt_optional", ()):
            if k not in value:  # absent from the checkpoint: the stateful decides (and says)
                sd.pop(k, None)
        if isinstance(t, torch.optim.Optimizer):
            _int_state_keys(sd)
        t.load_state_dict(sd)
        return t
    if isinstance(t, MutableMapping) and isinstance(value, Mapping):
        _apply(t, value, name, keep_per_rank, cast, sds)
        return t
    if _same_length(t, value):  # item by item: tensors in a list are loaded into in place
        items = [
            _put(a, b, _join(name, str(i)), keep_per_rank, cast, sds)
            for i, (a, b) in enumerate(zip(t, value))
        ]
        return tuple(items) if isinstance(t, tuple) else items
    return like(t, materialize(value))


def _same_length(t: Any, value: Any) -> bool:
    return (
        isinstance(t, (list, tuple))
        and isinstance(value, (list, tuple))
        and len(t) == len(value)
        and _holds_tensors(t)
    )


def _holds_tensors(t: Any) -> bool:
    """Whether a list or tuple of the state dict holds tensors or statefuls (loaded into in
    place, item by item) rather than only values (replaced whole)."""
    if isinstance(t, torch.Tensor) or is_stateful(t) or isinstance(t, (np.ndarray, Shard)):
        return True
    if isinstance(t, Mapping):
        return any(_holds_tensors(v) for v in t.values())
    if isinstance(t, (list, tuple)):
        return any(_holds_tensors(v) for v in t)
    return False


def materialize(value: Any) -> Any:
    """A loaded leaf or subtree as PyTorch values: arrays become CPU tensors (sharing memory),
    lists and tuples keep their type, an optimizer's state dict (``state`` and
    ``param_groups``) has its state keyed by parameter index again."""
    if isinstance(value, np.ndarray):
        return numpy_to_tensor(value)
    if isinstance(value, Mapping):
        out = {k: materialize(v) for k, v in value.items()}
        _int_state_keys(out)  # an optimizer's state dict, keyed by parameter index again
        return out
    if isinstance(value, (list, tuple)):
        items = [materialize(v) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    return value


def like(template: Any, value: Any) -> Any:
    """A loaded JSON value shaped like the value it replaces: tuples where it had tuples."""
    if isinstance(template, tuple) and isinstance(value, list) and len(value) == len(template):
        return tuple(like(t, v) for t, v in zip(template, value))
    if isinstance(template, list) and isinstance(value, list) and len(value) == len(template):
        return [like(t, v) for t, v in zip(template, value)]
    if isinstance(template, dict) and isinstance(value, dict):
        return {k: like(template[k], v) if k in template else v for k, v in value.items()}
    return value


def _int_state_keys(sd: dict[str, Any]) -> None:
    """An optimizer's own ``state_dict()`` keys its state by parameter index (ints)."""
    groups = sd.get("param_groups")
    state = sd.get("state")
    if not isinstance(groups, list) or not isinstance(state, dict):
        return
    if not all(isinstance(g, Mapping) for g in groups):
        return
    if all(isinstance(p, int) for g in groups for p in g.get("params", [])):
        sd["state"] = {
            int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in state.items()
        }
