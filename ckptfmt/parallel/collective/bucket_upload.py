"""The upload phase of a manager's flush to a bucket (``levels.bucket.flush_to_bucket``):
every rank sets its own part of one committed level-1 checkpoint it holds locally in the draft
of the step's store (a bucket store: objects under ``U/<save_id>/``, PROTOCOL.md §7, step 2),
then the ranks vote and rank 0 has every writer's record for the store's commit.

Who calls what: :func:`upload_phase` is collective (every rank of the communicator, once per
checkpoint, one vote of the caller's boundary); the rest is each rank's own.
"""

from __future__ import annotations

import functools
import mmap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptfmt.container.reader import geometry, read_doc, read_manifest_bytes
from ckptfmt.format.shard_read import decode_shard, read_file
from ckptfmt.format.zarr_meta import DocChecker
from ckptfmt.manifest.codec import MANIFEST_NAME
from ckptfmt.manifest.grid import shard_cell
from ckptfmt.manifest.limits import display
from ckptfmt.manifest.model import FileRef, Manifest, TensorEntry
from ckptfmt.parallel.collective.boundary import Boundary
from ckptfmt.parallel.collective.publish import FaultHook
from ckptfmt.storage.files import Inside, naming
from ckptfmt.storage.objects.copies import CopyPlan, Tally
from ckptfmt.storage.pools import Pool
from ckptfmt.storage.store.base import Draft
from ckptfmt.storage.store.bucket import SINGLE_PUT_MAX, BucketDraft
from ckptfmt.transport.comm import Comm

__all__ = ["SINGLE_PUT_MAX", "UPLOAD_THREADS", "upload_phase"]

UPLOAD_THREADS = 8
"""Files each rank has in flight at once during a flush or a collective save to a bucket (a big
file's parts are in flight within its own upload too): enough to fill a node's link to the
store, few enough that the shards held in memory stay small (a file is verified in memory
before it is put)."""


def upload_phase(
    comm: Comm,
    b: Boundary,
    phase: str,
    draft: Draft,
    manifest: Manifest,
    local_path: Path,
    threads: int = UPLOAD_THREADS,
    hook: FaultHook | None = None,
    copies: CopyPlan | None = None,
    tally: Tally | None = None,
) -> list[Any]:
    """Collective (one vote of ``b``, named ``phase``): every rank sets its part of the
    checkpoint of ``manifest`` it holds at ``local_path`` in ``draft`` (its store's draft of the
    step, the same save id on every rank), as :func:`_upload_files` says; a data file
    ``copies`` lists (an incremental write's unchanged files, the same plan on every rank) is
    copied from the base inside the store instead, and neither read nor verified here.
    ``tally``: this rank's data bytes copied and uploaded. Any rank's failure raises on every
    rank (``b``'s error). Returns, on rank 0, every rank's ``Draft.written`` (what the store's
    commit lists); on the other ranks, an empty list."""
    fault = hook or (lambda _point: None)
    with b.guard(phase):
        fault("flush-staged")
        _upload_files(
            draft, manifest, local_path, comm.rank, comm.size, threads, copies, tally or Tally()
        )
        fault("flush-copied")
    gathered = b.vote(phase, draft.written() if not b.failed else [])
    return gathered if comm.rank == 0 else []


def _upload_files(
    draft: Draft,
    manifest: Manifest,
    local_path: Path,
    rank: int,
    ranks: int,
    threads: int,
    copies: CopyPlan | None = None,
    tally: Tally | None = None,
) -> None:
    """This rank's part of the step's members, ``threads`` at a time: its data files (each
    verified first, or copied inside the store from the base when ``copies`` lists them), its
    share of the ``zarr.json`` documents (every ``ranks``-th in name order from the
    ``rank``-th; every node's level-1 copy holds them all, each checked against the manifest
    before it is set), and on rank 0 the manifest."""
    tally = tally or Tally()
    src = Inside(local_path)
    checker = DocChecker(manifest)
    jobs: list[Callable[[], int]] = [
        functools.partial(_copy_or_upload, draft, src, t, f, local_path / f.path, copies, tally)
        for t in manifest.tensors()
        for r in t.regions
        if r.rank == rank
        for f in r.files
    ]
    jobs += [
        functools.partial(_upload_doc, draft, src, manifest, checker, rel)
        for rel in sorted(checker.paths)[rank::ranks]
    ]
    if rank == 0:
        jobs.append(functools.partial(_upload_manifest, draft, local_path))
    if not jobs:
        return
    with Pool(max_workers=max(1, min(threads, len(jobs)))) as pool:
        list(pool.map(lambda job: job(), jobs))


def _copy_or_upload(
    draft: Draft,
    src: Inside,
    t: TensorEntry,
    ref: FileRef,
    path: Path,
    copies: CopyPlan | None,
    tally: Tally,
) -> int:
    """One shard file: copied inside the store from the base when the plan lists it and the
    base's object is still there, else verified and set."""
    if (
        copies is not None
        and isinstance(draft, BucketDraft)
        and draft.copy_in_store(ref.path, copies)
    ):
        tally.add(ref.size, True)
        return ref.size
    out = _upload_verified(draft, src, t, ref, path)
    tally.add(ref.size, False)
    return out


def _upload_verified(draft: Draft, src: Inside, t: TensorEntry, ref: FileRef, path: Path) -> int:
    """Check every CRC of one shard file, then set it (from the bytes just checked, or, when it
    is big, from the file mapped into memory: the store streams it in parts)."""
    names = (display(t.name),)
    with naming(src):
        blob = read_file(src, ref, names)
        decode_shard(blob, geometry(t), shard_cell(ref.path), ref, names)
    if len(blob) <= SINGLE_PUT_MAX:
        return draft.set(ref.path, [blob], fsync=False)
    del blob  # streamed from the page cache instead, a part at a time
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            return draft.set(ref.path, [view[: ref.size]], fsync=False)
        finally:
            view.release()


def _upload_doc(
    draft: Draft, src: Inside, manifest: Manifest, checker: DocChecker, rel: str
) -> int:
    """One ``zarr.json`` of the level-1 copy, checked against the manifest, then set as
    stored."""
    return draft.set(rel, [read_doc(src, manifest, rel, checker)], fsync=False)


def _upload_manifest(draft: Draft, local_path: Path) -> int:
    """Rank 0: the manifest of the level-1 copy, as stored."""
    return draft.set(MANIFEST_NAME, [read_manifest_bytes(local_path)], fsync=False)
