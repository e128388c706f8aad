"""Operations on one checkpoint's redundancy that serve both the collective phases (over a
``Comm``) and the offline tools (no transport): choosing and repairing metadata copies, the one
parity encoder, the one rebuild engine."""

from __future__ import annotations

from ckptfmt.engine.encode import encode_offline
from ckptfmt.engine.rebuild import MemberStatus, lost_tensors, plan_all

__all__ = [
    "encode_offline",
    "lost_tensors",
    "MemberStatus",
    "plan_all",
]
