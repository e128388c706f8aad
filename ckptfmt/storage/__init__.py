"""Files on a POSIX file system: writing and reading inside a checkpoint directory, the atomic
commit, step directory names, node directory templates, refused destinations, the progress of the
operations that move bytes; a committed checkpoint in a bucket, read as a directory is
(``objects``); the write side, a store per place a checkpoint lives with its commit, and the
location a user's path or URL is parsed into (``store``)."""

from __future__ import annotations

from ckptfmt.storage.commit import is_committed
from ckptfmt.storage.commit import remove as remove_committed
from ckptfmt.storage.files import Inside, fsync_dir, write_error
from ckptfmt.storage.nodes import expand, is_spread, is_template, matching
from ckptfmt.storage.objects.bucket import Bucket
from ckptfmt.storage.objects.source import ObjectInside, open_committed
from ckptfmt.storage.objects.url import is_url
from ckptfmt.storage.paths import (
    check_destination,
    refuse_inside_checkpoint,
    refuse_url,
    removing_made,
)
from ckptfmt.storage.pools import Pool
from ckptfmt.storage.progress import Progress, ProgressCallback, metering
from ckptfmt.storage.steps import StepRef, parse_step, step_dir_name
from ckptfmt.storage.store import (
    DirectoryStore,
    Draft,
    Location,
    MemoryStore,
    Store,
    parse_location,
)

__all__ = [
    "Bucket",
    "check_destination",
    "DirectoryStore",
    "Draft",
    "Location",
    "MemoryStore",
    "parse_location",
    "Store",
    "expand",
    "fsync_dir",
    "Inside",
    "is_committed",
    "is_spread",
    "is_url",
    "is_template",
    "matching",
    "metering",
    "ObjectInside",
    "open_committed",
    "parse_step",
    "Pool",
    "Progress",
    "ProgressCallback",
    "refuse_inside_checkpoint",
    "refuse_url",
    "remove_committed",
    "removing_made",
    "step_dir_name",
    "StepRef",
    "write_error",
]
