"""A collective save straight to a bucket (``s3://bucket/run/ckpt``): the ranks of a job write
one checkpoint at a URL without a manager's levels.

A bucket has no directory to stage in and no rename (FORMAT.md §16), so each rank writes its
part into a scratch directory of its own (under ``TMPDIR``: node-local) with the ordinary
collective save, then every rank uploads its files (``bucket_upload.upload_phase``) and rank 0
writes the commit object, create-only or in place of the old one on its etag: the checkpoint
appears whole or not at all, and one it replaces stays whole until then (PROTOCOL.md §7). The
scratch directories are removed before the call returns, whatever happened.

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
from ckptfmt.format.incremental import unchanged_files
from ckptfmt.format.options import WriteOptions
from ckptfmt.manifest.model import Manifest
from ckptfmt.parallel.collective.boundary import Boundary
from ckptfmt.parallel.collective.bucket_upload import UPLOAD_THREADS, upload_phase
from ckptfmt.parallel.collective.save import save_collective
from ckptfmt.storage.objects import Bucket
from ckptfmt.storage.objects.commit import (
    Commit,
    Committed,
    drop_replaced,
    find_commit,
    refuse_existing,
    write_commit,
)
from ckptfmt.storage.objects.copies import CopyPlan, base_for
from ckptfmt.transport.comm import Comm

__all__ = ["save_to_bucket"]


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

    In order, every rank: rank 0 reads ``U``'s commit object and its etag (a checkpoint there
    is refused unless ``write.overwrite``; one vote); every rank writes its part into its own
    scratch directory (``save_collective``, its votes; no fsync: the bucket makes it durable);
    every rank puts its data files, each verified, and its share of the ``zarr.json``
    documents, rank 0 the manifest (one vote); rank 0 writes the new commit object, create-only
    or, when overwriting, in place of the one it read, conditional on its etag (the old
    checkpoint is whole until this put), then deletes the replaced save's objects (one vote).
    Any rank's failure raises :class:`~ckptfmt.errors.SaveFailedError` on every rank, and
    nothing new is visible without the commit object (what was put is left for ``ckptfmt
    gc``); a checkpoint that changed at ``U`` during the save is not replaced (that failure
    names it). ``node``: this rank's node, recorded in the manifest.

    ``base``: the URL of a committed checkpoint in the same bucket to save incrementally
    against: rank 0 reads its commit object and manifest in the first phase (one that is not
    a committed checkpoint, or is elsewhere, fails the save there, before anything is
    written); every rank's scratch save records content hashes; after it, rank 0 plans which
    data files the base holds alike (``format.incremental.unchanged_files``) and broadcasts the
    plan (one broadcast), and each rank copies those of its files inside the store instead of
    uploading them (``storage.objects.copies``)."""
    b = Boundary(comm, "save", step)
    dest = Bucket.at(url, storage_options)
    there: Committed | None = None  # rank 0's: what an overwrite replaces
    found: tuple[Bucket, Commit, Manifest] | None = None  # rank 0's: the base
    with b.guard("save-target"):
        if comm.rank == 0:
            there = find_commit(dest)
            refuse_existing(dest, there, write.overwrite, "pass write=WriteOptions(overwrite=True)")
            if base is not None:
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
            write=replace(
                write,
                overwrite=False,
                fsync=False,
                content_hash=write.content_hash or base is not None,
            ),
            meta=meta,
        )
        copies = None
        if base is not None:
            plan = None
            if found is not None:  # rank 0
                where, commit, base_manifest = found
                same = unchanged_files(manifest, base_manifest)
                plan = CopyPlan.of(where, commit, same).to_json()
            plan = comm.bcast_json(plan)
            copies = None if plan is None else CopyPlan.from_json(plan, dest)
        objects = upload_phase(comm, b, "save-upload", dest, manifest, local, threads, None, copies)
        with b.guard("save-commit"):
            if comm.rank == 0:
                commit = Commit(manifest.save_id, manifest.step, objects)
                write_commit(dest, commit, there)
                drop_replaced(dest, there, commit)
        b.vote("save-commit")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return manifest
