"""PyTorch Lightning with ``ckptfmt_torch.lightning.CheckpointIO``: the real Trainer on CPU.

``ModelCheckpoint`` (top-k, ``save_last``, ``every_n_train_steps``, its deletions) leaves
committed ckptfmt directories under Lightning's names; a run stopped (or SIGKILLed) after a
checkpoint and resumed with ``ckpt_path="last"`` ends bit for bit where an uninterrupted run
ends, and where the same resume through Lightning's default ``TorchCheckpointIO`` ends;
``AsyncCheckpointIO`` wraps it; 2-process DDP (rank 0 writing, every rank writing its share,
the manager's levels with a node's copy rebuilt from parity); refused objects and damaged
shards are named and nothing is half-written or half-loaded.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pytorch_lightning")

import ckptfmt_torch.lightning
import pytorch_lightning as L
import torch
from _lightning_worker import Data, Net, end_state, make_io
from kit import REPO
from kit.faults import flip
from pytorch_lightning.demos.boring_classes import BoringDataModule, BoringModel

import ckptfmt
from ckptfmt.errors import (
    ChecksumError,
    DamagedError,
    PickleRefusedError,
    UnsupportedValueError,
    UsageError,
)

QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Equal, with the same container types; tensors bit for bit (dtype, shape, bytes)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        assert got.reshape(-1).view(torch.uint8).equal(want.reshape(-1).view(torch.uint8)), where
    elif isinstance(want, dict):  # an OrderedDict (a module's state dict) loads as a dict
        assert isinstance(got, dict) and list(got) == list(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{where}/{i}")
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"


def fit(root: Path, max_steps: int, plugin: Any, **checkpoint: Any) -> dict[str, Any]:
    """One fit as the worker makes it (``ckpt_path="last"``: resumes when there is one);
    returns the end state."""
    L.seed_everything(0, verbose=False)
    model, dm = Net(), Data()
    opts = {"save_last": True, "every_n_train_steps": 4, "save_top_k": -1, **checkpoint}
    trainer = L.Trainer(
        plugins=[plugin],
        callbacks=[L.callbacks.ModelCheckpoint(root, **opts)],
        accelerator="cpu",
        max_steps=max_steps,
        **QUIET,
    )
    trainer.fit(model, datamodule=dm, ckpt_path="last")
    return end_state(model, trainer)


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def readme_lines(max_steps: int) -> L.Trainer:
    """The README's lines as they are there (``max_steps`` aside)."""
    model, dm = BoringModel(), BoringDataModule()
    checkpoints = L.callbacks.ModelCheckpoint("lightning", save_last=True, every_n_train_steps=4)
    trainer = L.Trainer(
        plugins=[ckptfmt_torch.lightning.CheckpointIO()],
        callbacks=[checkpoints], max_steps=max_steps, logger=False, enable_progress_bar=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=dm, ckpt_path="last")  # resumes from the newest checkpoint
    return trainer


def test_readme_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fit by the README's lines, then the same lines resume it."""
    monkeypatch.chdir(tmp_path)
    assert readme_lines(8).ckpt_path is None
    assert readme_lines(12).ckpt_path == str(tmp_path / "lightning" / "last.ckpt")
    assert ckptfmt.verify("lightning/last.ckpt").healthy
    assert ckptfmt.open("lightning/last.ckpt").manifest.step == 12
    assert sorted(os.listdir("lightning")) == ["epoch=0-step=12.ckpt", "last.ckpt"]


def test_model_checkpoint_top_k_last_and_deletions(tmp_path: Path) -> None:
    plugin = ckptfmt_torch.lightning.CheckpointIO()
    L.seed_everything(0, verbose=False)
    cb = L.callbacks.ModelCheckpoint(
        tmp_path, monitor="train_loss", save_top_k=2, save_last=True, every_n_train_steps=2
    )
    trainer = L.Trainer(plugins=[plugin], callbacks=[cb], max_steps=12, **QUIET)
    trainer.fit(Net(), datamodule=Data())
    kept = {Path(p).name for p in cb.best_k_models}
    assert len(kept) == 2 and Path(cb.last_model_path).name == "last.ckpt"
    assert set(os.listdir(tmp_path)) == kept | {"last.ckpt"}  # 6 saved, 4 deleted, no leftovers
    for name in kept | {"last.ckpt"}:
        assert ckptfmt.verify(tmp_path / name).healthy
    assert ckptfmt.open(tmp_path / "last.ckpt").manifest.step == 12
    got = plugin.load_checkpoint(tmp_path / cb.best_model_path)
    assert got["callbacks"][cb.state_key]["best_model_path"] == cb.best_model_path


def test_dict_matches_torch_checkpoint_io(tmp_path: Path) -> None:
    """The same dict as Lightning's default IO gives back, container types included; the
    loads move tensors as ``map_location`` says."""
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(max_steps=5, enable_checkpointing=False, **QUIET)
    trainer.fit(Net(), datamodule=Data())
    ck = trainer._checkpoint_connector.dump_checkpoint()
    ours, theirs = ckptfmt_torch.lightning.CheckpointIO(), L.plugins.TorchCheckpointIO()
    ours.save_checkpoint(ck, tmp_path / "a.ckpt")
    theirs.save_checkpoint(ck, tmp_path / "b.ckpt")
    want = theirs.load_checkpoint(tmp_path / "b.ckpt")
    assert_same(ours.load_checkpoint(tmp_path / "a.ckpt"), want)
    assert_same(want, ck)
    ours.save_checkpoint(ck, tmp_path / "a.ckpt")  # rewritten in place (last.ckpt is)
    assert leftovers(tmp_path) == []
    meta = ours.load_checkpoint(tmp_path / "a.ckpt", map_location="meta")
    assert meta["state_dict"]["net.0.weight"].is_meta
    same = ours.load_checkpoint(tmp_path / "a.ckpt", map_location=lambda storage, loc: storage)
    assert_same(same, want)
    assert ours.load_checkpoint(tmp_path / "a.ckpt", map_location={"cpu": "meta"})[
        "optimizer_states"
    ][0]["state"][0]["exp_avg"].is_meta


@pytest.mark.slow
def test_resume_is_bitwise(tmp_path: Path) -> None:
    """Stopped after a checkpoint at an epoch's end and resumed: the end state of an
    uninterrupted run, through ckptfmt, ckptfmt in AsyncCheckpointIO and the manager's levels,
    as through Lightning's TorchCheckpointIO. Stopped mid-epoch, Lightning starts the epoch's
    data over (its behaviour, whatever the IO): ckptfmt's resume still equals the default's."""
    whole = fit(tmp_path / "whole", 12, ckptfmt_torch.lightning.CheckpointIO())
    for io, mode in [("torch", "rank0"), ("ckptfmt", "rank0"), ("async", "rank0"),
                     ("ckptfmt", "levels")]:  # fmt: skip
        root, levels = tmp_path / f"{io}-{mode}", tmp_path / f"{io}-{mode}-levels"
        fit(root, 8, make_io(io, mode, levels))
        assert_same(fit(root, 12, make_io(io, mode, levels)), whole, f"{io} {mode}")
    mid = {}
    for io in ("torch", "ckptfmt"):
        fit(tmp_path / f"mid-{io}", 4, make_io(io, "rank0", tmp_path))
        mid[io] = fit(tmp_path / f"mid-{io}", 12, make_io(io, "rank0", tmp_path))
    assert_same(mid["ckptfmt"], mid["torch"])


def run_worker(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``python -m _lightning_worker args`` under coreutils ``timeout`` (a hung DDP job is
    killed with its process group: Lightning's ranks are the worker's children)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO / "tests/workers")]),
    }
    cmd = ["timeout", "-k", "5", str(timeout), sys.executable, "-m", "_lightning_worker", *args]
    start = time.monotonic()
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert time.monotonic() - start < timeout, f"timed out\n{out.stderr[-4000:]}"
    return out


def ok(out: subprocess.CompletedProcess[str]) -> None:
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-6000:]}"


def end(root: Path, name: str) -> Any:
    return torch.load(root / f"{name}.end.pt", weights_only=True)


@pytest.mark.slow
def test_sigkill_then_resume(tmp_path: Path) -> None:
    killed = run_worker("--root", str(tmp_path), "--runs", "k:12", "--kill-at", "8")
    assert killed.returncode in (-9, 128 + 9), killed.stderr[-4000:]  # SIGKILL after step 8
    saved = ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]
    assert sorted(os.listdir(tmp_path / "k")) == saved
    ok(run_worker("--root", str(tmp_path), "--runs", "k:12", "u:12"))
    assert_same(end(tmp_path, "k"), end(tmp_path, "u"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "io"),
    [("rank0", "ckptfmt"), ("rank0", "async"), ("collective", "async")],
)
def test_ddp_two_processes(tmp_path: Path, mode: str, io: str) -> None:
    """``strategy="ddp"`` (rank 0 writes) and ``ckptfmt_torch.lightning.DDPStrategy`` (every
    rank its share): 12 steps, and 8 resumed to 12, end the same."""
    ok(run_worker("--devices", "2", "--mode", mode, "--io", io, "--root", str(tmp_path),
                  "--runs", "a:12", "b:8", "b:12"))  # fmt: skip
    assert_same(end(tmp_path, "b"), end(tmp_path, "a"))
    doc = ckptfmt.open(tmp_path / "b" / "last.ckpt").manifest
    writers = {r.rank for e in doc.tensors() for r in e.regions}
    assert writers == ({0, 1} if mode == "collective" else {0})


@pytest.mark.slow
def test_collective_under_lightnings_ddp_is_refused_not_hung(tmp_path: Path) -> None:
    """Lightning's own DDPStrategy calls the plugin on rank 0 alone: a collective plugin says
    which strategy it needs at the first save instead of waiting for the other rank."""
    out = run_worker("--devices", "2", "--mode", "collective", "--plain-ddp",
                     "--root", str(tmp_path), "--runs", "a:8", timeout=120)  # fmt: skip
    assert out.returncode != 0
    assert "strategy=ckptfmt_torch.lightning.DDPStrategy()" in out.stderr
    assert not (tmp_path / "a").exists() or os.listdir(tmp_path / "a") == []


@pytest.mark.slow
def test_ddp_levels_rebuild_a_lost_node(tmp_path: Path) -> None:
    """The manager's levels under 2-process DDP: node ``n1``'s level-1 copy of the step to
    resume and its level-3 flush lost; rebuilt from the other node's parity, bit for bit."""
    args = ["--devices", "2", "--mode", "levels", "--root", str(tmp_path)]
    ok(run_worker(*args, "--runs", "a:12", "b:8"))
    levels = tmp_path / "b-levels"
    assert (tmp_path / "b" / "last.ckpt").is_file()  # the pointer to step 8
    shutil.rmtree(levels / "local" / "n1" / "step-0000000008")
    shutil.rmtree(levels / "shared" / "step-0000000008")
    ok(run_worker(*args, "--runs", "b:12"))
    assert_same(end(tmp_path, "b"), end(tmp_path, "a"))


def test_unsupported_hyperparameter_is_named_and_nothing_written(tmp_path: Path) -> None:
    L.seed_everything(0, verbose=False)
    extra = argparse.Namespace(data="/data")
    cb = L.callbacks.ModelCheckpoint(tmp_path, every_n_train_steps=2)
    trainer = L.Trainer(
        plugins=[ckptfmt_torch.lightning.CheckpointIO()], callbacks=[cb], max_steps=2, **QUIET
    )
    with pytest.raises(UnsupportedValueError) as info:
        trainer.fit(Net(extra=extra), datamodule=Data())
    assert info.value.name == "hyper_parameters/extra"
    assert "objects='pickle'" in str(info.value)
    assert os.listdir(tmp_path) == []
    plugin = ckptfmt_torch.lightning.CheckpointIO(objects="pickle")
    trainer = L.Trainer(plugins=[plugin], callbacks=[cb], max_steps=2, **QUIET)
    trainer.fit(Net(extra=extra), datamodule=Data())
    with pytest.raises(PickleRefusedError, match="hyper_parameters/extra"):
        plugin.load_checkpoint(cb.last_model_path or cb.best_model_path)
    trusted = ckptfmt_torch.lightning.CheckpointIO(trust_pickle=True)
    assert trusted.load_checkpoint(cb.best_model_path)["hyper_parameters"]["extra"] == extra


def test_damaged_shard_at_resume_is_named(tmp_path: Path) -> None:
    fit(tmp_path, 8, ckptfmt_torch.lightning.CheckpointIO())
    shard = tmp_path / "last.ckpt" / "state_dict" / "net.0.weight" / "c" / "0" / "0"
    flip(shard)
    L.seed_everything(0, verbose=False)
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = L.Trainer(
        plugins=[ckptfmt_torch.lightning.CheckpointIO()],
        callbacks=[L.callbacks.ModelCheckpoint(tmp_path, save_last=True)],
        max_steps=12,
        **QUIET,
    )
    with pytest.raises(ChecksumError) as info:
        trainer.fit(model, datamodule=Data(), ckpt_path="last")
    assert isinstance(info.value, DamagedError)
    assert "state_dict/net.0.weight/c/0/0" in str(info.value)
    assert_same(model.state_dict(), before)  # nothing of the checkpoint reached the model


def test_remove_checkpoint(tmp_path: Path) -> None:
    plugin = ckptfmt_torch.lightning.CheckpointIO()
    plugin.remove_checkpoint(tmp_path / "absent.ckpt")  # nothing there: nothing to do
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    with pytest.raises(UsageError, match="not a ckptfmt checkpoint"):
        plugin.remove_checkpoint(other)
    assert (other / "notes.txt").read_text() == "keep"
    plugin.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, tmp_path / "x.ckpt")
    plugin.remove_checkpoint(tmp_path / "x.ckpt")
    assert sorted(os.listdir(tmp_path)) == ["mine"]
    with pytest.raises(UsageError, match="WriteOptions"):
        plugin.save_checkpoint({}, tmp_path / "y.ckpt", storage_options={"a": 1})
