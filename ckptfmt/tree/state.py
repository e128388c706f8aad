"""A training state (nested mappings of arrays and JSON-able values) as flat named leaves and back.

Every ``Mapping`` is a level of the name (its keys are name components); every other object is a
leaf: a numpy array or numpy scalar (a tensor; a numpy scalar comes back as a 0-d array) or a
JSON-able value (see ``manifest/values.py``). An empty mapping is kept as a group entry so the
structure comes back as it was given. Key order is kept.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptfmt.errors import LimitExceededError, UsageError
from ckptfmt.manifest.limits import MAX_ENTRIES, MAX_NAME_DEPTH, check_component, display

Name = tuple[str, ...]


def arrays_of(state: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The arrays of ``state`` by '/'-joined name (a ``Shard``'s local array under its name):
    the destinations a load that reads straight into the caller's arrays is offered
    (``CheckpointManager.restore(into=True)``, the torch adapter's ``into=True``)."""
    out: dict[str, np.ndarray] = {}
    for name, leaf in flatten(state):
        data = leaf.data if isinstance(leaf, Shard) else leaf
        if isinstance(data, np.ndarray):
            out[display(name)] = data
    return out


def flatten(state: Mapping[str, Any]) -> list[tuple[Name, Any]]:
    """Leaves of ``state`` in order as ``(name, leaf)``; an empty mapping's leaf is ``{}``."""
    if not isinstance(state, Mapping):
        raise UsageError("the state must be a mapping of names to arrays or values")
    out: list[tuple[Name, Any]] = []

    def walk(node: Mapping[str, Any], prefix: Name) -> None:
        if len(prefix) > MAX_NAME_DEPTH:
            raise LimitExceededError("name depth", len(prefix), MAX_NAME_DEPTH)
        if not node and prefix:
            out.append((prefix, {}))
        for key, value in node.items():
            name = (*prefix, check_component(key, (*prefix, key)))
            if isinstance(value, Mapping):
                walk(value, name)
            else:
                out.append((name, value))
            if len(out) > MAX_ENTRIES:
                raise LimitExceededError("number of entries", len(out), MAX_ENTRIES)

    walk(state, ())
    return out


@dataclass(frozen=True)
class Shard:
    """A leaf holding one region of a larger tensor (what FSDP or tensor parallelism give a
    rank): ``data`` is the region, at ``offset`` in a tensor of ``global_shape``."""

    data: np.ndarray
    offset: tuple[int, ...]
    global_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        arr = np.asarray(self.data)
        offset = tuple(int(x) for x in self.offset)
        shape = tuple(int(x) for x in self.global_shape)
        if (
            len(offset) != arr.ndim
            or len(shape) != arr.ndim
            or any(o < 0 or o + n > d for o, n, d in zip(offset, arr.shape, shape))
        ):
            raise UsageError(
                f"a shard of shape {arr.shape} at {list(offset)} does not fit in {list(shape)}"
            )
        object.__setattr__(self, "data", arr)
        object.__setattr__(self, "offset", offset)
        object.__setattr__(self, "global_shape", shape)


@dataclass(frozen=True)
class PerRank:
    """A leaf of which every rank holds its own copy (an RNG state, a data-loader position):
    ``value`` is a JSON-able value or an array (every rank the same shape and dtype).

    Saved as a per-rank value entry, or a ``per_rank`` tensor whose leading axis is the rank
    (``spec/FORMAT.md`` §12); a collective load gives each rank its own ``value`` back, unwrapped.
    """

    value: Any


@dataclass(frozen=True)
class Pieces:
    """A whole tensor of which only some boxes are at hand: the manager's staging copy of a
    replicated tensor holds just the regions this rank writes (``parallel.manager``: every rank
    agreed on the state's structure, so the plan is known before the copy). A save declares it
    held whole, like the array it stands for, and takes each region it writes from the piece
    containing it. ``boxes``: (offset, data) pairs, data C-contiguous of ``dtype``."""

    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    boxes: tuple[tuple[tuple[int, ...], np.ndarray], ...]

    @property
    def nbytes(self) -> int:
        """The bytes at hand (not the whole tensor's)."""
        return sum(data.nbytes for _, data in self.boxes)

    def region(self, offset: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray | None:
        """The data of the box at ``offset`` of ``shape`` (a view), or None when no piece
        contains it."""
        for at, data in self.boxes:
            if all(a <= o and o + n <= a + d for a, o, n, d in zip(at, offset, shape, data.shape)):
                if not shape:
                    return data
                return data[tuple(slice(o - a, o - a + n) for a, o, n in zip(at, offset, shape))]
        return None


def is_tensor(leaf: Any) -> bool:
    if isinstance(leaf, (Shard, Pieces)):
        return True
    return isinstance(leaf, (np.ndarray, np.generic)) and not isinstance(leaf, (np.str_, np.bytes_))


def unflatten(leaves: Iterator[tuple[Name, Any]] | list[tuple[Name, Any]]) -> dict[str, Any]:
    """Inverse of :func:`flatten` (names are assumed checked and tree-shaped)."""
    root: dict[str, Any] = {}
    for name, leaf in leaves:
        node = root
        for component in name[:-1]:
            node = node.setdefault(component, {})
        node[name[-1]] = leaf
    return root
