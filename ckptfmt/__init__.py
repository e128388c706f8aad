"""ckptfmt: a framework-agnostic, multi-level checkpoint format for distributed training.

The public API of the core::

    ckptfmt.save(state, path)     # nested mapping of numpy arrays and JSON-able values
    ckptfmt.load(path)            # the same structure back, every byte verified
    ckptfmt.open(path)            # lazy read-only view: names, shapes, dtypes, slicing
    ckptfmt.verify(path)          # re-read and check everything; a report of what is damaged

The on-disk format is specified in ``spec/FORMAT.md``.
"""

from __future__ import annotations

from ckptfmt import errors
from ckptfmt.checkpoint import load, open_checkpoint, save
from ckptfmt.container.reader import Checkpoint, TensorView, latest
from ckptfmt.errors import CkptError, FlushWarning
from ckptfmt.format.options import WriteOptions
from ckptfmt.maintenance.verify import VerifyReport, verify
from ckptfmt.parallel.levels.pick import list_levels
from ckptfmt.parallel.manager.checkpoint_manager import (
    CheckpointManager,
    CheckpointWarning,
    RestoreReport,
)
from ckptfmt.parallel.manager.options import ExitPolicy, ManagerSettings
from ckptfmt.plan.options import ReadOptions
from ckptfmt.storage.progress import Progress, ProgressCallback
from ckptfmt.storage.steps import StepRef, step_dir_name
from ckptfmt.transport.comm import Comm, SingleComm
from ckptfmt.tree.casting import Cast
from ckptfmt.tree.state import PerRank, Shard
from ckptfmt.version import __version__

open = open_checkpoint

__all__ = [
    "Cast",
    "Checkpoint",
    "CheckpointManager",
    "CheckpointWarning",
    "Comm",
    "ExitPolicy",
    "FlushWarning",
    "PerRank",
    "Progress",
    "ProgressCallback",
    "ReadOptions",
    "RestoreReport",
    "Shard",
    "SingleComm",
    "StepRef",
    "errors",
    "list_levels",
    "ManagerSettings",
    "CkptError",
    "TensorView",
    "VerifyReport",
    "WriteOptions",
    "latest",
    "load",
    "open",
    "open_checkpoint",
    "save",
    "step_dir_name",
    "verify",
    "__version__",
]
