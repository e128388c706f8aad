"""Reading a committed checkpoint in a bucket: the read-side twin of ``storage.files.Inside``.

A checkpoint at ``U`` is read through its commit object (``U/ckptfmt-commit.json``): it names the
save id whose prefix ``U/<save_id>/`` holds every object, and each object's size. The readers of
``format`` and ``container`` take an :class:`ObjectInside` where they take a directory: a path
relative to the checkpoint's root is the key relative to ``U/<save_id>/``. Nothing is LISTed;
sizes come from the commit (no request); a read is a ranged GET of just the bytes asked for, so
indexing one tensor of ``ckptfmt.open`` fetches the shard index and the inner chunks it needs. A
reader that wants most of a shard object (a load, a restore) asks for it whole instead
(:meth:`ObjectHandle.prefetch`): one GET, index and chunks checked from the same buffer.

An object the commit does not list is absent to this reader, whatever the bucket holds.
"""

from __future__ import annotations

import functools
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import numpy as np

from ckptfmt.errors import (
    CkptError,
    DamagedError,
    MissingFileError,
    NotACheckpointError,
    SizeMismatchError,
)
from ckptfmt.storage.files import ClosedOnExit
from ckptfmt.storage.objects.bucket import Bucket
from ckptfmt.storage.objects.commit import (
    COMMIT_NAME,
    Commit,
    missing_objects,
    object_problems,
    read_commit,
    read_latest,
    step_bucket,
    step_names,
)
from ckptfmt.storage.steps import StepRef

READS_IN_FLIGHT = 8
"""Reads a reader of a bucket keeps going at once (``Files.reads_in_flight``): GETs of shard
objects by a load's threads, of ``zarr.json`` documents by their checks. Each waits a round
trip; 4, 8 and 16 measured alike for a 1 GiB restore by 2 ranks against a local server."""

READ_BATCH = 64 << 20
"""Bytes of consecutive chunks one GET asks for when a reader reads a whole shard object (a
request costs a round trip; 64 MiB holds a default 16 MiB shard whole)."""


class ObjectHandle(ClosedOnExit):
    """One object of a checkpoint, read with ranged GETs (a ``storage.files.ReadHandle``):
    :meth:`pread` is one GET of those bytes, :meth:`read_into` one GET filling the views; after
    :meth:`prefetch`, both are served from the object fetched whole. Holds no connection, so
    :meth:`close` has nothing to release but that buffer."""

    read_batch = READ_BATCH

    def __init__(self, bucket: Bucket, key: str, size: int, tensors: Sequence[str] = ()) -> None:
        self.bucket, self.key, self.size = bucket, key, size
        self.tensors = tuple(tensors)
        self._whole: memoryview | None = None

    def prefetch(self) -> None:
        """Fetch the object whole in one GET, kept as the library returned it (no copy): a
        reader that wants most of an object then pays one round trip, not one for the index
        and one per batch of chunks. An object of another size than listed raises
        :class:`SizeMismatchError`: the GET shows its size, which no HEAD then has to."""
        if self._whole is None:
            whole = self.bucket.get_view(self.key)
            self._check(len(whole))  # the GET's length is the object's
            self._whole = whole

    def pread(self, n: int, offset: int) -> bytes:
        n = max(0, min(n, self.size - offset))
        if self._whole is not None:
            return bytes(self._whole[offset : offset + n])
        data, size = self.bucket.get_range_sized(self.key, offset, n)
        self._check(size)
        return data

    def read_into(self, views: Sequence[memoryview], offset: int) -> None:
        want = sum(v.nbytes for v in views)
        if not want:
            return
        if self._whole is None:
            _, size = self.bucket.read_into(self.key, offset, views)
            self._check(size)
            return
        if offset + want > len(self._whole):
            raise EOFError
        src = np.frombuffer(self._whole, np.uint8, want, offset)
        pos = 0
        for view in views:  # numpy's copy lets the other readers' threads run meanwhile
            n = view.nbytes
            np.copyto(np.frombuffer(view, np.uint8), src[pos : pos + n])
            pos += n

    def _check(self, size: int) -> None:
        """Every answer states the object's size: another than listed is damage, whichever
        part was read (no HEAD needed to see an object cut short or grown)."""
        if size >= 0 and size != self.size:
            raise SizeMismatchError(self.key, self.size, size, self.tensors)

    def close(self) -> None:
        self._whole = None


class ObjectInside:
    """The files of the checkpoint committed at ``bucket`` (``U``) by ``commit``, for the
    readers (a ``storage.files.Files``). ``root`` is the URL of ``U/<save_id>``. ``checked``:
    every listed object was HEADed when the checkpoint was opened (:func:`open_committed`);
    without it, a collective load checks the objects it does not read beside its reads
    (:meth:`presence_checks`) and the ones it reads by reading them."""

    reads_in_flight = READS_IN_FLIGHT
    reads_parts = True

    def __init__(self, bucket: Bucket, commit: Commit, *, checked: bool = False) -> None:
        self.bucket = bucket
        self.commit = commit
        self.checked = checked
        self.objects = bucket.child(commit.save_id)
        self._sizes = commit.sizes()

    @property
    def root(self) -> str:
        return self.objects.url

    def key_url(self, rel: str) -> str:
        """The URL of the object ``rel`` (what messages name)."""
        return self.objects.key_url(rel)

    def at_key(self, exc: DamagedError) -> DamagedError:
        """``exc``, about an object named relative to the checkpoint, made to name the
        checkpoint (``root``, the URL its keys are under) as a directory's reader names its
        directory: ``s3://bucket/run/step-1/<save_id>: model/w/c/0: ...``; ``exc.location`` is
        the object's URL."""
        return exc.in_checkpoint(self.root)

    def not_whole(self, exc: MissingFileError | SizeMismatchError) -> NotACheckpointError:
        """What a reader of the whole checkpoint raises when a read finds a listed object
        missing or of another size: as :func:`open_committed`'s HEADs would have said."""
        if isinstance(exc, SizeMismatchError) and exc.actual != exc.expected:
            why = f"size {exc.actual}, the commit says {exc.expected}"
        elif isinstance(exc, SizeMismatchError):
            why = "of another size than the commit says"
        else:
            why = "missing"
        key = exc.location if exc.checkpoint or "://" in exc.path else self.key_url(exc.path)
        return NotACheckpointError(
            self.bucket.url, f"the commit lists objects that are not whole: {key} {why}"
        )

    def _listed(self, rel: str, tensors: Sequence[str] = ()) -> int:
        size = self._sizes.get(rel)
        if size is None:
            raise self.at_key(
                MissingFileError(rel, tensors, "missing: the commit object does not list it")
            )
        return size

    def read(self, rel: str, limit: int) -> bytes:
        """Up to ``limit`` bytes of ``rel`` (one GET); :class:`MissingFileError` (a
        FileNotFoundError) when the commit does not list it or the bucket lacks it,
        :class:`SizeMismatchError` when a read of it whole finds another size."""
        size = self._listed(rel)
        if size == 0:
            return self.objects.get(rel)[:limit]  # a GET all the same: is it there?
        # one byte more than listed, to see an object longer than its commit says
        data, actual = self.objects.get_range_sized(rel, 0, min(limit, size + 1))
        if actual != size:
            raise self.at_key(SizeMismatchError(rel, size, actual))
        return data

    def open_exact(self, rel: str, size: int, tensors: Sequence[str] = ()) -> ObjectHandle:
        """``rel``, which the commit must list with ``size`` bytes, for ranged reads (no request
        yet). An object shorter than listed shows as :class:`EOFError` on a read."""
        self.check_size(rel, size, tuple(tensors))
        return ObjectHandle(self.objects, rel, size, tensors)

    def check_size(self, rel: str, size: int, tensors: tuple[str, ...] = ()) -> None:
        """Raise a DamagedError unless the commit lists ``rel`` with ``size`` bytes (no request:
        opening the checkpoint checked the bucket against the commit)."""
        listed = self._listed(rel, tensors)
        if listed != size:
            raise self.at_key(SizeMismatchError(rel, size, listed, tensors))

    def presence_checks(
        self, read: AbstractSet[str], rank: int, ranks: int
    ) -> list[Callable[[], None]]:
        """One HEAD per object the commit lists and no rank's reads cover (``read``), this
        rank's share (every ``ranks``-th in key order, from ``rank``): each raises
        :class:`MissingFileError` or :class:`SizeMismatchError` naming the key's URL. The
        objects that are read need none: the answer to every GET, ranged or whole, states the
        object's size, which each read compares with the listed one. None when the open HEADed
        them all."""
        if self.checked:
            return []
        rest = sorted(k for k in self._sizes if k not in read)[rank::ranks]
        return [functools.partial(self._check_present, key) for key in rest]

    def _check_present(self, rel: str) -> None:
        size = self.objects.head(rel)
        listed = self._sizes[rel]
        if size is None:
            raise self.at_key(MissingFileError(rel, (), f"missing: listed in {COMMIT_NAME}"))
        if size != listed:
            raise self.at_key(SizeMismatchError(rel, listed, size))


def open_committed(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    check: bool = True,
    bucket: Bucket | None = None,
) -> ObjectInside:
    """The checkpoint committed at ``url`` (``U``): one GET of its commit object and, with
    ``check``, one HEAD per listed object (in parallel) to see that each is there with its size.
    Raises :class:`NotACheckpointError` naming the URL when there is no commit object, and
    naming the keys that are missing or of another size when it lists any."""
    bucket = bucket if bucket is not None else Bucket.at(url, storage_options)
    commit = read_commit(bucket)
    if commit is None:
        raise NotACheckpointError(
            bucket.url,
            f"no {COMMIT_NAME} (never committed, removed, or not a checkpoint)",
            steps_hint(bucket),
        )
    if check:
        problems = object_problems(bucket, commit)
        if problems:
            shown = "; ".join(
                f"{bucket.key_url(commit.save_id + '/' + k)} {why}"
                for k, why in sorted(problems.items())[:10]
            )
            more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
            raise NotACheckpointError(
                bucket.url, f"the commit lists objects that are not whole: {shown}{more}"
            )
    return ObjectInside(bucket, commit, checked=check)


_ANY_STEP = re.compile(r"^step-(\d+)$")


def steps_hint(bucket: Bucket) -> str:
    """For a URL with no commit object that is a level-3 root (its "directories" are step
    prefixes, ``step-00000100`` or ``step-100``): which steps it holds, the newest URL and
    ``ckptfmt list URL``, as a hint (one LIST); empty for anything else, or when the LIST
    fails (the error being told is the missing commit, not this)."""
    try:
        names = bucket.list_dirs("")
    except CkptError:
        return ""
    steps = sorted((int(m[1]), n) for n in names if (m := _ANY_STEP.match(n)))
    if not steps:
        return ""
    shown = ", ".join(n for _, n in steps[:8]) + (", ..." if len(steps) > 8 else "")
    return (
        f"it holds the checkpoints of {len(steps)} step(s) ({shown}): give one, such as the "
        f"newest, {bucket.key_url(steps[-1][1])}; `ckptfmt list {shlex.quote(bucket.url)}` "
        "lists them"
    )


def latest_url(root_url: str, storage_options: Mapping[str, Any] | None = None) -> StepRef | None:
    """``ckptfmt.latest`` of a root in a bucket (``s3://bucket/run``): the step the latest
    pointer names when it commits whole (a GET of the pointer, a GET of the commit, a HEAD per
    object); else, by one LIST of the step prefixes, the newest step that commits whole, its
    prefix named as a directory's step would be (``storage.steps.pick_steps``, loose:
    ``step-2`` written by hand counts, and ``step-0000000002`` beside it wins). A step whose
    commit object does not parse is skipped, as a directory whose manifest does not; a store
    that does not answer raises. None when there is none. The :class:`StepRef`'s path is the
    step's URL (a str)."""
    root = Bucket.at(root_url, storage_options)
    pointed = read_latest(root)
    if pointed is not None:
        where = step_bucket(root, pointed[0])
        if _whole(where):
            return StepRef(pointed[0], where.url)  # type: ignore[arg-type]
    for step, name in reversed(step_names(root, loose=True)):
        where = root.child(name)
        if _whole(where):
            return StepRef(step, where.url)  # type: ignore[arg-type]
    return None


def _whole(where: Bucket) -> bool:
    """Whether a checkpoint is committed whole at ``where`` (a GET, a HEAD per object); one
    whose commit object does not parse is not."""
    try:
        found = read_commit(where)
    except NotACheckpointError:
        return False
    return found is not None and not missing_objects(where, found)
