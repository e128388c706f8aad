"""How a checkpoint is read: one options object that the collective load (and the manager's
restore through it) takes instead of the same four parameters each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from ckptfmt.errors import UsageError
from ckptfmt.plan.per_rank import RankMap

__all__ = ["PerRankMode", "ReadOptions", "ReplicaMode"]

PerRankMode = Literal["error", "drop"]
ReplicaMode = Literal["node", "read", "bcast"]


@dataclass(frozen=True)
class ReadOptions:
    """The same on every rank of a load (checked: the ranks compare them in the load's first
    collective and all raise :class:`~ckptfmt.errors.UsageError` when they differ).

    ``rank_map`` (saved rank -> current rank, ``"identity"`` or None) and ``per_rank``
    (``"error"`` or ``"drop"``) decide what happens to per-rank entries when the number of
    ranks changed (:mod:`ckptfmt.plan.per_rank`, ``spec/reshard.md`` §3). ``replicas``, how
    state that several ranks hold alike (data-parallel replicas) is read: ``"node"`` (the
    default: what several ranks of one node want alike is read once on that node, by one of
    them, and passed to the others over the Comm; each node reads a replicated file once),
    ``"read"`` (every rank reads what it needs from its own directory itself) or ``"bcast"`` (a
    file every rank needs whole is read by one rank in the job and broadcast: the fewest readers
    of shared storage). In every mode what a rank's directory does not hold comes over the
    Comm. ``threads``: concurrent readers per host, shared among the ranks of a host (this
    value may differ between hosts)."""

    rank_map: RankMap = None
    per_rank: PerRankMode = "error"
    replicas: ReplicaMode = "node"
    threads: int = 2

    def __post_init__(self) -> None:
        if self.per_rank not in get_args(PerRankMode):
            raise UsageError(f"per_rank is 'error' or 'drop', got {self.per_rank!r}")
        if self.replicas not in get_args(ReplicaMode):
            raise UsageError(f"replicas is 'node', 'read' or 'bcast', got {self.replicas!r}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise UsageError(f"threads must be an int >= 1, got {self.threads!r}")
