"""``ResumableSampler``: the order of ``DistributedSampler``, plus a position that is saved, so a
restored job continues on exactly the next batch, at the same world size or another one.

The position is global: the epoch, and how many samples of that epoch's global order the whole
job has consumed. The global order does not depend on the world size (one permutation per epoch,
seeded with ``seed + epoch``), so a job that saved at N ranks and resumes at M continues it:
rank r of M takes the positions ``consumed + r``, ``consumed + r + M``, ... of the epoch's
order. Over the epoch every sample is seen once across the runs; only the end-of-epoch padding
that ``DistributedSampler`` adds (with ``drop_last=False``) repeats samples.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ckptfmt.errors import DataPositionError, UsageError

_KIND = "global"
"""The ``kind`` of a saved global position (a per-rank one of earlier versions has none)."""


class ResumableSampler(Sampler[int]):
    """Indices of this rank's part of a map-style dataset, epoch by epoch, resumable at any
    world size.

    Order: the epoch's permutation (``torch.randperm`` seeded with ``seed + epoch``, or
    ``0..n-1`` without ``shuffle``) is the job's global order. From the position the job
    started this epoch at (``start``, 0 unless restored mid-epoch), rank ``r`` takes the
    positions ``start + r``, ``start + r + num_replicas``, ...: as many as every rank can take
    with ``drop_last`` (the tail is dropped), else until the order is used up, the last ranks
    padded with positions past its end, which wrap to the epoch's first indices. That is
    ``DistributedSampler``'s order and padding, so swapping it in changes no batch, and a job
    restored at the same world size takes exactly the indices it would have taken.

    ``state_dict()`` is global: ``{"kind": "global", "epoch": e, "consumed": c, "length": n,
    "seed": s, "shuffle": b, "world_size": w}``; ``c`` positions of epoch ``e``'s order have
    been taken by the job as a whole (``start + taken_by_this_rank * num_replicas``: every rank
    takes the same number, as DDP does). Every rank holds the same state, so it is saved once,
    not per rank. ``load_state_dict`` at any world size continues at position ``c``.

    Steps when the world size changes: the per-rank batch size stays what the loader says, so
    one optimizer step takes ``num_replicas * batch_size`` samples of the global order; the
    position is counted in samples, and the training loop's step counter goes on counting
    optimizer steps. A resumed job's first batch starts at ``c`` even when ``c`` is not a
    multiple of the new global batch; give ``batch_size`` (the per-rank batch size) to require
    that every restored position falls on a global batch of this job instead.

    Refused with :class:`~ckptfmt.errors.DataPositionError` (never rounded): a position of a
    dataset of another length, of another seed or shuffling, past the epoch's end, or, with
    ``batch_size``, not a multiple of this job's global batch. A per-rank position of earlier
    versions (``{"epoch": e, "index": i}``, no ``kind``) is read as ``c = i * num_replicas``,
    which is right only at the world size that saved it (see ``docs/torch.md``).

    The position counts what the ``DataLoader`` took from the sampler. With ``num_workers=0`` that
    is exactly what the training loop has consumed. Worker processes fetch ahead
    (``prefetch_factor * num_workers`` batches); then save the position the loop has reached,
    not the sampler's: ``{**sampler.state_dict(), "consumed": c}`` with ``c = start +
    steps_done_since * num_replicas * batch_size`` (Lightning's ``DataPosition`` does this).
    ``seek`` moves the sampler before its epoch's iteration starts (not while a loader iterates).
    """

    def __init__(
        self,
        data: Sized | int,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        batch_size: int | None = None,
    ) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        self.num_replicas = num_replicas or (dist.get_world_size() if distributed else 1)
        self.rank = rank if rank is not None else (dist.get_rank() if distributed else 0)
        if not 0 <= self.rank < self.num_replicas:
            raise UsageError(f"rank {self.rank} is outside 0..{self.num_replicas - 1}")
        if batch_size is not None and batch_size < 1:
            raise UsageError(f"batch_size {batch_size}: give the per-rank batch size, 1 or more")
        self.length = data if isinstance(data, int) else len(data)
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.batch_size = batch_size
        self.epoch = 0
        self.start = 0  # global position this rank's stretch of the epoch began at
        self.index = 0  # indices this rank has taken since ``start``

    @property
    def num_samples(self) -> int:
        """The indices this rank takes in the current epoch from ``start`` on."""
        rest = max(self.length - self.start, 0)
        if self.drop_last:
            return rest // self.num_replicas
        return -(-rest // self.num_replicas)

    @property
    def consumed(self) -> int:
        """Positions of the current epoch's global order the job has taken (at most its
        length: positions past the end are padding, and taking them ends the epoch)."""
        return min(self.start + self.index * self.num_replicas, max(self.length, self.start))

    def global_order(self, epoch: int | None = None) -> list[int]:
        """The job's order of ``epoch`` (the current one by default), the same at every world
        size: a permutation of ``0..length-1``."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + (self.epoch if epoch is None else epoch))
            return torch.randperm(self.length, generator=g).tolist()
        return list(range(self.length))

    def order(self, epoch: int | None = None) -> list[int]:
        """This rank's indices of ``epoch`` (the current one by default) from ``start`` on
        (from the beginning for another epoch), in order."""
        start = self.start if epoch is None or epoch == self.epoch else 0
        order = self.global_order(epoch)
        n = max(len(order) - start, 0)
        per_rank = n // self.num_replicas if self.drop_last else -(-n // self.num_replicas)
        # positions past the end wrap to the epoch's first indices: DistributedSampler's padding
        return [
            order[(start + self.rank + k * self.num_replicas) % len(order)] for k in range(per_rank)
        ]

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        while self.index < len(order):
            i = order[self.index]
            self.index += 1
            yield i
        self.epoch += 1
        self.start = self.index = 0

    def __len__(self) -> int:
        """The indices left in the current epoch."""
        return self.num_samples - self.index

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning, unless it is already the current one (so a
        restored position survives the usual ``set_epoch`` at the top of the epoch loop)."""
        if epoch != self.epoch:
            self.epoch, self.start, self.index = epoch, 0, 0

    def seek(self, epoch: int, consumed: int) -> None:
        """Continue at global position ``consumed`` of ``epoch`` (checked as a restored
        position is); before a loader starts iterating this sampler, not during."""
        self._check_consumed(consumed)
        self.epoch, self.start, self.index = epoch, consumed, 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": _KIND,
            "epoch": self.epoch,
            "consumed": self.consumed,
            "length": self.length,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "world_size": self.num_replicas,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue at a saved position: a global one (any world size) or a per-rank one of
        earlier versions (this world size). Raises :class:`DataPositionError` for one this job
        cannot continue exactly, :class:`UsageError` for something that is no position."""
        if state_dict.get("kind") != _KIND:
            self._load_per_rank(state_dict)
            return
        fields = ("epoch", "consumed", "length", "seed", "world_size")
        if not all(_is_int(state_dict.get(k)) for k in fields) or not isinstance(
            state_dict.get("shuffle"), bool
        ):
            raise UsageError(f"not a position of ResumableSampler: {dict(state_dict)!r}")
        for key, mine in (
            ("length", self.length),
            ("shuffle", self.shuffle),
            ("seed", self.seed),
        ):
            if state_dict[key] != mine:
                raise DataPositionError(
                    f"it was saved with {key}={state_dict[key]!r} and this sampler has "
                    f"{key}={mine!r}: the global order differs (build the sampler over the same "
                    "dataset with the same seed and shuffle)",
                    expected=mine,
                    actual=state_dict[key],
                )
        epoch, consumed = state_dict["epoch"], state_dict["consumed"]
        if epoch < 0:
            raise UsageError(f"not a position of ResumableSampler: {dict(state_dict)!r}")
        self._check_consumed(consumed)
        self.epoch, self.start, self.index = epoch, consumed, 0

    def _load_per_rank(self, state_dict: Mapping[str, Any]) -> None:
        epoch: Any = state_dict.get("epoch")
        index: Any = state_dict.get("index")
        if not (
            _is_int(epoch)
            and _is_int(index)
            and epoch >= 0
            and 0 <= index <= -(-self.length // self.num_replicas)
        ):
            raise UsageError(f"not a position of ResumableSampler: {dict(state_dict)!r}")
        # a per-rank position of DistributedSampler's order from the epoch's start: i of this
        # rank's indices taken, i * num_replicas of the global order by the whole job
        self.epoch, self.start, self.index = epoch, 0, index

    def _check_consumed(self, consumed: int) -> None:
        if not 0 <= consumed <= self.length:
            raise DataPositionError(
                f"position {consumed} is outside an epoch of {self.length} samples",
                expected=self.length,
                actual=consumed,
            )
        if self.batch_size is not None and consumed < self.length:
            step = self.num_replicas * self.batch_size
            if consumed % step:
                raise DataPositionError(
                    f"position {consumed} (samples the job consumed this epoch) is not a "
                    f"multiple of this job's global batch {step} ({self.num_replicas} ranks x "
                    f"batch_size {self.batch_size}); aligned batches were asked for "
                    "(batch_size=...): resume at a world size whose global batch divides it, "
                    "or build the sampler without batch_size to continue mid-batch",
                    expected=step,
                    actual=consumed,
                )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
