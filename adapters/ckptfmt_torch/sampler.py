"""``ResumableSampler``: the order of ``DistributedSampler``, plus a position that is saved, so a
restored job continues on exactly the next batch."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ckptfmt.errors import UsageError


class ResumableSampler(Sampler[int]):
    """Indices of this rank's part of a map-style dataset, epoch by epoch, resumable.

    The order is ``torch.utils.data.DistributedSampler``'s (a permutation seeded with
    ``seed + epoch``, padded or cut to a multiple of ``num_replicas``, every ``num_replicas``-th
    index from ``rank``), so swapping it in changes no batch. ``state_dict()`` is
    ``{"epoch": e, "index": i}``: ``i`` indices of epoch ``e`` have been handed out; after
    ``load_state_dict`` iteration goes on with index ``i``. An epoch that runs out moves to the
    next one by itself; ``set_epoch`` as with ``DistributedSampler`` works too.

    The position counts what the ``DataLoader`` took from the sampler. With ``num_workers=0`` that
    is exactly what the training loop has consumed. Worker processes fetch ahead
    (``prefetch_factor * num_workers`` batches); then save the position the loop has reached
    instead: ``sampler.load_state_dict({"epoch": e, "index": batches_done * batch_size})`` before
    saving, or keep the count in the training state's counters.
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
    ) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        self.num_replicas = num_replicas or (dist.get_world_size() if distributed else 1)
        self.rank = rank if rank is not None else (dist.get_rank() if distributed else 0)
        if not 0 <= self.rank < self.num_replicas:
            raise UsageError(f"rank {self.rank} is outside 0..{self.num_replicas - 1}")
        self.length = data if isinstance(data, int) else len(data)
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        if drop_last:
            self.num_samples = self.length // self.num_replicas
        else:
            self.num_samples = -(-self.length // self.num_replicas)
        self.epoch = 0
        self.index = 0

    def order(self, epoch: int | None = None) -> list[int]:
        """This rank's indices of ``epoch`` (the current one by default), in order."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + (self.epoch if epoch is None else epoch))
            indices = torch.randperm(self.length, generator=g).tolist()
        else:
            indices = list(range(self.length))
        total = self.num_samples * self.num_replicas
        if not self.drop_last and total > len(indices) and indices:
            pad = total - len(indices)
            indices += (indices * (pad // len(indices) + 1))[:pad]
        return indices[:total][self.rank : total : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        while self.index < len(order):
            i = order[self.index]
            self.index += 1
            yield i
        self.epoch += 1
        self.index = 0

    def __len__(self) -> int:
        """The indices left in the current epoch."""
        return self.num_samples - self.index

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning, unless it is already the current one (so a
        restored position survives the usual ``set_epoch`` at the top of the epoch loop)."""
        if epoch != self.epoch:
            self.epoch, self.index = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        epoch, index = state_dict["epoch"], state_dict["index"]
        if not (
            isinstance(epoch, int) and isinstance(index, int) and 0 <= index <= self.num_samples
        ):
            raise UsageError(f"not a position of this sampler: {state_dict!r}")
        self.epoch, self.index = epoch, index
