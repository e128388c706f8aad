"""A collective save straight to a bucket (``s3://bucket/run/ckpt``): the ranks of a job write
one checkpoint at a URL without a manager's levels.

It is the collective save (``save.save_collective``) into a bucket store
(``storage.store.bucket``): every rank puts its own shard files under ``U/<save_id>/`` straight
from its arrays' memory (no scratch directory, nothing read back), rank 0 the ``zarr.json``
documents and the manifest; then rank 0 writes the commit object, create-only or in place of the
old one on its etag: the checkpoint appears whole or not at all, and one it replaces stays whole
until then (PROTOCOL.md §7).

Memory: each rank holds at most ``threads`` shard files at once beyond its state (a file up to
32 MiB joined for its PUT; a bigger one as up to 8 parts of 8 MiB or more): with the default
16 MiB shards and 8 in flight, about 8 x 16 MiB = 128 MiB per rank.

Who calls what: :func:`save_to_bucket` is collective (every rank of the communicator, once per
checkpoint).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ckptfmt.container.metadata import ManifestMeta
from ckptfmt.format.options import WriteOptions
from ckptfmt.manifest.model import Manifest
from ckptfmt.parallel.collective.save import save_collective
from ckptfmt.storage.objects import Bucket
from ckptfmt.storage.store.bucket import WRITES_IN_FLIGHT, BucketStore
from ckptfmt.storage.store.location import incremental_base
from ckptfmt.transport.comm import Comm

__all__ = ["save_to_bucket"]

UPLOAD_THREADS = WRITES_IN_FLIGHT


def save_to_bucket(
    comm: Comm,
    state: Mapping[str, Any],
    url: str,
    *,
    step: int | None,
    node: str,
    write: WriteOptions = WriteOptions(),
    meta: ManifestMeta = ManifestMeta(),
    storage_options: Mapping[str, Any] | None = None,
    threads: int = UPLOAD_THREADS,
    base: str | None = None,
) -> Manifest:
    """Collective: save ``state`` (each rank its own, as ``save_collective`` takes it) as one
    checkpoint at the URL ``url`` (``U``); return its manifest, the same on every rank.

    The phases of ``save_collective``, every rank in order: rank 0 reads ``U``'s commit object
    and its etag (a checkpoint there is refused unless ``write.overwrite``; the stage vote) and
    puts the ``zarr.json`` documents; every rank puts its shard files, ``threads`` at a time,
    each with the CRC32C of its bytes for the commit object (the write vote gathers them);
    rank 0 puts the manifest (a vote), writes the new commit object, create-only or, when
    overwriting, in place of the one it read, conditional on its etag (the old checkpoint is
    whole until this put), then deletes the replaced save's objects (the commit vote). Any
    rank's failure raises :class:`~ckptfmt.errors.SaveFailedError` on every rank, and nothing
    new is visible without the commit object (what was put is deleted, best effort, else left
    for ``ckptfmt gc``); a checkpoint that changed at ``U`` during the save is not replaced
    (that failure names it). ``node``: this rank's node, recorded in the manifest.

    ``base``: the URL of a committed checkpoint at another prefix of the same bucket to save
    incrementally against (another bucket, or ``U`` itself: :class:`UsageError` on every rank,
    nothing read). Every rank reads its commit object and manifest in the stage phase (one
    that is not a committed checkpoint fails the save there, before anything is put), hashes
    the content of each shard file it makes, and has the store copy the base's object
    (a server-side copy, no byte through the rank) where the base holds the same bytes at the
    same path, putting the rest as a full save does: the same phases and votes, no scratch
    directory, and the same memory bound."""
    store = BucketStore(Bucket.at(url, storage_options), writes_in_flight=threads)
    against = None if base is None else incremental_base(store, base, storage_options)
    manifest, _ = save_collective(
        comm,
        state,
        store,
        step=step,
        node=node,
        write=replace(write, fsync=False),  # a PUT that answered is durable
        meta=meta,
        base=against,
    )
    return manifest
