"""Incremental checkpoints in a bucket: an object whose content is unchanged since a base
checkpoint in the same bucket is copied there by the store (a server-side copy) instead of
uploaded again (``spec/FORMAT.md`` §17).

A bucket has no hard links. A server-side copy (S3 ``CopyObject``) is the nearest thing: one
request, no byte through the writer's link, and the new checkpoint's prefix ``U/<save_id>/``
holds a whole object of its own, so the checkpoint stays complete and plain at its own prefix
(any zarr reader opens it; ``ckptfmt verify`` checks it as any other) and deleting the base, or
any step, breaks nothing: no object is shared between two checkpoints, unlike the linked files
of a directory. What is copied is decided by the manifests (``format.incremental``): the same
path, geometry, size, CRC32C and content hash. The commit object lists the copy with the
size and whole-object CRC32C the base's commit object gives it.

A copied object is not read by the writer: a bit flipped in the base's object since it was put
goes into the copy too, and every reader finds it there by the chunk CRC32Cs, as in the base.

The pieces: :func:`read_base` reads a base's commit object and manifest; :class:`CopyPlan` says
which objects to copy from where; :func:`copy_unchanged` copies one (None when the base's object
is gone or too big to copy: the caller uploads it); :class:`Tally` counts bytes copied and
uploaded, as a directory's incremental save counts bytes linked and written.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptfmt.errors import MissingFileError, NotACheckpointError, UsageError
from ckptfmt.manifest.codec import MANIFEST_NAME, parse_manifest
from ckptfmt.manifest.limits import MANIFEST_MAX_BYTES
from ckptfmt.manifest.model import Manifest
from ckptfmt.storage.objects.bucket import COPY_MAX, Bucket
from ckptfmt.storage.objects.commit import COMMIT_NAME, Commit, ObjectRef, read_commit
from ckptfmt.storage.pools import Pool

__all__ = [
    "COPIES_IN_FLIGHT",
    "CopyPlan",
    "Tally",
    "base_for",
    "copy_files",
    "copy_unchanged",
    "read_base",
]

COPIES_IN_FLIGHT = 16
"""Server-side copies one writer has in flight at once (each is one short request)."""


def read_base(base: Bucket) -> tuple[Commit, Manifest]:
    """The commit object and manifest of the checkpoint at ``base`` (``U``): two GETs. Raises
    :class:`NotACheckpointError` naming ``base`` when it has no commit object, or its manifest
    is missing, does not parse or is of another save."""
    commit = read_commit(base)
    if commit is None:
        raise NotACheckpointError(base.url, f"no {COMMIT_NAME}: not a committed checkpoint")
    where = base.child(commit.save_id)
    try:
        data = where.get(MANIFEST_NAME)
    except MissingFileError:
        raise NotACheckpointError(
            base.url, f"no {MANIFEST_NAME} at {where.key_url(MANIFEST_NAME)}"
        ) from None
    if len(data) > MANIFEST_MAX_BYTES:
        raise NotACheckpointError(base.url, f"{MANIFEST_NAME} is larger than the format allows")
    manifest = parse_manifest(data, where.key_url(MANIFEST_NAME))
    if manifest.save_id != commit.save_id:
        raise NotACheckpointError(
            base.url,
            f"its manifest is of save {manifest.save_id}, the commit names {commit.save_id}",
        )
    return commit, manifest


def base_for(
    dest: Bucket, base: str, storage_options: Mapping[str, Any] | None = None
) -> tuple[Bucket, Commit, Manifest]:
    """The base of an incremental save to ``dest`` (``U``): the checkpoint at the URL ``base``,
    its commit object and manifest (:func:`read_base`). It must be another checkpoint in the
    same bucket (a server-side copy does not cross buckets; an overwrite of the base itself
    would delete the objects it copies once it commits): else :class:`UsageError`. Read
    before anything is written, so a bad base fails the save at once."""
    where = Bucket.at(base, storage_options)
    if (where.scheme, where.bucket) != (dest.scheme, dest.bucket) or where.prefix == dest.prefix:
        raise UsageError(
            f"the base of an incremental save to {dest.url} must be another checkpoint in the "
            f"same bucket ({dest.scheme}://{dest.bucket}/...), not {where.url}: unchanged "
            "objects are copied inside the store"
        )
    commit, manifest = read_base(where)
    return where, commit, manifest


@dataclass(frozen=True)
class CopyPlan:
    """What to copy: ``source`` is the base's ``U/<save_id>/`` prefix, ``refs`` the base's
    objects (key relative to it, size, whole-object CRC32C) to copy to the same key of the new
    save."""

    source: Bucket
    refs: dict[str, ObjectRef]

    @classmethod
    def of(cls, base: Bucket, commit: Commit, same: set[str]) -> CopyPlan:
        """The plan for the files ``same`` (``format.incremental.unchanged_files``) of the base
        at ``base`` (``U``) whose commit ``commit`` lists them; objects above
        :data:`COPY_MAX` are left out (uploaded)."""
        refs = {o.key: o for o in commit.objects if o.key in same and o.size <= COPY_MAX}
        return cls(base.child(commit.save_id), refs)

    def to_json(self) -> dict[str, Any]:
        """For a vote: rank 0 plans, every rank copies its own files."""
        return {
            "prefix": self.source.prefix,
            "refs": [[o.key, o.size, o.crc32c] for o in sorted(self.refs.values())],
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any], bucket: Bucket) -> CopyPlan:
        """The plan of :meth:`to_json`, its source a prefix of ``bucket``'s bucket (on
        ``bucket``'s client: the copies are requests of the writer's own client)."""
        refs = {k: ObjectRef(k, int(n), int(c)) for k, n, c in doc["refs"]}
        return cls(bucket.relocated(str(doc["prefix"])), refs)


def copy_unchanged(target: Bucket, key: str, plan: CopyPlan | None) -> ObjectRef | None:
    """Copy ``key`` from the plan's base to ``key`` under ``target`` (the new ``U/<save_id>/``)
    when the plan lists it; its ref (the base's). None when the plan does not list it, or the
    base's object is gone (``ckptfmt gc`` or retention removed it meanwhile): the caller
    uploads it then."""
    ref = plan.refs.get(key) if plan is not None else None
    if ref is None or plan is None:
        return None
    try:
        target.copy_object(key, key, source=plan.source)
    except MissingFileError:
        return None
    return ref


def copy_files(
    target: Bucket, keys: list[str], plan: CopyPlan | None
) -> tuple[list[ObjectRef], list[str]]:
    """Copy each of ``keys`` the plan lists from its base to ``target`` (``U/<save_id>/``),
    :data:`COPIES_IN_FLIGHT` at once: the refs of those copied, and the keys left to upload
    (not in the plan, or the base's object gone)."""
    if plan is None or not keys:
        return [], list(keys)
    with Pool(max(1, min(COPIES_IN_FLIGHT, len(keys)))) as pool:
        done = list(pool.map(lambda k: copy_unchanged(target, k, plan), keys))
    copied = [r for r in done if r is not None]
    left = [k for k, r in zip(keys, done) if r is None]
    return copied, left


@dataclass
class Tally:
    """A writer's bytes copied in the store and uploaded (writer threads add at once)."""

    copied_bytes: int = 0
    copied_files: int = 0
    uploaded_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, size: int, copied: bool) -> None:
        with self._lock:
            if copied:
                self.copied_bytes += size
                self.copied_files += 1
            else:
                self.uploaded_bytes += size

    def report(self) -> dict[str, Any]:
        """The tallies under the names a directory's incremental write reports
        (``linked_bytes``: copied in the store; ``written_bytes``: uploaded)."""
        return {
            "linked_bytes": self.copied_bytes,
            "linked_files": self.copied_files,
            "written_bytes": self.uploaded_bytes,
            "unlinkable": 0,
        }
