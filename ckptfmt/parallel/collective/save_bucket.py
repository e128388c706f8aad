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

import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ckptfmt.container.metadata import ManifestMeta
from ckptfmt.container.reader import read_manifest_bytes
from ckptfmt.format.incremental import unchanged_files
from ckptfmt.format.options import WriteOptions
from ckptfmt.manifest.model import Manifest
from ckptfmt.parallel.collective.boundary import Boundary
from ckptfmt.parallel.collective.bucket_upload import upload_phase
from ckptfmt.parallel.collective.save import save_collective
from ckptfmt.storage.objects import Bucket
from ckptfmt.storage.objects.commit import Commit, Committed, find_commit, refuse_existing
from ckptfmt.storage.objects.copies import CopyPlan, base_for
from ckptfmt.storage.store.bucket import WRITES_IN_FLIGHT, BucketStore
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

    ``base``: the URL of a committed checkpoint in the same bucket to save incrementally
    against: rank 0 reads its commit object and manifest first (one that is not a committed
    checkpoint, or is elsewhere, fails the save there, before anything is written; one vote);
    every rank saves into a scratch directory of its own with content hashes; rank 0 plans
    which data files the base holds alike (``format.incremental.unchanged_files``) and
    broadcasts the plan; then every rank copies those of its files inside the store and puts
    the rest (``bucket_upload.upload_phase``, one vote), and rank 0 commits (one vote). This
    route still goes through a scratch directory: the plan needs the hashes of the files
    before they are put."""
    if base is not None:
        return _save_against(
            comm, state, url, step, node, write, meta, storage_options, threads, base
        )
    store = BucketStore(Bucket.at(url, storage_options), writes_in_flight=threads)
    manifest, _ = save_collective(
        comm,
        state,
        store,
        step=step,
        node=node,
        write=replace(write, fsync=False),  # a PUT that answered is durable
        meta=meta,
    )
    return manifest


def _save_against(
    comm: Comm,
    state: Mapping[str, Any],
    url: str,
    step: int | None,
    node: str,
    write: WriteOptions,
    meta: ManifestMeta,
    storage_options: Mapping[str, Any] | None,
    threads: int,
    base: str,
) -> Manifest:
    """Collective: :func:`save_to_bucket` incremental against ``base`` (its docstring says
    the order)."""
    b = Boundary(comm, "save", step)
    dest = Bucket.at(url, storage_options)
    there: Committed | None = None  # rank 0's: what an overwrite replaces
    found: tuple[Bucket, Commit, Manifest] | None = None  # rank 0's: the base
    with b.guard("save-target"):
        if comm.rank == 0:
            there = find_commit(dest)
            refuse_existing(dest, there, write.overwrite, "pass write=WriteOptions(overwrite=True)")
            found = base_for(dest, base, storage_options)
    b.vote("save-target")
    scratch = Path(tempfile.mkdtemp(prefix="ckptfmt-upload-"))
    try:
        local = scratch / "checkpoint"
        manifest, _ = save_collective(
            comm,
            state,
            local,
            step=step,
            node=node,
            group=f"scratch:{comm.rank}",  # every rank its own copy: its files, the documents
            write=replace(write, overwrite=False, fsync=False, content_hash=True),
            meta=meta,
        )
        plan = None
        if found is not None:  # rank 0
            where, commit, base_manifest = found
            plan = CopyPlan.of(where, commit, unchanged_files(manifest, base_manifest)).to_json()
        plan = comm.bcast_json(plan)
        copies = None if plan is None else CopyPlan.from_json(plan, dest)
        store = BucketStore(dest, writes_in_flight=threads)
        draft = (
            store.replacing(manifest.save_id, there)
            if comm.rank == 0
            else store.join(manifest.save_id)
        )
        written = upload_phase(
            comm, b, "save-upload", draft, manifest, local, threads, None, copies
        )
        with b.guard("save-commit"):
            if comm.rank == 0:
                draft.stage_manifest(read_manifest_bytes(local), written, fsync=False)
                draft.discard(draft.publish())
        b.vote("save-commit")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return manifest
