"""Checkpoints in object storage (S3, GCS, Azure): a bucket prefix and its requests
(:class:`Bucket`), and the commit that makes a checkpoint appear whole on a store that has no
rename (:mod:`.commit`, ``spec/FORMAT.md``, "Checkpoints in object storage").

The object-store library (obstore, the ``cloud`` extra) is imported only when a :class:`Bucket`
is made; :mod:`.url` needs nothing, so entry points can tell a URL from a path without it.
"""

from __future__ import annotations

from ckptfmt.storage.objects.bucket import Bucket, Retries, part_size
from ckptfmt.storage.objects.commit import (
    COMMIT_NAME,
    LATEST_NAME,
    Commit,
    Committed,
    ObjectRef,
    delete_checkpoint,
    drop_replaced,
    find_commit,
    missing_objects,
    move_latest,
    new_save_id,
    newest_committed,
    object_problems,
    put_bytes,
    read_commit,
    read_latest,
    upload_files,
    write_commit,
)
from ckptfmt.storage.objects.gc import GcResult, gc
from ckptfmt.storage.objects.url import SUPPORTED, is_url, join_key, split_url

__all__ = [
    "COMMIT_NAME",
    "LATEST_NAME",
    "SUPPORTED",
    "Bucket",
    "Commit",
    "Committed",
    "GcResult",
    "ObjectRef",
    "Retries",
    "delete_checkpoint",
    "drop_replaced",
    "find_commit",
    "gc",
    "is_url",
    "join_key",
    "missing_objects",
    "move_latest",
    "new_save_id",
    "newest_committed",
    "object_problems",
    "part_size",
    "put_bytes",
    "read_commit",
    "read_latest",
    "split_url",
    "upload_files",
    "write_commit",
]
