"""The metadata documents of one checkpoint directory: the zarr group and array documents of
the whole hierarchy (the same bytes in every node's copy, ``spec/FORMAT.md``) and the manifest's
``created`` and ``writer`` fields."""

from __future__ import annotations

import datetime as _dt
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptfmt.format.zarr_meta import array_doc_bytes, group_doc_bytes
from ckptfmt.manifest.model import GroupEntry, Manifest
from ckptfmt.storage.pools import Pool
from ckptfmt.storage.store.base import Draft
from ckptfmt.storage.store.directory import draft_at
from ckptfmt.version import __version__

__all__ = ["ManifestMeta", "utc_now", "write_metadata", "writer_info"]


@dataclass(frozen=True)
class ManifestMeta:
    """What a save records about itself besides the state (``spec/FORMAT.md``, "Manifest"): its
    id (None: rank 0 draws one), when (empty: now), which software wrote it (None: ckptfmt) and
    the levels document (None: none)."""

    save_id: str | None = None
    created: str = ""
    writer: dict[str, Any] | None = None
    levels: dict[str, Any] | None = None


def utc_now() -> str:
    """RFC 3339 UTC time to the second, as the manifest's ``created``."""
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def writer_info() -> dict[str, Any]:
    """The manifest's ``writer``: which software wrote the checkpoint."""
    return {"library": "ckptfmt", "version": __version__}


def write_metadata(
    root: Path | Draft, manifest: Manifest, fsync: bool, like: Path | None = None
) -> None:
    """The zarr group and array documents of the whole hierarchy, into ``root`` (a draft of a
    store, or a directory written directly). ``like`` (an incremental save's base): a document
    whose bytes the base holds at the same path already is copied from there by the store
    (``Draft.copy_from``: hard-linked in a directory) instead of written (no fsync of it: the
    base's is durable)."""
    draft = draft_at(root) if isinstance(root, Path) else root
    names = [e.name for e in manifest.entries]
    groups = {n[:k] for n in names for k in range(len(n))} | {()}  # the root group always
    groups |= {e.name for e in manifest.entries if isinstance(e, GroupEntry)}
    docs = [("/".join(g), group_doc_bytes()) for g in sorted(groups, key=len)]
    for t in manifest.tensors():
        geometry = (tuple(t.shape), tuple(t.shard_shape), tuple(t.chunk_shape))
        docs.append((t.path, array_doc_bytes(t.dtype, *geometry)))
    if draft.writes_in_flight <= 1 or len(docs) < 2:
        for node, doc in docs:
            _document(draft, node, doc, fsync, like)
        return
    # a bucket: each put waits a round trip, and a model has hundreds of documents
    with Pool(min(draft.writes_in_flight, len(docs))) as pool:
        list(pool.map(lambda nd: _document(draft, nd[0], nd[1], fsync, like), docs))


def _document(draft: Draft, node: str, data: bytes, fsync: bool, like: Path | None) -> None:
    """Write the ``zarr.json`` of ``node``, or copy the base's when it holds the same bytes."""
    rel = f"{node}/zarr.json" if node else "zarr.json"
    if like is not None:
        source = like / rel
        try:
            same = stat.S_ISREG(os.lstat(source).st_mode) and source.read_bytes() == data
            if same and draft.copy_from(source, rel):
                return
        except OSError:
            pass  # no such document: written
    draft.set(rel, [data], fsync=fsync)
