"""Pure planning, no I/O: who writes what (:mod:`~ckptfmt.plan.ownership`: the save plan from
every rank's declarations), and reading a checkpoint in another layout than it was saved in (N
ranks saved, M load): :mod:`~ckptfmt.plan.reads` (saved regions x wanted box -> inner chunks
to read and where each piece goes), :mod:`~ckptfmt.plan.route` (which current rank reads
which chunks and what it sends to whom), :mod:`~ckptfmt.plan.per_rank` (the rules for
per-rank state when the number of ranks changes), :mod:`~ckptfmt.plan.options` (how a load
reads). ``ckptfmt.parallel.collective.load`` executes them;
``spec/reshard.md`` states the rules.
"""

from __future__ import annotations

from ckptfmt.plan.cache import PlanCache
from ckptfmt.plan.options import PerRankMode, ReadOptions, ReplicaMode
from ckptfmt.plan.ownership import Holding, SavePlan, TensorPlan, make_plan
from ckptfmt.plan.per_rank import RankMap
from ckptfmt.plan.reads import Box, FileRead, Layout, Piece, plan_reads
from ckptfmt.plan.route import Delivery, FileTask, TensorRoute, route

__all__ = [
    "PlanCache",
    "Holding",
    "TensorPlan",
    "SavePlan",
    "make_plan",
    "Box",
    "Delivery",
    "FileRead",
    "FileTask",
    "Layout",
    "PerRankMode",
    "Piece",
    "RankMap",
    "ReadOptions",
    "ReplicaMode",
    "TensorRoute",
    "plan_reads",
    "route",
]
