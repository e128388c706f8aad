"""Redundancy across failure domains: redundancy sets, the schemes that encode and rebuild their
members' data and own their geometry, the configuration and policy a save takes, and the record
a manifest keeps (``spec/redundancy.md``). Pure computation, no I/O."""

from __future__ import annotations

from ckptfmt.redundancy.config import DEFAULT_SET_SIZE, Policy, Redundancy
from ckptfmt.redundancy.record import RedundancyRecord, member_files, record_of
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
    "DEFAULT_SET_SIZE",
    "Policy",
    "Redundancy",
    "RedundancyRecord",
    "member_files",
    "record_of",
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
