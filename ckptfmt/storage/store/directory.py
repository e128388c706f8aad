"""A checkpoint in a directory of a POSIX file system: the draft is the staging directory
``.<name>.tmp-<save_id>`` beside it, renamed into place by the commit (``storage.commit``)."""

from __future__ import annotations

import builtins
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ckptfmt.errors import NotACheckpointError
from ckptfmt.storage import commit
from ckptfmt.storage.files import Buffer, Inside, make_dirs, write_gather


class DirectoryStore:
    """The checkpoint at the directory ``path`` (made absolute: ranks compare it as their
    group key)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).absolute()

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
        return DirectoryDraft(self.path, save_id, commit.prepare(self.path, save_id, overwrite))

    def join(self, save_id: str) -> DirectoryDraft:
        return DirectoryDraft(self.path, save_id, commit.staging_dir(self.path, save_id))

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
        self, final: Path, save_id: str, staging: Path, made: set[Path] | None = None
    ) -> None:
        self.final, self.save_id, self.staging = final, save_id, staging
        self._made: set[Path] = made if made is not None else set()
        self._made.add(staging)
        self._lock = threading.Lock()

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
            make_dirs(parent)
            with self._lock:
                self._made.add(parent)
        return target

    def set(
        self, rel: str, pieces: Sequence[Buffer], *, fsync: bool = True, copy_to: Any = None
    ) -> int:
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
            os.link(source, self._target(rel), follow_symlinks=False)
        except OSError:
            return False
        return True

    def written(self) -> builtins.list[Any]:
        return []

    def stage_manifest(self, data: bytes, written: Sequence[Any] = (), fsync: bool = True) -> None:
        commit.stage_manifest(self.staging, data, fsync)

    def publish(self, hook: Any = None, fsync: bool = True) -> Path | None:
        return commit.publish(self.staging, self.final, self.save_id, fsync, hook)

    def unpublish(self, replaced: Any, fsync: bool = True) -> None:
        commit.unpublish(self.staging, self.final, replaced, fsync)

    def discard(self, replaced: Any) -> None:
        commit.discard(replaced)

    def abort(self) -> None:
        commit.abort(self.staging)


def draft_at(root: Path, made: set[Path] | None = None) -> DirectoryDraft:
    """A draft over a directory that already exists and is written directly (a rebuild's or a
    reshard's staging directory, which its caller commits itself). ``made``: the directories
    known to exist (shared by the caller's drafts, so each is made once)."""
    return DirectoryDraft(root, "", root, made)
