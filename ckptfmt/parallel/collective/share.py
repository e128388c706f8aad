"""The staging copy of a save: only the share of the replicated tensors this rank will write.

In data-parallel training every rank holds the same whole tensors, and the save writes each
once: the plan (``plan.ownership``, the linear partition by cumulative bytes) cuts them into
regions spread evenly over the ranks, so each rank writes about 1/N of them. That plan depends
only on the replicated tensors' names, dtypes and shapes (in order), the grid options and the
number of ranks — provided every rank holds the same replicated tensors. So a rank can know
what it will write before anything is exchanged, and the staging copy (the part of a save the
training loop waits for) copies just that: N times less than the whole state.

Whether every rank holds the same ones is checked first by :func:`agree` (one small
collective, after a roll call with the manager's deadline, so that a rank left alone is told
instead of waiting): each rank offers the digest of its replicated tensors' declarations; the
share is used when every rank offered the same one, else (or when some rank's state was
refused) every tensor is staged whole, as before. The copied regions are handed to the save as
:class:`~ckptfmt.tree.state.Pieces`, which it declares held whole, exactly as the arrays they
stand for: the plan, the files and the manifest are the same as with a whole copy.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ckptfmt.dtypes import of_array
from ckptfmt.format.options import WriteOptions
from ckptfmt.manifest.limits import display
from ckptfmt.parallel.collective.staging import BufferPool
from ckptfmt.plan.cache import PlanCache
from ckptfmt.plan.ownership import Box, Holding, SavePlan
from ckptfmt.transport.comm import Comm
from ckptfmt.tree.state import Blob, Name, PerRank, Pieces, Shard, is_tensor, unflatten

Boxes = dict[Name, list[Box]]  # replicated tensor -> the regions this rank writes


def replicated(leaves: Sequence[tuple[Name, Any]]) -> list[Holding]:
    """The declarations of the whole (replicated) tensors among ``leaves`` (checked leaves of
    a state, in order), as the save declares them: what the plan's replicated part is made of.
    Bytes and pickled objects (:class:`Blob`) are among them: the save stores each as a whole
    ``uint8`` tensor, which takes its place in the partition like any other."""
    out = []
    for name, leaf in leaves:
        if isinstance(leaf, Blob):
            out.append(Holding(name, "uint8", tuple(leaf.data.shape)))
        elif is_tensor(leaf) and not isinstance(leaf, (Shard, PerRank, Pieces)):
            arr = np.asarray(leaf)
            out.append(Holding(name, of_array(arr.dtype, display(name)).name, arr.shape))
    return out


def digest(holdings: Sequence[Holding], write: WriteOptions, world: int) -> str:
    """What must be equal on every rank for the share to be known locally."""
    doc = [world, write.chunk_bytes, write.shard_bytes, [h.to_json() for h in holdings]]
    return hashlib.sha256(json.dumps(doc).encode("utf-8")).hexdigest()


class StartVote:
    """Whether each rank can start a save, voted in the save's first collective step (its
    staging agreement, :func:`agree`), so that every rank makes the same choice: a save some
    rank could not start (no slot free, or given up by the loop) is skipped on every rank.
    ``mine`` is asked once, after the roll call (the moment this rank's answer is final:
    ``mine`` may settle a race with the loop giving the save up); it returns why this rank
    cannot start the save, or None. ``skipping``: every rank that cannot, with its reason."""

    def __init__(self, mine: Callable[[], str | None]) -> None:
        self.mine = mine
        self.skipping: dict[int, str] = {}

    def alone(self) -> None:
        """One process: the vote is this rank's answer."""
        why = self.mine()
        self.skipping = {} if why is None else {0: why}


def agree(
    comm: Comm,
    deadline_s: float,
    step: int,
    seq: int,
    mine: str | None,
    vote: StartVote | None = None,
) -> bool:
    """Collective (every rank of ``comm``, from the thread that calls ``save``, before its
    staging copy): a roll call within ``deadline_s`` (raises
    :class:`~ckptfmt.errors.CollectiveTimeoutError` naming the ranks that did not come, or
    :class:`~ckptfmt.errors.OutOfStepError` when some are in another call: ``seq`` is the
    caller's call number), then
    every rank's digest (None: this rank stages whole, e.g. its state was refused) and its
    answer to ``vote`` (every rank passes one, or none does). True on every rank when every
    digest is the same one."""
    comm.roll_call(deadline_s, "save", step, seq)
    if vote is None:
        seen = comm.allgather_json(mine)
    else:
        answers = comm.allgather_json([mine, vote.mine()])
        seen = [d for d, _ in answers]
        vote.skipping = {r: str(w) for r, (_, w) in enumerate(answers) if w is not None}
    return mine is not None and all(d == mine for d in seen)


def share_plan(
    plans: PlanCache, holdings: Sequence[Holding], write: WriteOptions, world: int
) -> SavePlan:
    """The plan of ``world`` ranks each declaring ``holdings`` whole (what :func:`agree`
    established), from ``plans``: for data parallelism the very plan the save then finds there
    for its gathered declarations (the same layout), so it is made once."""
    decl = [h.to_json() for h in holdings]
    return plans.plan([decl] * world, write.chunk_bytes, write.shard_bytes)


def own_boxes(plan: SavePlan, rank: int) -> Boxes:
    """The regions of each tensor of ``plan`` that ``rank`` writes."""
    return {
        t.name: [(r.offset, r.shape) for r in t.regions if r.writer == rank] for t in plan.tensors
    }


def _copy(pool: BufferPool, data: np.ndarray, taken: list[np.ndarray]) -> np.ndarray:
    buf = pool.take(data.shape, data.dtype)
    taken.append(buf)
    np.copyto(buf, data, casting="no")
    return buf


def _pieces(pool: BufferPool, arr: np.ndarray, boxes: list[Box], taken: list[np.ndarray]) -> Pieces:
    parts = []
    for offset, shape in boxes:
        view = arr[tuple(slice(o, o + n) for o, n in zip(offset, shape))] if shape else arr
        parts.append((offset, _copy(pool, view, taken)))
    return Pieces(arr.dtype, arr.shape, tuple(parts))


def stage(
    pool: BufferPool,
    leaves: Sequence[tuple[Name, Any]],
    taken: list[np.ndarray],
    copy_now: bool,
    boxes: Boxes | None,
) -> tuple[dict[str, Any], int]:
    """The staging copy of checked ``leaves`` into buffers of ``pool`` (appended to ``taken``;
    values deep-copied): a replicated tensor named in ``boxes`` as the :class:`Pieces` this
    rank writes, every other tensor whole. Returns the state and the bytes of tensor data
    copied (without ``copy_now``: none is copied, the writer reads the caller's arrays, as
    ``donate=True`` asks). A background copy calls it on the saver thread."""
    out = []
    nbytes = 0
    for name, leaf in leaves:
        if not is_tensor(leaf):
            out.append((name, copy.deepcopy(leaf)))
            continue
        data = leaf.data if isinstance(leaf, Shard) else np.asarray(leaf)
        staged: Any = data
        if boxes is not None and name in boxes and not isinstance(leaf, Shard):
            if copy_now:
                staged = _pieces(pool, data, boxes[name], taken)
            nbytes += sum(math.prod(shape) for _, shape in boxes[name]) * data.itemsize
        else:
            if copy_now:
                data = staged = _copy(pool, data, taken)
            nbytes += data.nbytes
            if isinstance(leaf, Shard):
                staged = Shard(data, leaf.offset, leaf.global_shape)
        out.append((name, staged))
    return unflatten(out, pickled="keep"), nbytes  # saved again: blobs stay blobs


__all__ = ["Boxes", "agree", "digest", "own_boxes", "replicated", "share_plan", "stage"]
