"""Garbage collection in object storage: the save prefixes no commit object names, and unfinished
multipart uploads.

A save that crashed, failed or lost its commit race leaves objects under ``U/<save_id>/`` that no
reader ever takes for a checkpoint (no commit object names that save id); an overwrite that
stopped half way leaves the old save's objects. :func:`gc` deletes them. A multipart upload cut
short leaves parts that are invisible to LIST but billed; the object-store library has no call
that lists them, so :func:`gc` aborts them through boto3 when it is installed (S3 only) and
otherwise says that the bucket's lifecycle rule ``AbortIncompleteMultipartUpload`` is what
removes them.

Run it while no save to the same root is in flight (that save's objects have no commit object
yet), or give ``min_age``: only prefixes whose every object is older than that are removed.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ckptfmt.storage.objects.bucket import Bucket
from ckptfmt.storage.objects.commit import COMMIT_NAME, SAVE_ID, read_commit
from ckptfmt.storage.objects.url import join_key


@dataclass
class GcResult:
    """What :func:`gc` did: ``removed``, the URLs of the save prefixes deleted (``U/<save_id>``);
    ``objects``, how many objects they held; ``aborted``, the keys of the multipart uploads
    aborted; ``note``, why unfinished uploads were not looked at, when they were not."""

    removed: list[str] = field(default_factory=list)
    objects: int = 0
    aborted: list[str] = field(default_factory=list)
    note: str | None = None


def gc(root: Bucket, *, min_age: float = 0.0, multipart: bool = True) -> GcResult:
    """Delete, under ``root`` (a checkpoint ``U`` or a level-3 root), every object inside a save
    prefix ``<U>/<save_id>/`` whose ``U`` has no commit object naming that save id, and abort
    the unfinished multipart uploads under ``root`` (``multipart``). An object is kept when any
    split of its key into ``<U>/<save_id>/<rest>`` is one a commit names, so no committed
    checkpoint loses an object, whatever its own key segments look like. ``min_age``: leave a
    prefix holding an object newer than that many seconds (a save may be in flight)."""
    listed = root.list_meta("")
    keys = [k for k, _size, _t in listed]
    commits: dict[str, str | None] = {}

    def named(u: str) -> str | None:
        if u not in commits:
            commit = read_commit(root.child(u)) if u else read_commit(root)
            commits[u] = None if commit is None else commit.save_id
        return commits[u]

    # the commit objects under root, read once each (also those whose U holds no save prefix)
    for k in keys:
        if k == COMMIT_NAME or k.endswith("/" + COMMIT_NAME):
            named(k[: -len(COMMIT_NAME)].rstrip("/"))
    doomed: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for key, _size, modified in listed:
        parts = key.split("/")
        splits = [i for i, p in enumerate(parts[:-1]) if SAVE_ID.match(p)]
        if not splits:
            continue  # not inside a save prefix: a commit object, the latest pointer, a user's
        if any(named("/".join(parts[:i])) == parts[i] for i in splits):
            continue
        first = splits[0]
        doomed["/".join(parts[: first + 1])].append((key, modified))
    result = GcResult()
    now = time.time()
    for prefix, objects in sorted(doomed.items()):
        if min_age > 0 and any(now - t < min_age for _, t in objects):
            continue
        root.delete([k for k, _ in objects])
        result.removed.append(root.key_url(prefix))
        result.objects += len(objects)
    if multipart:
        result.aborted, result.note = abort_uploads(root, min_age=min_age)
    return result


def abort_uploads(root: Bucket, *, min_age: float = 0.0) -> tuple[list[str], str | None]:
    """Abort the unfinished multipart uploads under ``root``: ``(keys aborted, note)``, the
    note saying why none were looked at (not S3, or boto3 not installed)."""
    lifecycle = (
        "set the bucket lifecycle rule AbortIncompleteMultipartUpload "
        "(e.g. DaysAfterInitiation: 1) to remove unfinished multipart uploads"
    )
    if root.scheme not in ("s3", "s3a"):
        return [], f"unfinished multipart uploads are not looked at on {root.scheme}://"
    try:
        import boto3
    except ImportError:
        return [], f"boto3 is not installed, so unfinished multipart uploads were left: {lifecycle}"
    client = boto3.client("s3", **_boto3_options(root))
    aborted: list[str] = []
    prefix = join_key(root.prefix) + "/" if root.prefix else ""
    now = time.time()
    kwargs: dict[str, Any] = {"Bucket": root.bucket, "Prefix": prefix}
    while True:
        page = client.list_multipart_uploads(**kwargs)
        for upload in page.get("Uploads", []):
            if min_age > 0 and now - upload["Initiated"].timestamp() < min_age:
                continue
            client.abort_multipart_upload(
                Bucket=root.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
            )
            aborted.append(upload["Key"])
        if not page.get("IsTruncated"):
            return sorted(aborted), None
        kwargs["KeyMarker"] = page.get("NextKeyMarker")
        kwargs["UploadIdMarker"] = page.get("NextUploadIdMarker")


def _boto3_options(root: Bucket) -> dict[str, Any]:
    """boto3's client arguments from the bucket's storage options (boto3 reads the AWS_*
    environment itself for what they do not give)."""
    opts = root.options
    out: dict[str, Any] = {}
    for ours, theirs in (
        ("aws_access_key_id", "aws_access_key_id"),
        ("aws_secret_access_key", "aws_secret_access_key"),
        ("aws_session_token", "aws_session_token"),
        ("aws_region", "region_name"),
        ("aws_endpoint", "endpoint_url"),
    ):
        if opts.get(ours) is not None:
            out[theirs] = opts[ours]
    if "endpoint_url" not in out and os.environ.get("AWS_ENDPOINT_URL"):
        out["endpoint_url"] = os.environ["AWS_ENDPOINT_URL"]
    return out
