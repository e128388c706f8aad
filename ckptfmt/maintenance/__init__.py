"""Offline tools over checkpoints, one process, no transport (never the collective protocol):
verify, the parity check, repair from redundancy, reshard, the node directories of a level-1
checkpoint."""

from __future__ import annotations

from ckptfmt.maintenance.nodes import NodeDirs, node_dirs
from ckptfmt.maintenance.repair import RepairReport, rebuild
from ckptfmt.maintenance.reshard import ReshardReport, reshard
from ckptfmt.maintenance.verify import VerifyReport, verify

__all__ = [
    "node_dirs",
    "NodeDirs",
    "rebuild",
    "RepairReport",
    "reshard",
    "ReshardReport",
    "verify",
    "VerifyReport",
]
