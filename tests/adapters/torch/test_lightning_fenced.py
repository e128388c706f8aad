"""``ckptfmt_torch.lightning.CheckpointIO(fenced=True)`` with the real Lightning Trainer: a
checkpoint at every step whose copy overlaps the next step's forward and backward (Lightning
runs them in the optimizer step's closure; the fence is passed after it), each holding the
state of its own step bit for bit; a parameter changed outside the optimizer before the fence
fails that save (nothing committed) and stops the fit with ``StateChangedError``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit.arrays import flat_tree as flat

pytest.importorskip("pytorch_lightning")

import ckptfmt_torch.lightning
import pytorch_lightning as L
import torch
from _lightning_worker import Data, Net

import ckptfmt
from ckptfmt.errors import StateChangedError, UsageError

QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
pytestmark = [
    pytest.mark.torch,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
]


class Snapshot(L.Callback):
    """The model's parameters and the optimizer's state at every batch's end (before
    ``ModelCheckpoint``'s save there, which Lightning runs last), by global step."""

    def __init__(self) -> None:
        self.at: dict[int, dict[str, np.ndarray]] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl: Any, *args: Any) -> None:
        got = {f"state_dict/{k}": v.detach().clone().numpy() for k, v in pl.state_dict().items()}
        for i, st in trainer.optimizers[0].state_dict()["state"].items():
            got.update({f"optim/{i}/{k}": v.clone().numpy() for k, v in st.items()})
        self.at[trainer.global_step] = got


class Meddle(L.Callback):
    """At the start of batch ``at`` (after the last save, before the optimizer's step: the
    fence), a parameter changed in place outside the optimizer."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer: L.Trainer, pl: Any, *args: Any) -> None:
        if trainer.global_step == self.at:
            with torch.no_grad():
                pl.net[2].weight.mul_(2.0)


def saved(root: Path, step: int) -> dict[str, np.ndarray]:
    """Step ``step`` of the manager's level 1, as the Snapshot names it."""
    got = flat(ckptfmt.load(root / "local" / "n0" / ckptfmt.step_dir_name(step)))
    out = {k: v for k, v in got.items() if k.startswith("state_dict/")}
    for k, v in got.items():
        parts = k.split("/")
        if parts[:3] == ["optimizer_states", "0", "state"]:
            out["optim/" + "/".join(parts[3:])] = v
    return out


def trainer(root: Path, *callbacks: L.Callback, steps: int = 8) -> tuple[L.Trainer, Any]:
    plugin = ckptfmt_torch.lightning.CheckpointIO(
        fenced=True, local_dir=root / "local" / "{node}", node="n0", keep_local=50
    )
    cb = L.callbacks.ModelCheckpoint(root / "ckpt", every_n_train_steps=1, save_top_k=-1)
    t = L.Trainer(
        plugins=[plugin],
        callbacks=[*callbacks, cb],
        accelerator="cpu",
        max_steps=steps,
        **QUIET,
    )
    return t, plugin


def test_every_step_each_checkpoint_is_its_steps_state(tmp_path: Path) -> None:
    L.seed_everything(0, verbose=False)
    snap = Snapshot()
    fenced: list[Any] = []

    class Note(L.Callback):  # the plugin's saver, while it is there
        def on_train_end(self, trainer: L.Trainer, pl: Any) -> None:
            fenced.append(plugin._saver)

    t, plugin = trainer(tmp_path, snap, Note())
    t.fit(Net(), datamodule=Data())
    assert sorted(snap.at) == list(range(1, 9))
    for step, want in snap.at.items():
        got = saved(tmp_path, step)
        assert got.keys() == want.keys() and len(want) >= 8, step
        for k, v in want.items():
            assert got[k].dtype == v.dtype and np.array_equal(got[k], v), (step, k)
        assert ckptfmt.verify(tmp_path / "local" / "n0" / ckptfmt.step_dir_name(step)).healthy
    # the saves went through the fence: one blocked time per save, the fence removed since
    saver = fenced[0]
    assert saver is not None and len(saver.blocked_s) == 8 and not saver._hooks


def test_a_parameter_changed_outside_the_optimizer_fails_that_save(tmp_path: Path) -> None:
    L.seed_everything(0, verbose=False)
    snap = Snapshot()
    t, _ = trainer(tmp_path, snap, Meddle(at=5))
    with pytest.raises(StateChangedError, match=r"step 5 .*net\.2\.weight") as caught:
        t.fit(Net(), datamodule=Data())
    assert not caught.value.committed
    steps = sorted(p.name for p in (tmp_path / "local" / "n0").glob("step-*"))
    assert steps == [ckptfmt.step_dir_name(s) for s in range(1, 5)]  # 5 never committed
    for step in range(1, 5):
        got = saved(tmp_path, step)
        for k, v in snap.at[step].items():
            assert np.array_equal(got[k], v), (step, k)


def test_fenced_needs_the_manager() -> None:
    with pytest.raises(UsageError, match="fenced=True"):
        ckptfmt_torch.lightning.CheckpointIO(fenced=True)
