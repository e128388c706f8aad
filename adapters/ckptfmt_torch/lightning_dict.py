"""Lightning's checkpoint dict to the tree ``ckptfmt_torch.save`` stores, and back as it was
(``ckptfmt_torch.lightning.CheckpointIO`` uses these; nothing here touches a file).

- A mapping whose keys are not all names (``ModelCheckpoint``'s ``best_k_models`` is keyed by
  file paths) is stored as ``{ITEMS: [(key, value), ...]}`` and given back as the mapping.
- Which mappings were ``OrderedDict``s, each with its ``_metadata`` (the module versions
  ``load_state_dict`` passes to each module), is one JSON string under ``CONTAINERS`` at the
  top of the saved dict, by key path; a load makes them ``OrderedDict``s again.
- ``map_location`` moves the loaded tensors as ``torch.load`` would.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ckptfmt.errors import InvalidNameError, UnsupportedValueError
from ckptfmt.manifest import check_component
from ckptfmt_torch import _compat

__all__ = [
    "CONTAINERS",
    "ITEMS",
    "Location",
    "containers_json",
    "keyed",
    "placed",
    "restored",
    "unkeyed",
]

# keys starting with "%" are this module's, so a user's such key makes its mapping pairs too
ITEMS = "%items"
CONTAINERS = "%containers"
Location = torch.device | str | Mapping[str, Any] | Callable[..., Any]


def keyed(obj: Any) -> Any:
    """``obj`` with every mapping whose keys are not all valid names (nor ints: an optimizer's
    parameter indices) as ``{ITEMS: [(key, value), ...]}``; the tensors are the same."""
    if isinstance(obj, Mapping):
        out = {k: keyed(v) for k, v in obj.items()}
        return out if all(_is_name(k) for k in obj) else {ITEMS: [(k, v) for k, v in out.items()]}
    if isinstance(obj, (list, tuple)):
        items = [keyed(v) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    return obj


def _is_name(key: Any) -> bool:
    if isinstance(key, int) and not isinstance(key, bool):
        return True
    try:
        check_component(key)
    except InvalidNameError:
        return False
    return not key.startswith("%")


def unkeyed(obj: Any) -> Any:
    """What :func:`keyed` made of ``obj``, undone (pairs load as lists or tuples)."""
    if isinstance(obj, dict):
        if list(obj) == [ITEMS] and isinstance(obj[ITEMS], (list, tuple)):
            return {k: unkeyed(v) for k, v in obj[ITEMS]}
        return {k: unkeyed(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [unkeyed(v) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    return obj


def placed(obj: Any, where: Location) -> Any:
    """``obj`` with its tensors moved as ``torch.load``'s ``map_location`` would move them (a
    function's ``None`` keeps a tensor where it is, as ``torch.load`` keeps its storage)."""
    if isinstance(obj, torch.Tensor):
        if callable(where) and not isinstance(where, (str, torch.device)):
            moved = where(obj, "cpu")
            return obj if moved is None else moved
        if isinstance(where, Mapping):
            return obj.to(where["cpu"]) if "cpu" in where else obj
        return obj.to(where)
    if isinstance(obj, dict):
        return {k: placed(v, where) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [placed(v, where) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    return obj


def _mappings(obj: Any, where: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every mapping in ``obj`` with its key path, where every key on it can be written in JSON
    (strings and ints; below another key nothing is addressable, so nothing is recorded)."""
    if isinstance(obj, Mapping):
        yield where, obj
        items: Any = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return
    for k, v in items:
        if isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool)):
            yield from _mappings(v, (*where, k))


def containers_json(checkpoint: Mapping[str, Any]) -> str | None:
    """JSON naming the ``OrderedDict``s of ``checkpoint`` by key path, each with its
    ``_metadata`` (the versions ``load_state_dict`` passes to each module) as pairs; ``None``
    when there is none. Metadata that is not JSON is refused, naming it."""
    found: list[dict[str, Any]] = []
    for where, mapping in _mappings(checkpoint, ()):
        if not isinstance(mapping, OrderedDict):
            continue
        entry: dict[str, Any] = {"path": list(where)}
        meta = _compat.state_dict_metadata(mapping)
        if meta is not None:
            name = "/".join(map(str, (*where, "_metadata")))
            if not isinstance(meta, Mapping):
                raise UnsupportedValueError(name, f"a {type(meta).__name__}, not a mapping")
            entry["metadata"] = [[k, v] for k, v in meta.items()]
            entry["ordered"] = isinstance(meta, OrderedDict)
            try:
                json.dumps(entry, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise UnsupportedValueError(name, f"not JSON ({exc})") from None
        found.append(entry)
    return json.dumps(found, allow_nan=False) if found else None


def restored(obj: Any, containers: Any) -> Any:
    """``obj`` with the mappings :func:`containers_json` named made ``OrderedDict``s again, each
    with its ``_metadata``."""
    if not isinstance(containers, str):
        return obj
    for entry in json.loads(containers):
        obj = _replaced(obj, entry["path"], entry)
    return obj


def _replaced(obj: Any, where: list[Any], entry: dict[str, Any]) -> Any:
    if not where:
        if not isinstance(obj, dict):
            return obj
        out: Any = OrderedDict(obj)
        if "metadata" in entry:
            pairs = [(k, v) for k, v in entry["metadata"]]
            _compat.set_state_dict_metadata(
                out, OrderedDict(pairs) if entry.get("ordered", True) else dict(pairs)
            )
        return out
    head, rest = where[0], where[1:]
    if isinstance(obj, dict) and head in obj:
        obj[head] = _replaced(obj[head], rest, entry)
    elif isinstance(obj, (list, tuple)) and isinstance(head, int) and 0 <= head < len(obj):
        items = list(obj)
        items[head] = _replaced(items[head], rest, entry)
        return tuple(items) if isinstance(obj, tuple) else items
    return obj
