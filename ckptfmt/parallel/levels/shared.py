"""Level 3 of a manager, whatever holds it: a shared directory or a bucket.

A manager's level 3 is one place every rank can reach. :class:`SharedLevel` names what the
manager does there: look whether it can be written (at the start), record where the levels are,
list the committed steps, flush a level-1 checkpoint into it (collective), apply retention,
delete a step, remove what crashed flushes left, and name the copy of one step that a restore
loads. :class:`DirLevel` is the shared directory (the code in ``parallel.levels.layout``);
``parallel.levels.bucket.BucketLevel`` is an object-store prefix; ``parallel.levels.pick``
chooses between them (``s3://bucket/run``), where
steps live as ``step-<n>/`` prefixes committed by a commit object (``spec/FORMAT.md``,
"Checkpoints in object storage").

Who calls what: the methods marked collective are called by every rank of the communicator they
are given; the others by one rank (rank 0) unless their docstring says otherwise.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from pathlib import Path
from typing import Any

from ckptfmt.manifest.model import Manifest
from ckptfmt.parallel.collective.publish import FaultHook
from ckptfmt.parallel.levels.clear import clear_root
from ckptfmt.parallel.levels.layout import Levels, flush_collective, retain
from ckptfmt.parallel.levels.room import make_room_here
from ckptfmt.storage import commit
from ckptfmt.storage.files import Files
from ckptfmt.storage.steps import list_step_dirs, parse_step, step_dir_name
from ckptfmt.transport.comm import Comm

__all__ = ["DirLevel", "SharedLevel"]


class SharedLevel(ABC):
    """Where a manager's level 3 is: a directory or a bucket prefix."""

    #: whether one rank looks for every rank (a bucket: each LIST and GET costs, and every rank
    #: sees the same; a shared directory: each rank looks at its own mount)
    one_looks: bool = False

    @property
    @abstractmethod
    def where(self) -> str:
        """The root, as messages name it (a path or a URL)."""

    @abstractmethod
    def problems(self) -> list[dict[str, Any]]:
        """What stands in the way of writing here, as the fields of a :class:`StorageError`
        each (``path``, ``reason``, ``err``, ``level``). Rank 0, once, at the manager's start."""

    @abstractmethod
    def record(self, local_dir: str | None, nodes: list[str]) -> None:
        """Write ``ckptfmt-levels.json`` (where level 1 is: ``local_dir``, and the ``nodes``)
        at the root, for ``ckptfmt list``. Rank 0, once per job start."""

    @abstractmethod
    def committed(self) -> list[int]:
        """The committed steps this rank sees here, oldest first."""

    @abstractmethod
    def step(self, step: int) -> Any:
        """Where ``step`` is (a directory, or the bucket of its prefix): what a restore
        candidate names and :meth:`describe` prints."""

    def __truediv__(self, name: str) -> Any:
        """The location of the step directory or prefix ``name`` (``"step-00000100"``), as
        :meth:`step` gives it: a level 3 is a restore order's root (``restore_order``)."""
        return self.step(parse_step(name))

    def whole(self, step: int) -> bool:
        """Whether the committed ``step`` is there whole, as a reader must see it before it
        offers the step: a directory's commit (its manifest, renamed in last) says so; a
        bucket's commit object lists objects that must each be there with their sizes."""
        return True

    def newest(self) -> list[int] | None:
        """The newest committed step alone when it can be found without listing the root
        (a bucket's latest pointer); None: list it (:meth:`committed`)."""
        return None

    def open_step(self, comm: Comm, location: Any, expect_step: int) -> tuple[Any, Files | None]:
        """What a restore's load of the step at ``location`` reads: the path or URL it names,
        and the source of its files (None: the directory ``location`` itself). Collective
        for a bucket (see ``BucketLevel.open_step``); local for a directory."""
        return location, None

    def describe(self, location: Any) -> str:
        """A step location of :meth:`step`, as messages name it."""
        return str(location)

    @abstractmethod
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
        """Collective: copy the committed level-1 checkpoint of ``manifest`` at ``local_path``
        here; raises :class:`SaveFailedError` on every rank if any rank failed.
        ``incremental``: against the newest committed step here (with ``bases``, the newest of
        those saves: the flush does not read what it links or copies, ``newest_base``), an
        unchanged data file is not written again (a directory links it, a bucket copies it
        inside the store); ``report`` then gets this rank's ``linked_bytes`` and
        ``written_bytes``."""

    @abstractmethod
    def retain(self, keep: int, protect: set[int]) -> list[int]:
        """Remove all but the newest ``keep`` committed steps (never one in ``protect``),
        each out of sight first; the steps removed."""

    def make_room(self, nbytes: int, protect: set[int]) -> list[int]:
        """Rank 0, after a flush failed because this level is full: remove the oldest steps
        so that ``nbytes`` fit, never the newest nor one in ``protect`` (``parallel.levels.room``);
        the steps removed. A level with no room to run out of (a bucket) removes none."""
        return []

    @abstractmethod
    def remove(self, step: int) -> None:
        """Remove ``step`` if it is committed here, out of sight first."""

    @abstractmethod
    def clean_leftovers(self) -> None:
        """Remove what crashed flushes left."""

    @abstractmethod
    def clear(self) -> list[str]:
        """Remove every step and record the manager wrote here, and nothing else
        (``levels.clear``); return what is left at the root."""


class DirLevel(SharedLevel):
    """Level 3 in a shared directory (every rank mounts it)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def where(self) -> str:
        return str(self.root)

    def problems(self) -> list[dict[str, Any]]:
        return Levels(None, self.root).problems("", shared=True)

    def record(self, local_dir: str | None, nodes: list[str]) -> None:
        Levels(local_dir, self.root).record(nodes)

    def committed(self) -> list[int]:
        return [s for s, p in list_step_dirs(self.root) if commit.is_committed(p)]

    def step(self, step: int) -> Path:
        return self.root / step_dir_name(step)

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
        flush_collective(
            comm,
            manifest,
            local_path,
            self.root,
            fsync=fsync,
            fault=fault,
            seq=seq,
            incremental=incremental,
            report=report,
            bases=bases,
        )

    def retain(self, keep: int, protect: set[int]) -> list[int]:
        return retain(self.root, keep, protect)

    def make_room(self, nbytes: int, protect: set[int]) -> list[int]:
        return make_room_here(self.root, nbytes, protect)

    def remove(self, step: int) -> None:
        path = self.step(step)
        if commit.is_committed(path):
            commit.remove(path)

    def clean_leftovers(self) -> None:
        commit.clean_leftovers(self.root)

    def clear(self) -> list[str]:
        return clear_root(self.root)
