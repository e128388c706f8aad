"""Single-process save and load of a whole checkpoint (``ckptfmt.save`` / ``ckptfmt.load``).

``save`` is the collective save of ``ckptfmt.parallel.protocol`` run by one process, so one
code path writes every checkpoint; ``load`` reads every tensor whole, verifying every byte.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ckptfmt.container.reader import check_allocation, check_documents, read_manifest, tensor_reads
from ckptfmt.errors import StorageFullError, UsageError
from ckptfmt.format.options import WriteOptions
from ckptfmt.manifest.grid import DEFAULT_CHUNK_BYTES, DEFAULT_SHARD_BYTES
from ckptfmt.manifest.limits import MAX_CHUNK_BYTES
from ckptfmt.manifest.model import GroupEntry, Manifest, TensorEntry, ValueEntry
from ckptfmt.parallel.protocol import SaveFailedError, save_collective
from ckptfmt.storage.files import Inside, storage_full
from ckptfmt.storage.paths import check_destination, refuse_url
from ckptfmt.storage.progress import ProgressCallback, metering
from ckptfmt.transport.comm import SingleComm
from ckptfmt.tree.state import flatten, unflatten

__all__ = ["load", "save", "writer_threads"]
if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("ckptfmt supports little-endian hosts only")


def save(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    overwrite: bool = False,
    fsync: bool = True,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: ProgressCallback | None = None,
) -> Manifest:
    """Save ``state`` as a committed checkpoint directory at ``path``; return its manifest.

    ``state`` maps names to numpy arrays (any dtype of ``ckptfmt.dtypes``), JSON-able values or
    further mappings. A committed checkpoint at ``path`` is replaced only with ``overwrite=True``;
    a non-empty directory that is not a checkpoint is never written into. On any error nothing is
    left at ``path`` that was not there before. This is the collective save of
    ``ckptfmt.parallel`` run by a single process. ``progress``: called with
    :class:`~ckptfmt.Progress` events (the bytes of the data files written; the last once the
    checkpoint is committed), from this thread (``ckptfmt.storage.progress``).
    """
    check_destination(path)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise UsageError(f"step must be a non-negative int or None, got {step!r}")
    if not 1 <= chunk_bytes <= min(shard_bytes, MAX_CHUNK_BYTES):
        raise UsageError(
            f"need 1 <= chunk_bytes <= shard_bytes and chunk_bytes <= {MAX_CHUNK_BYTES}"
        )
    try:
        with metering("save", progress) as meter:
            manifest, _plan = save_collective(
                SingleComm(),
                state,
                path,
                step=step,
                node=socket.gethostname(),
                write=WriteOptions(
                    chunk_bytes, shard_bytes, writer_threads(), fsync, overwrite=overwrite
                ),
            )
            meter.finish()
    except SaveFailedError as exc:  # one process: re-raise its own error, not the vote's
        if exc.cause is not None:
            _raise_full(exc.cause, state, Path(path))
            raise exc.cause from None
        raise
    except OSError as exc:
        _raise_full(exc, state, Path(path))
        raise
    return manifest


def _raise_full(exc: BaseException, state: Mapping[str, Any], path: Path) -> None:
    """A full file system (or quota) met anywhere in the save, as :class:`StorageFullError`
    naming the checkpoint's directory and the bytes the save needed at least (its tensors'
    bytes; the shard indexes and metadata come on top). The staging directory is gone by now
    (the save's vote removed it)."""
    if not isinstance(exc, OSError):
        return
    full = exc if isinstance(exc, StorageFullError) else storage_full(exc, path.absolute())
    if full is None:
        return
    needed = sum(
        int(getattr(leaf, "nbytes", 0) or 0)
        for _, leaf in flatten(state)
        if isinstance(getattr(leaf, "nbytes", None), int)
    )
    raise full.with_context(
        level=f"single-process save of {path}",
        needed=max(needed, full.needed or 0),
        directory=str(path.absolute()),
    ) from None


def writer_threads() -> int:
    """Concurrent shard writers: two streams saturate tmpfs here; more only add contention."""
    return max(1, min(2, os.cpu_count() or 1))


def load(
    path: str | os.PathLike[str],
    *,
    max_bytes: int | None = None,
    progress: ProgressCallback | None = None,
) -> dict[str, Any]:
    """Load a whole checkpoint into memory as the nested structure that was saved, bit-exact.

    Every byte read is checked against its CRC32C, and every ``zarr.json`` against the manifest;
    damage raises a :class:`DamagedError` that names the file and the tensors it affects.
    ``max_bytes``: the most the tensors may take in memory, checked against the manifest before
    anything is allocated (:class:`AllocationLimitError`); None: the machine's physical memory
    (or the address-space limit), 0: no limit. ``progress``: called with
    :class:`~ckptfmt.Progress` events (the bytes of the data files read and verified), from
    this thread (``ckptfmt.storage.progress``).
    """
    refuse_url(path)
    root = Path(path)
    manifest = read_manifest(root)
    src = Inside(root)
    check_documents(src, manifest)
    check_allocation(manifest.tensors(), max_bytes)
    leaves: list[tuple[tuple[str, ...], Any]] = []
    jobs: list[Callable[[], None]] = []
    sizes: list[int] = []  # each job's stored bytes (progress)
    for e in manifest.entries:
        if isinstance(e, TensorEntry):
            out, tensor_jobs = tensor_reads(src, e, sizes)
            jobs += tensor_jobs
            leaves.append((e.name, out))
        elif isinstance(e, ValueEntry):
            leaves.append((e.name, e.value))
        elif isinstance(e, GroupEntry):
            leaves.append((e.name, {}))
        else:
            leaves.append((e.name, list(e.values)))
    with metering("load", progress) as meter, ThreadPoolExecutor(writer_threads()) as pool:
        meter.expect(sum(sizes))
        for future, size in zip([pool.submit(job) for job in jobs], sizes):
            future.result()  # the first damage found is raised
            meter.add(size, "read")
        meter.finish()
    return unflatten(leaves)
