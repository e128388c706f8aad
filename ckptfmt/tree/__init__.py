"""The state model: a nested mapping flattened to named leaves (arrays, :class:`Shard`,
:class:`PerRank`, JSON values) and back, applied in place into a caller's arrays, and dtype
casts by policy (refused unless asked)."""

from __future__ import annotations

from ckptfmt.tree.apply import apply_loaded
from ckptfmt.tree.casting import (
    Cast,
    Conversion,
    allowed,
    check_policy,
    convert,
    plan_casts,
    report_casts,
)
from ckptfmt.tree.state import (
    Blob,
    Container,
    Objects,
    PerRank,
    Shard,
    arrays_of,
    encode_objects,
    flatten,
    unflatten,
)

__all__ = [
    "allowed",
    "apply_loaded",
    "arrays_of",
    "Blob",
    "Cast",
    "check_policy",
    "Container",
    "Conversion",
    "convert",
    "encode_objects",
    "flatten",
    "Objects",
    "PerRank",
    "plan_casts",
    "report_casts",
    "Shard",
    "unflatten",
]
