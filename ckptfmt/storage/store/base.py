"""The write side of storage: a :class:`Store` is where one checkpoint lives (a directory, a
bucket prefix, a dict in memory), and a :class:`Draft` is one checkpoint being written there,
invisible to readers until its store's commit makes it whole in one step.

The read side is ``storage.files.Files`` (:meth:`Store.files` opens the committed checkpoint
through it). Each store brings its own commit strategy (``spec/PROTOCOL.md`` §1 and §7):

* a directory: a staging directory beside the destination, renamed into place (an overwrite
  swapped in by ``renameat2(RENAME_EXCHANGE)``; ``storage.commit``);
* a bucket: objects under ``U/<save_id>/``, then the commit object, create-only or in place of
  the old one on its etag (``storage.objects.commit``);
* memory: the draft's dict swapped in under a lock (for tests).

The verbs (``spec``'s house style): a store ``prepare``s a draft (the committer, once per
checkpoint) or ``join``s one (every other writer of it); a draft ``set``s, ``get``s, ``list``s
and ``delete``s members, and ``sync``s those it set without an fsync; the committer then
``stage_manifest``s, ``publish``es, and either ``discard``s what the publish replaced or
``unpublish``es it (another group failed). ``abort`` removes a draft that will never be
committed.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ckptfmt.manifest.model import Manifest
from ckptfmt.storage.files import Buffer, Files

Hook = Callable[[str], None]
"""A test's crash point, called with the name of a step of the commit."""


@runtime_checkable
class Draft(Protocol):
    """One checkpoint being written into a :class:`Store`: nothing of it is visible to a reader
    until :meth:`publish`. Writers of one checkpoint each hold a draft of the same ``save_id``
    (the committer's from :meth:`Store.prepare`, the others' from :meth:`Store.join`); each
    member is written by exactly one of them. Thread-safe for :meth:`set` of distinct members."""

    save_id: str

    writes_in_flight: int
    """Members one writer should keep going at once: 0 to leave it to the caller's thread
    budget (a directory: the disk's queue is the node's, shared by its ranks), more for a bucket
    (each put waits a round trip)."""

    @property
    def where(self) -> str:
        """Where the draft is being written (a staging directory, a URL): for messages."""
        ...

    @property
    def path(self) -> Path | None:
        """The draft's local directory, for the writers that need a file system (the parity
        of a level-1 save, an incremental save's hard links); None where there is none."""
        ...

    def set(
        self, rel: str, pieces: Sequence[Buffer], *, fsync: bool = True, copy_to: Any = None
    ) -> int:
        """Create the member ``rel`` (it must not exist) holding the concatenation of
        ``pieces``, streamed (no copy of the whole where the store can avoid one); return its
        size. ``copy_to`` (a uint8 array as long as the member): also leave its bytes there."""
        ...

    def sync(self) -> None:
        """Make durable, many at once, the members this draft object wrote with ``set(...,
        fsync=False)`` since its last ``sync`` (a file system commits concurrent fsyncs together:
        one by one, each waits for its own). Their directories are made durable by
        :meth:`stage_manifest`. A store whose writes are durable when ``set`` returns (a bucket,
        memory) does nothing."""
        ...

    def get(self, rel: str) -> bytes:
        """The bytes of member ``rel`` written to this draft (FileNotFoundError when absent)."""
        ...

    def list(self) -> list[tuple[str, int]]:
        """``(rel, size)`` of the members written to this draft so far, sorted."""
        ...

    def delete(self, rels: Sequence[str]) -> None:
        """Remove members of this draft (an absent one is no error)."""
        ...

    def copy_from(self, source: Path, rel: str) -> bool:
        """Make member ``rel`` a copy of the committed file ``source`` without moving its bytes
        through this process (a hard link on a file system); False when this store cannot (the
        caller then writes it)."""
        ...

    def written(self) -> builtins.list[Any]:
        """What this writer put, as the committer needs it (JSON-able; gathered from every
        writer and handed to :meth:`stage_manifest`): a bucket's object refs; empty for a
        directory, whose rename needs no list."""
        ...

    # --- the committer's ----------------------------------------------------------------------

    def stage_manifest(self, data: bytes, written: Sequence[Any] = (), fsync: bool = True) -> None:
        """Write the manifest last and make the draft durable (with the members this draft
        object set without an fsync and did not :meth:`sync`); still invisible. ``written``:
        every writer's :meth:`written`."""
        ...

    def publish(self, hook: Hook | None = None, fsync: bool = True) -> Any:
        """Make the draft the checkpoint, in one step; an old one there stays whole until then.
        Returns what was replaced, for :meth:`discard` (or :meth:`unpublish`)."""
        ...

    def unpublish(self, replaced: Any, fsync: bool = True) -> None:
        """Undo :meth:`publish` (another group of the same save failed): the replaced
        checkpoint, if any, is back; this draft is gone."""
        ...

    def discard(self, replaced: Any) -> None:
        """Remove what :meth:`publish` replaced, once the commit stands everywhere."""
        ...

    def abort(self) -> None:
        """Remove this draft (a failed save); the store's checkpoint is untouched."""
        ...


@runtime_checkable
class Store(Protocol):
    """Where one checkpoint lives, for writing it (:meth:`prepare`, :meth:`join`), reading it
    (:meth:`files`) and removing it (:meth:`delete`)."""

    @property
    def where(self) -> str:
        """The checkpoint's path or URL, for messages."""
        ...

    @property
    def group(self) -> str:
        """A key equal for every writer that reaches the same store (the ranks of a collective
        save that share a draft and its committer)."""
        ...

    def is_committed(self) -> bool:
        """Whether a committed checkpoint is there."""
        ...

    def prepare(self, save_id: str, overwrite: bool) -> Draft:
        """The committer, once per checkpoint: check the destination (a checkpoint there is
        refused, :class:`DestinationExistsError`, unless ``overwrite``) and open the draft."""
        ...

    def join(self, save_id: str) -> Draft:
        """Every other writer of the checkpoint, after the committer prepared it: the same
        draft, without checking or creating anything."""
        ...

    def files(self) -> Files:
        """The committed checkpoint, for the readers."""
        ...

    def delete(self) -> None:
        """Remove the committed checkpoint as a whole (no reader sees half of it)."""
        ...


@runtime_checkable
class StoreBase(Protocol):
    """The base of an incremental save that lives in the save's own store, whose unchanged
    files the store copies into the draft itself (a bucket's server-side copy:
    ``bucket.BucketBase``; a directory's base is a plain path, its files hard-linked).
    Thread-safe."""

    @property
    def where(self) -> str:
        """The base's path or URL, for messages."""
        ...

    def manifest(self) -> Manifest:
        """The base's manifest, read once (:class:`NotACheckpointError` naming the base when
        it is not a committed checkpoint)."""
        ...

    def copy(self, draft: Draft, rel: str) -> bool:
        """Make member ``rel`` of ``draft`` a copy of the base's file at ``rel`` inside the
        store; False when it cannot (the caller writes the member)."""
        ...
