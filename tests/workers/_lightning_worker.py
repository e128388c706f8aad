"""PyTorch Lightning runs for tests/adapters/torch/test_lightning.py: a small model and data
module, a Trainer with the plugin as the README shows it, and the end state written out.

    python -m _lightning_worker --root DIR --name run --max-steps 12 [--io ckptfmt|torch|async]
        [--kill-at K] [--kill-in-save N] [--devices 2] [--mode rank0|collective|levels]
        [--data plain|shuffled]

``--kill-in-save N``: the process SIGKILLs itself in the middle of the N-th commit of a
checkpoint directory (every file written into its staging directory, not yet renamed into place).

``--data shuffled``: ``ShuffledData`` (a ``ResumableSampler``, checkpoints mid-epoch) with the
``DataPosition`` callback and ``use_distributed_sampler=False``.

Runs of one launch go one after the other (``--runs`` ``name:max_steps`` ...): under
``strategy="ddp"`` Lightning starts the other ranks by running this same command again, so every
rank makes the same fits in the same order. Rank 0 writes each run's parameters and optimizer
state to ``ROOT/<name>.end.pt`` (``torch.save``, read by the test only).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import ckptfmt_torch
import ckptfmt_torch.lightning
import pytorch_lightning as L
import torch
from kit.crash import kill_in_save
from torch.utils.data import DataLoader, TensorDataset


class Net(L.LightningModule):
    """An MLP with Adam and a step schedule: optimizer and scheduler state to resume."""

    def __init__(self, width: int = 32, lr: float = 1e-2, extra: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 4)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)}


class Data(L.LightningDataModule):
    """64 random samples, 8 batches of 8 per epoch (4 per rank under 2-process DDP), in order."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.ds = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g))

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.ds, batch_size=8, shuffle=False)


class ShuffledData(L.LightningDataModule):
    """96 random samples in a shuffled order from ``ckptfmt_torch.ResumableSampler``: 12
    batches of 8 per epoch, 6 per rank under 2-process DDP, so a checkpoint every 4 steps
    falls mid-epoch. The Trainer needs ``use_distributed_sampler=False``."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.ds = TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 4, generator=g))

    def train_dataloader(self) -> DataLoader[Any]:
        sampler = ckptfmt_torch.ResumableSampler(self.ds, shuffle=True, seed=3)
        return DataLoader(self.ds, batch_size=8, sampler=sampler)


class Record(L.Callback):
    """Notes the dataset index of every sample of every training batch this rank sees and
    writes them to ``ROOT/<name>.seen.w<world size>.rank<r>.json`` when the fit ends
    (ShuffledData's rows are distinct, so a row tells its index)."""

    def __init__(self, root: Path, name: str, ds: TensorDataset) -> None:
        self.root, self.name = root, name
        self.rows = {tuple(r.tolist()): i for i, r in enumerate(ds.tensors[0])}
        self.seen: list[list[int]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl: Any, out: Any, batch: Any, i: int) -> None:
        self.seen.append([self.rows[tuple(r.tolist())] for r in batch[0]])

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        w, r = trainer.world_size, trainer.global_rank
        (self.root / f"{self.name}.seen.w{w}.rank{r}.json").write_text(json.dumps(self.seen))


class KillAt(L.Callback):
    """SIGKILL this process when step ``at`` is done (and checkpointed): a real crash."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def end_state(model: L.LightningModule, trainer: L.Trainer) -> dict[str, Any]:
    return {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optim": trainer.optimizers[0].state_dict(),
        "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        "global_step": trainer.global_step,
    }


def make_io(io: str, mode: str, root: Path, nodes: int = 1) -> Any:
    """The plugin as the README shows it; ``root``: the run's own levels, with XOR parity
    across ``nodes`` when there are several."""
    if io == "torch":
        return L.plugins.TorchCheckpointIO()
    if mode == "levels":
        plugin = ckptfmt_torch.lightning.CheckpointIO(
            local_dir=root / "local" / "{node}",
            shared_dir=root / "shared",
            redundancy="xor" if nodes > 1 else None,
        )
    else:
        plugin = ckptfmt_torch.lightning.CheckpointIO(collective=mode == "collective")
    return L.plugins.AsyncCheckpointIO(plugin) if io == "async" else plugin


def fit(args: argparse.Namespace, name: str, max_steps: int) -> None:
    L.seed_everything(0, verbose=False)
    root = Path(args.root)
    model = Net()
    dm: L.LightningDataModule = ShuffledData() if args.data == "shuffled" else Data()
    checkpoint = L.callbacks.ModelCheckpoint(
        root / name, save_last=True, every_n_train_steps=4, save_top_k=-1
    )
    callbacks: list[L.Callback] = [checkpoint]
    if args.data == "shuffled":
        callbacks.append(ckptfmt_torch.lightning.DataPosition())
        assert isinstance(dm, ShuffledData)
        callbacks.append(Record(root, name, dm.ds))
    if args.kill_at is not None:
        callbacks.append(KillAt(args.kill_at))
    strategy: Any = "auto"
    if args.devices > 1:
        ours = args.mode != "rank0" and not args.plain_ddp
        strategy = ckptfmt_torch.lightning.DDPStrategy() if ours else "ddp"
    trainer = L.Trainer(
        plugins=[make_io(args.io, args.mode, root / f"{name}-levels", args.devices)],
        callbacks=callbacks,
        strategy=strategy,
        accelerator="cpu",
        devices=args.devices,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=True,
        use_distributed_sampler=args.data != "shuffled",
    )
    trainer.fit(model, datamodule=dm, ckpt_path="last")
    # AsyncCheckpointIO's teardown waits for the writes of rank 0 alone: the other ranks must
    # not look for the next fit's "last" checkpoint before it is in
    trainer.strategy.barrier()
    if trainer.is_global_zero:
        torch.save(end_state(model, trainer), root / f"{name}.end.pt")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--runs", nargs="+", required=True, help="name:max_steps, in order")
    p.add_argument("--io", choices=["ckptfmt", "torch", "async"], default="ckptfmt")
    p.add_argument("--mode", choices=["rank0", "collective", "levels"], default="rank0")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--kill-in-save", type=int, default=None)
    p.add_argument("--plain-ddp", action="store_true", help="Lightning's DDP, whatever the mode")
    p.add_argument("--data", choices=["plain", "shuffled"], default="plain")
    args = p.parse_args()
    # a node per rank, as on a cluster: the levels' parity goes across them
    os.environ["CKPTFMT_NODE"] = f"n{os.environ.get('LOCAL_RANK', '0')}"
    if args.kill_in_save is not None:
        kill_in_save(args.kill_in_save)
    for run in args.runs:
        name, steps = run.split(":")
        fit(args, name, int(steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
