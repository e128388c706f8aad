"""A checkpoint at a bucket prefix ``U`` (``s3://bucket/run/ckpt``): the draft is the objects
under ``U/<save_id>/``, each writer putting its own straight from memory; the commit is the commit
object ``U/ckptfmt-commit.json``, create-only or in place of the old one on its etag
(``storage.objects.commit``, ``spec/PROTOCOL.md`` §7)."""

from __future__ import annotations

import builtins
import contextlib
import json
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ckptfmt.checksum import crc32c
from ckptfmt.errors import CkptError, UsageError
from ckptfmt.manifest.codec import MANIFEST_NAME
from ckptfmt.manifest.model import Manifest
from ckptfmt.storage.files import Buffer
from ckptfmt.storage.objects.bucket import MULTIPART_ABOVE, Bucket, part_size
from ckptfmt.storage.objects.commit import (
    COMMIT_NAME,
    Commit,
    Committed,
    ObjectRef,
    delete_checkpoint,
    drop_replaced,
    find_commit,
    read_commit,
    refuse_existing,
    write_commit,
)
from ckptfmt.storage.objects.copies import CopyPlan, copy_unchanged, read_base
from ckptfmt.storage.objects.source import ObjectInside, open_committed
from ckptfmt.storage.store.base import Draft

WRITES_IN_FLIGHT = 8
"""Members each writer puts at once (a big one's parts are in flight within its own upload
too): enough to fill a node's link to the store, few enough that what is held in memory stays
small (see :meth:`BucketDraft.set`)."""

SINGLE_PUT_MAX = 2 * MULTIPART_ABOVE
"""A member up to this size is joined into one buffer and put in one PUT (a default 16 MiB shard
is a little over 16 MiB with its index: in parts it would take five requests); a bigger one is
streamed in parts of ``part_size`` (at most ``UPLOAD_CONCURRENCY`` of them in memory at once)."""


class BucketStore:
    """The checkpoint at the prefix of ``bucket`` (``U``). ``writes_in_flight``: the members
    each writer puts at once."""

    def __init__(self, bucket: Bucket, writes_in_flight: int = WRITES_IN_FLIGHT) -> None:
        self.bucket = bucket
        self.writes_in_flight = writes_in_flight

    def __repr__(self) -> str:
        return f"BucketStore({self.bucket.url!r})"

    @property
    def where(self) -> str:
        return self.bucket.url

    @property
    def group(self) -> str:
        return self.bucket.url

    def is_committed(self) -> bool:
        return read_commit(self.bucket) is not None

    def prepare(self, save_id: str, overwrite: bool) -> BucketDraft:
        """Read what is committed at ``U`` and its etag (what an overwrite replaces, on that
        etag); a checkpoint there is refused unless ``overwrite``. Makes nothing: a prefix
        needs no creating."""
        there = find_commit(self.bucket)
        refuse_existing(self.bucket, there, overwrite, "pass write=WriteOptions(overwrite=True)")
        return BucketDraft(self.bucket, save_id, there, self.writes_in_flight)

    def join(self, save_id: str) -> BucketDraft:
        return BucketDraft(self.bucket, save_id, None, self.writes_in_flight)

    def replacing(self, save_id: str, there: Committed | None) -> BucketDraft:
        """The committer's draft when it read what is committed at ``U`` itself (``there``,
        from ``find_commit``; a flush, which replaces whatever it finds): its commit replaces
        that one on its etag. Makes no request."""
        return BucketDraft(self.bucket, save_id, there, self.writes_in_flight)

    def files(self) -> ObjectInside:
        return open_committed(self.bucket.url, bucket=self.bucket)

    def base(self, other: BucketStore) -> BucketBase:
        """``other`` as the base of an incremental save into this store (nothing read yet):
        another checkpoint in the same bucket, since a server-side copy does not cross buckets
        and an overwrite of the base itself would delete the objects it copies once it
        commits; else :class:`UsageError`."""
        here, there = self.bucket, other.bucket
        if (there.scheme, there.bucket) != (here.scheme, here.bucket) or (
            there.prefix == here.prefix
        ):
            raise UsageError(
                f"the base of an incremental save to {here.url} must be another checkpoint in "
                f"the same bucket ({here.scheme}://{here.bucket}/...), not {there.url}: "
                "unchanged objects are copied inside the store"
            )
        return BucketBase(there)

    def delete(self) -> None:
        delete_checkpoint(self.bucket)


class BucketBase:
    """The base of an incremental save into a :class:`BucketStore`: the committed checkpoint at
    ``bucket`` (another prefix of the same bucket, :meth:`BucketStore.base`). Its commit object
    and manifest are read once, by :meth:`manifest` (two GETs; each writer reads them itself);
    an unchanged file is then copied from its object by the store (:meth:`copy`), nothing
    through the writer. Thread-safe."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self._read: tuple[CopyPlan, Manifest] | None = None
        self._lock = threading.Lock()

    @property
    def where(self) -> str:
        return self.bucket.url

    def manifest(self) -> Manifest:
        """The base's manifest (read the first time: :class:`NotACheckpointError` naming the
        base when it is not a committed checkpoint)."""
        return self._base()[1]

    def copy(self, draft: Draft, rel: str) -> bool:
        """Make member ``rel`` of ``draft`` (a :class:`BucketDraft` of the same bucket) a copy
        of the base's object at ``rel``, inside the store. False when it cannot (another kind
        of draft, an object the commit does not list or above the copy limit, an object gone
        since): the caller puts the member then."""
        return isinstance(draft, BucketDraft) and draft.copy_in_store(rel, self._base()[0])

    def _base(self) -> tuple[CopyPlan, Manifest]:
        with self._lock:
            if self._read is None:
                commit, manifest = read_base(self.bucket)
                every = {o.key for o in commit.objects}
                self._read = CopyPlan.of(self.bucket, commit, every), manifest
            return self._read


class BucketDraft:
    """The objects of one save under ``U/<save_id>/``. ``there``: the commit object the
    committer found at ``U`` (what its commit replaces); None for the other writers.

    Memory: a member up to :data:`SINGLE_PUT_MAX` is held joined while its PUT is in flight
    (its size, once), a bigger one as at most ``UPLOAD_CONCURRENCY`` parts of ``part_size``
    (8 x 8 MiB up to 72 GiB); with ``writes_in_flight`` members at once, a writer holds at most
    ``writes_in_flight`` times that beyond the arrays it saves."""

    path = None

    def __init__(
        self,
        bucket: Bucket,
        save_id: str,
        there: Committed | None,
        writes_in_flight: int = WRITES_IN_FLIGHT,
    ) -> None:
        self.bucket, self.save_id, self.there = bucket, save_id, there
        self.writes_in_flight = writes_in_flight
        self.target = bucket.child(save_id)
        self.commit: Commit | None = None
        self._refs: dict[str, ObjectRef] = {}
        self._lock = threading.Lock()

    @property
    def where(self) -> str:
        return self.target.url

    def set(
        self, rel: str, pieces: Sequence[Buffer], *, fsync: bool = True, copy_to: Any = None
    ) -> int:
        """Put ``pieces`` at ``U/<save_id>/<rel>``: one PUT of them joined when small (one copy
        of the member in memory, for as long as the PUT takes), else a multipart upload of parts
        assembled from them one at a time. The CRC32C of the whole is computed from the bytes
        sent, for the commit object. ``fsync`` means nothing here: a PUT that answered is
        durable."""
        size = sum(len(p) for p in pieces)
        if copy_to is not None:  # the bytes wanted in memory anyway: put from there
            _gather(pieces, copy_to)
            pieces = [memoryview(copy_to)]
        if size <= SINGLE_PUT_MAX:
            blob = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            crc = crc32c(blob)
            self.target.put(rel, blob)
        else:
            parts = _Parts(pieces, part_size(size))
            self.target.upload_parts(rel, parts, size)
            if parts.nbytes != size:
                raise CkptError(f"internal: {rel}: {parts.nbytes} bytes sent of {size}")
            crc = parts.crc
        with self._lock:
            self._refs[rel] = ObjectRef(rel, size, crc)
        return size

    def sync(self) -> None:
        pass  # a PUT that answered is durable

    def get(self, rel: str) -> bytes:
        return self.target.get(rel)

    def list(self) -> list[tuple[str, int]]:
        return sorted(self.target.list())

    def delete(self, rels: Sequence[str]) -> None:
        self.target.delete(rels)
        with self._lock:
            for rel in rels:
                self._refs.pop(rel, None)

    def copy_from(self, source: Path, rel: str) -> bool:
        return False  # a local file: its bytes must travel; the caller writes it

    def copy_in_store(self, rel: str, plan: CopyPlan | None) -> bool:
        """Make member ``rel`` a copy, inside the store, of the same member of ``plan``'s base
        (an incremental write's unchanged file): no byte through this process. False when the
        plan does not list it or the base's object is gone: the caller puts it then."""
        ref = copy_unchanged(self.target, rel, plan)
        if ref is None:
            return False
        with self._lock:
            self._refs[rel] = ref
        return True

    def written(self) -> builtins.list[Any]:
        with self._lock:
            return [r.to_json() for r in self._refs.values()]

    def stage_manifest(self, data: bytes, written: Sequence[Any] = (), fsync: bool = True) -> None:
        """Put the manifest (unless this writer put these very bytes already, with its files:
        a flush), then hold the commit object that lists every writer's objects (``written``:
        each writer's :meth:`written`, this one's among them)."""
        put = self._refs.get(MANIFEST_NAME)
        if put is None or (put.size, put.crc32c) != (len(data), crc32c(data)):
            self.set(MANIFEST_NAME, [data])
        refs = dict(self._refs)
        for mine in written:
            for r in mine:
                refs.setdefault(r["key"], ObjectRef(**r))
        step = json.loads(data).get("step")
        self.commit = Commit(self.save_id, step, sorted(refs.values()))

    def publish(self, hook: Any = None, fsync: bool = True) -> Committed | None:
        """Write the commit object: the checkpoint appears, or replaces the one found at
        ``U`` on its etag, in one put (``storage.objects.commit.write_commit``)."""
        if self.commit is None:
            raise CkptError(f"internal: {self.where} published before its manifest was staged")
        write_commit(self.bucket, self.commit, self.there)
        return self.there

    def unpublish(self, replaced: Any, fsync: bool = True) -> None:
        """Put back the commit object this one replaced (on the etag of this one), or remove
        this one where it replaced none; then this save's objects go."""
        now = find_commit(self.bucket)
        ours = now is not None and now.commit is not None and now.commit.save_id == self.save_id
        if ours and isinstance(replaced, Committed) and replaced.commit is not None:
            write_commit(self.bucket, replaced.commit, now)
        elif ours:
            self.bucket.delete([COMMIT_NAME])
        self.abort()

    def discard(self, replaced: Any) -> None:
        if self.commit is not None and isinstance(replaced, Committed):
            drop_replaced(self.bucket, replaced, self.commit)

    def abort(self) -> None:
        """Best effort: delete what this save put under its prefix (every writer's: the
        committer aborts after the vote, once every writer is done); a store out of reach keeps
        them, for ``ckptfmt gc``."""
        with contextlib.suppress(CkptError, OSError):
            self.target.delete([k for k, _ in self.target.list("")])


class _Parts:
    """The parts of a multipart upload assembled from ``pieces``, ``size`` bytes each (the last
    shorter), with the CRC32C of what was handed out."""

    def __init__(self, pieces: Sequence[Buffer], size: int) -> None:
        self.pieces, self.size = pieces, size
        self.crc = 0
        self.nbytes = 0

    def __iter__(self) -> Iterator[bytes]:
        part = bytearray()
        for piece in self.pieces:
            view = memoryview(piece).cast("B")
            while view:
                take = min(self.size - len(part), len(view))
                part += view[:take]
                view = view[take:]
                if len(part) == self.size:
                    yield self._out(part)
                    part = bytearray()
        if part:
            yield self._out(part)

    def _out(self, part: bytearray) -> bytes:
        data = bytes(part)
        self.crc = crc32c(data, self.crc)
        self.nbytes += len(data)
        return data


def _gather(pieces: Sequence[Buffer], into: Any) -> None:
    at = 0
    for p in pieces:
        view = np.frombuffer(memoryview(p).cast("B"), dtype=np.uint8)
        into[at : at + view.size] = view
        at += view.size
