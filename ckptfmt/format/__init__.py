"""The shard-file format: each tensor a sharded zarr v3 array with a CRC32C on every inner chunk,
and its zarr documents; ``shard_io`` is the one writer of shard files, ``shard_read`` their
reader, ``chunk_reads`` the partial reads of inner chunks (``spec/FORMAT.md``)."""

from __future__ import annotations

from ckptfmt.format.options import WriteOptions, checked_write
from ckptfmt.format.shard_io import Geometry, plan_region, run_jobs
from ckptfmt.format.shard_read import read_region, verify_file
from ckptfmt.format.zarr_meta import array_doc, group_doc

__all__ = [
    "plan_region",
    "run_jobs",
    "WriteOptions",
    "array_doc",
    "checked_write",
    "Geometry",
    "group_doc",
    "read_region",
    "verify_file",
]
