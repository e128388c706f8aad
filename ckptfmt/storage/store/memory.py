"""A checkpoint held in this process's memory: a dict of members, committed by swapping the
draft's dict in under a lock. For tests (a third store beside a directory and a bucket, which
the conformance suite runs like them) and for throw-away checkpoints; nothing survives the
process. Every writer of one checkpoint must be in this process (thread ranks)."""

from __future__ import annotations

import builtins
import threading
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import numpy as np

from ckptfmt.errors import (
    DestinationExistsError,
    MissingFileError,
    NotACheckpointError,
    SizeMismatchError,
)
from ckptfmt.manifest.codec import MANIFEST_NAME
from ckptfmt.storage.files import Buffer, ClosedOnExit

_Members = dict[str, bytes]


class MemoryStore:
    """One checkpoint's place in memory, named ``name`` in messages (``memory:<name>``)."""

    def __init__(self, name: str = "checkpoint") -> None:
        self.name = name
        self.committed: _Members | None = None
        self.save_id: str | None = None
        self._drafts: dict[str, _Members] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"MemoryStore({self.name!r})"

    @property
    def where(self) -> str:
        return f"memory:{self.name}"

    @property
    def group(self) -> str:
        return f"memory:{id(self)}"

    def is_committed(self) -> bool:
        return self.committed is not None

    def prepare(self, save_id: str, overwrite: bool) -> MemoryDraft:
        with self._lock:
            if self.committed is not None and not overwrite:
                raise DestinationExistsError(
                    self.where,
                    "a checkpoint is already there "
                    "(pass write=WriteOptions(overwrite=True) to replace it)",
                )
            self._drafts[save_id] = {}
        return MemoryDraft(self, save_id)

    def join(self, save_id: str) -> MemoryDraft:
        return MemoryDraft(self, save_id)

    def files(self) -> MemoryFiles:
        with self._lock:
            if self.committed is None:
                raise NotACheckpointError(self.where, "nothing is committed there")
            return MemoryFiles(self.where, self.committed)

    def delete(self) -> None:
        with self._lock:
            self.committed, self.save_id = None, None


class MemoryDraft:
    """The members of one save, in a dict of the store's; invisible until :meth:`publish`."""

    path = None
    writes_in_flight = 0

    def __init__(self, store: MemoryStore, save_id: str) -> None:
        self.store, self.save_id = store, save_id

    @property
    def where(self) -> str:
        return f"{self.store.where} (save {self.save_id})"

    def _members(self) -> _Members:
        members = self.store._drafts.get(self.save_id)
        if members is None:
            raise FileNotFoundError(f"{self.where}: no such draft (aborted, or never prepared)")
        return members

    def set(
        self, rel: str, pieces: Sequence[Buffer], *, fsync: bool = True, copy_to: Any = None
    ) -> int:
        data = b"".join(pieces)
        if copy_to is not None:
            copy_to[:] = np.frombuffer(data, np.uint8)
        with self.store._lock:
            members = self._members()
            if rel in members:
                raise FileExistsError(f"{self.where}: {rel} is written already")
            members[rel] = data
        return len(data)

    def sync(self) -> None:
        pass  # nothing outlives the process: nothing to make durable

    def get(self, rel: str) -> bytes:
        with self.store._lock:
            members = self._members()
            if rel not in members:
                raise FileNotFoundError(rel)
            return members[rel]

    def list(self) -> list[tuple[str, int]]:
        with self.store._lock:
            return sorted((k, len(v)) for k, v in self._members().items())

    def delete(self, rels: Sequence[str]) -> None:
        with self.store._lock:
            members = self._members()
            for rel in rels:
                members.pop(rel, None)

    def copy_from(self, source: Path, rel: str) -> bool:
        return False

    def written(self) -> builtins.list[Any]:
        return []

    def stage_manifest(self, data: bytes, written: Sequence[Any] = (), fsync: bool = True) -> None:
        self.set(MANIFEST_NAME, [data])

    def publish(self, hook: Any = None, fsync: bool = True) -> tuple[_Members | None, str | None]:
        store = self.store
        with store._lock:
            replaced = (store.committed, store.save_id)
            store.committed = store._drafts.pop(self.save_id)
            store.save_id = self.save_id
        return replaced

    def unpublish(self, replaced: Any, fsync: bool = True) -> None:
        store = self.store
        with store._lock:
            if store.save_id == self.save_id:
                store.committed, store.save_id = replaced

    def discard(self, replaced: Any) -> None:
        pass  # the replaced dict goes with its last reference

    def abort(self) -> None:
        with self.store._lock:
            self.store._drafts.pop(self.save_id, None)


class MemoryFiles:
    """The read side (``storage.files.Files``) of a committed :class:`MemoryStore`: a snapshot
    of its members, unchanged by later commits."""

    reads_in_flight = 1
    reads_parts = True  # as a bucket's objects are: the memory store stands in for one

    def __init__(self, root: str, members: _Members) -> None:
        self.root = root
        self._members = members

    def _exact(self, rel: str, size: int, tensors: Sequence[str]) -> bytes:
        data = self._members.get(rel)
        if data is None:
            raise MissingFileError(rel, tuple(tensors)).in_checkpoint(self.root)
        if len(data) != size:
            raise SizeMismatchError(rel, size, len(data), tuple(tensors)).in_checkpoint(self.root)
        return data

    def read(self, rel: str, limit: int) -> bytes:
        data = self._members.get(rel)
        if data is None:
            raise FileNotFoundError(rel)
        return data[:limit]

    def open_exact(self, rel: str, size: int, tensors: Sequence[str] = ()) -> MemoryHandle:
        return MemoryHandle(self._exact(rel, size, tensors))

    def check_size(self, rel: str, size: int, tensors: tuple[str, ...] = ()) -> None:
        self._exact(rel, size, tensors)

    def presence_checks(
        self, read: AbstractSet[str], rank: int, ranks: int
    ) -> list[Callable[[], None]]:
        return []


class MemoryHandle(ClosedOnExit):
    """One member read at offsets (a ``storage.files.ReadHandle``)."""

    read_batch = 0

    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)

    def pread(self, n: int, offset: int) -> bytes:
        return bytes(self.data[offset : offset + n])

    def read_into(self, views: Sequence[memoryview], offset: int) -> None:
        for v in views:
            dst = v if v.format == "B" and v.ndim == 1 else v.cast("B")
            n = len(dst)
            if offset + n > len(self.data):
                raise EOFError
            dst[:] = self.data[offset : offset + n]
            offset += n

    def prefetch(self) -> None:
        pass

    def close(self) -> None:
        pass
