"""A training state (nested mappings of arrays and JSON-able values) as flat named leaves and back.

Every ``Mapping`` is a level of the name (its keys are name components). A list or tuple is a
level too, its items named ``"0"``, ``"1"``, ... under a :class:`Container` leaf that says which
it was, unless it is a list of plain JSON (no tuple, array, bytes or object anywhere in it),
which stays one JSON value. Every other object is a leaf: a numpy array or numpy scalar (a
tensor; a numpy scalar comes back as a 0-d array), ``bytes`` (a :class:`Blob` of its bytes), a
JSON-able value (see ``manifest/values.py``), or, only when the save asks for it, any other
object as a :class:`Blob` of its pickle (unpickled by a load only when trusted). An empty
mapping is kept as a group entry so the structure comes back as it was given. Key order is kept.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ckptfmt.errors import LimitExceededError, PickleRefusedError, UnsupportedValueError, UsageError
from ckptfmt.manifest.limits import MAX_ENTRIES, MAX_NAME_DEPTH, check_component, display

Name = tuple[str, ...]
Objects = Literal["refuse", "pickle"]
"""What a save does with an object that is neither an array, bytes, a container nor JSON-able:
``"refuse"`` it (:class:`UnsupportedValueError` naming its key path) or store its ``"pickle"``."""


@dataclass(frozen=True)
class Container:
    """The leaf at a list's or tuple's name (``kind``: ``"list"`` or ``"tuple"``); its items are
    the leaves under the index names ``"0"``, ``"1"``, ..."""

    kind: Literal["list", "tuple"]


@dataclass(frozen=True)
class Blob:
    """Opaque bytes stored as a 1-d ``uint8`` tensor: ``encoding`` says what they are
    (``"bytes"``: a ``bytes`` value; ``"pickle"``: an object's pickle). ``data`` may share
    memory with the ``bytes`` object it came from (read-only)."""

    data: np.ndarray
    encoding: Literal["bytes", "pickle"]

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def _plain_json(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is stored as one JSON value (no tuple, which JSON cannot tell from a
    list; no array, bytes or other object anywhere in it)."""
    if depth > 64:
        return True  # encode_value refuses it with the limit
    if value is None or isinstance(value, (str, bool, int, float)):
        return True
    if isinstance(value, np.generic):
        return not isinstance(value, (np.void, np.bytes_))
    if type(value) is list:
        return all(_plain_json(v, depth + 1) for v in value)
    if type(value) is dict:  # a key that is not a string: refused as a value, by its name
        return all(_plain_json(v, depth + 1) for v in value.values())
    return False


def _is_leaf(value: Any) -> bool:
    """An array, a leaf wrapper or a JSON scalar: a leaf as it is."""
    if value is None or isinstance(value, (str, bool, int, float, Blob, PerRank)):
        return True
    return is_tensor(value)


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


def flatten(
    state: Mapping[str, Any],
    objects: Objects | Literal["keep"] = "keep",
    *,
    sequences: bool = True,
) -> list[tuple[Name, Any]]:
    """Leaves of ``state`` in order as ``(name, leaf)``; an empty mapping's leaf is ``{}``, a
    list's or tuple's a :class:`Container` before its items (module docstring), ``bytes`` a
    :class:`Blob`. ``objects``: what becomes of any other object (:data:`Objects`; ``"keep"``:
    left as the leaf, for walks that only look). ``sequences=False`` keeps lists and tuples as
    leaves (a walk over the caller's state that replaces them whole)."""
    if not isinstance(state, Mapping):
        raise UsageError("the state must be a mapping of names to arrays or values")
    out: list[tuple[Name, Any]] = []

    def add(name: Name, value: Any) -> None:
        if isinstance(value, Mapping):
            walk(value, name)
        elif _is_leaf(value) or isinstance(value, (Shard, Pieces)):
            out.append((name, value))
        elif isinstance(value, bytes):
            out.append((name, Blob(np.frombuffer(value, np.uint8), "bytes")))
        elif isinstance(value, (list, tuple)) and (not sequences or _plain_json(value)):
            out.append((name, value))
        elif isinstance(value, (list, tuple)):
            if len(name) >= MAX_NAME_DEPTH:
                raise LimitExceededError("name depth", len(name) + 1, MAX_NAME_DEPTH)
            out.append((name, Container("tuple" if isinstance(value, tuple) else "list")))
            for i, item in enumerate(value):
                add((*name, str(i)), item)
        elif isinstance(value, Container) or objects == "keep":
            out.append((name, value))
        elif objects == "pickle":
            try:
                blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # whatever the object's __reduce__ raises
                raise UnsupportedValueError(display(name), f"cannot be pickled: {exc}") from exc
            out.append((name, Blob(np.frombuffer(blob, np.uint8), "pickle")))
        else:
            raise UnsupportedValueError(
                display(name),
                f"{type(value).__name__} is neither an array, bytes, a list, tuple or mapping "
                "nor JSON-able (save(..., objects='pickle') stores it as a pickled blob, "
                "loaded only with trust_pickle=True)",
            )
        if len(out) > MAX_ENTRIES:
            raise LimitExceededError("number of entries", len(out), MAX_ENTRIES)

    def walk(node: Mapping[str, Any], prefix: Name) -> None:
        if len(prefix) > MAX_NAME_DEPTH:
            raise LimitExceededError("name depth", len(prefix), MAX_NAME_DEPTH)
        if not node and prefix:
            out.append((prefix, {}))
        for key, value in node.items():
            add((*prefix, check_component(key, (*prefix, key))), value)

    walk(state, ())
    return out


def encode_objects(state: Mapping[str, Any], objects: Objects) -> Mapping[str, Any]:
    """``state`` with every object that is not an array, bytes, a container or JSON-able
    stored as ``objects`` says (``"pickle"``: a :class:`Blob` of its pickle, taken now;
    ``"refuse"``: the state as it is; the save's own walk refuses them, naming the first with
    :class:`UnsupportedValueError`). Arrays are not copied."""
    if objects not in ("refuse", "pickle"):
        raise UsageError(f"objects must be 'refuse' or 'pickle', got {objects!r}")
    if objects == "refuse":
        return state
    return unflatten(flatten(state, objects), pickled="keep")


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
    replicated tensor holds just the regions this rank writes
    (``parallel.manager.checkpoint_manager``: every rank agreed on the state's structure, so the
    plan is known before the copy). A save declares it held whole, like the array it stands for, and
    takes each region it writes from the piece containing it. ``boxes``: (offset, data) pairs, data
    C-contiguous of ``dtype``."""

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


def unflatten(
    leaves: Iterator[tuple[Name, Any]] | list[tuple[Name, Any]],
    *,
    pickled: Literal["refuse", "load", "keep"] = "refuse",
) -> dict[str, Any]:
    """Inverse of :func:`flatten` (names are assumed checked and tree-shaped): a
    :class:`Container`'s items become its list or tuple, a ``"bytes"`` :class:`Blob` its
    ``bytes``. A ``"pickle"`` blob: ``"refuse"`` raises :class:`PickleRefusedError` naming it
    before anything is unpickled, ``"load"`` unpickles it (only for a checkpoint the caller
    trusts), ``"keep"`` leaves the :class:`Blob` (a staging copy that is saved again)."""
    root: dict[str, Any] = {}
    containers: list[tuple[Name, str]] = []
    blobs: list[tuple[Name, Blob]] = []
    for name, leaf in leaves:
        node = root
        for component in name[:-1]:
            node = node.setdefault(component, {})
        if isinstance(leaf, Container):
            containers.append((name, leaf.kind))
            node[name[-1]] = node.get(name[-1], {})
            continue
        if isinstance(leaf, Blob) and pickled != "keep":
            blobs.append((name, leaf))
            if leaf.encoding == "pickle" and pickled == "refuse":
                raise PickleRefusedError(
                    f"entry {display(name)!r}",
                    "it holds a pickled object (saved with objects='pickle'); load with "
                    "trust_pickle=True only a checkpoint from a source you trust",
                )
        node[name[-1]] = leaf
    for name, blob in blobs:
        data = bytes(np.ascontiguousarray(blob.data, np.uint8).reshape(-1))
        _put(root, name, data if blob.encoding == "bytes" else pickle.loads(data))
    for name, kind in reversed(containers):  # innermost first
        items = _get(root, name)
        seq = [items[str(i)] for i in range(len(items))]
        _put(root, name, tuple(seq) if kind == "tuple" else seq)
    return root


def _get(root: dict[str, Any], name: Name) -> Any:
    node: Any = root
    for component in name:
        node = node[component]
    return node


def _put(root: dict[str, Any], name: Name, value: Any) -> None:
    _get(root, name[:-1])[name[-1]] = value
