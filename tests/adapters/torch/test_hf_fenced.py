"""``CheckpointOptions(async_save=True, fenced=True)`` on the real Hugging Face ``Trainer`` (the
tiny GPT-2 of ``tests/workers/_hf_worker.py``): a checkpoint at every step whose copy overlaps
the next step's forward and backward, the optimizer's step the fence, each checkpoint the
state of its own step bit for bit; a parameter changed outside the optimizer before the fence
fails that save (nothing committed) and stops the training with ``StateChangedError``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit.arrays import flat_tree as flat

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch
import transformers
from _hf_worker import model_and_args
from ckptfmt_torch.hf import CheckpointOptions, Trainer

import ckptfmt
from ckptfmt.errors import StateChangedError, UsageError

pytestmark = pytest.mark.torch
STEPS = 6


class Snapshot(transformers.TrainerCallback):
    """Every parameter and its optimizer state at each step's end, before the trainer's save
    (the callbacks' ``on_step_end`` runs first), by global step."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.at: dict[int, dict[str, np.ndarray]] = {}

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        opt = getattr(self.trainer.optimizer, "optimizer", self.trainer.optimizer)
        params = [p for g in opt.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(params)}  # state_dict()'s numbering
        got: dict[str, np.ndarray] = {}
        for name, p in model.named_parameters():
            got[f"model/{name}"] = p.detach().numpy().copy()
            for k, v in opt.state.get(p, {}).items():
                got[f"optimizer/state/{index[id(p)]}/{k}"] = torch.as_tensor(v).numpy().copy()
        self.at[state.global_step] = got


class Meddle(transformers.TrainerCallback):
    """At the start of step ``at`` (after the last save, before the optimizer's step: the
    fence), a parameter changed in place outside the optimizer."""

    def __init__(self, at: int) -> None:
        self.trainer: Any = None
        self.at = at

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.at:
            model = self.trainer.accelerator.unwrap_model(self.trainer.model)
            with torch.no_grad():
                model.transformer.h[0].mlp.c_fc.weight.mul_(2.0)


def trainer(out: Path, *callbacks: Any) -> Trainer:
    model, args, data = model_and_args(out, max_steps=STEPS, save_steps=1)
    options = CheckpointOptions(
        async_save=True,
        fenced=True,
        local_dir=str(out / "local" / "{node}"),
        node="n0",
        keep_local=STEPS + 1,
    )
    t = Trainer(model=model, args=args, train_dataset=data, ckptfmt=options)
    for cb in callbacks:
        cb.trainer = t
        t.add_callback(cb)
    return t


def saved(out: Path, step: int) -> dict[str, np.ndarray]:
    got = flat(ckptfmt.load(out / "local" / "n0" / ckptfmt.step_dir_name(step)))
    return {k: v for k, v in got.items() if k.startswith(("model/", "optimizer/state/"))}


def test_every_step_each_checkpoint_is_its_steps_state(tmp_path: Path) -> None:
    snap = Snapshot()
    t = trainer(tmp_path, snap)
    t.train()
    assert sorted(snap.at) == list(range(1, STEPS + 1))
    for step, want in snap.at.items():
        got = saved(tmp_path, step)
        wanted = {k: v for k, v in want.items() if k != "model/lm_head.weight"}  # tied
        assert got.keys() == wanted.keys(), step
        for k, v in wanted.items():
            assert got[k].dtype == v.dtype and np.array_equal(got[k], v), (step, k)
    assert t._ckptfmt_saver is None  # closed when train() returned: the fence is off
    assert not t.optimizer.optimizer._optimizer_step_pre_hooks


def test_a_parameter_changed_outside_the_optimizer_fails_that_save(tmp_path: Path) -> None:
    snap = Snapshot()
    t = trainer(tmp_path, snap, Meddle(at=3))
    with pytest.raises(StateChangedError, match=r"step 3 .*c_fc\.weight") as caught:
        t.train()
    assert not caught.value.committed
    steps = sorted(p.name for p in (tmp_path / "local" / "n0").glob("step-*"))
    assert steps == [ckptfmt.step_dir_name(s) for s in (1, 2)]  # 3 never committed
    for step in (1, 2):
        got = saved(tmp_path, step)
        for k, v in snap.at[step].items():
            if k in got:
                assert np.array_equal(got[k], v), (step, k)


def test_fenced_needs_background_saves() -> None:
    with pytest.raises(UsageError, match="async_save=True"):
        CheckpointOptions(fenced=True, local_dir="/tmp/x/{node}")
