"""Checkpoints in object storage (S3, GCS, Azure): a bucket prefix and its requests
(:class:`Bucket`), and the commit that makes a checkpoint appear whole on a store that has no
rename (:mod:`.commit`, ``spec/FORMAT.md``, "Checkpoints in object storage").

The object-store library (obstore, the ``cloud`` extra) is imported only when a :class:`Bucket`
is made; :mod:`.url` needs nothing, so entry points can tell a URL from a path without it.
"""

from __future__ import annotations

from ckptfmt.storage.objects.bucket import Bucket, Retries, part_size
from ckptfmt.storage.objects.url import SUPPORTED, is_url, join_key, split_url

__all__ = ["SUPPORTED", "Bucket", "Retries", "is_url", "join_key", "part_size", "split_url"]
