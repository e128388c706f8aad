"""ckptfmt: a framework-agnostic, multi-level checkpoint format for distributed training.

The public API of the core::

    ckptfmt.save(state, path)     # nested mapping of numpy arrays and JSON-able values
    ckptfmt.load(path)            # the same structure back, every byte verified
    ckptfmt.open(path)            # lazy read-only view: names, shapes, dtypes, slicing
    ckptfmt.verify(path)          # re-read and check everything; a report of what is damaged

The on-disk format is specified in ``spec/FORMAT.md``.
"""

from __future__ import annotations

__version__ = "0.1.0"

from ckptfmt.checkpoint import load, save  # noqa: E402
from ckptfmt.errors import CkptError  # noqa: E402
from ckptfmt.reader import Checkpoint, TensorView, open_checkpoint  # noqa: E402
from ckptfmt.verify import VerifyReport, verify  # noqa: E402

open = open_checkpoint  # noqa: A001 - ckptfmt.open is the documented name

__all__ = [
    "Checkpoint",
    "CkptError",
    "TensorView",
    "VerifyReport",
    "load",
    "open",
    "open_checkpoint",
    "save",
    "verify",
]
