"""Single-process save and load of a whole checkpoint (``ckptfmt.save`` / ``ckptfmt.load``).

The many-rank protocol builds on the same pieces: a rank writes its regions with
``storage.shard_io.write_region``; the manifest lists every region with its writer rank; the commit
protocol of ``storage.commit`` makes the checkpoint appear whole or not at all.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import socket
import sys
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ckptfmt import __version__
from ckptfmt.codecs.grid import DEFAULT_CHUNK_BYTES, DEFAULT_SHARD_BYTES, choose_grid
from ckptfmt.codecs.zarr_meta import array_doc, group_doc
from ckptfmt.dtypes import DType, of_array
from ckptfmt.errors import LimitExceededError, UsageError
from ckptfmt.manifest.codec import dump_manifest
from ckptfmt.manifest.limits import MAX_DIM, MAX_NDIM, MAX_TENSOR_BYTES, display
from ckptfmt.manifest.model import (
    Entry,
    GroupEntry,
    Manifest,
    RankInfo,
    Region,
    TensorEntry,
    ValueEntry,
)
from ckptfmt.manifest.values import encode_value
from ckptfmt.reader import read_manifest, read_tensor
from ckptfmt.state import flatten, is_tensor, unflatten
from ckptfmt.storage import commit
from ckptfmt.storage.files import Inside, write_json
from ckptfmt.storage.shard_io import Geometry, ShardJob, plan_region, run_jobs

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("ckptfmt supports little-endian hosts only")


def as_storable(array: np.ndarray | np.generic, name: str) -> tuple[np.ndarray, DType]:
    """The array as the writer needs it (C-contiguous, little-endian) and its logical dtype.

    Copies only when the input is not already so.
    """
    arr = np.asarray(array)
    dtype = of_array(arr.dtype, name)
    if arr.ndim > MAX_NDIM:
        raise LimitExceededError(f"number of dimensions of {name!r}", arr.ndim, MAX_NDIM)
    if any(d > MAX_DIM for d in arr.shape) or arr.nbytes > MAX_TENSOR_BYTES:
        raise LimitExceededError(f"size of {name!r}", arr.nbytes, MAX_TENSOR_BYTES)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(dtype.numpy)
    return (arr if arr.flags.c_contiguous else arr.copy(order="C")), dtype


def new_save_id() -> str:
    return uuid.uuid4().hex


def utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def writer_info() -> dict[str, Any]:
    return {"library": "ckptfmt", "version": __version__}


def save(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    overwrite: bool = False,
    fsync: bool = True,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Manifest:
    """Save ``state`` as a committed checkpoint directory at ``path``; return its manifest.

    ``state`` maps names to numpy arrays (any dtype of ``ckptfmt.dtypes``), JSON-able values or
    further mappings. A committed checkpoint at ``path`` is replaced only with ``overwrite=True``;
    a non-empty directory that is not a checkpoint is never written into. On any error nothing is
    left at ``path`` that was not there before.
    """
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise UsageError(f"step must be a non-negative int or None, got {step!r}")
    if chunk_bytes < 1 or shard_bytes < chunk_bytes:
        raise UsageError("need 1 <= chunk_bytes <= shard_bytes")
    leaves = flatten(state)
    # check every leaf before touching the disk
    prepared: list[tuple[tuple[str, ...], Any]] = []
    for name, leaf in leaves:
        shown = display(name)
        if is_tensor(leaf):
            prepared.append((name, as_storable(leaf, shown)))
        elif isinstance(leaf, dict) and not leaf:
            prepared.append((name, None))
        else:
            encode_value(leaf, shown)  # raises for what JSON cannot hold
            prepared.append((name, leaf))
    final = Path(path)
    save_id = new_save_id()
    staging = commit.prepare(final, save_id, overwrite)
    try:
        entries = _write_entries(staging, prepared, fsync, chunk_bytes, shard_bytes)
        manifest = Manifest(
            save_id=save_id,
            step=step,
            created=utc_now(),
            world_size=1,
            ranks=(RankInfo(0, socket.gethostname()),),
            entries=tuple(entries),
            writer=writer_info(),
        )
        commit.finalize(staging, final, dump_manifest(manifest), save_id)
    except BaseException:
        commit.abort(staging)
        raise
    return manifest


def write_groups(root: Path, names: list[tuple[str, ...]], fsync: bool) -> None:
    """Write the zarr group documents of the root and of every mapping level above a name."""
    groups = {name[:k] for name in names for k in range(len(name))}
    for g in sorted(groups, key=len):
        (root / "/".join(g)).mkdir(parents=True, exist_ok=True)
        write_json(root / "/".join(g) / "zarr.json", group_doc(), fsync)


def _write_entries(
    root: Path,
    prepared: list[tuple[tuple[str, ...], Any]],
    fsync: bool,
    chunk_bytes: int,
    shard_bytes: int,
) -> list[Entry]:
    names = [n for n, _ in prepared]
    write_groups(root, names, fsync)
    entries: list[Entry | None] = []
    made: set[Path] = set()
    pending: list[tuple[int, TensorEntry, list[ShardJob]]] = []
    for name, item in prepared:
        if item is None:
            (root / "/".join(name)).mkdir(parents=True, exist_ok=True)
            write_json(root / "/".join(name) / "zarr.json", group_doc(), fsync)
            entries.append(GroupEntry(name))
        elif isinstance(item, tuple) and isinstance(item[0], np.ndarray):
            arr, dtype = item
            entry, jobs = _plan_tensor(
                root, name, arr, dtype, fsync, chunk_bytes, shard_bytes, made
            )
            pending.append((len(entries), entry, jobs))
            entries.append(None)
        else:
            entries.append(ValueEntry(name, item))
    all_jobs = [j for _, _, jobs in pending for j in jobs]
    with ThreadPoolExecutor(max_workers=writer_threads()) as pool:
        refs = iter(run_jobs(all_jobs, pool, fsync))
    for i, entry, jobs in pending:
        files = tuple(next(refs) for _ in jobs)
        regions = (Region((0,) * len(entry.shape), entry.shape, 0, files),) if files else ()
        entries[i] = dataclasses.replace(entry, regions=regions)
    return [e for e in entries if e is not None]


def writer_threads() -> int:
    """Concurrent shard writers: two streams saturate tmpfs here; more only add contention."""
    return max(1, min(2, os.cpu_count() or 1))


def _plan_tensor(
    root: Path,
    name: tuple[str, ...],
    arr: np.ndarray,
    dtype: DType,
    fsync: bool,
    chunk_bytes: int,
    shard_bytes: int,
    made: set[Path],
) -> tuple[TensorEntry, list[ShardJob]]:
    path = "/".join(name)
    shard, chunk = choose_grid(arr.shape, dtype.itemsize, chunk_bytes, shard_bytes)
    (root / path).mkdir(parents=True, exist_ok=True)
    write_json(root / path / "zarr.json", array_doc(dtype, arr.shape, shard, chunk), fsync)
    geo = Geometry(path, dtype.numpy, arr.shape, shard, chunk)
    jobs = plan_region(root, geo, arr, (0,) * arr.ndim, made) if arr.size else []
    return TensorEntry(name, path, dtype.name, arr.shape, shard, chunk, ()), jobs


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a whole checkpoint into memory as the nested structure that was saved, bit-exact.

    Every byte read is checked against its CRC32C; damage raises a :class:`DamagedError` that names
    the file and the tensors it affects.
    """
    root = Path(path)
    manifest = read_manifest(root)
    src = Inside(root)
    leaves: list[tuple[tuple[str, ...], Any]] = []
    for e in manifest.entries:
        if isinstance(e, TensorEntry):
            leaves.append((e.name, read_tensor(src, e)))
        elif isinstance(e, ValueEntry):
            leaves.append((e.name, e.value))
        elif isinstance(e, GroupEntry):
            leaves.append((e.name, {}))
        else:
            leaves.append((e.name, list(e.values)))
    return unflatten(leaves)
