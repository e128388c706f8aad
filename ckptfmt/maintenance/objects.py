"""Checkpoints in a bucket for the entry points: ``ckptfmt.open``, ``load``, ``verify``,
and ``save`` given a URL (``s3://bucket/run/ckpt``), and the CLI.

Reading goes through :class:`~ckptfmt.storage.objects.source.ObjectInside`: the commit object
first (no commit object, or one whose objects are not all there with their sizes: no checkpoint),
then the manifest ``U/<save_id>/ckptfmt.json``, then ranged GETs of just what is read. A
one-process save writes the checkpoint into a local staging directory, then
:func:`publish` uploads its files under ``U/<save_id>/`` and writes the commit object last,
create-only (``spec/FORMAT.md``, "Checkpoints in object storage").
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ckptfmt.container.reader import Checkpoint
from ckptfmt.container.reader import read_manifest as read_local_manifest
from ckptfmt.errors import (
    CkptError,
    DamagedError,
    DestinationExistsError,
    NotACheckpointError,
)
from ckptfmt.format.incremental import unchanged_files
from ckptfmt.maintenance.checks import (
    Problem,
    VerifyReport,
    check_data,
    check_metadata,
    check_schema,
)
from ckptfmt.maintenance.verify_parity import NOT_PRESENT, summary
from ckptfmt.manifest.codec import MANIFEST_NAME, parse_manifest
from ckptfmt.manifest.limits import MANIFEST_MAX_BYTES
from ckptfmt.manifest.model import Manifest
from ckptfmt.redundancy.record import record_of
from ckptfmt.storage.objects.bucket import Bucket
from ckptfmt.storage.objects.commit import (
    COMMIT_NAME,
    Commit,
    Committed,
    drop_replaced,
    find_commit,
    object_problems,
    read_commit,
    refuse_existing,
    upload_files,
    write_commit,
)
from ckptfmt.storage.objects.copies import CopyPlan, Tally, copy_files
from ckptfmt.storage.objects.gc import GcResult
from ckptfmt.storage.objects.gc import gc as bucket_gc
from ckptfmt.storage.objects.source import ObjectInside, open_committed, steps_hint
from ckptfmt.storage.progress import current_meter

StorageOptions = Mapping[str, Any] | None


def read_manifest(src: ObjectInside) -> Manifest:
    """The manifest of the checkpoint in ``src``, checked (its seal, the format's rules) and
    of the save the commit names."""
    where = src.key_url(MANIFEST_NAME)
    try:
        data = src.read(MANIFEST_NAME, MANIFEST_MAX_BYTES + 1)
    except FileNotFoundError:
        raise NotACheckpointError(src.bucket.url, f"no {MANIFEST_NAME} at {where}") from None
    manifest = parse_manifest(data, where)
    if manifest.save_id != src.commit.save_id:
        raise NotACheckpointError(
            src.bucket.url,
            f"{where} is of save {manifest.save_id}, the commit names {src.commit.save_id}",
        )
    return manifest


def open_url(url: str, storage_options: StorageOptions = None) -> Checkpoint:
    """``ckptfmt.open`` of the checkpoint at ``url``: the commit and the manifest are read (and
    every listed object HEADed); a tensor's data only when it is indexed, by ranged GETs of the
    shard index and the inner chunks the selection touches."""
    src = open_committed(url, storage_options)
    return Checkpoint(src.root, manifest=read_manifest(src), src=src)


def open_source(url: str, storage_options: StorageOptions = None) -> tuple[Manifest, ObjectInside]:
    """The manifest and files of the checkpoint at ``url`` (``ckptfmt.load``'s reads): no HEAD
    pass, since a load that reads every object checks each by reading it; what it does not
    read, ``ObjectInside.presence_checks`` checks."""
    src = open_committed(url, storage_options, check=False)
    return read_manifest(src), src


def at_key(exc: DamagedError, src: ObjectInside) -> DamagedError:
    """``exc`` (about a path relative to the checkpoint) made to name the checkpoint's URL."""
    return src.at_key(exc)


# --- verify ------------------------------------------------------------------------------------


def verify_url(url: str, storage_options: StorageOptions = None) -> VerifyReport:
    """``ckptfmt.verify`` of the checkpoint at ``url``: every object the commit lists is there
    with its size, the manifest and every ``zarr.json`` check, every data object's chunks are
    read and their CRC32Cs checked (ranged GETs of a few MiB each). Problems name the keys,
    relative to the report's path ``U/<save_id>``. Raises :class:`NotACheckpointError` without
    a commit object or a readable manifest."""
    bucket = Bucket.at(url, storage_options)
    commit = read_commit(bucket)
    if commit is None:
        raise NotACheckpointError(bucket.url, f"no {COMMIT_NAME}", steps_hint(bucket))
    src = ObjectInside(bucket, commit)
    damaged = object_problems(bucket, commit)
    if MANIFEST_NAME in damaged:
        raise NotACheckpointError(
            bucket.url, f"{src.key_url(MANIFEST_NAME)} is {damaged[MANIFEST_NAME]}"
        )
    manifest = read_manifest(src)
    check_schema(src.read(MANIFEST_NAME, MANIFEST_MAX_BYTES + 1), src.root)
    report = VerifyReport(src.root, manifest)
    for key, why in damaged.items():
        kind = "missing" if why == "missing" else "size"
        report.problems.append(Problem(key, kind, f"{why} (listed in {COMMIT_NAME})"))
    sizes = {k: s for k, s in commit.sizes().items() if k not in damaged}
    present = _Present(src, sizes)
    problems, expected = check_metadata(present, manifest)
    report.problems += [p for p in problems if p.file not in damaged]
    current_meter().expect(sum(f.size for _, f in manifest.files()))
    before = len(report.problems)
    check_data(present, manifest, report, expected)
    report.problems[before:] = [p for p in report.problems[before:] if p.file not in damaged]
    for _, ref in manifest.files():
        if ref.path not in commit.sizes() and ref.path not in damaged:
            report.problems.append(
                Problem(ref.path, "missing", f"the manifest lists it, {COMMIT_NAME} does not")
            )
    record = record_of(manifest)
    if record is not None:  # level-1 parity never goes to a bucket: a level-3 copy, by design
        report.redundancy = summary(record, NOT_PRESENT)
    report.unexpected_files = sorted(set(commit.sizes()) - expected)
    return report


class _Present(ObjectInside):
    """An :class:`ObjectInside` that knows which listed objects are absent or mis-sized (they
    are reported once, from the HEADs, not again by every read)."""

    def __init__(self, src: ObjectInside, sizes: dict[str, int]) -> None:
        super().__init__(src.bucket, src.commit)
        self._sizes = sizes


# --- save ----------------------------------------------------------------------------------------


def check_target(
    url: str, storage_options: StorageOptions, overwrite: bool
) -> tuple[Bucket, Committed | None]:
    """The bucket prefix a save to ``url`` writes and what is committed there now (the commit
    object an overwrite replaces, with its etag), refused before anything is staged when a
    checkpoint is committed there and ``overwrite`` is not given."""
    bucket = Bucket.at(url, storage_options)
    there = find_commit(bucket)
    refuse_existing(bucket, there, overwrite, "pass write=WriteOptions(overwrite=True)")
    return bucket, there


def copy_plan(manifest: Manifest, base: tuple[Bucket, Commit, Manifest] | None) -> CopyPlan | None:
    """What an incremental save of ``manifest`` copies from ``base``
    (``storage.objects.copies.base_for``):
    its files with the same content there (``format.incremental.unchanged_files``)."""
    if base is None:
        return None
    where, commit, base_manifest = base
    return CopyPlan.of(where, commit, unchanged_files(manifest, base_manifest))


def publish(
    bucket: Bucket,
    staged: Path,
    manifest: Manifest,
    *,
    replacing: Committed | None = None,
    copies: CopyPlan | None = None,
    tally: Tally | None = None,
) -> Commit:
    """Upload the checkpoint directory ``staged`` (every file, by its path relative to it) under
    ``U/<save_id>/`` (``bucket`` is ``U``; the save id is the manifest's), then commit it:
    create-only, or, when ``replacing`` (what :func:`check_target` found there), in place of
    that commit object on its etag; only then are the replaced save's objects deleted. Until
    the commit put the old checkpoint (if any) is whole and nothing new is visible; a failed
    upload deletes what it put (best effort: what a lost store keeps, no commit names, and
    ``ckptfmt gc`` removes). ``copies``: an incremental save's unchanged files, copied inside
    the store from its base instead of uploaded (``storage.objects.copies``); ``tally`` counts
    the bytes copied and uploaded."""
    files = sorted((p.relative_to(staged).as_posix(), p) for p in staged.rglob("*") if p.is_file())
    try:
        target = bucket.child(manifest.save_id)
        copied, left = copy_files(target, [rel for rel, _ in files], copies)
        rest = set(left)
        refs = upload_files(bucket, manifest.save_id, [f for f in files if f[0] in rest])
    except BaseException:
        _forget(bucket, manifest.save_id)
        raise
    if tally is not None:
        for ref in copied:
            tally.add(ref.size, True)
        for ref in refs:
            tally.add(ref.size, False)
    commit = Commit(manifest.save_id, manifest.step, sorted(copied + refs))
    write_commit(bucket, commit, replacing)
    drop_replaced(bucket, replacing, commit)
    return commit


def _forget(bucket: Bucket, save_id: str) -> None:
    """Best effort after a failed upload (never after the commit put, whose outcome may be
    unknown): delete what this save put under ``U/<save_id>/``; when the store is out of reach
    that fails too, and ``ckptfmt gc`` removes the prefix later."""
    target = bucket.child(save_id)
    with contextlib.suppress(CkptError, OSError):
        target.delete([k for k, _ in target.list("")])


def publish_dir(
    local: Path, url: str, storage_options: StorageOptions = None, *, overwrite: bool = False
) -> Commit:
    """Upload the committed checkpoint directory ``local`` to ``url`` and commit it there (what
    ``ckptfmt import`` to a URL does after importing into a local directory)."""
    bucket, there = check_target(url, storage_options, overwrite)
    return publish(bucket, local, read_local_manifest(local), replacing=there)


# --- plain files: a Hugging Face directory in a bucket --------------------------------------------

FILES_IN_FLIGHT = 8
"""Files uploaded or downloaded at once by :func:`upload_tree` and :func:`download_tree`."""


def upload_tree(
    local: Path,
    url: str,
    storage_options: StorageOptions = None,
    *,
    overwrite: bool = False,
    last: Sequence[str] = (),
) -> list[str]:
    """Upload every file under the directory ``local`` to ``url/<its relative path>`` (an
    export for other tools, which read plain keys: no commit object); the files named in
    ``last`` (an index that names the others) go after all the rest. Refused
    (:class:`DestinationExistsError`) when anything is under ``url`` already, unless
    ``overwrite``, which replaces the keys it writes. Returns the keys written."""
    bucket = Bucket.at(url, storage_options)
    there = bucket.list("")
    if there and not overwrite:
        raise DestinationExistsError(
            bucket.url, f"{len(there)} object(s) are there already (give overwrite to replace)"
        )
    files = sorted(
        (p.relative_to(local).as_posix(), p) for p in Path(local).rglob("*") if p.is_file()
    )
    first = [f for f in files if f[0] not in last]
    then = [f for f in files if f[0] in last]
    for batch in (first, then):
        if batch:
            with ThreadPoolExecutor(min(FILES_IN_FLIGHT, len(batch))) as pool:
                list(pool.map(lambda f: bucket.upload(f[0], f[1]), batch))
    return [rel for rel, _ in first + then]


def download_tree(url: str, local: Path, storage_options: StorageOptions = None) -> Path:
    """Download what is at ``url`` into ``local``: the object ``url`` itself as
    ``local/<its name>`` when it is one (a safetensors file), else every object under it (a
    directory) with its relative path. Returns the local file or directory. Raises
    :class:`NotACheckpointError` when nothing is there."""
    bucket = Bucket.at(url, storage_options)
    under = bucket.list("")
    local.mkdir(parents=True, exist_ok=True)
    if not under:
        name = bucket.prefix.rsplit("/", 1)[-1]
        parent = Bucket.at(url.rsplit("/", 1)[0], storage_options)
        if not name or parent.head(name) is None:
            raise NotACheckpointError(bucket.url, "no object and nothing under it")
        parent.download(name, local / name)
        return local / name
    target = local / (bucket.prefix.rsplit("/", 1)[-1] or "bucket")

    def one(item: tuple[str, int]) -> None:
        path = target / item[0]
        path.parent.mkdir(parents=True, exist_ok=True)
        bucket.download(item[0], path)

    with ThreadPoolExecutor(min(FILES_IN_FLIGHT, len(under))) as pool:
        list(pool.map(one, under))
    return target


def upload_file(
    local: Path, url: str, storage_options: StorageOptions = None, *, overwrite: bool = False
) -> None:
    """Upload the file ``local`` as the object ``url`` (a ``torch.save`` export); refused
    (:class:`DestinationExistsError`) when the object exists, unless ``overwrite``."""
    parent, _, name = url.rstrip("/").rpartition("/")
    bucket = Bucket.at(parent, storage_options)
    if not name or "://" not in parent:
        raise NotACheckpointError(url, "not the URL of an object (s3://bucket/key)")
    if not overwrite and bucket.head(name) is not None:
        raise DestinationExistsError(url, "an object is there already (give overwrite)")
    bucket.upload(name, local)


def gc(
    url: str,
    storage_options: StorageOptions = None,
    *,
    min_age: float = 0.0,
    multipart: bool = True,
) -> GcResult:
    """Remove, under the bucket prefix ``url`` (a checkpoint or a level-3 root), every save
    prefix ``U/<save_id>/`` no commit object names, and abort unfinished multipart uploads
    (``ckptfmt gc``; ``storage.objects.gc.gc``, which says what is kept and why)."""
    return bucket_gc(Bucket.at(url, storage_options), min_age=min_age, multipart=multipart)
