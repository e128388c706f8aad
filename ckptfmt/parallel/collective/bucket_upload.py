"""The upload phase of a collective write to a bucket, shared by a manager's flush
(``level3_bucket.flush_to_bucket``) and a collective save straight to a URL
(``save_bucket.save_to_bucket``): every rank puts its own part of one checkpoint directory it
holds locally under ``U/<save_id>/`` (PROTOCOL.md §7, step 2), then the ranks vote and rank 0
has every object's ref for the commit object.

Who calls what: :func:`upload_phase` is collective (every rank of the communicator, once per
checkpoint, one vote of the caller's boundary); the rest is each rank's own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ckptfmt.checksum import crc32c
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
from ckptfmt.storage.objects import Bucket
from ckptfmt.storage.objects.bucket import MULTIPART_ABOVE
from ckptfmt.storage.objects.commit import ObjectRef
from ckptfmt.storage.objects.copies import CopyPlan, Tally, copy_unchanged
from ckptfmt.transport.comm import Comm

__all__ = ["SINGLE_PUT_MAX", "UPLOAD_THREADS", "upload_phase"]

UPLOAD_THREADS = 8
"""Files each rank has in flight at once during a flush or a collective save to a bucket (a big
file's parts are in flight within its own upload too): enough to fill a node's link to the
store, few enough that the shards held in memory stay small (a file is verified in memory
before it is put)."""

SINGLE_PUT_MAX = 2 * MULTIPART_ABOVE
"""A shard file up to this size is put in one PUT from the bytes just verified (a default 16 MiB
shard is a little over 16 MiB with its index: in parts it would take five requests and a second
read); a bigger one is streamed from the file in parts."""


def upload_phase(
    comm: Comm,
    b: Boundary,
    phase: str,
    dest: Bucket,
    manifest: Manifest,
    local_path: Path,
    threads: int = UPLOAD_THREADS,
    hook: FaultHook | None = None,
    copies: CopyPlan | None = None,
    tally: Tally | None = None,
) -> list[ObjectRef]:
    """Collective (one vote of ``b``, named ``phase``): every rank uploads its part of the
    checkpoint of ``manifest`` it holds at ``local_path`` to ``dest`` (``U``), as
    :func:`_upload_files` says; a data file ``copies`` lists (an incremental write's unchanged
    files, the same plan on every rank) is copied from the base inside the store instead, and
    neither read nor verified here. ``tally``: this rank's data bytes copied and uploaded.
    Any rank's failure raises on every rank (``b``'s error).
    Returns, on rank 0, every rank's object refs sorted by key (the commit object's list);
    on the other ranks, an empty list."""
    mine: list[ObjectRef] = []
    fault = hook or (lambda _point: None)
    with b.guard(phase):
        fault("flush-staged")
        mine = _upload_files(
            dest, manifest, local_path, comm.rank, comm.size, threads, copies, tally or Tally()
        )
        fault("flush-copied")
    gathered = b.vote(phase, [r.to_json() for r in mine])
    if comm.rank != 0:
        return []
    return sorted((ObjectRef(**r) for refs in gathered for r in refs), key=lambda r: r.key)


def _upload_files(
    dest: Bucket,
    manifest: Manifest,
    local_path: Path,
    rank: int,
    ranks: int,
    threads: int,
    copies: CopyPlan | None,
    tally: Tally,
) -> list[ObjectRef]:
    """This rank's part of the step's objects, put under ``<save_id>/``, ``threads`` at a
    time: its data files (each verified first), its share of the ``zarr.json`` documents
    (every ``ranks``-th in name order from the ``rank``-th; every node's level-1 copy holds
    them all, each checked against the manifest before it is put), and on rank 0 the
    manifest. Their object refs."""
    src = Inside(local_path)
    save_id = manifest.save_id
    checker = DocChecker(manifest)
    jobs: list[Callable[[], ObjectRef]] = [
        functools.partial(
            _copy_or_upload, dest, save_id, src, t, f, local_path / f.path, copies, tally
        )
        for t in manifest.tensors()
        for r in t.regions
        if r.rank == rank
        for f in r.files
    ]
    jobs += [
        functools.partial(_upload_doc, dest, save_id, src, manifest, checker, rel)
        for rel in sorted(checker.docs)[rank::ranks]
    ]
    if rank == 0:
        jobs.append(functools.partial(_upload_manifest, dest, save_id, local_path))
    if not jobs:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(jobs)))) as pool:
        return list(pool.map(lambda job: job(), jobs))


def _copy_or_upload(
    dest: Bucket,
    save_id: str,
    src: Inside,
    t: TensorEntry,
    ref: FileRef,
    path: Path,
    copies: CopyPlan | None,
    tally: Tally,
) -> ObjectRef:
    """One shard file: copied inside the store from the base when the plan lists it and the
    base's object is still there (its ref is the base's), else verified and uploaded."""
    copied = copy_unchanged(dest.child(save_id), ref.path, copies)
    if copied is not None:
        tally.add(ref.size, True)
        return copied
    out = _upload_verified(dest, save_id, src, t, ref, path)
    tally.add(ref.size, False)
    return out


def _upload_verified(
    dest: Bucket, save_id: str, src: Inside, t: TensorEntry, ref: FileRef, path: Path
) -> ObjectRef:
    """Check every CRC of one shard file, then put it (one PUT from the bytes just checked, or
    a multipart upload of the file when it is big; its CRC32C from the bytes sent)."""
    names = (display(t.name),)
    with naming(src):
        blob = read_file(src, ref, names)
        decode_shard(blob, geometry(t), shard_cell(ref.path), ref, names)
    key = f"{save_id}/{ref.path}"
    if len(blob) <= SINGLE_PUT_MAX:
        dest.put(key, blob)
        crc = crc32c(blob)
    else:
        del blob  # streamed from the file instead: a multipart upload with parts in flight
        crc = dest.upload(key, path, size=ref.size)
    return ObjectRef(ref.path, ref.size, crc)


def _upload_doc(
    dest: Bucket, save_id: str, src: Inside, manifest: Manifest, checker: DocChecker, rel: str
) -> ObjectRef:
    """One ``zarr.json`` of the level-1 copy, checked against the manifest, then put as
    stored."""
    data = read_doc(src, manifest, rel, checker)
    dest.put(f"{save_id}/{rel}", data)
    return ObjectRef(rel, len(data), crc32c(data))


def _upload_manifest(dest: Bucket, save_id: str, local_path: Path) -> ObjectRef:
    """Rank 0: the manifest of the level-1 copy, as stored."""
    data = read_manifest_bytes(local_path)
    dest.put(f"{save_id}/{MANIFEST_NAME}", data)
    return ObjectRef(MANIFEST_NAME, len(data), crc32c(data))
