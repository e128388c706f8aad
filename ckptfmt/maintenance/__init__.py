"""Offline tools over checkpoints, one process, no transport (never the collective protocol):
verify, the parity check, repair from redundancy, reshard, the node directories of a level-1
checkpoint, checkpoints and plain files in a bucket (``objects``)."""

from __future__ import annotations

from ckptfmt.maintenance.nodes import NodeDirs, node_dirs
from ckptfmt.maintenance.objects import (
    check_target,
    download_tree,
    gc,
    publish_dir,
    upload_file,
    upload_tree,
)
from ckptfmt.maintenance.repair import RepairReport, rebuild
from ckptfmt.maintenance.reshard import ReshardReport, reshard
from ckptfmt.maintenance.verify import VerifyReport, verify
from ckptfmt.storage.objects.gc import GcResult

__all__ = [
    "check_target",
    "download_tree",
    "gc",
    "GcResult",
    "node_dirs",
    "publish_dir",
    "NodeDirs",
    "rebuild",
    "RepairReport",
    "reshard",
    "ReshardReport",
    "upload_file",
    "upload_tree",
    "verify",
    "VerifyReport",
]
