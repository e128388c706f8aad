"""A checkpoint in a directory of a POSIX file system: the draft is the staging directory
``.<name>.tmp-<save_id>`` beside it, renamed into place by the commit (``storage.commit``).

With :class:`~ckptfmt.storage.slots.Slots` (a manager's level 1), the staging directory is a
recycled step directory when one is spare, and every writer overwrites the files it finds there
in place (``storage/slots.py``)."""

from __future__ import annotations

import builtins
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ckptfmt.errors import NotACheckpointError
from ckptfmt.manifest.codec import MANIFEST_NAME
from ckptfmt.manifest.model import Manifest
from ckptfmt.storage import commit
from ckptfmt.storage.files import Buffer, Inside, Stream, make_dirs, storage_full, write_gather
from ckptfmt.storage.pools import Pool
from ckptfmt.storage.slots import Slots, sweep

SYNCS_IN_FLIGHT = 16
"""fsyncs a draft issues at once (:meth:`DirectoryDraft.sync`, the tree at
:meth:`DirectoryDraft.stage_manifest`): a journaling file system commits concurrent fsyncs
together, where each of a series waits for a commit of its own (the 107 directories of a
staging tree on the development machine's ext4, under load: 0.42 s one by one, 0.06 s
sixteen at a time)."""


class DirectoryStore:
    """The checkpoint at the directory ``path`` (made absolute: ranks compare it as their
    group key). ``slots``: the spare step directories of its root, of which the committer
    takes one as its staging directory; every writer then writes in place (the same on every
    writer of a checkpoint)."""

    def __init__(self, path: str | os.PathLike[str], slots: Slots | None = None) -> None:
        self.path = Path(path).absolute()
        self.slots = slots

    def __repr__(self) -> str:
        return f"DirectoryStore({str(self.path)!r})"

    @property
    def where(self) -> str:
        return str(self.path)

    @property
    def group(self) -> str:
        return str(self.path)

    def is_committed(self) -> bool:
        return commit.is_committed(self.path)

    def prepare(self, save_id: str, overwrite: bool) -> DirectoryDraft:
        """Refuse a committed checkpoint (unless ``overwrite``) or a non-empty directory that is
        not one, undo an overwrite a crash cut, and make the staging directory."""
        taken: list[Path] = []
        slots = self.slots

        def take(staging: Path) -> bool:
            if slots is not None and slots.take(staging):
                taken.append(staging)
                return True
            return False

        staging = commit.prepare(self.path, save_id, overwrite, take)
        draft = DirectoryDraft(self.path, save_id, staging, in_place=slots is not None)
        draft.recycled = bool(taken)
        return draft

    def join(self, save_id: str) -> DirectoryDraft:
        staging = commit.staging_dir(self.path, save_id)
        return DirectoryDraft(self.path, save_id, staging, in_place=self.slots is not None)

    def files(self) -> Inside:
        if not self.is_committed():
            raise NotACheckpointError(self.where, "no committed checkpoint is there")
        return Inside(self.path)

    def delete(self) -> None:
        commit.remove(self.path)


class DirectoryDraft:
    """The staging directory of one save into a :class:`DirectoryStore` (or any directory
    written directly: :func:`draft_at`)."""

    writes_in_flight = 0

    def __init__(
        self,
        final: Path,
        save_id: str,
        staging: Path,
        made: set[Path] | None = None,
        in_place: bool = False,
    ) -> None:
        self.final, self.save_id, self.staging = final, save_id, staging
        self._made: set[Path] = made if made is not None else set()
        self._made.add(staging)
        self._lock = threading.Lock()
        self._unsynced: list[Path] = []  # set with fsync=False, for sync()
        self.in_place = in_place  # a file found in the staging directory is overwritten
        self.recycled = False  # the committer's: the staging directory is a recycled step's

    @property
    def where(self) -> str:
        return str(self.staging)

    @property
    def path(self) -> Path:
        return self.staging

    def local(self, rel: str) -> Path:
        """The path of member ``rel``, its directory made (for writers that need the file
        itself: a hard link, a parity file)."""
        return self._target(rel)

    def _target(self, rel: str) -> Path:
        target = self.staging / rel
        parent = target.parent
        if parent not in self._made:
            try:
                make_dirs(parent)
            except (FileExistsError, NotADirectoryError):
                if not self.in_place:
                    raise
                # a file of the recycled step where this step has a directory
                _clear_files_above(self.staging, rel)
                make_dirs(parent)
            with self._lock:
                self._made.add(parent)
        return target

    def set(
        self,
        rel: str,
        pieces: Sequence[Buffer] | Stream,
        *,
        fsync: bool = True,
        copy_to: Any = None,
    ) -> int:
        """As ``Draft.set``; ``pieces`` may also be a :class:`~ckptfmt.storage.files.Stream`
        (a shard file whose chunk CRCs are computed as it is written)."""
        target = self._target(rel)
        if self.in_place:
            size = write_gather(target, pieces, fsync, copy_to=copy_to, in_place=True)
        else:
            size = write_gather(target, pieces, fsync, copy_to=copy_to)
        if not fsync:
            with self._lock:
                self._unsynced.append(target)
        return size

    def sync(self) -> None:
        with self._lock:
            files, self._unsynced = self._unsynced, []
        if not in_memory(self.staging):
            fsync_all(files)

    def get(self, rel: str) -> bytes:
        return (self.staging / rel).read_bytes()

    def list(self) -> list[tuple[str, int]]:
        return sorted(
            (p.relative_to(self.staging).as_posix(), p.stat().st_size)
            for p in self.staging.rglob("*")
            if p.is_file()
        )

    def delete(self, rels: Sequence[str]) -> None:
        for rel in rels:
            (self.staging / rel).unlink(missing_ok=True)

    def copy_from(self, source: Path, rel: str) -> bool:
        try:
            target = self._target(rel)
            if self.in_place:  # a recycled step's file is no copy of ``source``
                target.unlink(missing_ok=True)
            os.link(source, target, follow_symlinks=False)
        except OSError:
            return False
        return True

    def written(self) -> builtins.list[Any]:
        return []

    def stage_manifest(self, data: bytes, written: Sequence[Any] = (), fsync: bool = True) -> None:
        """``storage.commit.stage_manifest``, with the manifest, the members this draft set
        without an fsync and not synced yet, and every directory of the tree fsynced together,
        :data:`SYNCS_IN_FLIGHT` at once, rather than one by one."""
        commit.stage_manifest(self.staging, data, fsync=False)
        if fsync and not in_memory(self.staging):
            with self._lock:
                files, self._unsynced = self._unsynced, []
            tree = [Path(d) for d, _, _ in os.walk(self.staging)]
            fsync_all([*files, self.staging / MANIFEST_NAME, *tree])

    def sweep(self, manifest: Manifest) -> int:
        """The committer of a draft made from a recycled step directory, once every writer is
        done and before :meth:`stage_manifest`: remove what the step of ``manifest`` does not
        hold (``slots.sweep``); how many files. Nothing for a fresh staging directory."""
        return sweep(self.staging, manifest) if self.recycled else 0

    def publish(self, hook: Any = None, fsync: bool = True) -> Path | None:
        return commit.publish(self.staging, self.final, self.save_id, fsync, hook)

    def unpublish(self, replaced: Any, fsync: bool = True) -> None:
        commit.unpublish(self.staging, self.final, replaced, fsync)

    def discard(self, replaced: Any) -> None:
        commit.discard(replaced)

    def abort(self) -> None:
        commit.abort(self.staging)


INLINE_FSYNC_S = 1e-4
"""An fsync that returns within this found nothing to wait for (tmpfs, or the data written
back already): :func:`fsync_all` goes on one by one in the caller's thread while they do."""


MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs"})
"""File systems whose fsync does nothing (their files live in memory only)."""

_IN_MEMORY: dict[int, bool] = {}  # by st_dev


def in_memory(path: Path) -> bool:
    """Whether the directory ``path`` is on a memory file system (tmpfs: ``/dev/shm``), where an
    fsync has nothing to do, so :meth:`DirectoryDraft.sync` and the tree's fsyncs are skipped
    (dispatching them costs a loaded machine more than the no-op itself). From
    ``/proc/mounts`` (the longest mount point above ``path``), once per device; False where
    that cannot be told (the fsyncs are done)."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return False
    known = _IN_MEMORY.get(dev)
    if known is None:
        known = _mount_type(os.path.realpath(path)) in MEMORY_FILE_SYSTEMS
        _IN_MEMORY[dev] = known
    return known


def _mount_type(real: str) -> str:
    best, kind = "", ""
    try:
        with open("/proc/mounts", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, fields[2]
    except OSError:
        return ""
    return kind


def fsync_all(paths: Sequence[Path]) -> None:
    """fsync the files and directories ``paths``: one by one in this thread while each returns at
    once (on tmpfs the pool's hand-offs would cost more than the fsyncs), the rest
    :data:`SYNCS_IN_FLIGHT` at once from the first that waits. A full file system (where fsync
    reports it) raised as :class:`StorageFullError`."""
    for i, path in enumerate(paths):
        start = time.perf_counter()
        _fsync(path)
        rest = paths[i + 1 :]
        if len(rest) > 1 and time.perf_counter() - start > INLINE_FSYNC_S:
            list(_fsync_pool().map(_fsync, rest))
            return


_POOL: tuple[int, Pool] | None = None
_POOL_LOCK = threading.Lock()


def _fsync_pool() -> Pool:
    """The process's fsync threads, started once (starting them for every save cost more than
    the fsyncs on tmpfs): remade in a child process after a fork, which has none of them. Its
    tasks are single fsyncs, so callers on any thread share it without waiting on each other."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            pool = Pool(SYNCS_IN_FLIGHT, thread_name_prefix="ckptfmt-fsync")
            _POOL = (os.getpid(), pool)
        return _POOL[1]


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        full = storage_full(exc, path)
        if full is None:
            raise
        raise full from None


def _clear_files_above(staging: Path, rel: str) -> None:
    """Remove the files (of a recycled step) standing where the directories of ``rel`` go."""
    at = staging
    for part in rel.split("/")[:-1]:
        at = at / part
        if at.is_symlink() or (at.exists() and not at.is_dir()):
            at.unlink(missing_ok=True)


def draft_at(root: Path, made: set[Path] | None = None) -> DirectoryDraft:
    """A draft over a directory that already exists and is written directly (a rebuild's or a
    reshard's staging directory, which its caller commits itself). ``made``: the directories
    known to exist (shared by the caller's drafts, so each is made once)."""
    return DirectoryDraft(root, "", root, made)
