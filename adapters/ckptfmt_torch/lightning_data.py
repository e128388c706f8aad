"""``DataPosition``: a Lightning callback that carries the training data loader's position in
each checkpoint, so that a run stopped mid-epoch resumes on exactly the next batch.

    train_dataloader():  DataLoader(ds, batch_size=8, sampler=ckptfmt_torch.ResumableSampler(ds))
    trainer = L.Trainer(callbacks=[ckptfmt_torch.lightning.DataPosition(), ModelCheckpoint(...)],
                        use_distributed_sampler=False, ...)   # the sampler splits across ranks

Lightning's own resume restores the loops' counters but not the data: resumed mid-epoch, it
takes the epoch's batches from the start again (only a loader with ``state_dict`` is moved on).
This callback records, with every checkpoint, how many batches of which epoch the training loop
has finished (``{"epoch": e, "batches": n}``, in ``checkpoint["callbacks"]``), and on resume sets
each :class:`~ckptfmt_torch.ResumableSampler` of the training loaders to the next index before
the first batch is drawn, so the resumed run sees the batches the uninterrupted one would. The
count is the loop's, not the sampler's, so worker processes that fetch ahead do not shift it.
Every rank does the same with its own sampler (each takes the same number of batches).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from torch.utils.data import DataLoader

from ckptfmt.errors import DataPositionError, UsageError
from ckptfmt_torch.sampler import ResumableSampler

try:
    from pytorch_lightning import Callback, LightningModule, Trainer
except ImportError:  # pragma: no cover - only ``lightning`` installed
    from lightning.pytorch import Callback, LightningModule, Trainer  # type: ignore[no-redef]

__all__ = ["DataPosition"]

log = logging.getLogger(__name__)


class DataPosition(Callback):
    """Saves the training loop's position in the data with each checkpoint and moves the
    training loaders' :class:`~ckptfmt_torch.ResumableSampler` there on resume, at the same
    number of devices or another (see the module). Its state is ``{"epoch": e, "batches": n,
    "samples": [c, ...], "world_size": w}``: ``n`` batches of epoch ``e`` done, ``c`` samples
    of the epoch's global order consumed through each training loader, by ``w`` ranks."""

    def __init__(self) -> None:
        self._done: dict[str, Any] | None = None
        self._resume: dict[str, Any] | None = None
        self._loaders: list[tuple[ResumableSampler, int]] = []
        self._base: tuple[int, list[int]] = (0, [])  # (epoch, samples) the counting starts at
        self._taken = 0  # batches since then

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # before Lightning restores the callbacks' states: nothing left from an earlier run
        self._done = self._resume = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The loaders are set up (their length taken, their iterator not yet drawn from):
        check that they can be moved, and move them to the restored position."""
        self._loaders = _samplers(trainer.train_dataloader)
        self._base, self._taken = (trainer.current_epoch, [0] * len(self._loaders)), 0
        if self._resume is None:
            return
        state, self._resume = self._resume, None
        epoch, batches = state["epoch"], state["batches"]
        if "samples" not in state:  # saved by an earlier version: batches per rank
            for sampler, batch_size in self._loaders:
                index = min(batches * batch_size, sampler.num_samples)
                sampler.load_state_dict({"epoch": epoch, "index": index})
            log.info("DataPosition: resumed after batch %d of epoch %d (per rank)", batches, epoch)
            return
        samples, saved_world = list(state["samples"]), state["world_size"]
        if len(samples) != len(self._loaders):
            raise DataPositionError(
                f"the checkpoint holds the position of {len(samples)} training loader(s) and "
                f"the Trainer has {len(self._loaders)}",
                expected=len(self._loaders),
                actual=len(samples),
            )
        for (sampler, _), consumed in zip(self._loaders, samples, strict=True):
            sampler.seek(epoch, consumed)
        self._base = (epoch, samples)
        sampler, batch_size = self._loaders[0]
        left = len(sampler) // batch_size + (len(sampler) % batch_size > 0)
        world = sampler.num_replicas
        if world != saved_world:
            # Lightning counts the epoch's batches in this run's units: its epoch ends after
            # ``num_training_batches``; set the count done to what is left at this world size
            _set_batches_done(trainer, batches, left)
        what = (
            f"DataPosition: resumed at sample {samples[0]} of {sampler.length} of epoch {epoch} "
            f"(global order), saved by {saved_world} rank(s), continued by {world}: global "
            f"batch {saved_world * batch_size} -> {world * batch_size} samples, {left} batch(es) "
            f"per rank left in the epoch; the step counter goes on counting optimizer steps"
        )
        if trainer.is_global_zero:
            (log.warning if world != saved_world else log.info)(what)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # before ModelCheckpoint's save in this hook: Lightning runs checkpoint callbacks last
        epoch = trainer.current_epoch
        if epoch != self._base[0]:
            self._base, self._taken = (epoch, [0] * len(self._loaders)), 0
        self._taken += 1
        samples = [
            min(base + self._taken * sampler.num_replicas * batch_size, sampler.length)
            for base, (sampler, batch_size) in zip(self._base[1], self._loaders, strict=True)
        ]
        world = self._loaders[0][0].num_replicas if self._loaders else 1
        self._done = {
            "epoch": epoch,
            "batches": batch_idx + 1,
            "samples": samples,
            "world_size": world,
        }

    def state_dict(self) -> dict[str, Any]:
        return dict(self._done) if self._done is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        epoch, batches = state_dict.get("epoch"), state_dict.get("batches")
        ok = isinstance(epoch, int) and isinstance(batches, int) and epoch >= 0 and batches >= 0
        if "samples" in state_dict:
            samples, world = state_dict["samples"], state_dict.get("world_size")
            ok = ok and isinstance(world, int) and world >= 1 and isinstance(samples, list)
            ok = ok and all(isinstance(c, int) and c >= 0 for c in samples)
        if not ok:
            raise UsageError(f"not a DataPosition state: {state_dict!r}")
        self._done = self._resume = dict(state_dict)


def _set_batches_done(trainer: Trainer, saved: int, left: int) -> None:
    """Make Lightning's count of the epoch's batches done agree with the batches left at this
    world size: it ends the epoch when the count reaches ``num_training_batches`` (this run's
    batches per epoch), and its ``batch_idx`` goes on from the count."""
    total = trainer.num_training_batches
    if not isinstance(total, int):  # an iterable without a length: it ends when exhausted
        return
    current: Any = trainer.fit_loop.epoch_loop.batch_progress.current  # a _ProcessedTracker
    # shift every counter alike: saved in on_train_batch_end, ``completed`` is one behind
    # ``ready`` and Lightning's restart adds the one
    delta = max(total - left, 0) - current.ready
    current.ready += delta
    current.started += delta
    current.processed += delta
    current.completed += delta
    log.debug("DataPosition: Lightning's batch count of the epoch %d -> %d", saved, current.ready)


def _samplers(loaders: Any) -> list[tuple[ResumableSampler, int]]:
    """Each training loader's ``ResumableSampler`` with its batch size; a ``UsageError`` saying
    what to change for a loader without one."""
    out = []
    for loader in _flat(loaders):
        batch_sampler = getattr(loader, "batch_sampler", None)
        found = [getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)]
        sampler = next((s for s in found if isinstance(s, ResumableSampler)), None)
        batch_size = getattr(batch_sampler, "batch_size", None) or getattr(loader, "batch_size", 1)
        if sampler is None:
            what = type(found[0]).__name__
            hint = (
                "; Lightning put it there for DDP: pass use_distributed_sampler=False to the "
                "Trainer (ResumableSampler splits the data across the ranks itself)"
                if "Distributed" in what
                else ""
            )
            raise UsageError(
                f"DataPosition moves a ckptfmt_torch.ResumableSampler, and the training "
                f"DataLoader has a {what}: build it as DataLoader(dataset, batch_size=..., "
                f"sampler=ckptfmt_torch.ResumableSampler(dataset, shuffle=..., seed=...)){hint}"
            )
        if not isinstance(batch_size, int):
            raise UsageError(
                f"DataPosition needs the batch size of the training DataLoader {loader!r}"
            )
        out.append((sampler, batch_size))
    return out


def _flat(loaders: Any) -> list[Any]:
    if isinstance(loaders, DataLoader):
        return [loaders]
    if isinstance(loaders, Mapping):
        return [x for v in loaders.values() for x in _flat(v)]
    if isinstance(loaders, (list, tuple)):
        return [x for v in loaders for x in _flat(v)]
    raise UsageError(
        "DataPosition moves the samplers of DataLoaders; the training data is a "
        f"{type(loaders).__name__}"
    )
