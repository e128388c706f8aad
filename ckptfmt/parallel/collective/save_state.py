"""One rank's state as the collective save takes it: every leaf checked before anything touches
the disk (``check_state``, ``check_leaf``), arrays made storable, and the data of each region
the plan gives this rank to write (``region_data``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptfmt.dtypes import DType, of_array
from ckptfmt.errors import CkptError, LimitExceededError
from ckptfmt.manifest.limits import MAX_DIM, MAX_NDIM, MAX_TENSOR_BYTES, display
from ckptfmt.manifest.values import encode_value
from ckptfmt.plan.ownership import Holding, TensorPlan
from ckptfmt.tree.state import Blob, Container, PerRank, Pieces, Shard, flatten, is_tensor

Name = tuple[str, ...]


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

    # (name, "tensor" | "bytes" | "pickle" | "value" | "group" | "list" | "tuple" | "per_rank_*")
    order: list[tuple[Name, str]]
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
    :class:`PerRank` arrays as row ``rank`` of their per-rank tensors. An object that is not
    storable is refused (:class:`UnsupportedValueError` naming it); a save that stores objects
    pickled turned them into :class:`Blob` leaves before (``tree.state.encode_objects``)."""
    local = LocalState([], {}, {})
    for name, leaf in flatten(state, "refuse"):
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
        elif isinstance(leaf, Blob):  # bytes or a pickle: a 1-d uint8 tensor, marked
            arr, dtype = as_storable(leaf.data, shown)
            local.tensors[name] = (arr, dtype, arr.shape, None)
            local.order.append((name, leaf.encoding))
        elif isinstance(leaf, Container):
            local.order.append((name, leaf.kind))
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
    if isinstance(value, Container):
        return
    if isinstance(value, Blob):
        value = value.data
    if is_tensor(value):
        arr = value.data if isinstance(value, Shard) else value
        if not hasattr(arr, "dtype") or not hasattr(arr, "shape"):
            arr = np.asarray(arr)
        of_array(np.dtype(arr.dtype), shown)
        if len(arr.shape) > MAX_NDIM:
            raise LimitExceededError(f"number of dimensions of {shown!r}", len(arr.shape), MAX_NDIM)
    elif not (isinstance(leaf, dict) and not leaf):
        encode_value(value, shown)  # raises for what JSON cannot hold


def region_data(
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
