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

from collections.abc import Mapping
from typing import Any

from torch.utils.data import DataLoader

from ckptfmt.errors import UsageError
from ckptfmt_torch.sampler import ResumableSampler

try:
    from pytorch_lightning import Callback, LightningModule, Trainer
except ImportError:  # pragma: no cover - only ``lightning`` installed
    from lightning.pytorch import Callback, LightningModule, Trainer  # type: ignore[no-redef]

__all__ = ["DataPosition"]


class DataPosition(Callback):
    """Saves the training loop's position in the data with each checkpoint and moves the
    training loaders' :class:`~ckptfmt_torch.ResumableSampler` there on resume (see the
    module). Its state is ``{"epoch": e, "batches": n}``: ``n`` batches of epoch ``e`` done."""

    def __init__(self) -> None:
        self._done: dict[str, int] | None = None
        self._resume: dict[str, int] | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # before Lightning restores the callbacks' states: nothing left from an earlier run
        self._done = self._resume = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The loaders are set up (their length taken, their iterator not yet drawn from):
        check that they can be moved, and move them to the restored position."""
        samplers = _samplers(trainer.train_dataloader)
        if self._resume is None:
            return
        epoch, batches = self._resume["epoch"], self._resume["batches"]
        for sampler, batch_size in samplers:
            index = min(batches * batch_size, sampler.num_samples)
            sampler.load_state_dict({"epoch": epoch, "index": index})
        self._resume = None

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # before ModelCheckpoint's save in this hook: Lightning runs checkpoint callbacks last
        self._done = {"epoch": trainer.current_epoch, "batches": batch_idx + 1}

    def state_dict(self) -> dict[str, Any]:
        return dict(self._done) if self._done is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        epoch, batches = state_dict.get("epoch"), state_dict.get("batches")
        if not (
            isinstance(epoch, int) and isinstance(batches, int) and epoch >= 0 and batches >= 0
        ):
            raise UsageError(f"not a DataPosition state: {state_dict!r}")
        self._done = self._resume = {"epoch": epoch, "batches": batches}


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
