"""What ``ckptfmt inspect`` reports, as one JSON-able document built from the manifest alone.

The table on a terminal is rendered from this same document (``render.inspect_tables``), so the
two never disagree. Keys are stable: new ones may be added, none renamed or removed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ckptfmt import Checkpoint
from ckptfmt.manifest import (
    GroupEntry,
    Manifest,
    PerRankValueEntry,
    Region,
    TensorEntry,
    ValueEntry,
)
from ckptfmt.redundancy import record_of

REPR_CHARS = 60


def short_repr(value: Any, limit: int = REPR_CHARS) -> str:
    """A value's Python repr (which spells non-finite floats), cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def type_name(value: Any) -> str:
    """The JSON type of a value as users know it."""
    if value is None:
        return "null"
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "dict"}.get(
        type(value), type(value).__name__
    )


def _region(r: Region) -> dict[str, Any]:
    return {
        "offset": list(r.offset),
        "shape": list(r.shape),
        "rank": r.rank,
        "files": [{"path": f.path, "size": f.size, "crc32c": f"{f.crc32c:08x}"} for f in r.files],
    }


def _tensor(t: TensorEntry, nbytes: int, regions: bool) -> dict[str, Any]:
    sizes = [f.size for r in t.regions for f in r.files]
    out: dict[str, Any] = {
        "name": "/".join(t.name),
        "dtype": t.dtype,
        "shape": list(t.shape),
        "bytes": nbytes,
        "stored_bytes": sum(sizes),
        "files": len(sizes),
        "regions": len(t.regions),
        "writer_ranks": sorted({r.rank for r in t.regions}),
        "shard_shape": list(t.shard_shape),
        "chunk_shape": list(t.chunk_shape),
        "per_rank": t.per_rank,
        "encoding": t.encoding,
    }
    if regions:
        out["region_details"] = [_region(r) for r in t.regions]
    return out


def _value(e: ValueEntry | PerRankValueEntry) -> dict[str, Any]:
    if isinstance(e, ValueEntry):
        return {
            "name": "/".join(e.name),
            "type": type_name(e.value),
            "per_rank": False,
            "repr": short_repr(e.value),
        }
    return {
        "name": "/".join(e.name),
        "type": "per-rank",
        "per_rank": True,
        "repr": short_repr(list(e.values)),
    }


def describe(ckpt: Checkpoint, *, regions: bool = False) -> dict[str, Any]:
    """The inspect document of an open checkpoint; ``regions`` adds each region's layout."""
    m = ckpt.manifest
    views = ckpt.tensors()
    tensors: list[dict[str, Any]] = []
    values: list[dict[str, Any]] = []
    groups: list[str] = []
    containers: list[dict[str, Any]] = []  # lists and tuples: name, kind, number of items
    at: dict[tuple[str, ...], dict[str, Any]] = {}
    for e in m.entries:
        if isinstance(e, TensorEntry):
            tensors.append(_tensor(e, views["/".join(e.name)].nbytes, regions))
        elif isinstance(e, GroupEntry) and e.container is not None:
            containers.append({"name": "/".join(e.name), "kind": e.container, "items": 0})
            at[e.name] = containers[-1]
        elif isinstance(e, GroupEntry):
            groups.append("/".join(e.name))
        else:
            values.append(_value(e))
    items: dict[tuple[str, ...], set[str]] = {name: set() for name in at}
    for e in m.entries:
        for k in range(1, len(e.name)):
            if e.name[:k] in items:
                items[e.name[:k]].add(e.name[k])
    for name, c in at.items():
        c["items"] = len(items[name])
    nodes: dict[str, list[int]] = {}
    for r in m.ranks:
        nodes.setdefault(r.node, []).append(r.rank)
    return {
        "path": str(ckpt.path),
        "format_version": m.format_version,
        "step": m.step,
        "save_id": m.save_id,
        "created": m.created,
        "writer": m.writer,
        "world": {
            "size": m.world_size,
            "nodes": [{"node": node, "ranks": ranks} for node, ranks in nodes.items()],
        },
        "levels": sorted(m.levels),
        "redundancy": _redundancy(m),
        "totals": {
            "tensors": len(tensors),
            "values": len(values),
            "bytes": sum(t["bytes"] for t in tensors),
            "stored_bytes": sum(t["stored_bytes"] for t in tensors),
            "files": sum(t["files"] for t in tensors),
        },
        "tensors": tensors,
        "values": values,
        "empty_groups": groups,
        "containers": containers,
    }


def _redundancy(m: Manifest) -> dict[str, Any] | None:
    """The level-1 redundancy record in brief (None when the save has none)."""
    rec = record_of(m)
    if rec is None:
        return None
    data = sum(sum(s.sizes) for s in rec.sets)
    parity = sum(f.size for s in rec.sets for f in s.parity)
    return {
        "scheme": rec.scheme,
        "m": rec.m,
        "sets": [list(s.members) for s in rec.sets],
        "parity_bytes": parity,
        "overhead": parity / data if data else 0.0,
    }


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``"0-2,5,7-8"``."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def human_bytes(n: int) -> str:
    """``1536`` as ``"1.5 KiB"``; under 1 KiB in plain bytes."""
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        size /= 1024
        if size < 1024 or unit == "PiB":
            break
    return f"{size:.1f} {unit}"
