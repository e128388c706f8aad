"""The collective protocol over a :class:`~ckptfmt.transport.Comm`: save, load, flush and rebuild
of one checkpoint by every rank, each phase behind one error boundary, and the
:class:`CheckpointManager` that runs them across the levels."""

from __future__ import annotations

from ckptfmt.parallel.level3_pick import list_levels
from ckptfmt.parallel.levels import resolve_node
from ckptfmt.parallel.load import load_collective
from ckptfmt.parallel.manager import CheckpointManager
from ckptfmt.parallel.options import ExitPolicy, OnError
from ckptfmt.parallel.outcomes import CheckpointWarning
from ckptfmt.parallel.protocol import SaveFailedError, save_collective
from ckptfmt.parallel.restore import RestoreReport
from ckptfmt.parallel.save_bucket import save_to_bucket
from ckptfmt.parallel.staging import SaveHandle

__all__ = [
    "CheckpointManager",
    "CheckpointWarning",
    "ExitPolicy",
    "OnError",
    "list_levels",
    "load_collective",
    "resolve_node",
    "RestoreReport",
    "save_collective",
    "save_to_bucket",
    "SaveFailedError",
    "SaveHandle",
]
