"""Where a user says a checkpoint is, parsed once where it is handed in (``ckptfmt.save``,
``load``, ``open``, the collective save, the CLI): a directory, a ``{node}`` template or a
mapping node -> directory (a level-1 checkpoint spread over node-local directories), a URL of a
bucket prefix, or a :class:`~ckptfmt.storage.store.Store` given as it is. The code past the
boundary takes the :class:`Location` (or its store) and asks no more whether a string is a URL.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ckptfmt.errors import UrlNotSupportedError, UsageError
from ckptfmt.storage.files import Files
from ckptfmt.storage.nodes import is_spread
from ckptfmt.storage.objects.bucket import Bucket
from ckptfmt.storage.objects.url import is_url
from ckptfmt.storage.paths import refuse_url
from ckptfmt.storage.store.base import Store
from ckptfmt.storage.store.bucket import BucketBase, BucketStore
from ckptfmt.storage.store.directory import DirectoryStore

Kind = Literal["directory", "spread", "url", "store"]


@dataclass(frozen=True)
class Location:
    """A parsed checkpoint location: its ``kind``, what the user gave (``spec``) and the
    store settings that came with it (``storage_options``, for a URL only)."""

    kind: Kind
    spec: Any
    storage_options: Mapping[str, Any] | None = None

    @property
    def is_bucket(self) -> bool:
        return self.kind == "url"

    def store(self) -> Store:
        """The store that writes (and reads) the checkpoint here. A spread level-1 checkpoint
        has one per node: :class:`UsageError` (its writers each take their node's directory)."""
        if self.kind == "store":
            return self.spec  # type: ignore[no-any-return]
        if self.kind == "directory":
            return DirectoryStore(self.spec)
        if self.kind == "url":
            return BucketStore(Bucket.at(self.spec, self.storage_options))
        raise UsageError(
            f"{self.spec!r} names a checkpoint spread over node directories: one store per node"
        )

    def on_disk(self) -> Location:
        """This location, where only a file system works (level 1, a rebuild of level-1
        copies, ``ckptfmt list`` of a directory): a directory, node directories, or a
        :class:`DirectoryStore`. A bucket's URL raises :class:`UrlNotSupportedError`, the error
        an unsupported URL (``http://``) raises when it is parsed; another store,
        :class:`UsageError`."""
        if self.kind == "url":
            scheme = str(self.spec).partition("://")[0].lower()
            raise UrlNotSupportedError(
                str(self.spec), scheme, "a directory on a file system is needed"
            )
        if self.kind == "store" and not isinstance(self.spec, DirectoryStore):
            raise UsageError(f"{self}: a directory on a file system is needed here, not a store")
        return self

    def directory(self) -> Path:
        """The one directory of a checkpoint on a file system (:meth:`on_disk`); a checkpoint
        spread over node directories raises :class:`UsageError` (each node's is one)."""
        self.on_disk()
        if self.kind == "store":
            return Path(self.spec.path)
        if self.kind == "spread":
            raise UsageError(
                f"{self} names a checkpoint spread over node directories: give one directory"
            )
        return Path(self.spec)

    def files(self) -> Files:
        """The read side of the committed checkpoint here (``storage.files.Files``), its
        store's (:meth:`Store.files`): the directory's files (:class:`Inside`), or the objects
        its commit lists in a bucket (the commit object read, every object HEADed). Nothing
        committed there: :class:`NotACheckpointError`; a spread checkpoint has one per node:
        :class:`UsageError`."""
        return self.store().files()

    @property
    def shown(self) -> Path | str:
        """Where the checkpoint is, for a reader's ``path`` and for messages: a bucket's URL as
        given (a ``Path`` would fold its ``//``), a store's ``where``, else a ``Path`` (a
        spread checkpoint's template; a mapping's text)."""
        if self.kind == "url":
            return str(self.spec)
        if self.kind == "store":
            return str(self.spec.where)
        return Path(str(self))

    def __str__(self) -> str:
        if self.kind == "store":
            return str(self.spec.where)
        return os.fspath(self.spec) if not isinstance(self.spec, Mapping) else str(self.spec)


LocationSpec = str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]] | Store | Location


def parse_location(
    spec: LocationSpec, storage_options: Mapping[str, Any] | None = None
) -> Location:
    """``spec`` as a :class:`Location`. A URL of a supported scheme (``s3://``, ``gs://``,
    ``az://``, ``memory://``) is a bucket prefix; another URL (``file://``, ``http://``)
    raises :class:`UrlNotSupportedError`; ``storage_options`` with anything but a URL raise
    :class:`UsageError` (they configure an object store). A :class:`Location` is returned as
    it is (a boundary that parsed it passes it on)."""
    if isinstance(spec, Location):
        if storage_options and storage_options != spec.storage_options:
            raise UsageError(f"{spec} was parsed with other storage_options")
        return spec
    if isinstance(spec, Store):
        found = Location("store", spec)
    elif isinstance(spec, str) and is_url(spec):
        if "\0" in spec:  # else the store's parse error, after a request was tried
            raise UsageError(f"{spec!r}: a URL cannot hold a NUL character")
        return Location("url", spec, storage_options)
    elif is_spread(spec):
        # a template of another scheme (http://h/{node}) or a node directory that is a URL
        # would name directories under ./http:/
        for each in spec.values() if isinstance(spec, Mapping) else (spec,):
            if not isinstance(each, str | os.PathLike):  # the state passed as the path, say
                raise UsageError(
                    "a checkpoint location that is a mapping maps nodes to directories; "
                    f"this one maps to {type(each).__name__} (a state passed where the location "
                    "goes?)"
                )
            refuse_url(each)
        found = Location("spread", spec)
    elif isinstance(spec, str | os.PathLike):
        refuse_url(spec)
        found = Location("directory", spec)
    else:
        raise UsageError(
            f"a checkpoint location is a path, a {{node}} template, a mapping node -> "
            f"directory, a URL or a Store, not {type(spec).__name__}"
        )
    if storage_options:
        raise UsageError(f"storage_options apply to object-store URLs, not to the path {found}")
    paths = found.spec.values() if isinstance(found.spec, Mapping) else (found.spec,)
    for each in paths:
        if isinstance(each, str | os.PathLike) and "\0" in os.fsdecode(each):
            # the OS refuses it with a bare ValueError deep in the save or load
            raise UsageError(f"{os.fsdecode(each)!r}: a path cannot hold a NUL character")
    return found


def incremental_base(
    store: Store,
    base: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
) -> Path | BucketBase:
    """``base`` as the base of an incremental save into ``store``, parsed once where the user
    hands it in; nothing is read yet. Into a directory: the base is a directory (its unchanged
    files hard-linked). Into a bucket: a committed checkpoint at another prefix of the same
    bucket, a URL (its unchanged objects copied by the store; ``storage_options`` as for the
    save). Anything else: :class:`UsageError`."""
    found = parse_location(base)
    if isinstance(store, BucketStore):
        if found.kind != "url":
            raise UsageError(
                f"the base of an incremental save to {store.where} is a checkpoint in the same "
                f"bucket (a URL), not the path {base!s}"
            )
        return store.base(BucketStore(Bucket.at(found.spec, storage_options)))
    if isinstance(store, DirectoryStore):
        if found.kind != "directory":
            raise UsageError(f"the base of an incremental save is a directory, not {base}")
        return Path(found.spec)
    raise UsageError(f"base applies to a save into a directory or a bucket, not to {store.where}")
