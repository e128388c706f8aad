"""The collective protocol over a :class:`~ckptfmt.transport.Comm`: save, load, flush and rebuild
of one checkpoint by every rank, each phase behind one error boundary, and the
:class:`CheckpointManager` that runs them across the levels."""

from __future__ import annotations

from ckptfmt.parallel.collective.load import load_collective
from ckptfmt.parallel.collective.save import SaveFailedError, save_collective
from ckptfmt.parallel.collective.save_bucket import save_to_bucket
from ckptfmt.parallel.collective.save_manifest import (
    Declared,
    build_manifest,
    check_rank0_declares_all,
    gathered_per_rank,
    geometry_of,
    order_and_values,
)
from ckptfmt.parallel.collective.save_state import LocalState, check_state, region_data
from ckptfmt.parallel.collective.staging import SaveHandle
from ckptfmt.parallel.levels.layout import resolve_node
from ckptfmt.parallel.levels.pick import list_levels
from ckptfmt.parallel.manager.checkpoint_manager import CheckpointManager
from ckptfmt.parallel.manager.options import ExitPolicy, ManagerSettings, OnError
from ckptfmt.parallel.manager.outcomes import CheckpointWarning
from ckptfmt.parallel.manager.restore import RestoreReport

__all__ = [
    "CheckpointManager",
    "CheckpointWarning",
    "ExitPolicy",
    "OnError",
    "list_levels",
    "ManagerSettings",
    "load_collective",
    "resolve_node",
    "RestoreReport",
    "save_collective",
    "save_to_bucket",
    "SaveFailedError",
    "SaveHandle",
    # the pieces of a collective save, for a framework whose own protocol runs the exchanges
    # (the DCP writer, ckptfmt_torch/dcp_save.py): declare, plan, write regions, manifest
    "Declared",
    "LocalState",
    "build_manifest",
    "check_rank0_declares_all",
    "check_state",
    "gathered_per_rank",
    "geometry_of",
    "order_and_values",
    "region_data",
]
