"""Redundancy across failure domains: redundancy sets, and the schemes that encode and rebuild
their members' data (``spec/redundancy.md``).

Framework-free and in-process: the parallel save pipeline wires these in (next version).
"""

from __future__ import annotations

from ckptfmt.redundancy.schemes import (
    SCHEMES,
    Layout,
    Partner,
    RedundancyScheme,
    ReedSolomon,
    UnrecoverableError,
    Xor,
    layout,
    scheme,
)
from ckptfmt.redundancy.sets import make_sets

__all__ = [
    "SCHEMES",
    "Layout",
    "Partner",
    "RedundancyScheme",
    "ReedSolomon",
    "UnrecoverableError",
    "Xor",
    "layout",
    "make_sets",
    "scheme",
]
