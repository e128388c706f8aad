"""The commit on an object store, which has no rename (``spec/FORMAT.md``, "Checkpoints in object
storage"; ``spec/PROTOCOL.md``, "The commit in object storage").

A checkpoint at ``U`` is every object under ``U/<save_id>/`` (a prefix never reused nor written
twice) plus the **commit object** ``U/ckptfmt-commit.json``, written last, which names the save
id and lists every object with its size and CRC32C. In order:

1. the committer looks at ``U`` (:func:`find_commit`): what is committed there and its etag; a
   checkpoint there is refused unless overwriting;
2. every writer uploads its own files under ``U/<save_id>/`` (:func:`upload_files`,
   :func:`put_bytes`), in parallel, and hands its :class:`ObjectRef` list to one committer;
3. the committer writes the commit object (:func:`write_commit`): create-only when ``U`` held
   no checkpoint (of two saves one wins), else in place of the commit object it found, on that
   one's etag (of two overwrites one wins). A refused or unanswered put is read back, since it
   may answer the retry of its own put. Until this put the old checkpoint is whole; from it on,
   the new one. Only then the replaced save's objects go (:func:`drop_replaced`);
4. a level-3 root's **latest pointer** ``R/ckptfmt-latest.json`` is moved forward
   (:func:`move_latest`) with a put conditional on the etag it read, so a stale writer leaves it.

A reader reads the commit object (:func:`read_commit`) and checks that every object it lists is
there with its size (:func:`missing_objects`, HEADs in parallel); otherwise it sees no checkpoint.
Finding the newest step reads the pointer and that step's commit; it LISTs only when the pointer
is missing or names a step that does not commit (:func:`newest_committed`).
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptfmt.checksum import crc32c
from ckptfmt.errors import (
    CkptError,
    DestinationExistsError,
    MissingFileError,
    NotACheckpointError,
    ObjectStoreError,
)
from ckptfmt.storage.objects.bucket import Bucket
from ckptfmt.storage.pools import Pool
from ckptfmt.storage.steps import pick_steps, step_dir_name

log = logging.getLogger("ckptfmt")

COMMIT_NAME = "ckptfmt-commit.json"
LATEST_NAME = "ckptfmt-latest.json"
COMMIT_FORMAT = "ckptfmt-commit"
COMMIT_VERSION = 1
COMMIT_ATTEMPTS = 4
"""Create-only puts of a commit object whose outcome stayed unknown, each followed by a read."""
LATEST_ATTEMPTS = 8
"""Conditional moves of the latest pointer tried before giving up (each 412 means another writer
moved it in between: it is read again)."""
FILES_IN_FLIGHT = 8
"""Files one writer uploads at once (each large one in up to 8 parts at once)."""
HEADS_IN_FLIGHT = 16
"""HEAD requests in flight when checking a commit's objects."""

SAVE_ID = re.compile(r"^[0-9a-f]{32}$")


def new_save_id() -> str:
    """A fresh save id: 32 lowercase hex digits, never reused."""
    return uuid.uuid4().hex


@dataclass(frozen=True, order=True)
class ObjectRef:
    """One object of a checkpoint: ``key`` relative to ``U/<save_id>/``, its ``size`` in bytes
    and the CRC32C of its whole content."""

    key: str
    size: int
    crc32c: int

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "size": self.size, "crc32c": self.crc32c}


@dataclass(frozen=True)
class Commit:
    """What the commit object says: the save id whose prefix holds the checkpoint, the step (None
    outside a manager) and every object, sorted by key."""

    save_id: str
    step: int | None
    objects: list[ObjectRef] = field(default_factory=list)

    def to_bytes(self) -> bytes:
        body = {
            "format": COMMIT_FORMAT,
            "version": COMMIT_VERSION,
            "save_id": self.save_id,
            "step": self.step,
            "objects": [o.to_json() for o in sorted(self.objects)],
        }
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Commit:
        """Parse and check a commit object read from ``where`` (its URL); a malformed one raises
        :class:`NotACheckpointError` naming it."""
        try:
            body = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise NotACheckpointError(where, f"the commit object is not JSON ({exc})") from None
        problem = _commit_problem(body)
        if problem:
            raise NotACheckpointError(where, f"invalid commit object: {problem}")
        objects = [ObjectRef(o["key"], o["size"], o["crc32c"]) for o in body["objects"]]
        return cls(body["save_id"], body["step"], objects)

    def sizes(self) -> dict[str, int]:
        return {o.key: o.size for o in self.objects}


def _commit_problem(body: Any) -> str | None:
    if not isinstance(body, dict):
        return "not a JSON object"
    if body.get("format") != COMMIT_FORMAT:
        return f"format is {body.get('format')!r}, not {COMMIT_FORMAT!r}"
    if body.get("version") != COMMIT_VERSION:
        return f"version {body.get('version')!r} is not supported (this reader knows 1)"
    if not isinstance(body.get("save_id"), str) or not SAVE_ID.match(body["save_id"]):
        return f"save_id {body.get('save_id')!r} is not 32 lowercase hex digits"
    step = body.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        return f"step {step!r} is not a non-negative integer or null"
    objects = body.get("objects")
    if not isinstance(objects, list):
        return "objects is not a list"
    keys: list[str] = []
    for i, o in enumerate(objects):
        if not isinstance(o, dict) or set(o) != {"key", "size", "crc32c"}:
            return f"objects[{i}] is not {{key, size, crc32c}}"
        key, size, crc = o["key"], o["size"], o["crc32c"]
        if not isinstance(key, str) or not _relative_key(key):
            return f"objects[{i}].key {key!r} is not a relative key"
        for name, value, top in (("size", size, 1 << 63), ("crc32c", crc, 1 << 32)):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < top:
                return f"objects[{i}].{name} {value!r} is out of range"
        keys.append(key)
    if keys != sorted(set(keys)):
        return "objects are not sorted by key, or a key repeats"
    return None


def _relative_key(key: str) -> bool:
    parts = key.split("/")
    return bool(key) and all(p not in ("", ".", "..") for p in parts)


# --- writing -------------------------------------------------------------------------------------


def upload_files(
    bucket: Bucket, save_id: str, files: Sequence[tuple[str, Path]]
) -> list[ObjectRef]:
    """Upload each ``(rel, path)`` to ``U/<save_id>/<rel>`` (``bucket`` is ``U``), up to
    :data:`FILES_IN_FLIGHT` files at once; return their refs, sorted by key. Each writer (rank)
    calls it for its own files; the CRC32C comes from the reads that feed the upload."""
    target = bucket.child(save_id)

    def one(item: tuple[str, Path]) -> ObjectRef:
        rel, path = item
        size = Path(path).stat().st_size
        return ObjectRef(rel, size, target.upload(rel, Path(path), size=size))

    if len(files) <= 1:
        return sorted(one(f) for f in files)
    with Pool(min(FILES_IN_FLIGHT, len(files))) as pool:
        return sorted(pool.map(one, files))


def put_bytes(bucket: Bucket, save_id: str, rel: str, data: bytes) -> ObjectRef:
    """Write ``data`` (metadata, a manifest) to ``U/<save_id>/<rel>`` in one PUT; its ref."""
    bucket.child(save_id).put(rel, data)
    return ObjectRef(rel, len(data), crc32c(data))


@dataclass(frozen=True)
class Committed:
    """The commit object found at ``U`` before a save, as an overwrite replaces it: ``commit``,
    what it says (None when it does not parse: its save is then left for ``ckptfmt gc``), and
    ``etag``, the store's tag of that very object (None when the store gives none)."""

    commit: Commit | None
    etag: str | None

    @property
    def who(self) -> str:
        return (
            f"save {self.commit.save_id}" if self.commit else "a commit object that does not parse"
        )


def find_commit(bucket: Bucket) -> Committed | None:
    """What is committed at ``U`` (``bucket``) and its etag, read once, for a save that may
    replace it (:func:`write_commit`); None when ``U`` holds no commit object. A commit object
    that does not parse is returned too (``commit`` None): it is there, and an overwrite
    replaces it."""
    try:
        data, etag = bucket.get_tagged(COMMIT_NAME)
    except MissingFileError:
        return None
    try:
        return Committed(Commit.from_bytes(data, bucket.key_url(COMMIT_NAME)), etag)
    except NotACheckpointError:
        return Committed(None, etag)


def refuse_existing(bucket: Bucket, there: Committed | None, overwrite: bool, how: str) -> None:
    """Raise :class:`DestinationExistsError` when ``U`` holds a commit object (``there``, from
    :func:`find_commit`) and the save does not overwrite; ``how``: how to ask for an
    overwrite, for the message."""
    if there is not None and not overwrite:
        raise DestinationExistsError(
            bucket.url, f"a checkpoint is committed there ({there.who}); {how} to replace it"
        )


def write_commit(bucket: Bucket, commit: Commit, replacing: Committed | None = None) -> None:
    """Write the commit object of ``U`` (``bucket``): the checkpoint appears, in one put.

    ``replacing`` None: create-only (``If-None-Match: *``), for a ``U`` that held no commit
    object when the save looked. ``replacing``, the commit object the save found there
    (:func:`find_commit`, an overwrite): a put conditional on its etag (``If-Match``), which
    replaces it in one step, so that ``U`` holds the old checkpoint, whole, until this put and
    the new one from it on; a store that gives no etag, or answers 501 to a conditional put,
    gets a plain put (the same single-step replacement, without the refusal of a concurrent
    writer's). Either way a refused put (412) is read back: this save id there means the commit
    is in (the 412 answered a retry of a put whose first answer was lost); another raises
    :class:`DestinationExistsError` naming the save that is there (another save committed or
    overwrote in between; nothing of this save is visible). A put whose outcome is unknown (no
    answer, or a 5xx: the library does not retry a conditional put once sent, since it may have
    acted) is also read back, and put again while the object it was to replace is still there
    unchanged, up to :data:`COMMIT_ATTEMPTS` times."""
    body = commit.to_bytes()
    for attempt in range(COMMIT_ATTEMPTS):
        try:
            _put_commit(bucket, body, replacing)
            return
        except DestinationExistsError:
            break
        except ObjectStoreError as exc:
            if exc.status == 412:
                break
            if (exc.status is not None and exc.status < 500) or attempt + 1 == COMMIT_ATTEMPTS:
                raise
            now = find_commit(bucket)
            unchanged = now is None if replacing is None else _same(now, replacing)
            if not unchanged:
                break
    there = find_commit(bucket)
    if there is not None and there.commit is not None and there.commit.save_id == commit.save_id:
        return
    if replacing is None:
        who = there.who if there is not None else "another save, since removed"
        reason = f"a checkpoint is already committed there ({who})"
    else:
        held = there.who if there is not None else "none: it was removed"
        reason = (
            f"the checkpoint there ({replacing.who}) changed while this save was writing "
            f"(now {held}); this save was not committed"
        )
    raise DestinationExistsError(bucket.key_url(COMMIT_NAME), reason)


def _put_commit(bucket: Bucket, body: bytes, replacing: Committed | None) -> None:
    if replacing is None:
        bucket.put(COMMIT_NAME, body, create_only=True)
        return
    if replacing.etag:
        try:
            bucket.put(COMMIT_NAME, body, if_match=replacing.etag)
            return
        except ObjectStoreError as exc:
            if exc.status != 501:  # 501: the store does not do conditional replaces
                raise
    bucket.put(COMMIT_NAME, body)


def _same(now: Committed | None, then: Committed) -> bool:
    """Whether the commit object read ``now`` is the one read ``then`` (by etag, or by what it
    says when the store gives no etag)."""
    if now is None:
        return False
    if now.etag and then.etag:
        return now.etag == then.etag
    return now.commit == then.commit


def drop_replaced(bucket: Bucket, replaced: Committed | None, commit: Commit) -> int:
    """After ``commit`` replaced ``replaced`` at ``U`` (:func:`write_commit`): delete the old
    save's objects, those its commit listed and whatever else is under its prefix (a crash
    beside them). Nothing when ``U`` held nothing, when the old commit did not parse (its save
    is unknown: ``ckptfmt gc`` finds it) or named this very save (a repeated commit of one
    save). Each save's objects live under its own prefix, so the new checkpoint shares none of
    them. Best effort: the checkpoint is committed whatever happens here; a delete that fails
    is logged and the objects are left for ``ckptfmt gc``. Returns how many were deleted."""
    old = replaced.commit if replaced is not None else None
    if old is None or old.save_id == commit.save_id:
        return 0
    target = bucket.child(old.save_id)
    listed = {o.key for o in old.objects}
    try:
        rest = {k for k, _ in target.list()} - listed
        keys = sorted(listed | rest)
        target.delete(keys)
    except (CkptError, OSError) as exc:
        log.warning(
            "the checkpoint at %s replaced save %s; its objects were not all deleted (%s): "
            "`ckptfmt gc %s` removes them",
            bucket.url,
            old.save_id,
            exc,
            bucket.url,
        )
        return 0
    return len(keys)


def read_commit(bucket: Bucket) -> Commit | None:
    """The commit object of ``U`` (``bucket``), None when there is none (no checkpoint)."""
    try:
        data = bucket.get(COMMIT_NAME)
    except MissingFileError:
        return None
    return Commit.from_bytes(data, bucket.key_url(COMMIT_NAME))


def object_problems(bucket: Bucket, commit: Commit) -> dict[str, str]:
    """What is wrong with the objects ``commit`` lists under ``U/<save_id>/``, by key
    (``"missing"``, ``"size 10, the commit says 12"``); empty when all are there. One HEAD per
    object, :data:`HEADS_IN_FLIGHT` at once; sizes only (contents are checked by the reads)."""
    target = bucket.child(commit.save_id)

    def one(ref: ObjectRef) -> tuple[str, str | None]:
        size = target.head(ref.key)
        if size is None:
            return ref.key, "missing"
        if size != ref.size:
            return ref.key, f"size {size}, the commit says {ref.size}"
        return ref.key, None

    if not commit.objects:
        return {}
    with Pool(min(HEADS_IN_FLIGHT, len(commit.objects))) as pool:
        found = list(pool.map(one, commit.objects))
    return {key: why for key, why in sorted(found) if why is not None}


def missing_objects(bucket: Bucket, commit: Commit) -> list[str]:
    """The keys (relative to ``U/<save_id>/``) of the objects ``commit`` lists that are absent
    or of another size, sorted; empty when the checkpoint is whole."""
    return list(object_problems(bucket, commit))


def delete_checkpoint(bucket: Bucket, *, everything: bool = False) -> str | None:
    """Remove the checkpoint at ``U`` (``bucket``): the commit object first (the checkpoint
    vanishes as a whole, never seen half-deleted), then the objects under its save id. With
    ``everything`` (retention of a step), every other object under ``U`` too (uncommitted
    saves); never with a save to ``U`` in flight. Returns the save id removed, None when ``U``
    held no commit object."""
    commit = read_commit(bucket)
    if commit is not None:
        bucket.delete([COMMIT_NAME])
        target = bucket.child(commit.save_id)
        listed = {o.key for o in commit.objects}
        rest = {k for k, _ in target.list()} - listed  # what a crash left beside them
        target.delete(sorted(listed | rest))
    if everything:
        bucket.delete([k for k, _ in bucket.list()])
    return None if commit is None else commit.save_id


# --- the latest pointer --------------------------------------------------------------------------


def _latest_bytes(step: int, save_id: str) -> bytes:
    return json.dumps({"step": step, "save_id": save_id}, separators=(",", ":")).encode()


def _parse_latest(data: bytes, where: str) -> tuple[int, str] | None:
    try:
        body = json.loads(data)
        step, save_id = body["step"], body["save_id"]
    except (ValueError, TypeError, KeyError):
        return None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return None
    if not isinstance(save_id, str) or not SAVE_ID.match(save_id):
        return None
    return step, save_id


def read_latest(root: Bucket) -> tuple[int, str] | None:
    """``(step, save_id)`` the latest pointer of level-3 root ``root`` names; None when there is
    no pointer or it is unreadable (the caller then LISTs the steps)."""
    try:
        data = root.get(LATEST_NAME)
    except MissingFileError:
        return None
    return _parse_latest(data, root.key_url(LATEST_NAME))


def move_latest(root: Bucket, step: int, save_id: str) -> bool:
    """Point the latest pointer of ``root`` at ``step`` (committed with ``save_id``), never
    backwards: a pointer already at a newer step is left (returns False), as is one at this very
    save. Created create-only when absent, else replaced on the etag just read; a 412 (another
    writer moved it in between) reads it again, :data:`LATEST_ATTEMPTS` times at most, as does a
    put whose outcome is unknown (no answer, 5xx: the library does not retry conditional puts)."""
    body = _latest_bytes(step, save_id)
    for _ in range(LATEST_ATTEMPTS):
        try:
            data, etag = root.get_tagged(LATEST_NAME)
        except MissingFileError:
            try:
                root.put(LATEST_NAME, body, create_only=True)
                return True
            except DestinationExistsError:
                continue  # another writer created it first: compare with theirs
        current = _parse_latest(data, root.key_url(LATEST_NAME))
        if current is not None and (current[0] > step or current == (step, save_id)):
            return False
        if not etag:
            raise ObjectStoreError(
                root.key_url(LATEST_NAME), "GET", None, "the store gave no etag to update on"
            )
        try:
            root.put(LATEST_NAME, body, if_match=etag)
            return True
        except ObjectStoreError as exc:
            # 412: moved in between; no answer or a 5xx: it may have acted. Read it again.
            if exc.status is not None and exc.status != 412 and exc.status < 500:
                raise
    raise ObjectStoreError(
        root.key_url(LATEST_NAME),
        "PUT",
        412,
        f"the pointer changed under each of {LATEST_ATTEMPTS} conditional writes",
    )


def list_steps(root: Bucket) -> list[int]:
    """The steps with a step prefix of the exact name (``step-0000000100``) under level-3 root
    ``root``, committed or not, oldest first: one LIST with delimiter (the fallback, never the
    hot path). A manager's view: the names it writes."""
    return [step for step, _ in step_names(root)]


def step_names(root: Bucket, *, loose: bool = False) -> list[tuple[int, str]]:
    """``(step, name)`` of the step prefixes under ``root``, oldest first, chosen by the rule
    of a directory's step names (``storage.steps.pick_steps``; ``loose``: ``step-100`` too, for
    a step no exact name holds): one LIST with delimiter."""
    return pick_steps(root.list_dirs(""), loose=loose)


def step_bucket(root: Bucket, step: int) -> Bucket:
    """The checkpoint prefix ``U`` of ``step`` under level-3 root ``root``."""
    return root.child(step_dir_name(step))


def committed_step(root: Bucket, step: int, *, check: bool = True) -> Commit | None:
    """The commit of ``step`` under ``root`` when it is a whole checkpoint (with ``check``, every
    object listed is there with its size), else None."""
    commit = read_commit(step_bucket(root, step))
    if commit is None or (check and missing_objects(step_bucket(root, step), commit)):
        return None
    return commit


def newest_committed(
    root: Bucket, *, check: bool = True, below: int | None = None
) -> tuple[int, Commit] | None:
    """The newest whole checkpoint under level-3 root ``root`` (older than ``below`` if given):
    the latest pointer and that step's commit (two GETs and the HEADs of ``check``); a LIST of
    the steps only when the pointer is missing, names a step that does not commit, or is not
    older than ``below``. In a job, one rank calls it and broadcasts the answer."""
    pointed = read_latest(root)
    if pointed is not None and (below is None or pointed[0] < below):
        commit = committed_step(root, pointed[0], check=check)
        if commit is not None:
            return pointed[0], commit
    for step in reversed(list_steps(root)):
        if below is not None and step >= below:
            continue
        commit = committed_step(root, step, check=check)
        if commit is not None:
            return step, commit
    return None
