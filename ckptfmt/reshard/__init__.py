"""Reading a checkpoint in another layout than it was saved in (N ranks saved, M load).

Pure planning, no I/O: :mod:`~ckptfmt.reshard.plan` (saved regions x wanted box -> inner chunks
to read and where each piece goes), :mod:`~ckptfmt.reshard.route` (which current rank reads
which chunks and what it sends to whom), :mod:`~ckptfmt.reshard.per_rank` (the rules for
per-rank state when the number of ranks changes). ``ckptfmt.parallel.load`` executes them;
``spec/reshard.md`` states the rules.
"""

from __future__ import annotations

from ckptfmt.reshard.per_rank import PerRankError, PerRankWarning, RankMap
from ckptfmt.reshard.plan import Box, FileRead, Layout, Piece, plan_reads
from ckptfmt.reshard.route import Delivery, FileTask, TensorRoute, route

__all__ = [
    "Box",
    "Delivery",
    "FileRead",
    "FileTask",
    "Layout",
    "PerRankError",
    "PerRankWarning",
    "Piece",
    "RankMap",
    "TensorRoute",
    "plan_reads",
    "route",
]
