"""Files on a POSIX file system: writing and reading inside a checkpoint directory, the atomic
commit, step directory names, node directory templates, refused destinations, the progress of the
operations that move bytes."""

from __future__ import annotations

from ckptfmt.storage.files import Inside, fsync_dir
from ckptfmt.storage.nodes import expand, is_spread, is_template, matching
from ckptfmt.storage.paths import check_destination, refuse_url
from ckptfmt.storage.progress import Progress, ProgressCallback, metering
from ckptfmt.storage.steps import StepRef, parse_step, step_dir_name

__all__ = [
    "check_destination",
    "expand",
    "fsync_dir",
    "Inside",
    "is_spread",
    "is_template",
    "matching",
    "metering",
    "parse_step",
    "Progress",
    "ProgressCallback",
    "refuse_url",
    "step_dir_name",
    "StepRef",
]
