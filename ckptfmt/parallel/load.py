"""Collective load of one checkpoint: every rank gets what it wants, reading only its own
directory and receiving the rest from the ranks that wrote it.

Every rank calls :func:`load_collective` with the directory it can see (its node's level-1 copy,
or the shared level-3 copy) and what it wants of each tensor (the whole tensor, or a region).
For each stored region, in manifest order: if every rank wants all of it, its writer reads it
(verified) and broadcasts it; otherwise each wanting rank that shares the writer's directory reads
it itself, and the writer sends it to the others. Damage found by any rank is voted on at the end,
so no rank is left waiting; then every rank raises.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ckptfmt.errors import CkptError, DamagedError
from ckptfmt.manifest.limits import display
from ckptfmt.manifest.model import GroupEntry, Manifest, TensorEntry, ValueEntry
from ckptfmt.parallel.comm import Comm
from ckptfmt.parallel.protocol import groups_of
from ckptfmt.reader import geometry, read_manifest
from ckptfmt.state import unflatten
from ckptfmt.storage.files import Inside
from ckptfmt.storage.shard_io import read_region

Box = tuple[tuple[int, ...], tuple[int, ...]]


class LoadFailedError(CkptError):
    """A collective load failed on some rank (``failures``: rank -> message)."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        lines = "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))
        super().__init__(f"load failed on {len(failures)} rank(s): {lines}")


def _intersect(a: Box, b: Box) -> Box | None:
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1]))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


def _copy(dst: np.ndarray, dst_box: Box, src: np.ndarray, src_box: Box) -> None:
    """Copy the overlap of two boxes (global coordinates) from ``src`` into ``dst``."""
    inter = _intersect(dst_box, src_box) if dst_box[1] else (dst_box if not src_box[1] else None)
    if inter is None:
        return
    if not dst_box[1]:  # 0-d
        dst[...] = src
        return
    lo, shape = inter
    dst[tuple(slice(a - o, a - o + n) for a, o, n in zip(lo, dst_box[0], shape))] = src[
        tuple(slice(a - o, a - o + n) for a, o, n in zip(lo, src_box[0], shape))
    ]


def load_collective(
    comm: Comm,
    path: str | os.PathLike[str],
    wants: Mapping[str, Box | None] | None = None,
    group: str | None = None,
    expect_step: int | None = None,
) -> tuple[dict[str, Any], Manifest]:
    """Collective: load the checkpoint every rank sees at ``path`` (its own copy).

    ``wants`` maps tensor names ('/'-joined) to a region ``(offset, shape)`` or None (the whole
    tensor); tensors not named are loaded whole. ``group``: ranks with equal keys see the same
    directory (as in ``save_collective``). Returns the nested state (regions as arrays of the
    region's shape) and the manifest.
    """
    root = Path(path).absolute()
    error: str | None = None
    manifest: Manifest | None = None
    try:
        manifest = read_manifest(root)
        if expect_step is not None and manifest.step != expect_step:
            error = f"{root} holds step {manifest.step}, not {expect_step} (a misplaced copy)"
    except CkptError as exc:
        error = f"{type(exc).__name__}: {exc}"
    want_json = {
        k: (None if v is None else [list(v[0]), list(v[1])]) for k, v in (wants or {}).items()
    }
    info = comm.allgather_json(
        {
            "path": str(root),
            "group": group if group is not None else str(root),
            "error": error,
            "wants": want_json,
            "save_id": manifest.save_id if manifest else None,
        }
    )
    failures = {r: i["error"] for r, i in enumerate(info) if i["error"]}
    if not failures and len({i["save_id"] for i in info}) != 1:
        failures = {r: f"has save {i['save_id']}" for r, i in enumerate(info)}
    if failures:
        raise LoadFailedError(failures)
    assert manifest is not None
    if manifest.world_size != comm.size:
        raise LoadFailedError(
            {
                comm.rank: f"saved by {manifest.world_size} ranks, loading with "
                f"{comm.size} (resharding is not supported yet)"
            }
        )
    leaders = groups_of([i["group"] for i in info])
    src = Inside(root)
    out: dict[str, np.ndarray] = {}
    tag = 0
    for t in manifest.tensors():
        name = display(t.name)
        geo = geometry(t)
        whole: Box = ((0,) * len(t.shape), t.shape)
        boxes: list[Box] = []
        for k, i in enumerate(info):
            w = i["wants"].get(name)
            if w is None and t.per_rank:  # each rank its own row
                boxes.append(((k,) + (0,) * (len(t.shape) - 1), (1, *t.shape[1:])))
            else:
                boxes.append(whole if w is None else (tuple(w[0]), tuple(w[1])))
        mine = boxes[comm.rank]
        out[name] = np.empty(mine[1], dtype=geo.dtype)
        for r in t.regions:
            rbox: Box = (r.offset, r.shape)
            wanting = [k for k, b in enumerate(boxes) if _intersect(b, rbox) or not t.shape]
            if not wanting:
                continue
            everyone = all(b == whole for b in boxes)
            buf: np.ndarray | None = None
            if comm.rank == r.rank or (
                not everyone and comm.rank in wanting and leaders[comm.rank] == leaders[r.rank]
            ):
                buf = np.zeros(r.shape, dtype=geo.dtype)
                if error is None:
                    try:
                        read_region(src, geo, r.files, r.offset, buf, (name,))
                    except (DamagedError, OSError) as exc:
                        error = f"{type(exc).__name__}: {exc}"
            if everyone and comm.size > 1:
                if buf is None:
                    buf = np.empty(r.shape, dtype=geo.dtype)
                comm.bcast_buffer(buf.reshape(-1).view(np.uint8), r.rank)
            elif comm.size > 1:
                remote = [k for k in wanting if leaders[k] != leaders[r.rank]]
                if comm.rank == r.rank and buf is not None:
                    for k in remote:
                        comm.send(buf.reshape(-1).view(np.uint8), k, tag)
                elif comm.rank in remote:
                    buf = np.empty(r.shape, dtype=geo.dtype)
                    comm.recv(buf.reshape(-1).view(np.uint8), r.rank, tag)
                tag += 1
            if buf is not None and comm.rank in wanting:
                _copy(out[name], mine, buf, rbox)
    gathered = comm.allgather_json(error)
    failures = {r: e for r, e in enumerate(gathered) if e}
    if failures:
        raise LoadFailedError(failures)
    leaves: list[tuple[tuple[str, ...], Any]] = []
    for e in manifest.entries:
        if isinstance(e, TensorEntry):
            arr = out[display(e.name)]
            own_row = e.per_rank and display(e.name) not in (wants or {})
            leaves.append((e.name, arr.reshape(e.shape[1:]) if own_row else arr))
        elif isinstance(e, ValueEntry):
            leaves.append((e.name, e.value))
        elif isinstance(e, GroupEntry):
            leaves.append((e.name, {}))
        else:
            leaves.append((e.name, e.values[comm.rank]))
    return unflatten(leaves), manifest
