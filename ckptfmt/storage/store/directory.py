"""A checkpoint in a directory of a POSIX file system: the draft is the staging directory
``.<name>.tmp-<save_id>`` beside it, renamed into place by the commit (``storage.commit``).

With :class:`~ckptfmt.storage.slots.Slots` (a manager's level 1), the staging directory is a
recycled step directory when one is spare, and every writer overwrites the files it finds there
in place (``storage/slots.py``)."""

from __future__ import annotations

import builtins
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ckptfmt.errors import NotACheckpointError
from ckptfmt.manifest.model import Manifest
from ckptfmt.storage import commit
from ckptfmt.storage.files import Buffer, Inside, Stream, make_dirs, write_gather
from ckptfmt.storage.slots import Slots, sweep


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
        if self.in_place:
            return write_gather(self._target(rel), pieces, fsync, copy_to=copy_to, in_place=True)
        return write_gather(self._target(rel), pieces, fsync, copy_to=copy_to)

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
        commit.stage_manifest(self.staging, data, fsync)

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
