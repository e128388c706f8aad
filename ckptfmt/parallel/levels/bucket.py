"""Level 3 on object storage: a manager's ``shared_dir="s3://bucket/run"``.

Steps live at ``<root>/step-<n>/``, each committed by its commit object, with the latest pointer
at the root (``spec/FORMAT.md``, "Checkpoints in object storage"). Level 1 stays node-local; a
flush (:func:`flush_to_bucket`) uploads each rank's committed level-1 files straight to the
bucket, in parallel on every rank, and rank 0 commits. A restore (``parallel.manager.restore``)
reads the pointer (one GET by rank 0), and LISTs the root only when the pointer is missing or its
step does not load; the chosen step is read through ranged GETs of the objects each rank needs
(:meth:`BucketLevel.open_step`), never downloaded whole.

Who calls what: :func:`flush_to_bucket` and :meth:`BucketLevel.open_step` are collective (every
rank of the communicator, once); everything else is rank 0's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from ckptfmt.container.reader import read_manifest_bytes
from ckptfmt.errors import (
    CkptError,
    LoadFailedError,
    NotACheckpointError,
    ObjectStoreSetupError,
    RankFailure,
    UsageError,
)
from ckptfmt.format.incremental import unchanged_files
from ckptfmt.manifest.model import Manifest
from ckptfmt.parallel.collective.boundary import Boundary
from ckptfmt.parallel.collective.bucket_upload import UPLOAD_THREADS, upload_phase
from ckptfmt.parallel.collective.publish import FaultHook
from ckptfmt.parallel.levels.layout import LEVELS_FILE, read_record
from ckptfmt.parallel.levels.shared import SharedLevel
from ckptfmt.storage.files import Files
from ckptfmt.storage.objects import Bucket, Retries
from ckptfmt.storage.objects.commit import (
    COMMIT_NAME,
    LATEST_NAME,
    SAVE_ID,
    Commit,
    Committed,
    delete_checkpoint,
    find_commit,
    list_steps,
    missing_objects,
    move_latest,
    newest_committed,
    read_commit,
    read_latest,
    step_bucket,
    step_names,
)
from ckptfmt.storage.objects.copies import CopyPlan, Tally, read_base
from ckptfmt.storage.objects.source import ObjectInside
from ckptfmt.storage.steps import STEP_NAME, parse_step, step_dir_name
from ckptfmt.storage.store.bucket import BucketStore
from ckptfmt.transport.comm import Comm

log = logging.getLogger("ckptfmt")

__all__ = ["UPLOAD_THREADS", "BucketLevel", "bucket_levels", "flush_to_bucket"]


# the start's check that the bucket answers: fails in seconds, not after the flush's retries
_PROBE = Retries(max_retries=2, retry_timeout=10.0, connect_timeout=3.0, timeout=10.0)


class BucketLevel(SharedLevel):
    """Level 3 at a bucket prefix (``Bucket``): every rank reaches the same objects, so one rank
    looks for all of them (:attr:`one_looks`)."""

    one_looks = True

    def __init__(self, root: Bucket, probe: Bucket | None = None) -> None:
        self.root = root
        self._probe = probe or root

    @classmethod
    def at(cls, url: str, storage_options: Mapping[str, Any] | None = None) -> BucketLevel:
        """The level at ``url``; makes no request."""
        root = Bucket.at(url, storage_options)
        probe = Bucket.at(url, storage_options, retries=_PROBE)
        return cls(root, probe)

    @property
    def where(self) -> str:
        return self.root.url

    def problems(self) -> list[dict[str, Any]]:
        """One LIST (with a delimiter, of the root) on a client that gives up in seconds: a
        bucket that does not exist, credentials refused or an endpoint out of reach is
        named at the start, on every rank (``agree_nodes``)."""
        try:
            self._probe.list_dirs("")
        except ObjectStoreSetupError as exc:  # names what to set already
            reason = str(exc).removeprefix(f"{exc.path}: ")
            return [{"path": self.root.url, "reason": reason, "err": None, "level": 3}]
        except CkptError as exc:
            status = getattr(exc, "status", None)
            why = "no such bucket" if status == 404 or isinstance(exc, FileNotFoundError) else ""
            reason = f"{why}: {exc}" if why else str(exc)
            return [{"path": self.root.url, "reason": reason, "err": None, "level": 3}]
        return []

    def record(self, local_dir: str | None, nodes: list[str]) -> None:
        """Rank 0 alone, after the start's check: a failure is logged, not raised (the
        other ranks have gone on; the record only serves ``ckptfmt list``)."""
        doc = {"local_dir": local_dir, "nodes": sorted(set(nodes))}
        try:
            self.root.put(LEVELS_FILE, json.dumps(doc, indent=1).encode())
        except CkptError as exc:
            log.warning("could not record the levels at %s: %s", self.root.url, exc)

    def committed(self) -> list[int]:
        """Every step under the root with a commit object, oldest first (a LIST and a HEAD per
        step: for ``steps()``, retention and the restore's fallback, never the hot path). A
        commit object that does not parse is listed all the same: the restore that tries it
        says why it is refused, retention removes it in its turn."""
        return [s for s in list_steps(self.root) if self.step(s).head(COMMIT_NAME) is not None]

    def whole(self, step: int) -> bool:
        """The step's commit object parses and every object it lists is there with its size
        (a GET, and a HEAD per object, 16 in flight)."""
        try:
            found = read_commit(self.step(step))
        except NotACheckpointError:  # a commit object that does not parse
            return False
        return found is not None and not missing_objects(self.step(step), found)

    def newest(self) -> list[int] | None:
        """The step the latest pointer names, when its commit object is there (one GET of
        the pointer, one HEAD of the commit); None when the pointer is missing or names a step that
        no longer commits (the caller then LISTs: :meth:`committed`)."""
        latest = read_latest(self.root)
        if latest is None:
            return None
        step, _save_id = latest
        if self.step(step).head(COMMIT_NAME) is None:
            return None
        return [step]

    def step(self, step: int) -> Bucket:
        return self.root.child(step_dir_name(step))

    def describe(self, location: Any) -> str:
        return location.url if isinstance(location, Bucket) else str(location)

    def flush(
        self,
        comm: Comm,
        manifest: Manifest,
        local_path: Path,
        *,
        fsync: bool,
        fault: FaultHook | None,
        seq: int | None,
        incremental: bool = False,
        report: dict[str, Any] | None = None,
        bases: Collection[str] | None = None,
    ) -> None:
        flush_to_bucket(
            comm,
            manifest,
            local_path,
            self.root,
            fault=fault,
            seq=seq,
            incremental=incremental,
            report=report,
            bases=bases,
        )

    def retain(self, keep: int, protect: set[int]) -> list[int]:
        if keep <= 0:
            return []
        removed = []
        for step in self.committed()[:-keep]:
            if step not in protect:
                self.remove(step)
                removed.append(step)
        return removed

    def remove(self, step: int) -> None:
        """The step's commit object first (never seen half-deleted), then everything under its
        prefix; a commit object that does not parse goes the same way."""
        where = self.step(step)
        try:
            delete_checkpoint(where, everything=True)
        except NotACheckpointError:
            where.delete([COMMIT_NAME])
            where.delete([k for k, _ in where.list()])

    def clear(self) -> list[str]:
        """The latest pointer first (no reader is sent to a step going away), then every
        step's commit object (each step vanishes whole), then the objects of its saves
        (``step-<n>/<save id>/...``, committed or left by a crashed flush), then the levels
        record. Every other key under the root, also under a ``step-<n>/`` prefix, is left,
        and returned."""
        commits, saves, left = [], [], []
        for key, _ in self.root.list():
            parts = key.split("/")
            if len(parts) > 1 and STEP_NAME.match(parts[0]):
                if len(parts) == 2 and parts[1] == COMMIT_NAME:
                    commits.append(key)
                    continue
                if len(parts) > 2 and SAVE_ID.match(parts[1]):
                    saves.append(key)
                    continue
            if key not in (LATEST_NAME, LEVELS_FILE):
                left.append(key)
        self.root.delete([LATEST_NAME])
        self.root.delete(commits)
        self.root.delete(saves)
        self.root.delete([LEVELS_FILE])
        return left

    def clean_leftovers(self) -> None:
        """Nothing to do on the restore's path: an uncommitted prefix is invisible, and
        removing it needs a LIST of the whole root (``ckptfmt gc``)."""

    def open_step(self, comm: Comm, location: Any, expect_step: int) -> tuple[Any, Files | None]:
        """Collective (a broadcast from rank 0): the URL of the step's checkpoint (its
        ``<save_id>/`` prefix) and a source reading its objects. Rank 0 reads the commit
        object; a step without one raises :class:`LoadFailedError` (damage) on every rank, so
        the restore tries the next older copy. A store that cannot be read raises it too, as
        a storage failure. That every object the commit lists is there with its size is
        checked by the load, beside its reads (``ObjectInside.presence_checks``): an object
        missing or of another size fails the load as damage, and the restore goes on to the
        next older copy all the same, without a HEAD pass before the first read."""
        verdict = _check_step(location) if comm.rank == 0 else {}
        verdict = comm.bcast_json(verdict)
        if "failure" in verdict:  # the store answered nothing usable: not damage
            raise LoadFailedError(
                {0: RankFailure.from_json(verdict["failure"])}, operation="load", step=expect_step
            )
        if "error" in verdict:
            raise LoadFailedError(
                {0: RankFailure("", verdict["error"], "load-open", kind="damage")},
                operation="load",
                step=expect_step,
            )
        found = Commit.from_bytes(verdict["commit"].encode(), location.key_url(COMMIT_NAME))
        return location.key_url(found.save_id), _object_source(location, found)


def _check_step(location: Bucket) -> dict[str, Any]:
    """Rank 0's look at a step before it is loaded: ``{"commit": <its bytes>}``, or ``{"error":
    why}`` (no commit object, or one that does not parse: damage), or ``{"failure": ...}``
    (the store did not answer)."""
    try:
        found = read_commit(location)
        if found is None:
            return {"error": f"{location.url}: no commit object (never committed)"}
    except NotACheckpointError as exc:
        return {"error": str(exc)}
    except CkptError as exc:
        return {"failure": RankFailure.of(exc, "load-open").to_json()}
    return {"commit": found.to_bytes().decode()}


def _object_source(location: Bucket, found: Commit) -> Files:
    """What the collective load reads the committed step through."""
    return ObjectInside(location, found)


# --- the flush ----------------------------------------------------------------------------------


def flush_to_bucket(
    comm: Comm,
    manifest: Manifest,
    local_path: Path,
    root: Bucket,
    *,
    fault: FaultHook | None = None,
    seq: int | None = None,
    threads: int = UPLOAD_THREADS,
    incremental: bool = False,
    report: dict[str, Any] | None = None,
    bases: Collection[str] | None = None,
) -> Bucket:
    """Collective: upload a committed level-1 checkpoint to the bucket ``root`` as its step
    prefix, every rank the files it wrote (each verified, every CRC in it checked, before it
    is put: damage on level 1 is refused, not propagated) and its share of the metadata
    documents (each checked against the manifest), rank 0 the manifest, all of a rank's
    objects in one pool; then rank 0 writes the commit object, which lists every object with
    its size and CRC32C (create-only; over a commit of the step already there, in its place on
    its etag, so the step holds the old checkpoint, whole, until then), deletes the replaced
    save's objects and moves the latest pointer. One vote per phase (stage,
    upload, commit), as ``flush_collective``: any rank's failure raises
    :class:`SaveFailedError` on every rank, and without a commit object nothing of this flush
    is visible (the objects already put are left for ``ckptfmt gc``). A step already committed
    with this save's id (a retried flush) is not uploaded again. Returns the step's bucket
    prefix.

    ``incremental``: rank 0 takes the newest committed step under ``root`` as the base (the
    latest pointer, else a LIST; with ``bases``, only when it is one of those saves) and reads
    its commit object and manifest; a data file whose path, geometry, size, CRC32C and content
    hash the base records alike is copied from the base's object inside the store
    (``storage.objects.copies``) instead of read, verified and uploaded (the plan rides on the
    stage vote; each rank copies its own files). The step
    holds objects of its own: retention may delete the base, or any step, afterwards. A base
    that cannot be read makes a full flush (logged). ``report``: this rank's ``linked_bytes``
    (copied in the store), ``written_bytes`` (uploaded) and ``linked_files``."""
    hook = fault or (lambda _point: None)
    b = Boundary(comm, "flush", manifest.step, seq=seq)
    step = manifest.step or 0
    dest = root.child(step_dir_name(step))
    already = False
    there: Committed | None = None  # rank 0's: the step's commit object that this one replaces
    plan: dict[str, Any] | None = None  # rank 0's: what an incremental flush copies
    with b.guard("flush-stage"):
        if manifest.world_size != comm.size:  # every rank uploads what it wrote: the same ranks
            raise UsageError(f"cannot flush a save of {manifest.world_size} ranks with {comm.size}")
        if comm.rank == 0:
            already, there = _already_flushed(dest, manifest)
            if incremental and not already:
                found = _copy_plan(root, manifest, bases)
                plan = None if found is None else found.to_json()
    votes = b.vote("flush-stage", [already, plan])
    if votes[0][0]:
        with b.guard("flush-commit"):
            if comm.rank == 0:  # a pointer left behind by the flush that committed it
                move_latest(root, step, manifest.save_id)
        b.vote("flush-commit")
        return dest
    copies = None if votes[0][1] is None else CopyPlan.from_json(votes[0][1], root)
    tally = Tally()
    store = BucketStore(dest, writes_in_flight=threads)
    draft = (
        store.replacing(manifest.save_id, there) if comm.rank == 0 else store.join(manifest.save_id)
    )
    written = upload_phase(
        comm, b, "flush-upload", draft, manifest, local_path, threads, hook, copies, tally
    )
    if report is not None:
        report.update(tally.report())
    with b.guard("flush-commit"):
        if comm.rank == 0:
            hook("flush-committing")
            draft.stage_manifest(read_manifest_bytes(local_path), written, fsync=False)
            draft.discard(draft.publish())
            move_latest(root, step, manifest.save_id)
    b.vote("flush-commit")
    hook("flushed")
    return dest


def _copy_plan(
    root: Bucket, manifest: Manifest, bases: Collection[str] | None = None
) -> CopyPlan | None:
    """Rank 0, for an incremental flush: what to copy from the newest committed step under
    ``root`` (None when there is none, it is not one of the saves ``bases``, or it cannot be
    read: the flush uploads everything)."""
    try:
        newest = newest_committed(root, check=False)
        if newest is None or (bases is not None and newest[1].save_id not in bases):
            return None
        where = step_bucket(root, newest[0])
        commit, base = read_base(where)
    except CkptError as exc:
        log.warning("incremental flush to %s: no base to copy from (%s)", root.url, exc)
        return None
    return CopyPlan.of(where, commit, unchanged_files(manifest, base))


def _already_flushed(dest: Bucket, manifest: Manifest) -> tuple[bool, Committed | None]:
    """Rank 0: whether ``dest`` is committed with this very save, every object in place, and
    the commit object found there. A commit of another save (the step saved again after a
    restart), one whose objects are not all there, or one that does not parse is left in
    place: this flush's commit replaces it on its etag once every object is up
    (:func:`write_commit`), so the step holds the old checkpoint until then."""
    there = find_commit(dest)
    if there is None or there.commit is None:
        return False, there
    found = there.commit
    return found.save_id == manifest.save_id and not missing_objects(dest, found), there


def step_of(location: Bucket) -> int:
    """The step of a step prefix (``.../step-0000000100``)."""
    return parse_step(location.prefix.rsplit("/", 1)[-1])


def bucket_levels(
    url: str, storage_options: Mapping[str, Any] | None = None
) -> tuple[dict[int, str], dict[str, Any]]:
    """For ``ckptfmt list`` of a bucket root: the state of every step prefix under ``url``
    (flushed, damaged: objects missing or of another size, not committed; ``step-100``
    written by hand too, as for a directory: ``storage.steps.pick_steps``) and the recorded
    ``ckptfmt-levels.json`` (``{}`` when there is none). A LIST, then a GET and the HEADs of
    each committed step."""
    root = Bucket.at(url, storage_options)
    try:
        cfg = read_record(root.get(LEVELS_FILE), root.key_url(LEVELS_FILE))
    except FileNotFoundError:
        cfg = {}
    out: dict[int, str] = {}
    for step, name in step_names(root, loose=True):  # the names a directory's listing takes
        where = root.child(name)
        try:
            found = read_commit(where)
        except CkptError as exc:  # an unreadable commit object
            out[step] = f"damaged: {exc}"
            continue
        if found is None:
            out[step] = "not committed"
            continue
        bad = missing_objects(where, found)
        out[step] = (
            f"damaged: {len(bad)} object(s) missing or of another size ({', '.join(bad[:3])})"
            if bad
            else "flushed"
        )
    return out, cfg if isinstance(cfg, dict) else {}
