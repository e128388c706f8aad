"""A save's staging: the ranks' agreement on what each copies, then the copy.

Tensors that every rank holds whole (replicated: data parallelism) are written once, each rank
writing its share; :meth:`Stager.agree` is the ranks' agreement on those shares (a digest of what
each holds, compared), and :meth:`Stager.stage` the copy of this rank's part of the state into
the pool's buffers (``ckptfmt.parallel.collective.share``). A training loop saves the same tensors
each time, so the shares of the last agreed digest are kept, and the plan they come from is kept
in :attr:`Stager.plans`, where the manager's save finds it for the same layout (planned once).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ckptfmt.format.options import WriteOptions
from ckptfmt.parallel.collective import share
from ckptfmt.parallel.collective.staging import BufferPool
from ckptfmt.plan.cache import PlanCache
from ckptfmt.transport.comm import Comm
from ckptfmt.tree.state import Name

__all__ = ["Stager"]


class Stager:
    """One rank's staging for a manager on ``comm`` (the saver thread's agreement runs on its
    duplicate, which has the same ranks)."""

    def __init__(
        self, comm: Comm, deadline_s: float, write: WriteOptions, pool: BufferPool
    ) -> None:
        self.comm = comm
        self.deadline_s = deadline_s
        self.write = write
        self.pool = pool
        self.plans = PlanCache()  # the share's plans and the saves' (one layout: one plan)
        self._own: tuple[str, share.Boxes] | None = None  # the last share: digest, boxes

    def agree(
        self,
        step: int,
        seq: int,
        leaves: list[tuple[Name, Any]] | None,
        comm: Comm | None = None,
        vote: share.StartVote | None = None,
    ) -> share.Boxes | None:
        """Collective (every rank, before its staging copy: from ``save`` on ``comm`` None, the
        manager's communicator, or from the saver thread on its own for a background copy;
        ``leaves`` None where the state was refused): the regions of the replicated tensors
        this rank writes, when every rank holds the same ones, else None (stage everything).
        ``vote`` (every rank gives one, or none does) is voted on in the same exchange
        (:class:`~ckptfmt.parallel.collective.share.StartVote`). One process: None, and the
        vote is this rank's. Raises what the roll call raises."""
        if self.comm.size == 1:
            if vote is not None:
                vote.alone()
            return None
        holdings = share.replicated(leaves) if leaves is not None else []
        mine = share.digest(holdings, self.write, self.comm.size) if leaves is not None else None
        if not share.agree(comm or self.comm, self.deadline_s, step, seq, mine, vote):
            return None
        assert mine is not None  # agree is True only where this rank has a digest
        # the training thread and the saver thread may both agree (saves in flight): the kept
        # share is read and replaced whole, never half of one and half of another
        own = self._own
        if own is None or own[0] != mine:
            plan = share.share_plan(self.plans, holdings, self.write, self.comm.size)
            own = self._own = (mine, share.own_boxes(plan, self.comm.rank))
        return own[1]

    def stage(
        self,
        leaves: list[tuple[Name, Any]],
        taken: list[np.ndarray],
        copy_now: bool,
        boxes: share.Boxes | None,
    ) -> tuple[dict[str, Any], int]:
        """Local: the staging copy into the pool's buffers (``share.stage``): the staged
        state and its bytes; the buffers taken are appended to ``taken``."""
        return share.stage(self.pool, leaves, taken, copy_now, boxes)
