"""Single-process save, load and open of a whole checkpoint (``ckptfmt.save`` /
``ckptfmt.load`` / ``ckptfmt.open``).

``save`` is the collective save of ``ckptfmt.parallel.collective.save`` run by one process, so one
code path writes every checkpoint; ``load`` reads every tensor whole, verifying every byte.
``load`` and ``open`` read one directory, or a level-1 checkpoint spread over node directories
(a ``{node}`` template or a mapping node -> directory) through ``maintenance.source``, which
rebuilds a lost node's part from the redundancy into scratch space, never into the source.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ckptfmt.container.reader import (
    Checkpoint,
    Where,
    check_allocation,
    check_documents,
    read_manifest,
    tensor_reads,
)
from ckptfmt.errors import (
    DamagedError,
    MissingFileError,
    NotACheckpointError,
    PerRankWarning,
    SizeMismatchError,
    UsageError,
)
from ckptfmt.format.options import WriteOptions
from ckptfmt.format.zarr_meta import document_paths
from ckptfmt.maintenance import objects as in_bucket
from ckptfmt.maintenance.nodes import NodeDirs
from ckptfmt.maintenance.source import Source, open_whole
from ckptfmt.manifest.codec import MANIFEST_NAME, parse_manifest
from ckptfmt.manifest.limits import MANIFEST_MAX_BYTES, display
from ckptfmt.manifest.model import (
    GroupEntry,
    Manifest,
    PerRankValueEntry,
    TensorEntry,
    ValueEntry,
)
from ckptfmt.parallel.collective.save import SaveFailedError, save_collective
from ckptfmt.plan.options import ReadOptions
from ckptfmt.plan.per_rank import resolve
from ckptfmt.storage.files import Files, Inside, write_error
from ckptfmt.storage.paths import check_destination
from ckptfmt.storage.progress import ProgressCallback, metering
from ckptfmt.storage.store import Store, incremental_base, parse_location
from ckptfmt.transport.comm import SingleComm
from ckptfmt.tree.state import Blob, Container, Objects, encode_objects, flatten, unflatten

__all__ = [
    "load",
    "load_own",
    "load_with_manifest",
    "open_checkpoint",
    "save",
    "writer_threads",
]
if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("ckptfmt supports little-endian hosts only")


def save(
    state: Mapping[str, Any],
    path: str | os.PathLike[str] | Store,
    *,
    step: int | None = None,
    write: WriteOptions | None = None,
    progress: ProgressCallback | None = None,
    objects: Objects = "refuse",
    storage_options: Mapping[str, Any] | None = None,
    base: str | os.PathLike[str] | None = None,
) -> Manifest:
    """Save ``state`` as a committed checkpoint directory at ``path``; return its manifest.

    ``state`` maps names to numpy arrays (any dtype of ``ckptfmt.dtypes``), JSON-able values,
    ``bytes``, ``None``, further mappings, and lists and tuples of any of these (they load back
    as the same types). ``objects``: any other object (a custom class, an
    ``argparse.Namespace``, a ``Path``) is refused (``"refuse"``:
    :class:`UnsupportedValueError` naming its key path) or stored as its pickle
    (``"pickle"``), which :func:`load` unpickles only with ``trust_pickle=True``.
    ``write``: how the files are written (:class:`~ckptfmt.WriteOptions`: chunk and shard
    sizes, fsync; default: the defaults with up to two writer threads); a
    committed checkpoint at ``path`` is replaced only with ``WriteOptions(overwrite=True)``, in
    one step: at every instant ``path`` names the old checkpoint or the new one, whole (on
    Linux the two directories are swapped by one ``renameat2(RENAME_EXCHANGE)``; elsewhere the
    old one is renamed aside first and put back by the next save or restore if a crash comes
    between the two renames: ``spec/PROTOCOL.md`` §1); a non-empty directory that is not a
    checkpoint is never written into. On any error nothing is left at ``path`` that was not
    there before. This is the collective save of
    ``ckptfmt.parallel`` run by a single process. ``progress``: called with
    :class:`~ckptfmt.Progress` events (the bytes of the data files written; the last once the
    checkpoint is committed), from this thread (``ckptfmt.storage.progress``).

    ``path`` may be an object-store URL (``s3://bucket/run/ckpt``; ``gs://``, ``az://``): each
    shard file is put under ``<url>/<save_id>/`` straight from the arrays' memory (no local
    copy; a file above 32 MiB in parts), then the commit object ``<url>/ckptfmt-commit.json``
    is written, create-only: nothing is visible before it (``spec/FORMAT.md``, "Checkpoints in
    object storage"). An overwrite writes it in place of the old one, conditional on its etag:
    the old checkpoint stays whole until that put, and its objects are deleted after it.
    ``storage_options``: settings of the store that override the ``AWS_*`` environment
    (``endpoint_url``, ``region``, ``aws_access_key_id``, ``allow_http``, ... as obstore and
    fsspec name them); for URLs only. ``path`` may also be a ``ckptfmt.storage.store.Store``
    (a ``MemoryStore``, a store of one's own): the checkpoint is written through it.

    ``base``: the directory of a committed checkpoint to save incrementally against: a data
    file whose content is the same as the base's file at the same path (by a content hash the
    base's manifest records, ``WriteOptions(content_hash=True)``, and the CRC32C, never the CRC
    alone) is hard-linked from the base instead of written (written after all where the file
    system refuses a link: another file system). The result is a complete checkpoint that
    any reader opens on its own; deleting the base later breaks nothing. The manifest records
    the content hashes, so the next save can be incremental against this one. A base without
    recorded hashes links nothing. The base's files are not read: one damaged since it was
    written is linked as it is (readers of the new checkpoint find it by its CRC32C, as in the
    base), so give a base known whole (``ckptfmt.verify`` it if in doubt). With a URL
    ``path``, ``base`` is the URL of a committed checkpoint in the same bucket: an unchanged
    file is copied from it inside the store (a server-side copy, no upload;
    ``storage.objects.copies``), and the checkpoint at ``path`` holds objects of its own:
    deleting the base breaks nothing there either.
    """
    where = parse_location(path, storage_options)
    if where.kind == "directory":
        check_destination(where.spec)
    store = where.store()
    against = None if base is None else incremental_base(store, base, storage_options)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise UsageError(f"step must be a non-negative int or None, got {step!r}")
    write = write if write is not None else WriteOptions(threads=writer_threads())
    if not isinstance(write, WriteOptions):
        raise UsageError(f"write must be a ckptfmt.WriteOptions, got {type(write).__name__}")
    state = encode_objects(state, objects)
    try:
        with metering("save", progress) as meter:
            manifest, _plan = save_collective(
                SingleComm(),
                state,
                store,
                step=step,
                node=socket.gethostname(),
                write=write,
                base=against,
            )
            meter.finish()
    except SaveFailedError as exc:  # one process: re-raise its own error, not the vote's
        if exc.cause is not None:
            _raise_full(exc.cause, state, Path(store.where))
            raise exc.cause from None
        raise
    except OSError as exc:
        _raise_full(exc, state, Path(store.where))
        raise
    return manifest


def _raise_full(exc: BaseException, state: Mapping[str, Any], path: Path) -> None:
    """A full file system (or quota) met anywhere in the save, as :class:`StorageFullError`
    naming the checkpoint's directory and the bytes the save needed at least (its tensors'
    bytes; the shard indexes and metadata come on top); a file over the size limit (``EFBIG``)
    as :class:`StorageError` naming it too (``storage.files.write_error``). The staging
    directory is gone by now (the save's vote removed it)."""
    if not isinstance(exc, OSError):
        return
    needed = sum(
        int(getattr(leaf, "nbytes", 0) or 0)
        for _, leaf in flatten(state)
        if isinstance(getattr(leaf, "nbytes", None), int)
    )
    failed = write_error(exc, path.absolute(), "single-process save", needed)
    if failed is not None:
        raise failed from None


def writer_threads() -> int:
    """Concurrent shard writers: two streams saturate tmpfs here; more only add contention."""
    return max(1, min(2, os.cpu_count() or 1))


def load(
    path: NodeDirs | Store,
    *,
    read: ReadOptions | None = None,
    max_bytes: int | None = None,
    progress: ProgressCallback | None = None,
    trust_pickle: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a whole checkpoint into memory as the nested structure that was saved, bit-exact
    (lists, tuples and ``bytes`` as the same types).

    ``path``: the checkpoint's directory; or a level-1 checkpoint spread over node-local
    directories, as a ``{node}`` template (``/local/{node}/ckpt/step-0000000100``) or a mapping
    node -> directory (as ``verify`` takes): each region is read from the directory of the node
    that wrote it, and a node's part that is lost or damaged is rebuilt from the redundancy into
    a temporary directory (``TMPDIR``), removed before this returns; the source directories are
    only read.

    Every byte read is checked against its CRC32C, and every ``zarr.json`` against the manifest;
    damage raises a :class:`DamagedError` that names the file and the tensors it affects.
    ``read``: :class:`~ckptfmt.ReadOptions`; one process reads every rank's part, so only its
    ``threads`` (concurrent readers) applies, and a per-rank value comes back as the list of
    every saved rank's. ``max_bytes``: the most the tensors may take in memory, checked against
    the manifest before anything is allocated (:class:`AllocationLimitError`); None: the
    machine's physical memory (or the address-space limit), 0: no limit. ``progress``: called
    with :class:`~ckptfmt.Progress` events (the bytes of the data files read and verified),
    from this thread (``ckptfmt.storage.progress``). ``trust_pickle``: unpickle the objects a
    save stored with ``objects="pickle"`` (unpickling runs code: only for a checkpoint from a
    source you trust); without it such an entry raises :class:`PickleRefusedError` naming it,
    and nothing is unpickled.

    ``path`` may be the URL of a checkpoint in a bucket (``s3://bucket/run/ckpt``): its commit
    object is read, then every object it lists (one GET of a shard object up to 64 MiB, ranged
    GETs of a larger one), each answer's stated size checked against the commit (one missing or
    of another size: :class:`NotACheckpointError` naming it) and every chunk's CRC32C checked
    (damage names the object's URL). ``storage_options`` as for
    :func:`save`.
    """
    return load_with_manifest(
        path,
        read=read,
        max_bytes=max_bytes,
        progress=progress,
        trust_pickle=trust_pickle,
        storage_options=storage_options,
    )[0]


def load_with_manifest(
    path: NodeDirs | Store,
    *,
    read: ReadOptions | None = None,
    max_bytes: int | None = None,
    progress: ProgressCallback | None = None,
    trust_pickle: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], Manifest]:
    """:func:`load`, and the manifest of what was loaded (for the adapters' in-place loads,
    which return it)."""
    leaves, manifest = _load(path, _read_options(read), max_bytes, progress, storage_options)
    return unflatten(leaves, pickled="load" if trust_pickle else "refuse"), manifest


def load_own(
    path: NodeDirs | Store,
    *,
    read: ReadOptions | None = None,
    progress: ProgressCallback | None = None,
    trust_pickle: bool = False,
) -> tuple[dict[str, Any], Manifest]:
    """:func:`load` by the one rank of a one-process job, and the manifest: what a collective
    load of one rank gives (``ckptfmt.parallel.load_collective``), from any ``path``
    :func:`load` takes. Per-rank entries follow ``read``'s ``rank_map`` and ``per_rank`` as
    there (this process takes the items of at most one saved rank; :class:`PerRankError`
    when the rules refuse), every tensor whole. The adapters' in-place loads of a ``{node}``
    template in one process go through it."""
    read = _read_options(read)
    leaves, manifest = _load(path, read, None, progress)
    per_rank = {
        display(e.name): e
        for e in manifest.entries
        if isinstance(e, PerRankValueEntry) or (isinstance(e, TensorEntry) and e.per_rank)
    }
    found = resolve(list(per_rank), manifest.world_size, 1, read.rank_map, read.per_rank)
    if found.warning:
        warnings.warn(found.warning, PerRankWarning, stacklevel=2)
    mine = found.sources[0]
    own: list[tuple[tuple[str, ...], Any]] = []
    for name, value in leaves:
        if display(name) not in per_rank:
            own.append((name, value))
        elif mine is not None:
            own.append((name, value[mine]))
    return unflatten(own, pickled="load" if trust_pickle else "refuse"), manifest


def _read_options(read: ReadOptions | None) -> ReadOptions:
    read = read if read is not None else ReadOptions(threads=writer_threads())
    if not isinstance(read, ReadOptions):
        raise UsageError(f"read must be a ckptfmt.ReadOptions, got {type(read).__name__}")
    return read


def _load(
    path: NodeDirs | Store,
    read: ReadOptions,
    max_bytes: int | None,
    progress: ProgressCallback | None,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[list[tuple[tuple[str, ...], Any]], Manifest]:
    """Every entry of the checkpoint at ``path`` (module docstring) and its manifest."""
    where = parse_location(path, storage_options)
    if where.kind == "url":
        manifest, objects = in_bucket.open_source(where.spec, storage_options)
        try:
            check_documents(objects, manifest)
            check_allocation(manifest.tensors(), max_bytes)
            leaves = _read_all(
                manifest, objects, max(read.threads, objects.reads_in_flight), progress
            )
            covered = {MANIFEST_NAME, *document_paths(manifest)}
            covered.update(f.path for _, f in manifest.files())
            for check in objects.presence_checks(covered, 0, 1):  # what the commit lists besides
                check()
            return leaves, manifest
        except (MissingFileError, SizeMismatchError) as exc:
            raise objects.not_whole(exc) from None
        except DamagedError as exc:
            raise in_bucket.at_key(exc, objects) from None
    if where.kind == "store":
        src, manifest = _store_files(where.spec)
        check_documents(src, manifest)
        check_allocation(manifest.tensors(), max_bytes)
        return _read_all(manifest, src, read.threads, progress), manifest
    if where.kind == "spread":
        with tempfile.TemporaryDirectory(prefix="ckptfmt-rebuild-") as scratch:
            source = open_whole(where.spec, Path(scratch))
            check_allocation(source.manifest.tensors(), max_bytes)
            try:
                source.check_documents()
                leaves = _read_all(source.manifest, source.inside, read.threads, progress)
            except DamagedError:  # a CRC failed on level 1: rebuild from parity, read again
                if not source.level1 or source.rebuilt_nodes:
                    raise
                source = source.with_rebuild(Path(scratch))
                if not source.rebuilt_nodes:
                    raise
                leaves = _read_all(source.manifest, source.inside, read.threads, progress)
            return leaves, source.manifest
    root = Path(where.spec)
    manifest = read_manifest(root)
    src = Inside(root)
    check_documents(src, manifest)
    check_allocation(manifest.tensors(), max_bytes)
    return _read_all(manifest, src, read.threads, progress), manifest


def _read_all(
    manifest: Manifest, src: Where, threads: int, progress: ProgressCallback | None
) -> list[tuple[tuple[str, ...], Any]]:
    """Every entry of ``manifest`` read from ``src``, as it was saved (a per-rank value as the
    list of every rank's), by name."""
    leaves: list[tuple[tuple[str, ...], Any]] = []
    jobs: list[Callable[[], None]] = []
    sizes: list[int] = []  # each job's stored bytes (progress)
    for e in manifest.entries:
        if isinstance(e, TensorEntry):
            out, tensor_jobs = tensor_reads(src, e, sizes)
            jobs += tensor_jobs
            leaves.append((e.name, Blob(out, e.encoding) if e.encoding else out))  # type: ignore[arg-type]
        elif isinstance(e, ValueEntry):
            leaves.append((e.name, e.value))
        elif isinstance(e, GroupEntry):
            leaves.append((e.name, Container(e.container) if e.container else {}))  # type: ignore[arg-type]
        else:
            leaves.append((e.name, list(e.values)))
    with metering("load", progress) as meter, ThreadPoolExecutor(threads) as pool:
        meter.expect(sum(sizes))
        for future, size in zip([pool.submit(job) for job in jobs], sizes):
            future.result()  # the first damage found is raised
            meter.add(size, "read")
        meter.finish()
    return leaves


def open_checkpoint(
    path: NodeDirs | Store, *, storage_options: Mapping[str, Any] | None = None
) -> Checkpoint:
    """Open a committed checkpoint read-only (``ckptfmt.open``); see :class:`Checkpoint`.

    ``path`` as for :func:`load`: one directory, or a level-1 checkpoint spread over node
    directories (a ``{node}`` template or a mapping node -> directory), its lost or damaged
    files (missing, of the wrong size, a damaged ``zarr.json``) rebuilt from the redundancy into
    a temporary directory that lives as long as the returned object; a chunk whose CRC fails
    when it is read raises :class:`DamagedError` (``load`` rebuilds then; ``ckptfmt rebuild``
    repairs the source).

    ``path`` may be the URL of a checkpoint in a bucket: the commit object and the manifest are
    read (and every listed object HEADed) now; indexing a tensor reads, with ranged GETs, the
    shard index and only the inner chunks the selection touches. ``storage_options`` as for
    :func:`save`."""
    where = parse_location(path, storage_options)
    if where.kind == "url":
        return in_bucket.open_url(where.spec, storage_options)
    if where.kind == "store":
        src, manifest = _store_files(where.spec)
        return Checkpoint(where.spec.where, manifest=manifest, src=src)
    if where.kind == "directory":
        return Checkpoint(where.spec)
    scratch = tempfile.TemporaryDirectory(prefix="ckptfmt-rebuild-")
    source = open_whole(where.spec, Path(scratch.name))
    if not source.rebuilt_nodes:
        scratch.cleanup()
    return Checkpoint(_shown(source), manifest=source.manifest, src=source.inside, keep=scratch)


def _store_files(store: Store) -> tuple[Files, Manifest]:
    """The read side of a store's committed checkpoint and its manifest, checked."""
    src = store.files()
    try:
        data = src.read(MANIFEST_NAME, MANIFEST_MAX_BYTES + 1)
    except FileNotFoundError:
        raise NotACheckpointError(store.where, f"no {MANIFEST_NAME}") from None
    return src, parse_manifest(data, f"{store.where}/{MANIFEST_NAME}")


def _shown(source: Source) -> str:
    """The path a spread checkpoint's view names: its template, or its first node directory."""
    if isinstance(source.spec, Mapping):
        return str(min(source.dirs.values()))
    return os.fspath(source.spec)
