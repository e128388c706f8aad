"""PyTorch Lightning with ``ckptfmt_torch.lightning.CheckpointIO``: the real Trainer on CPU.

``ModelCheckpoint`` (top-k, ``save_last``, ``every_n_train_steps``, its deletions) leaves
committed ckptfmt directories under Lightning's names; a run stopped (or SIGKILLed) after a
checkpoint and resumed with ``ckpt_path="last"`` ends bit for bit where an uninterrupted run
ends, and where the same resume through Lightning's default ``TorchCheckpointIO`` ends;
``AsyncCheckpointIO`` wraps it and keeps what it keeps around Lightning's own IO; 2-process DDP
(rank 0 writing, every rank writing its share, the manager's levels with a node's copy rebuilt
from parity, a run SIGKILLed mid-epoch resumed bit for bit with ``DataPosition``); the dict
comes back as saved (``OrderedDict`` and ``_metadata``); ``load_from_checkpoint`` and
``trainer.validate/test/predict(ckpt_path=...)`` give what they give from Lightning's own
files; refused objects and damaged shards are named (with the checkpoint to resume from
instead) and nothing is half-written or half-loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pytorch_lightning")

import ckptfmt_torch.lightning
import pytorch_lightning as L
import torch
from _lightning_worker import Data, Net, ShuffledData, end_state, make_io
from kit import REPO
from kit.faults import flip
from kit.s3 import S3
from pytorch_lightning.demos.boring_classes import BoringDataModule, BoringModel

import ckptfmt
from ckptfmt.errors import (
    ChecksumError,
    DamagedError,
    NotACheckpointError,
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
    elif isinstance(want, dict):  # an OrderedDict with its _metadata, or a dict
        assert type(got) is type(want) and list(got) == list(want), where
        assert getattr(got, "_metadata", None) == getattr(want, "_metadata", None), where
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
def test_sigkill_in_the_middle_of_a_save_then_resume(tmp_path: Path) -> None:
    """SIGKILLed while ``last.ckpt`` of step 12 is being replaced (the 6th commit: every file
    of the new one staged, not yet renamed in): ``last.ckpt`` is still step 8's, whole (the end
    of the first epoch); the resume from it ends bit for bit where an uninterrupted run ends,
    and the next save of ``last.ckpt`` removes the staged copy the crash left (a whole
    checkpoint's bytes, one more every crash otherwise)."""
    killed = run_worker("--root", str(tmp_path), "--runs", "k:16", "--kill-in-save", "6")
    assert killed.returncode in (-9, 128 + 9), killed.stderr[-4000:]
    run = tmp_path / "k"
    assert [n.split("-")[0] for n in leftovers(run)] == [".last.ckpt.tmp"]
    assert ckptfmt.open(run / "last.ckpt").manifest.step == 8
    assert ckptfmt.verify(run / "last.ckpt").healthy
    ok(run_worker("--root", str(tmp_path), "--runs", "k:16", "u:16"))
    assert_same(end(tmp_path, "k"), end(tmp_path, "u"))
    assert leftovers(run) == []
    assert ckptfmt.open(run / "last.ckpt").manifest.step == 16


def test_levels_pointer_is_written_while_a_newer_save_to_it_is_in_flight(tmp_path: Path) -> None:
    """Through the manager, ``last.ckpt`` saved at step 4 and again at step 8 while step 4's
    save is still in flight (two saves in flight): once step 4 is committed it names step 4
    (the newest whole one until step 8 is committed: a run killed now resumes from it), then
    step 8, whose state it loads bit for bit."""
    asked, held, release = threading.Event(), threading.Event(), threading.Event()

    def on_save(report: Any) -> None:  # the saver thread, before the save's handle is done
        if report.step == 4:
            assert asked.wait(30)  # step 4 ends once step 8 is saved to the same names
        else:
            held.set()
            assert release.wait(30)

    io = ckptfmt_torch.lightning.CheckpointIO(
        shared_dir=tmp_path / "l3", saves_in_flight=2, on_save=on_save
    )
    run = tmp_path / "run"
    states = {s: {"global_step": s, "state_dict": {"w": torch.randn(5)}} for s in (4, 8)}
    for step, checkpoint in states.items():
        io.save_checkpoint(checkpoint, run / f"step={step}.ckpt")
        io.save_checkpoint(checkpoint, run / "last.ckpt")
    asked.set()
    assert held.wait(30)  # step 4 committed, step 8 written but not over
    try:
        assert json.loads((run / "last.ckpt").read_text())["step"] == 4
        assert sorted(os.listdir(run)) == ["last.ckpt", "step=4.ckpt"]
    finally:
        release.set()
        io.close()
    assert json.loads((run / "last.ckpt").read_text())["step"] == 8
    got = io.load_checkpoint(run / "last.ckpt")
    assert_same(got["state_dict"], states[8]["state_dict"])
    io.close()


def test_levels_under_async_io_are_in_when_fit_returns(tmp_path: Path) -> None:
    """``AsyncCheckpointIO`` around the manager's levels on one device (Lightning's own
    strategy, whose teardown does not reach the wrapped plugin): the last save, slow to commit,
    is in when ``fit`` returns: ``last.ckpt`` and the top-k file name step 8 and load its
    weights bit for bit."""

    def slow(report: Any) -> None:  # the saver thread, before the save's handle is done
        if report.step == 8:
            time.sleep(1.0)

    L.seed_everything(0, verbose=False)
    io = ckptfmt_torch.lightning.CheckpointIO(
        local_dir=tmp_path / "l1", shared_dir=tmp_path / "l3", on_save=slow
    )
    model, run = Net(), tmp_path / "run"
    trainer = L.Trainer(
        plugins=[L.plugins.AsyncCheckpointIO(io)],
        callbacks=[L.callbacks.ModelCheckpoint(run, save_last=True, every_n_train_steps=4)],
        max_steps=8,
        **QUIET,
    )
    trainer.fit(model, datamodule=Data())
    assert sorted(os.listdir(run)) == ["epoch=0-step=8.ckpt", "last.ckpt"]
    assert json.loads((run / "last.ckpt").read_text())["step"] == 8
    got = io.load_checkpoint(run / "last.ckpt")
    assert_same(dict(got["state_dict"]), dict(model.state_dict()))
    io.close()


@pytest.mark.slow
def test_levels_sigkill_in_a_flush_then_resume(tmp_path: Path) -> None:
    """Through the manager's levels, SIGKILLed while step 12 is flushed to level 3 (the 6th
    commit): step 12 is committed on level 1, but ``last.ckpt`` still names step 8 (its
    pointer follows the whole save), and ``ckpt_path="last"`` resumes from step 8 (not the
    newer step 12, not from scratch), ending bit for bit where an uninterrupted run ends."""
    args = ["--root", str(tmp_path), "--mode", "levels"]
    killed = run_worker(*args, "--runs", "k:16", "--kill-in-save", "6")
    assert killed.returncode in (-9, 128 + 9), killed.stderr[-4000:]
    local = tmp_path / "k-levels" / "local" / "n0"
    assert ckptfmt.open(local / "step-0000000012").manifest.step == 12
    assert json.loads((tmp_path / "k" / "last.ckpt").read_text())["step"] == 8
    ok(run_worker(*args, "--runs", "k:16", "u:16"))
    assert_same(end(tmp_path, "k"), end(tmp_path, "u"))
    assert json.loads((tmp_path / "k" / "last.ckpt").read_text())["step"] == 16


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
    """A flipped byte in ``last.ckpt``: the resume stops naming that checkpoint, the file in it
    and the newest other checkpoint; nothing reached the model; the call the message gives
    resumes from that one, and ends where an undamaged resume ends."""
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
    assert info.value.path == "state_dict/net.0.weight/c/0/0"  # the fields kept
    text = str(info.value)
    assert str(tmp_path / "last.ckpt") in text
    assert "state_dict/net.0.weight/c/0/0" in text
    older = tmp_path / "epoch=0-step=8.ckpt"
    assert f"an older checkpoint is beside it: {older} (step 8)" in text
    assert f"trainer.fit(model, ckpt_path={str(older)!r})" in text
    assert_same(dict(model.state_dict()), before)  # nothing of the checkpoint reached the model
    assert ckptfmt.verify(older).healthy  # the hint's checkpoint, resumed as it says
    shutil.rmtree(tmp_path / "last.ckpt")
    resumed = fit_from(tmp_path, 12, older)
    assert_same(resumed, fit(tmp_path / "whole", 12, ckptfmt_torch.lightning.CheckpointIO()))


def fit_from(root: Path, max_steps: int, ckpt_path: Path) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    model = Net()
    trainer = L.Trainer(
        plugins=[ckptfmt_torch.lightning.CheckpointIO()],
        callbacks=[L.callbacks.ModelCheckpoint(root, save_last=True, every_n_train_steps=4)],
        max_steps=max_steps,
        **QUIET,
    )
    trainer.fit(model, datamodule=Data(), ckpt_path=ckpt_path)
    return end_state(model, trainer)


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


KILLED_IN_A_REMOVAL = """
import os, shutil, signal, sys
import torch
import ckptfmt_torch.lightning
root = sys.argv[1]
plugin = ckptfmt_torch.lightning.CheckpointIO()
for name in ("a.ckpt", "b.ckpt"):
    plugin.save_checkpoint({"state_dict": {"w": torch.ones(1 << 16)}}, os.path.join(root, name))
real = shutil.rmtree
def rmtree(path, *args, **kwargs):
    if ".del-" in os.fspath(path):  # a.ckpt renamed out of sight, not yet deleted
        os.kill(os.getpid(), signal.SIGKILL)
    return real(path, *args, **kwargs)
shutil.rmtree = rmtree
plugin.remove_checkpoint(os.path.join(root, "a.ckpt"))
"""


@pytest.mark.slow
def test_a_removal_cut_by_sigkill_is_finished_by_the_next(tmp_path: Path) -> None:
    """SIGKILLed while ModelCheckpoint's removal of ``a.ckpt`` deletes it (out of sight under
    a dot name, whole): the next removal in the directory (``b.ckpt``) deletes it too, where
    nothing would ever come to remove a name Lightning no longer uses."""
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_IN_A_REMOVAL, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert [n.split("-")[0] for n in leftovers(tmp_path)] == [".a.ckpt.del"]
    assert sorted(os.listdir(tmp_path))[1:] == ["b.ckpt"]
    ckptfmt_torch.lightning.CheckpointIO().remove_checkpoint(tmp_path / "b.ckpt")
    assert os.listdir(tmp_path) == []


# --- AsyncCheckpointIO: what is kept --------------------------------------------------------------


class SlowIO(ckptfmt_torch.lightning.CheckpointIO):
    """Latency injected before each write (a file system slower than the training steps):
    every deletion ``ModelCheckpoint`` asks for meets its checkpoint's write still queued."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []

    def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
        self.asked.append(Path(path).name)
        time.sleep(0.05)
        super().save_checkpoint(checkpoint, path, storage_options)


def top_k_async(root: Path, io: Any) -> tuple[set[str], set[str]]:
    """The issue's run: 33 steps, top 2 by ``train_loss`` every 3 steps and ``last.ckpt``,
    through ``AsyncCheckpointIO(io)``; the names on disk, and those ModelCheckpoint keeps."""
    L.seed_everything(0, verbose=False)
    cb = L.callbacks.ModelCheckpoint(
        root, monitor="train_loss", save_top_k=2, save_last=True, every_n_train_steps=3
    )
    trainer = L.Trainer(
        plugins=[L.plugins.AsyncCheckpointIO(io)], callbacks=[cb], max_steps=33, **QUIET
    )
    trainer.fit(Net(), datamodule=Data())
    return set(os.listdir(root)), {Path(p).name for p in cb.best_k_models} | {"last.ckpt"}


@pytest.mark.slow
def test_async_keeps_what_lightnings_async_keeps(tmp_path: Path) -> None:
    """The same run through Lightning's ``AsyncCheckpointIO(TorchCheckpointIO())``, through
    ``AsyncCheckpointIO(ckptfmt_torch.lightning.CheckpointIO())``, and through the latter on a
    slow file system (every deletion asked for while its write is queued: the write is
    skipped): the same names stay, ModelCheckpoint's top 2 and ``last.ckpt``, and each loads
    as Lightning's file of the same name."""
    theirs, kept = top_k_async(tmp_path / "torch", L.plugins.TorchCheckpointIO())
    assert theirs == kept and len(kept) == 3
    ours, kept_ours = top_k_async(tmp_path / "ckptfmt", ckptfmt_torch.lightning.CheckpointIO())
    slow = SlowIO()
    on_slow, kept_slow = top_k_async(tmp_path / "slow", slow)
    assert ours == on_slow == theirs and kept_ours == kept_slow == kept
    assert set(slow.asked) - kept  # deletions were asked for (while their writes were queued)
    reference = L.plugins.TorchCheckpointIO()
    for name in theirs:
        want = reference.load_checkpoint(tmp_path / "torch" / name)
        for root in ("ckptfmt", "slow"):
            got = ckptfmt_torch.lightning.CheckpointIO().load_checkpoint(tmp_path / root / name)
            assert_same(got["state_dict"], want["state_dict"], f"{root}/{name}")
            assert got["global_step"] == want["global_step"]


class Gate:
    """A stateful object in the checkpoint whose ``state_dict()`` (called while the save
    converts the dict) waits for ``release``: a write held in progress."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def state_dict(self) -> dict[str, Any]:
        self.entered.set()
        assert self.release.wait(30)
        return {"n": 1}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


def test_deletion_during_or_before_a_threads_write(tmp_path: Path) -> None:
    """A deletion asked for while the checkpoint is being written in another thread happens
    once it is written; one asked for before that thread's write began skips it; one asked for
    on the saving thread itself (nothing queued) leaves a later save of the name alone."""
    plugin = ckptfmt_torch.lightning.CheckpointIO()
    gate, path = Gate(), tmp_path / "a.ckpt"
    writer = threading.Thread(
        target=plugin.save_checkpoint, args=({"w": torch.ones(3), "g": gate}, path)
    )
    writer.start()
    assert gate.entered.wait(30)
    plugin.remove_checkpoint(path)  # being written
    assert not path.exists()
    gate.release.set()
    writer.join(30)
    assert os.listdir(tmp_path) == []  # written, then removed; no staging left

    plugin.remove_checkpoint(tmp_path / "b.ckpt")  # queued, not begun
    writer = threading.Thread(
        target=plugin.save_checkpoint, args=({"w": torch.ones(3)}, tmp_path / "b.ckpt")
    )
    writer.start()
    writer.join(30)
    assert os.listdir(tmp_path) == []

    plugin.remove_checkpoint(tmp_path / "c.ckpt")  # nothing there, nothing queued
    plugin.save_checkpoint({"w": torch.ones(3)}, tmp_path / "c.ckpt")
    assert os.listdir(tmp_path) == ["c.ckpt"]

    for i in range(1000):  # deletions of names never written: remembered, but not without end
        plugin.remove_checkpoint(tmp_path / f"never-{i}.ckpt")
    bound = ckptfmt_torch.lightning.MAX_TOMBSTONES
    assert len(plugin._tombstones) == bound and not plugin._writing and not plugin._doomed


# --- the dict as saved ----------------------------------------------------------------------------


class Versioned(Net):
    """A module of version 3 that records the version ``load_state_dict`` passes it."""

    def __init__(self, width: int = 32, lr: float = 1e-2, extra: Any = None) -> None:
        super().__init__(width, lr, extra)
        self.net[0]._version = 3  # type: ignore[assignment]
        self.net[0]._load_from_state_dict = self.record  # type: ignore[method-assign]
        self.seen: list[Any] = []

    def record(self, state_dict: Any, prefix: str, local_metadata: Any, *args: Any) -> None:
        self.seen.append(local_metadata.get("version"))
        torch.nn.Linear._load_from_state_dict(
            self.net[0], state_dict, prefix, local_metadata, *args
        )


def test_ordered_dict_and_metadata_come_back(tmp_path: Path) -> None:
    """``state_dict`` loads an ``OrderedDict`` with the ``_metadata`` it was saved with (also
    moved by ``map_location``); a resume passes the saved module version to the module."""
    L.seed_everything(0, verbose=False)
    cb = L.callbacks.ModelCheckpoint(tmp_path, save_last=True, every_n_train_steps=4)
    plugin = ckptfmt_torch.lightning.CheckpointIO()
    trainer = L.Trainer(plugins=[plugin], callbacks=[cb], max_steps=4, **QUIET)
    model = Versioned()
    trainer.fit(model, datamodule=Data())
    ck = trainer._checkpoint_connector.dump_checkpoint()
    assert isinstance(ck["state_dict"], OrderedDict) and ck["state_dict"]._metadata["net.0"] == {
        "version": 3
    }
    plugin.save_checkpoint(ck, tmp_path / "x.ckpt")
    got = plugin.load_checkpoint(tmp_path / "x.ckpt")
    assert_same(got, ck)
    assert_same(plugin.load_checkpoint(tmp_path / "x.ckpt", map_location="cpu"), ck)
    meta = plugin.load_checkpoint(tmp_path / "x.ckpt", map_location="meta")["state_dict"]
    assert type(meta) is OrderedDict and meta._metadata == ck["state_dict"]._metadata
    L.seed_everything(0, verbose=False)
    resumed = Versioned()
    trainer = L.Trainer(plugins=[plugin], max_steps=5, enable_checkpointing=False, **QUIET)
    trainer.fit(resumed, datamodule=Data(), ckpt_path=tmp_path / "last.ckpt")
    assert resumed.seen == [3]


# --- load_from_checkpoint; validate, test and predict from a checkpoint --------------------------


class Wider(Net):
    """Net with one more layer: a checkpoint of Net lacks its weights (``strict`` decides)."""

    def __init__(self, width: int = 32, lr: float = 1e-2, extra: Any = None) -> None:
        super().__init__(width, lr, extra)
        self.head = torch.nn.Linear(4, 4)


def two_fits(tmp_path: Path) -> tuple[Path, Path]:
    """The same 8 steps of ``Net(width=16, lr=0.02)`` saved through ckptfmt and through
    Lightning's ``TorchCheckpointIO``; the two ``last.ckpt``."""
    for name, io in (
        ("ours", ckptfmt_torch.lightning.CheckpointIO()),
        ("theirs", L.plugins.TorchCheckpointIO()),
    ):
        L.seed_everything(0, verbose=False)
        cb = L.callbacks.ModelCheckpoint(tmp_path / name, save_last=True, every_n_train_steps=4)
        trainer = L.Trainer(plugins=[io], callbacks=[cb], max_steps=8, **QUIET)
        trainer.fit(Net(width=16, lr=0.02), datamodule=Data())
    return tmp_path / "ours" / "last.ckpt", tmp_path / "theirs" / "last.ckpt"


def same_model(got: L.LightningModule, want: L.LightningModule) -> None:
    assert type(got) is type(want) and dict(got.hparams) == dict(want.hparams)
    assert_same(got.state_dict(), want.state_dict())
    assert got.device == want.device and got.training == want.training


def test_load_from_checkpoint(tmp_path: Path) -> None:
    """``ckptfmt_torch.lightning.load_from_checkpoint(Cls, path, ...)`` and Lightning's own
    ``Cls.load_from_checkpoint(path, ...)`` on the ckptfmt directory give what Lightning gives
    from its own file: hyper-parameters saved and overridden, ``map_location``, ``strict``."""
    ours, theirs = two_fits(tmp_path)
    load = ckptfmt_torch.lightning.load_from_checkpoint
    want = Net.load_from_checkpoint(theirs)
    assert dict(want.hparams) == {"width": 16, "lr": 0.02, "extra": None}
    same_model(load(Net, ours), want)
    same_model(Net.load_from_checkpoint(ours), want)  # Lightning's own call, on the directory
    same_model(load(Net, str(ours), lr=0.5), Net.load_from_checkpoint(theirs, lr=0.5))
    for where in ("cpu", torch.device("cpu"), {"cpu": "cpu"}, lambda storage, loc: storage):
        same_model(load(Net, ours, map_location=where), want)
    L.seed_everything(5, verbose=False)  # the same initial head, which the checkpoint lacks
    loose = load(Wider, ours, strict=False)
    L.seed_everything(5, verbose=False)
    same_model(loose, Wider.load_from_checkpoint(theirs, strict=False))
    assert_same(loose.net.state_dict(), want.net.state_dict())
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"head.weight\""):
        load(Wider, ours)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"head.weight\""):
        Wider.load_from_checkpoint(theirs)
    same_model(load(Net, theirs), want)  # a torch file goes to Lightning's loader
    levels = tmp_path / "levels"
    fit(tmp_path / "managed", 8, make_io("ckptfmt", "levels", levels))
    pointer = tmp_path / "managed" / "last.ckpt"  # a file naming step 8 of the manager
    with pytest.raises(UsageError, match=r"names step 8 of a CheckpointManager.*checkpoint_io="):
        Net.load_from_checkpoint(pointer)
    io = make_io("ckptfmt", "levels", levels)
    try:
        managed = load(Net, pointer, checkpoint_io=io)
    finally:
        io.close()
    whole = fit(tmp_path / "whole", 8, make_io("torch", "", levels))
    assert_same(dict(managed.state_dict()), whole["params"])
    (tmp_path / "empty.ckpt").mkdir()
    with pytest.raises(NotACheckpointError, match=r"empty\.ckpt"):
        Net.load_from_checkpoint(tmp_path / "empty.ckpt")
    with pytest.raises(UsageError, match="LightningModule"):
        load(torch.nn.Linear, ours)  # type: ignore[type-var]


class Evaluated(Net):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        out: torch.Tensor = self.net(batch[0])
        return out


class EvalData(Data):
    def val_dataloader(self) -> Any:
        return self.train_dataloader()

    def test_dataloader(self) -> Any:
        return self.train_dataloader()

    def predict_dataloader(self) -> Any:
        return self.train_dataloader()


def evaluate(io: Any, path: Path | str) -> tuple[Any, Any, Any]:
    """``validate``, ``test`` and ``predict`` of a fresh (differently seeded) model with
    ``ckpt_path=path``, each on its own Trainer with ``io`` (None: Lightning's default)."""
    out = []
    for how in ("validate", "test", "predict"):
        L.seed_everything(7, verbose=False)
        trainer = L.Trainer(plugins=[io] if io is not None else None, **QUIET)
        out.append(getattr(trainer, how)(Evaluated(width=16), EvalData(), ckpt_path=path))
    return tuple(out)  # type: ignore[return-value]


def test_validate_test_predict_from_a_checkpoint(tmp_path: Path) -> None:
    """``trainer.validate/test/predict(model, ckpt_path=...)`` with the plugin give Lightning's
    results from its own file bit for bit (metrics and predictions), and differ from the
    fresh model's; a Trainer without the plugin reads the ckptfmt directory too."""
    ours, theirs = two_fits(tmp_path)
    want = evaluate(None, theirs)
    assert_same(evaluate(ckptfmt_torch.lightning.CheckpointIO(), ours), want)
    assert_same(evaluate(None, ours), want)
    L.seed_everything(7, verbose=False)
    fresh = L.Trainer(**QUIET).validate(Evaluated(width=16), EvalData())
    assert fresh[0]["val_loss"] != want[0][0]["val_loss"]


# --- the data position: mid-epoch resume ----------------------------------------------------------


def fit_shuffled(root: Path, max_steps: int, position: bool) -> dict[str, Any]:
    """A fit on ``ShuffledData`` (12 batches an epoch, a checkpoint at step 8), with or
    without ``DataPosition``; resumes from ``last`` when there is one. (Unsynced writes, as
    ``torch.save``'s: durability is not what is tested here.)"""
    L.seed_everything(0, verbose=False)
    model = Net()
    callbacks: list[L.Callback] = [
        L.callbacks.ModelCheckpoint(root, save_last=True, every_n_train_steps=8, save_top_k=-1)
    ]
    if position:
        callbacks.append(ckptfmt_torch.lightning.DataPosition())
    trainer = L.Trainer(
        plugins=[ckptfmt_torch.lightning.CheckpointIO(write=ckptfmt.WriteOptions(fsync=False))],
        callbacks=callbacks,
        max_steps=max_steps,
        use_distributed_sampler=False,
        **QUIET,
    )
    trainer.fit(model, datamodule=ShuffledData(), ckpt_path="last")
    return end_state(model, trainer)


def test_data_position_resumes_mid_epoch(tmp_path: Path) -> None:
    """Stopped at step 8 of a 12-batch epoch and resumed to 16 (into the next epoch): with
    ``DataPosition`` the end state of the uninterrupted run bit for bit; without it (Lightning's
    own resume) the epoch's data starts over and the end differs."""
    whole = fit_shuffled(tmp_path / "whole", 16, position=True)
    fit_shuffled(tmp_path / "kept", 8, position=True)
    got = ckptfmt_torch.lightning.CheckpointIO().load_checkpoint(tmp_path / "kept" / "last.ckpt")
    assert got["callbacks"]["DataPosition"] == {
        "epoch": 0,
        "batches": 8,
        "samples": [64],
        "world_size": 1,
    }
    assert_same(fit_shuffled(tmp_path / "kept", 16, position=True), whole)
    fit_shuffled(tmp_path / "lost", 8, position=False)
    lost = fit_shuffled(tmp_path / "lost", 16, position=False)
    assert lost["global_step"] == 16
    assert not torch.equal(lost["params"]["net.0.weight"], whole["params"]["net.0.weight"])


def test_data_position_says_what_the_loader_needs(tmp_path: Path) -> None:
    trainer = L.Trainer(
        callbacks=[ckptfmt_torch.lightning.DataPosition()],
        max_steps=2,
        enable_checkpointing=False,
        **QUIET,
    )
    with pytest.raises(UsageError, match=r"sampler=ckptfmt_torch.ResumableSampler\(dataset"):
        trainer.fit(Net(), datamodule=Data())


@pytest.mark.slow
def test_ddp_killed_mid_epoch_resumes_bitwise(tmp_path: Path) -> None:
    """``strategy="ddp"``, 2 processes (gloo): SIGKILLed at step 10 (the last checkpoint at
    step 8, 2 batches into the second epoch of 6 per rank) and resumed with ``ckpt_path="last"``
    to step 14: with ``ResumableSampler`` and ``DataPosition`` the end state of an
    uninterrupted run, bit for bit."""
    args = ["--devices", "2", "--data", "shuffled", "--root", str(tmp_path)]
    killed = run_worker(*args, "--runs", "k:14", "--kill-at", "10")
    assert killed.returncode in (-9, 128 + 9), killed.stderr[-4000:]
    assert (tmp_path / "k" / "epoch=1-step=8.ckpt").is_dir()
    assert not (tmp_path / "k" / "epoch=2-step=12.ckpt").exists()
    ok(run_worker(*args, "--runs", "k:14", "u:14"))
    assert_same(end(tmp_path, "k"), end(tmp_path, "u"))
    got = ckptfmt_torch.lightning.CheckpointIO().load_checkpoint(
        tmp_path / "k" / "epoch=1-step=8.ckpt"
    )
    assert got["callbacks"]["DataPosition"] == {
        "epoch": 1,
        "batches": 2,
        "samples": [32],  # 2 batches x 8 x 2 ranks of epoch 1's global order
        "world_size": 2,
    }


def _seen(root: Path, name: str, world: int) -> list[list[list[int]]]:
    """Each rank's batches (dataset indices) of the fit ``name`` at ``world`` devices."""
    return [
        json.loads((root / f"{name}.seen.w{world}.rank{r}.json").read_text()) for r in range(world)
    ]


def _global(ranks: list[list[list[int]]]) -> list[int]:
    """The indices in the job's global order: step by step, position in batch, rank."""
    return [r[s][j] for s in range(len(ranks[0])) for j in range(len(ranks[0][s])) for r in ranks]


@pytest.mark.slow
def test_resume_on_fewer_devices_continues_the_data(tmp_path: Path) -> None:
    """4 steps at 2 devices (64 of the epoch's 96 samples: 2 x 4 batches of 8), resumed at 1
    device to step 8: the resumed run takes the 32 samples left, in the epoch's global order,
    says so on stderr, and ends bit for bit where a plain loop at 1 device ends that starts from
    the checkpoint's model, Adam and schedule and walks the rest of the epoch's permutation
    (computed here, not by the sampler)."""

    args = ["--data", "shuffled", "--root", str(tmp_path)]
    ok(run_worker(*args, "--devices", "2", "--runs", "e:4"))
    resumed = run_worker(*args, "--devices", "1", "--runs", "e:8")
    ok(resumed)
    assert (
        "DataPosition: resumed at sample 64 of 96 of epoch 0 (global order), saved by 2 rank(s),"
        " continued by 1: global batch 16 -> 8 samples, 4 batch(es) per rank left" in resumed.stderr
    ), resumed.stderr[-3000:]
    perm = torch.randperm(96, generator=torch.Generator().manual_seed(3 + 0)).tolist()
    before, after = _seen(tmp_path, "e", 2), _seen(tmp_path, "e", 1)
    assert [len(r) for r in before] == [4, 4] and [len(r) for r in after] == [4]
    assert _global(before) + _global(after) == perm  # every sample once, in order

    saved = ckptfmt_torch.lightning.CheckpointIO().load_checkpoint(
        tmp_path / "e" / "epoch=0-step=4.ckpt"
    )
    assert saved["callbacks"]["DataPosition"] == {
        "epoch": 0,
        "batches": 4,
        "samples": [64],
        "world_size": 2,
    }
    model = Net()
    model.load_state_dict(saved["state_dict"])
    conf = model.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]
    opt.load_state_dict(saved["optimizer_states"][0])
    sched.load_state_dict(saved["lr_schedulers"][0])
    ds = ShuffledData().ds
    for k in range(4):
        x, y = ds[perm[64 + 8 * k : 64 + 8 * (k + 1)]]
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model.net(x), y).backward()
        opt.step()
    got = end(tmp_path, "e")
    assert got["global_step"] == 8
    assert_same(got["params"], dict(model.state_dict()))
    assert_same(got["optim"]["state"], opt.state_dict()["state"])


@pytest.mark.slow
def test_resume_on_more_devices_continues_the_data(tmp_path: Path) -> None:
    """4 steps at 1 device (32 of 96 samples), resumed at 2 devices to step 8: the 64 samples
    left in 4 steps of 2 x 8, the epoch ending there (Lightning's batch count of the epoch set
    to this size's units), every sample once in the global order; and bit for bit where a plain
    loop at 2 devices ends that starts from the checkpoint's model, Adam and schedule and does
    what DDP does: rank r's batch of step s is the positions ``32 + 16 s + 2 j + r`` of the
    permutation (computed here), its gradient halved, the two summed (gloo's all-reduce of
    two; halving is exact, so the order of the sum does not matter)."""
    args = ["--data", "shuffled", "--root", str(tmp_path)]
    ok(run_worker(*args, "--devices", "1", "--runs", "f:4"))
    resumed = run_worker(*args, "--devices", "2", "--runs", "f:8")
    ok(resumed)
    assert (
        "DataPosition: resumed at sample 32 of 96 of epoch 0 (global order), saved by 1 rank(s),"
        " continued by 2: global batch 8 -> 16 samples, 4 batch(es) per rank left" in resumed.stderr
    ), resumed.stderr[-3000:]
    perm = torch.randperm(96, generator=torch.Generator().manual_seed(3 + 0)).tolist()
    before, after = _seen(tmp_path, "f", 1), _seen(tmp_path, "f", 2)
    assert [len(r) for r in before] == [4] and [len(r) for r in after] == [4, 4]
    assert _global(before) + _global(after) == perm

    saved = ckptfmt_torch.lightning.CheckpointIO().load_checkpoint(
        tmp_path / "f" / "epoch=0-step=4.ckpt"
    )
    assert saved["callbacks"]["DataPosition"]["samples"] == [32]
    model = Net()
    model.load_state_dict(saved["state_dict"])
    conf = model.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]
    opt.load_state_dict(saved["optimizer_states"][0])
    sched.load_state_dict(saved["lr_schedulers"][0])
    ds = ShuffledData().ds
    for s in range(4):
        grads = []
        for r in range(2):
            x, y = ds[[perm[32 + 16 * s + 2 * j + r] for j in range(8)]]
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model.net(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads, strict=True):
            p.grad = g0 / 2 + g1 / 2
        opt.step()
    got = end(tmp_path, "f")
    assert got["global_step"] == 8
    assert_same(got["params"], dict(model.state_dict()))
    assert_same(got["optim"]["state"], opt.state_dict()["state"])


def test_a_checkpoint_in_a_bucket_saves_resumes_and_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3: S3
) -> None:
    """A checkpoint path that is a bucket's URL (``trainer.save_checkpoint(url)``,
    ``fit(ckpt_path=url)``, the strategy's ``remove_checkpoint(url)`` that ``ModelCheckpoint``
    calls): saved to the bucket, resumed from it bit for bit like the same resume from a
    directory, and removed from it whole; nothing written under a local ``s3:/`` (the URL
    folded into a path made the resume a ``NotACheckpointError`` and the removal a no-op, the
    objects left in the bucket). With a manager, whose checkpoint paths are local pointer
    files, a URL is refused before anything is written."""
    monkeypatch.chdir(tmp_path)
    url = f"{s3.url}/run/step=4.ckpt"
    local = tmp_path / "local" / "step=4.ckpt"
    for path in (url, local):
        L.seed_everything(0, verbose=False)
        plugins = [ckptfmt_torch.lightning.CheckpointIO()]
        trainer = L.Trainer(plugins=plugins, max_steps=4, enable_checkpointing=False, **QUIET)
        trainer.fit(Net(), datamodule=Data())
        trainer.save_checkpoint(path)
    assert ckptfmt.verify(url).healthy and ckptfmt.open(url).manifest.step == 4
    from_bucket = fit_from(tmp_path / "a", 8, url)  # type: ignore[arg-type]
    from_dir = fit_from(tmp_path / "b", 8, local)
    assert_same(from_bucket, from_dir)
    assert s3.keys("run/step=4.ckpt/")
    trainer.strategy.remove_checkpoint(url)
    assert s3.keys("run/step=4.ckpt/") == []
    managed = ckptfmt_torch.lightning.CheckpointIO(local_dir=str(tmp_path / "l1"))
    with pytest.raises(UsageError, match="pointer files on a file system"):
        managed.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, url)
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "local"]
    assert s3.keys("run/") == []
