"""PyTorch objects <-> ckptfmt state: the only conversion this adapter does.

:func:`to_state` turns a PyTorch state dict (tensors, DTensors, objects with ``state_dict()`` /
``load_state_dict()``, JSON-able values, nested dicts) into a ckptfmt state: numpy arrays that
share memory with the tensors (no copy: bfloat16 and float8 travel as integer views re-labelled
with ``ml_dtypes``), ``ckptfmt.Shard`` leaves for a DTensor's local shard at its global offset,
and JSON values. :func:`from_state` puts a loaded ckptfmt state back: copied into the tensors in
place, values replaced, ``load_state_dict`` called on the stateful objects, the way
``torch.distributed.checkpoint.load`` does it.

Nothing is pickled: a value that is neither a tensor nor JSON-able raises
:class:`ckptfmt.errors.UnsupportedValueError` here, before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, Protocol, runtime_checkable

import ml_dtypes
import numpy as np
import torch

from ckptfmt.errors import UnsupportedDtypeError, UnsupportedValueError, UsageError
from ckptfmt.manifest.values import encode_value
from ckptfmt.state import PerRank, Shard

try:  # torch.distributed is optional in some PyTorch builds
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import Replicate
    from torch.distributed.tensor.placement_types import Shard as ShardPlacement
except ImportError:  # pragma: no cover - every build on these machines has it
    DTensor = None  # type: ignore[assignment,misc]

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
_VIA_BITS = {
    torch.bfloat16: (torch.int16, np.dtype(ml_dtypes.bfloat16)),
    torch.float8_e4m3fn: (torch.uint8, np.dtype(ml_dtypes.float8_e4m3fn)),
    torch.float8_e5m2: (torch.uint8, np.dtype(ml_dtypes.float8_e5m2)),
}
_TORCH_OF_NUMPY = {np_dt: t for t, np_dt in _DIRECT.items()}
_BITS_OF_NUMPY = {np_dt: (bits, t) for t, (bits, np_dt) in _VIA_BITS.items()}


@runtime_checkable
class Stateful(Protocol):
    """The convention of ``torch.distributed.checkpoint``: modules, optimizers, schedulers,
    gradient scalers and this adapter's helpers all have these two methods."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def is_stateful(obj: Any) -> bool:
    return isinstance(obj, Stateful) and not isinstance(obj, torch.Tensor)


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
    if t.dtype in _VIA_BITS:
        bits, np_dtype = _VIA_BITS[t.dtype]
        return t.view(bits).numpy().view(np_dtype)
    raise UnsupportedDtypeError(t.dtype, name or None)


def numpy_to_tensor(a: np.ndarray) -> torch.Tensor:
    """A CPU tensor sharing ``a``'s memory (a read-only or non-native array is copied first)."""
    a = np.asarray(a)
    if not a.flags.writeable or a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("="), copy=True)
    if a.dtype in _TORCH_OF_NUMPY:
        return torch.from_numpy(a)
    if a.dtype in _BITS_OF_NUMPY:
        bits, target = _BITS_OF_NUMPY[a.dtype]
        np_bits = np.int16 if bits == torch.int16 else np.uint8
        return torch.from_numpy(a.view(np_bits)).view(target)
    raise UnsupportedDtypeError(a.dtype)


def copy_into(dst: torch.Tensor, src: np.ndarray, name: str = "") -> None:
    """Copy a loaded array into a tensor in place (bit-exact when the dtypes agree; otherwise
    converted as ``Tensor.copy_`` converts)."""
    src = np.asarray(src)
    if tuple(dst.shape) != src.shape:
        raise UsageError(
            f"{name or 'tensor'}: the checkpoint holds shape {list(src.shape)}, the tensor "
            f"loaded into has {list(dst.shape)}"
        )
    with torch.no_grad():
        if dst.device.type == "cpu" and (
            _DIRECT.get(dst.dtype) == src.dtype
            or (dst.dtype in _VIA_BITS and _VIA_BITS[dst.dtype][1] == src.dtype)
        ):
            np.copyto(tensor_to_numpy(dst, name), src, casting="no")
        else:
            dst.copy_(numpy_to_tensor(np.ascontiguousarray(src)))


# --- DTensor: the local shard and where it lies -------------------------------------------------


def is_dtensor(obj: Any) -> bool:
    return DTensor is not None and isinstance(obj, DTensor)


def dtensor_box(t: Any, name: str = "") -> tuple[Box, tuple[int, ...]]:
    """``((global_offset, local_shape), global_shape)`` of this rank's shard of a DTensor.

    Only even/uneven contiguous ``Shard`` and ``Replicate`` placements give a box; ``Partial``
    (not yet reduced) and strided shards (FSDP on top of tensor parallelism) are refused.
    """
    for p in t.placements:
        if type(p) not in (ShardPlacement, Replicate):  # exact: _StridedShard subclasses Shard
            raise UnsupportedValueError(name, f"DTensor placement {p!r} is not supported")
    global_shape = tuple(int(x) for x in t.shape)
    local_shape, offset = compute_local_shape_and_global_offset(
        t.shape, t.device_mesh, t.placements
    )
    local_shape = tuple(int(x) for x in local_shape)
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


def to_state(obj: Mapping[str, Any], path: str = "") -> dict[str, Any]:
    """Collective only where a stateful's ``state_dict()`` is (``get_state_dict`` of FSDP).

    The ckptfmt state of a PyTorch state dict: tensors as numpy views, DTensors as ``Shard``
    leaves (or arrays when replicated), stateful objects by their ``state_dict()``, int keys as
    their decimal strings, ``PerRank`` leaves kept (their tensor converted), values checked to be
    JSON-able.
    """
    if not isinstance(obj, Mapping):
        raise UsageError("a state dict is a mapping of names to tensors, values or statefuls")
    return {_key(k, path): _leaf(v, _join(path, _key(k, path))) for k, v in obj.items()}


def _leaf(v: Any, path: str) -> Any:
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
        return to_state(v.state_dict(), path)
    if isinstance(v, Mapping):
        return to_state(v, path)
    _check_value(v, path)
    return v


def _check_value(v: Any, path: str) -> None:
    """A value is stored as JSON: refuse tensors hidden in lists and anything JSON cannot hold
    (nothing is ever pickled)."""

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            raise UnsupportedValueError(
                path, "a tensor inside a list or tuple (put tensors in dicts, under names)"
            )
        if isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif isinstance(x, Mapping):
            for y in x.values():
                walk(y)

    walk(v)
    encode_value(v, path)


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
) -> None:
    """Put a loaded ckptfmt state back into a PyTorch state dict, in place.

    Tensors (and a DTensor's local shard) are copied into; a stateful object gets
    ``load_state_dict`` with its own ``state_dict()`` filled from the checkpoint; other values are
    replaced (tuples stay tuples where the target had them). Every name of ``target`` must be in
    the checkpoint; names only the checkpoint has are added (a fresh optimizer's empty state
    takes its entries that way). ``keep_per_rank``: ``PerRank`` leaves the load left out (it
    dropped them, as asked, for another number of ranks) keep their values.
    """
    if not isinstance(loaded, Mapping):
        raise UsageError(f"{path or 'the state'}: the checkpoint holds a value, not a mapping")
    for k in list(target):
        key = _key(k, path)
        name = _join(path, key)
        if key not in loaded:
            if keep_per_rank and _only_per_rank(target[k]):
                continue
            raise UsageError(f"the checkpoint has no entry {name!r}")
        target[k] = _put(target[k], loaded[key], name, keep_per_rank)
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


def _put(t: Any, value: Any, name: str, keep_per_rank: bool = False) -> Any:
    """``t`` updated from ``value`` (the same object when updated in place)."""
    if is_dtensor(t):
        copy_into(t.to_local(), value, name)
        return t
    if isinstance(t, torch.Tensor):
        copy_into(t, value, name)
        return t
    if isinstance(t, PerRank):  # the loaded value is this rank's own
        return PerRank(_put(t.value, value, name, keep_per_rank))
    if isinstance(t, Shard):
        np.copyto(t.data, np.asarray(value).reshape(t.data.shape))
        return t
    if isinstance(t, np.ndarray) and isinstance(value, np.ndarray) and t.shape == value.shape:
        np.copyto(t, value)
        return t
    if is_stateful(t):
        sd = t.state_dict()
        from_state(sd, value, name, keep_per_rank=keep_per_rank)
        if isinstance(t, torch.optim.Optimizer):
            _int_state_keys(sd)
        t.load_state_dict(sd)
        return t
    if isinstance(t, MutableMapping) and isinstance(value, Mapping):
        from_state(t, value, name, keep_per_rank=keep_per_rank)
        return t
    return like(t, value)


def materialize(value: Any) -> Any:
    """A loaded leaf or subtree as PyTorch values: arrays become CPU tensors (sharing memory)."""
    if isinstance(value, np.ndarray):
        return numpy_to_tensor(value)
    if isinstance(value, Mapping):
        return {k: materialize(v) for k, v in value.items()}
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
    if all(isinstance(p, int) for g in groups for p in g.get("params", [])):
        sd["state"] = {
            int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in state.items()
        }
