"""A Hugging Face ``Trainer`` run checkpointed with ``ckptfmt_torch.hf``: ``_hf_worker.py
PLAN.json``, alone or under ``torchrun`` (DDP on CPU, gloo), for
``tests/adapters/torch/test_hf_trainer.py``, which also imports :func:`build` and :func:`run`
to train in its own process.

The model is a tiny GPT-2 built from a config (no download) with dropout on, the data random
tokens that HF's sampler shuffles (seeded), so that a resumed run ends bit-identical to an
uninterrupted one only if the model, the optimizer, the LR schedule, every rank's RNG and the
data position all come back.

``PLAN.json``: ``{"out": DIR, "mode": "ckptfmt" | "async" | "hf", "max_steps": 24,
"save_steps": 4, "stop_at": N or null, "kill_at": N or null, "resume": null | true | PATH,
"limit": K or null, "result": PREFIX, "record": false}``. ``stop_at``: training stops after
step N (an interrupted run, its checkpoints as they are); ``kill_at``: the process SIGKILLs
itself right after the save of step N was handed over (an async save may still be in flight);
``kill_in_save``: it SIGKILLs itself in the middle of its N-th commit of a checkpoint directory
(every file staged, not yet renamed into place; a manager's flush to level 3 is one too).
Each rank
writes ``PREFIX.rank<r>.npz`` (:func:`final_state`) at the end, and with ``record`` the
dataset indices of its batches to ``PREFIX.seen.rank<r>.json``; after a restore through the
manager, its step, level and refusals to ``PREFIX.restore.rank<r>.json``. ``"options":
{"local_dir": ..., "shared_dir": ...}``: saves through the manager (``CheckpointOptions`` of
those fields).
Mode ``"reference"``: HF's own ``Trainer`` resuming from HF's own files with the data position
handed to it by hand, ``"position": [epoch, steps_to_skip, epochs]`` (see
:class:`HandSetPosition`). Several plans (``_hf_worker.py A.json B.json``) run one after the
other in the same processes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from ckptfmt_torch.hf import CheckpointOptions, Trainer
from kit.crash import kill_in_save
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

N_SAMPLES, SEQ, VOCAB = 64, 16, 64


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random token sequences, the same in every process."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randint(0, VOCAB, (N_SAMPLES, SEQ), generator=g)

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class StopAt(transformers.TrainerCallback):
    """Stops training after step ``n``, or SIGKILLs the process once step ``n`` is saved."""

    def __init__(self, n: int, kill: bool = False) -> None:
        self.n, self.kill = n, kill

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if not self.kill and state.global_step >= self.n:
            control.should_training_stop = True

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.kill and state.global_step >= self.n:
            os.kill(os.getpid(), signal.SIGKILL)


class PerRankSeed(transformers.TrainerCallback):
    """Seeds each rank's generators differently at the start (HF seeds them alike), so that a
    resume must give every rank its own RNG back; on resume HF then restores them from the
    checkpoint."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        torch.manual_seed(1000 + args.process_index)


class HandSetPosition(transformers.Trainer):
    """HF's own ``Trainer`` resumed from HF's own checkpoint files, with the data position given
    by hand instead of HF's ``global_step % steps_per_epoch``: ``(epoch, steps, epochs)``: resume
    in ``epoch`` skipping ``steps`` optimizer steps of this run's loader, and run up to
    ``epochs`` epochs (HF counts them from ``max_steps`` at this size, too few when the epochs
    of the run that saved were longer). The reference of a resume at another number of ranks:
    nothing of ckptfmt takes part in it."""

    def __init__(self, *args: Any, position: list[int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.position = position

    def set_initial_training_values(self, args: Any, dataloader: Any) -> Any:
        values = list(super().set_initial_training_values(args, dataloader))
        values[0] = self.position[2]
        return tuple(values)

    def _init_training_state(self, *args: Any) -> tuple[int, int]:
        super()._init_training_state(*args)  # HF's trainer_state.json, callbacks, references
        epoch, steps = self.position[0], self.position[1]
        return epoch, steps * self.args.gradient_accumulation_steps


def model_and_args(
    out: str | os.PathLike[str], max_steps: int = 24, save_steps: int = 4, limit: int | None = None
) -> tuple[GPT2LMHeadModel, TrainingArguments, Tokens]:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=SEQ,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        str(out),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=save_steps,
        save_total_limit=limit,
        logging_steps=1000,
        seed=0,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return model, args, Tokens()


def build(
    out: str | os.PathLike[str],
    *,
    mode: str = "ckptfmt",
    max_steps: int = 24,
    save_steps: int = 4,
    limit: int | None = None,
    stop_at: int | None = None,
    kill_at: int | None = None,
    options: CheckpointOptions | None = None,
    position: list[int] | None = None,
) -> transformers.Trainer:
    """A trainer of the tiny model: ``mode`` ``"hf"`` is HF's own ``Trainer``, ``"reference"``
    HF's own with a ``position`` given by hand (:class:`HandSetPosition`), ``"async"`` ours
    with background saves, ``"ckptfmt"`` ours as the README enables it."""
    model, args, data = model_and_args(out, max_steps, save_steps, limit)
    if mode == "reference":
        if position is None:
            raise ValueError("mode 'reference' needs a position")
        trainer: transformers.Trainer = HandSetPosition(
            model=model, args=args, train_dataset=data, position=position
        )
    elif mode == "hf":
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    elif options is not None:
        trainer = Trainer(model=model, args=args, train_dataset=data, ckptfmt=options)
    elif mode == "async":  # the README's lines
        trainer = Trainer(
            model=model, args=args, train_dataset=data, ckptfmt=CheckpointOptions(async_save=True)
        )
    else:
        trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.add_callback(PerRankSeed())
    if stop_at is not None:
        trainer.add_callback(StopAt(stop_at))
    if kill_at is not None:
        trainer.add_callback(StopAt(kill_at, kill=True))
    return trainer


def final_state(trainer: transformers.Trainer) -> dict[str, np.ndarray]:
    """Every parameter, its optimizer state (by parameter name) and this rank's torch RNG."""
    out: dict[str, np.ndarray] = {}
    model = trainer.accelerator.unwrap_model(trainer.model)
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    for name, p in model.named_parameters():
        out[f"param/{name}"] = p.detach().numpy().copy()
        for key, value in (opt.state.get(p, {}) if opt is not None else {}).items():
            out[f"optim/{name}/{key}"] = torch.as_tensor(value).numpy().copy()
    out["rng/torch"] = torch.get_rng_state().numpy().copy()
    return out


def record(trainer: transformers.Trainer) -> list[list[int]]:
    """The dataset indices of every training batch the model is given on this rank, in order
    (a forward pre-hook: what the model saw, whatever the loader skipped)."""
    rows = {tuple(r.tolist()): i for i, r in enumerate(Tokens().x)}
    seen: list[list[int]] = []

    def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if module.training:
            seen.append([rows[tuple(r.tolist())] for r in kwargs["input_ids"]])

    trainer.model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def run(
    out: str | os.PathLike[str],
    resume: str | bool | None = None,
    seen: list[list[int]] | None = None,
    **kw: Any,
) -> Any:
    """Train as :func:`build` says; return the trainer. ``seen``: a list to fill with the
    dataset indices of every batch (:func:`record`)."""
    trainer = build(out, **kw)
    hooked = record(trainer) if seen is not None else []
    trainer.train(resume_from_checkpoint=resume)
    if seen is not None:
        seen.extend(hooked)
    return trainer


def main() -> None:
    for path in sys.argv[1:]:
        plan = json.loads(Path(path).read_text())
        if plan.get("kill_in_save"):
            kill_in_save(plan["kill_in_save"])
        keys = ("mode", "max_steps", "save_steps", "limit", "stop_at", "kill_at", "position")
        kw: dict[str, Any] = {k: plan[k] for k in keys if plan.get(k)}
        if plan.get("options"):
            kw["options"] = CheckpointOptions(**plan["options"])
        seen: list[list[int]] | None = [] if plan.get("record") else None
        trainer = run(plan["out"], plan.get("resume"), seen, **kw)
        rank = int(os.environ.get("RANK", "0"))
        np.savez(f"{plan['result']}.rank{rank}.npz", **final_state(trainer))
        if seen is not None:
            Path(f"{plan['result']}.seen.rank{rank}.json").write_text(json.dumps(seen))
        mgr = getattr(trainer, "checkpoint_manager", None)
        report = None if mgr is None else mgr.last_restore
        if report is not None:  # what the manager's restore took
            took = {"step": report.step, "level": report.level, "tried": report.tried}
            Path(f"{plan['result']}.restore.rank{rank}.json").write_text(json.dumps(took))
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
