"""``ckptfmt_torch.hf.Trainer`` on the real Hugging Face ``Trainer`` (CPU, a tiny GPT-2 built
from a config, random tokens shuffled by HF's sampler, dropout on): the trainer the README
enables in one line (``tests/workers/_hf_worker.py`` has those lines).

Checked: a run stopped (or SIGKILLed) and resumed ends bit-identical to an uninterrupted one
(every parameter, the optimizer's state, each rank's RNG), as HF's own resume does, in one
process and under ``torchrun`` with 2 DDP ranks, with blocking and background saves;
``checkpoint-N/`` holds HF's files beside the ckptfmt data and nothing pickled;
``save_total_limit`` rotation; a torn checkpoint is never resumed from; an unsupported object
is refused before anything is written; a damaged shard is named at resume.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch
import transformers
from _hf_worker import build, final_state, model_and_args, run
from ckptfmt_torch.hf import (
    CheckpointMixin,
    CheckpointOptions,
    Trainer,
    is_complete,
    last_checkpoint,
)
from kit import REPO
from kit.cli import run_cli
from kit.faults import flip
from kit.full_disk import run_in_tmpfs_mounts
from kit.launch import assert_ok, run_torchrun, with_kit_path

import ckptfmt
from ckptfmt.errors import (
    DamagedCheckpointError,
    DamagedError,
    UnsupportedValueError,
    UsageError,
)

pytestmark = pytest.mark.torch

WORKER = REPO / "tests" / "workers" / "_hf_worker.py"
STEPS, SAVE, STOP = 12, 4, 6  # the stopped run's newest checkpoint is 4: 2 batches are skipped


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    assert any(k.startswith("optim/") for k in a)
    differ = [k for k in a if not np.array_equal(a[k], b[k])]
    assert not differ, f"not bit-identical: {differ[:5]}"


def checkpoints(out: Path) -> list[str]:
    return sorted((p.name for p in out.glob("checkpoint-*")), key=lambda n: int(n.split("-")[1]))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    """The uninterrupted run (one process)."""
    out = tmp_path_factory.mktemp("reference")
    return final_state(run(out, max_steps=STEPS, save_steps=SAVE))


def test_checkpoint_layout_and_rotation(tmp_path: Path) -> None:
    trainer = run(tmp_path, max_steps=STEPS, save_steps=SAVE, limit=2)
    assert checkpoints(tmp_path) == ["checkpoint-8", "checkpoint-12"]  # rotated as HF does
    ck = tmp_path / "checkpoint-12"
    names = {p.name for p in ck.iterdir()}
    assert {"ckptfmt", "config.json", "trainer_state.json", "training_args.json"} <= names
    pickles = [p for p in ck.rglob("*") if p.suffix in (".pt", ".pth", ".bin", ".pkl")]
    assert not pickles  # nothing HF would unpickle; the arguments are JSON
    assert json.loads((ck / "trainer_state.json").read_text())["global_step"] == 12
    assert json.loads((ck / "training_args.json").read_text())["save_steps"] == SAVE
    assert not ckptfmt.verify(ck / "ckptfmt").problems
    loaded = ckptfmt.load(ck / "ckptfmt")
    assert {"model", "optimizer", "scheduler", "rng", "trainer"} <= loaded.keys()
    assert loaded["trainer"]["global_step"] == 12
    model = trainer.accelerator.unwrap_model(trainer.model)
    for name, p in model.state_dict().items():
        if name == "lm_head.weight":  # tied to the embedding: stored once, as HF stores it
            assert name not in loaded["model"]
            continue
        assert np.array_equal(loaded["model"][name], p.numpy()), name
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(ck).n_embd == 32  # HF's tools read the config


@pytest.mark.slow
def test_resume_is_bit_identical_like_hfs_own(
    tmp_path: Path, reference: dict[str, np.ndarray]
) -> None:
    run(tmp_path / "ck", max_steps=STEPS, save_steps=SAVE, stop_at=STOP)
    assert checkpoints(tmp_path / "ck") == ["checkpoint-4"]
    resumed = final_state(run(tmp_path / "ck", resume=True, max_steps=STEPS, save_steps=SAVE))
    assert_same(reference, resumed)
    # HF's own resume of the same run, for comparison: ours is never worse
    run(tmp_path / "hf", mode="hf", max_steps=STEPS, save_steps=SAVE, stop_at=STOP)
    hf = final_state(run(tmp_path / "hf", resume=True, mode="hf", max_steps=STEPS, save_steps=SAVE))
    assert_same(reference, hf)


@pytest.mark.slow
def test_resume_from_a_path_and_never_from_a_torn_checkpoint(
    tmp_path: Path, reference: dict[str, np.ndarray]
) -> None:
    run(tmp_path, max_steps=STEPS, save_steps=SAVE, stop_at=9)
    assert checkpoints(tmp_path) == ["checkpoint-4", "checkpoint-8"]
    # a path to an older checkpoint than the newest
    resumed = final_state(
        run(tmp_path, resume=str(tmp_path / "checkpoint-4"), max_steps=STEPS, save_steps=SAVE)
    )
    assert_same(reference, resumed)
    # checkpoint-8 torn (its trainer_state.json, written last, missing): True takes checkpoint-4
    for p in tmp_path.glob("checkpoint-*"):
        if int(p.name.split("-")[1]) > 8:
            shutil.rmtree(p)
    (tmp_path / "checkpoint-8" / "trainer_state.json").unlink()
    assert not is_complete(tmp_path / "checkpoint-8")
    assert last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-4")
    resumed = final_state(run(tmp_path, resume=True, max_steps=STEPS, save_steps=SAVE))
    assert_same(reference, resumed)
    assert is_complete(tmp_path / "checkpoint-8")  # saved again, whole


@pytest.mark.slow
def test_async_saves_resume_bit_identical(tmp_path: Path, reference: dict[str, np.ndarray]) -> None:
    kw: dict[str, Any] = {"mode": "async", "max_steps": STEPS, "save_steps": SAVE, "limit": 2}
    run(tmp_path, stop_at=9, **kw)
    ck = tmp_path / "checkpoint-8"
    assert is_complete(ck) and (ck / "ckptfmt").is_symlink()  # the manager's level-3 step
    assert not ckptfmt.verify(ck / "ckptfmt").problems
    resumed = final_state(run(tmp_path, resume=True, **kw))
    assert_same(reference, resumed)
    assert checkpoints(tmp_path) == ["checkpoint-8", "checkpoint-12"]
    steps = sorted(p.name for p in (tmp_path / "ckptfmt").glob("step-*"))
    assert len(steps) <= 3  # the manager keeps the limit's steps (+ one in flight)


@pytest.mark.slow
def test_hf_weights_load_with_from_pretrained(tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    trainer = build(tmp_path, max_steps=SAVE, save_steps=SAVE)
    trainer.ckptfmt = CheckpointOptions(hf_weights=True)  # type: ignore[attr-defined]
    trainer.train()
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / f"checkpoint-{SAVE}")
    model = trainer.accelerator.unwrap_model(trainer.model)
    for (name, p), q in zip(model.named_parameters(), loaded.parameters(), strict=True):
        assert torch.equal(p, q), name


def _run_worker(
    tmp_path: Path, name: str, spec: dict[str, Any]
) -> subprocess.CompletedProcess[str]:
    """Run the HF worker on ``spec`` (written to ``name``.json), its result to ``name``."""
    (tmp_path / f"{name}.json").write_text(json.dumps({**spec, "result": str(tmp_path / name)}))
    return subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path / f"{name}.json")],
        cwd=REPO,
        env=with_kit_path(dict(os.environ)),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_sigkill_during_an_async_save_then_resume(tmp_path: Path) -> None:
    """A real SIGKILL right after the save of step 8 was handed to the background: the
    resumed job (a new process) ends bit-identical to an uninterrupted one."""

    def job(name: str, **plan: Any) -> subprocess.CompletedProcess[str]:
        spec = {"mode": "async", "max_steps": STEPS, "save_steps": SAVE, **plan}
        return _run_worker(tmp_path, name, spec)

    assert job("full", out=str(tmp_path / "full")).returncode == 0
    killed = job("killed", out=str(tmp_path / "run"), kill_at=8)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (tmp_path / "killed.rank0.npz").exists()
    resumed = job("resumed", out=str(tmp_path / "run"), resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same(
        dict(np.load(tmp_path / "full.rank0.npz")), dict(np.load(tmp_path / "resumed.rank0.npz"))
    )


def test_unsupported_object_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    from transformers import TrainerCallback

    class Annotate(TrainerCallback):  # a user's object in the scheduler's state_dict()
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            kw["lr_scheduler"].note = Path("/somewhere")

    trainer = build(tmp_path, max_steps=SAVE, save_steps=SAVE)
    trainer.add_callback(Annotate())
    with pytest.raises(UnsupportedValueError, match="scheduler/note") as info:
        trainer.train()
    assert "PosixPath" in str(info.value)
    assert checkpoints(tmp_path) == []  # nothing half-written


def test_damaged_shard_at_resume_is_named(tmp_path: Path) -> None:
    run(tmp_path, max_steps=SAVE, save_steps=SAVE)
    data = tmp_path / f"checkpoint-{SAVE}" / "ckptfmt"
    shard = next((data / "model" / "transformer.wte.weight" / "c").rglob("*"))
    while shard.is_dir():
        shard = next(shard.iterdir())
    flip(shard)
    with pytest.raises(DamagedError) as info:
        run(tmp_path, resume=True, max_steps=2 * SAVE, save_steps=SAVE)
    assert str(shard.relative_to(data)) in str(info.value)  # the file, by its path
    assert f"{data.resolve()}: " in str(info.value)  # in the checkpoint, by its path
    assert isinstance(info.value, DamagedCheckpointError) and info.value.older is None
    assert info.value.hint == f"`ckptfmt verify {data}` lists every damaged file"
    told = run_cli("verify", data)  # the command the hint names
    assert told.exit_code == 1 and str(shard.relative_to(data)) in told.output


def _first_shard(data: Path) -> Path:
    shard = next((data / "model" / "transformer.wte.weight" / "c").rglob("*"))
    while shard.is_dir():
        shard = next(shard.iterdir())
    return shard


def _fingerprint(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_resume_meeting_damage_names_it_and_the_older_checkpoint(
    tmp_path: Path, reference: dict[str, np.ndarray]
) -> None:
    """``resume_from_checkpoint=True`` picks checkpoint-8 for the user; damaged, it is named,
    with checkpoint-4 and the call that resumes from it; nothing is trained or written. The
    call, as the message gives it, then resumes and ends where an uninterrupted run ends."""
    run(tmp_path, max_steps=STEPS, save_steps=SAVE, stop_at=9)
    assert checkpoints(tmp_path) == ["checkpoint-4", "checkpoint-8"]
    newest, older = tmp_path / "checkpoint-8", tmp_path / "checkpoint-4"
    shard = _first_shard(newest / "ckptfmt")
    flip(shard)
    before = _fingerprint(tmp_path)
    trainer = build(tmp_path, max_steps=STEPS, save_steps=SAVE)
    with pytest.raises(DamagedCheckpointError) as info:
        trainer.train(resume_from_checkpoint=True)
    exc = info.value
    message = str(exc)
    assert exc.path == str(newest) and message.startswith(f"{newest}: cannot resume")
    assert f"{(newest / 'ckptfmt').resolve()}: {shard.relative_to(newest / 'ckptfmt')}" in message
    assert "CRC32C mismatch" in message
    assert exc.older == str(older) and f"an older checkpoint exists: {older}" in message
    call = f"trainer.train(resume_from_checkpoint={str(older)!r})"
    assert call in message and exc.hint.endswith(call)
    assert trainer.state.global_step == 0  # not one step trained on wrong data
    assert _fingerprint(tmp_path) == before  # and nothing written
    resumed = build(tmp_path, max_steps=STEPS, save_steps=SAVE)
    eval(call, {"trainer": resumed})  # the call the message gives, as it gives it
    assert_same(reference, final_state(resumed))


def _torchrun(tmp_path: Path, name: str, **plan: Any) -> None:
    spec = {"max_steps": STEPS, "save_steps": SAVE, "result": str(tmp_path / name), **plan}
    (tmp_path / f"{name}.json").write_text(json.dumps(spec))
    assert_ok(run_torchrun(2, WORKER, str(tmp_path / f"{name}.json"), timeout=300))


def _ranks(tmp_path: Path, name: str) -> list[dict[str, np.ndarray]]:
    return [dict(np.load(tmp_path / f"{name}.rank{r}.npz")) for r in range(2)]


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, np.ndarray]]:
    """The uninterrupted run under ``torchrun``, 2 ranks (HF's own trainer: the same run)."""
    tmp = tmp_path_factory.mktemp("ddp_reference")
    _torchrun(tmp, "full", out=str(tmp / "full"), mode="hf")
    return _ranks(tmp, "full")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ckptfmt", "async"])
def test_torchrun_ddp_resume_bit_identical(
    tmp_path: Path, mode: str, ddp_reference: list[dict[str, np.ndarray]]
) -> None:
    _torchrun(tmp_path, "stopped", out=str(tmp_path / "run"), mode=mode, stop_at=STOP)
    data = tmp_path / "run" / "checkpoint-4" / "ckptfmt"
    doc = (data / "ckptfmt.json").read_text()
    assert '"rank": 0' in doc and '"rank": 1' in doc  # both ranks wrote their share
    _torchrun(tmp_path, "resumed", out=str(tmp_path / "run"), mode=mode, resume=True)
    full, resumed = ddp_reference, _ranks(tmp_path, "resumed")
    assert not np.array_equal(full[0]["rng/torch"], full[1]["rng/torch"])  # ranks differ
    for a, b in zip(full, resumed, strict=True):
        assert_same(a, b)


def test_mixin_on_a_users_trainer_subclass(tmp_path: Path) -> None:
    calls: list[int] = []

    class UsersTrainer(transformers.Trainer):  # stands for SFTTrainer and the like
        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
            calls.append(1)
            return super().compute_loss(model, inputs, *args, **kw)

    class MyTrainer(CheckpointMixin, UsersTrainer):
        pass

    model, args, data = model_and_args(tmp_path, max_steps=SAVE, save_steps=SAVE)
    MyTrainer(model=model, args=args, train_dataset=data).train()
    assert len(calls) == SAVE
    assert is_complete(tmp_path / f"checkpoint-{SAVE}")
    assert not ckptfmt.verify(tmp_path / f"checkpoint-{SAVE}" / "ckptfmt").problems


@pytest.mark.slow
def test_levels_local_and_shared(tmp_path: Path, reference: dict[str, np.ndarray]) -> None:
    """Level 1 on a node-local directory, flushed to the shared one every second save: the
    resume restores from level 1 (the manager's restore), bit-identical."""
    options = CheckpointOptions(
        local_dir=str(tmp_path / "local" / "{node}"),
        shared_dir=str(tmp_path / "shared"),
        flush_every=2,
    )
    kw: dict[str, Any] = {"max_steps": STEPS, "save_steps": SAVE, "options": options}
    run(tmp_path / "out", stop_at=9, **kw)
    assert not (tmp_path / "out" / "checkpoint-4" / "ckptfmt").exists()  # on level 1 only
    assert (tmp_path / "out" / "checkpoint-8" / "ckptfmt").is_symlink()  # flushed
    assert list((tmp_path / "local").glob("*/step-*"))
    resumed = final_state(run(tmp_path / "out", resume=True, **kw))
    assert_same(reference, resumed)


@pytest.mark.slow
def test_levels_sigkill_in_a_flush_then_resume(
    tmp_path: Path, reference: dict[str, np.ndarray]
) -> None:
    """Level 1 flushed every second save; SIGKILLed while step 8 is flushed (the 3rd commit):
    step 8 is committed on level 1 but ``checkpoint-8`` is torn, and the newest complete
    ``checkpoint-4`` has its step on level 1 only. ``resume_from_checkpoint=True`` restores
    step 4 from level 1 (not the newer step 8, and no error) and ends bit-identical to an
    uninterrupted run."""
    levels = {"local_dir": str(tmp_path / "local" / "{node}"), "shared_dir": str(tmp_path / "l3")}
    plan = {"max_steps": STEPS, "save_steps": SAVE, "out": str(tmp_path / "run")}
    plan["options"] = {**levels, "flush_every": 2}

    def job(name: str, **more: Any) -> subprocess.CompletedProcess[str]:
        return _run_worker(tmp_path, name, {**plan, **more})

    killed = job("killed", kill_in_save=3)
    assert killed.returncode == -9, killed.stderr[-2000:]
    steps = sorted(p.name for p in (tmp_path / "local").glob("*/step-*"))
    assert steps == ["step-0000000004", "step-0000000008"]
    assert last_checkpoint(tmp_path / "run") == str(tmp_path / "run" / f"checkpoint-{SAVE}")
    resumed = job("resumed", resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    took = json.loads((tmp_path / "resumed.restore.rank0.json").read_text())
    assert (took["step"], took["level"]) == (SAVE, 1)
    assert_same(reference, dict(np.load(tmp_path / "resumed.rank0.npz")))


@pytest.mark.slow
@pytest.mark.parametrize("managed", [False, True], ids=["direct", "manager"])
def test_load_best_model_at_end_reads_the_best_checkpoint(tmp_path: Path, managed: bool) -> None:
    """HF's best-model bookkeeping as it is: the best checkpoint survives the rotation and its
    weights (from ckptfmt) are the model's at the end. Through the manager (background saves,
    level 3 in ``output_dir/ckptfmt``, the README's line) its step survives the manager's own
    retention too (``keep_shared`` from ``save_total_limit`` counts the newest steps only)."""
    model, _, data = model_and_args(tmp_path)
    args = transformers.TrainingArguments(
        str(tmp_path),
        max_steps=3 * SAVE,
        save_steps=SAVE,
        eval_steps=SAVE,
        eval_strategy="steps",
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        greater_is_better=True,  # the first evaluation's (highest) loss: not the last checkpoint
        save_total_limit=1,
        per_device_train_batch_size=4,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
    )
    options = CheckpointOptions(async_save=True) if managed else None
    trainer = Trainer(
        model=model, args=args, train_dataset=data, eval_dataset=data, ckptfmt=options
    )
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(tmp_path / f"checkpoint-{SAVE}")
    assert is_complete(tmp_path / f"checkpoint-{SAVE}")
    assert checkpoints(tmp_path) == [f"checkpoint-{SAVE}"]
    best = ckptfmt.load(tmp_path / f"checkpoint-{SAVE}" / "ckptfmt")["model"]
    for name, p in trainer.model.state_dict().items():
        if name in best:
            assert np.array_equal(best[name], p.numpy()), name


class ScriptedScore(transformers.TrainerCallback):
    """Each evaluation's ``eval_score`` from a script (step -> score): the best checkpoint is
    the one the test says."""

    def __init__(self, scores: dict[int, float]) -> None:
        self.scores = scores

    def on_evaluate(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        kw["metrics"]["eval_score"] = self.scores[state.global_step]


@pytest.mark.slow
@pytest.mark.parametrize("managed", [False, True], ids=["direct", "manager"])
def test_a_new_best_at_its_own_save_is_the_best_checkpoint(tmp_path: Path, managed: bool) -> None:
    """The checkpoint being saved is the best one at its save (step 12 beats step 4, the best
    until then): as in HF's own ``Trainer``, it is the ``best_model_checkpoint`` (in the state
    and in its ``trainer_state.json``) and ``load_best_model_at_end`` ends on its weights, bit
    for bit what HF's own run ends on (not on step 4's)."""
    scores = {SAVE: 1.0, 2 * SAVE: 0.5, 3 * SAVE: 2.0}
    ends = {}
    for name in ("hf", "ours"):
        model, _, data = model_and_args(tmp_path / name)
        args = transformers.TrainingArguments(
            str(tmp_path / name),
            max_steps=3 * SAVE,
            save_steps=SAVE,
            eval_steps=SAVE,
            eval_strategy="steps",
            load_best_model_at_end=True,
            metric_for_best_model="score",
            per_device_train_batch_size=4,
            use_cpu=True,
            report_to=[],
            disable_tqdm=True,
        )
        kw: dict[str, Any] = {"train_dataset": data, "eval_dataset": data}
        if name == "hf":
            trainer = transformers.Trainer(model=model, args=args, **kw)
        else:
            options = CheckpointOptions(async_save=True) if managed else None
            trainer = Trainer(model=model, args=args, ckptfmt=options, **kw)
        trainer.add_callback(ScriptedScore(scores))
        trainer.train()
        best = tmp_path / name / f"checkpoint-{3 * SAVE}"
        assert trainer.state.best_model_checkpoint == str(best), name
        saved = json.loads((best / "trainer_state.json").read_text())
        assert saved["best_model_checkpoint"] == str(best), name
        ends[name] = {k: v.numpy().tobytes() for k, v in trainer.model.state_dict().items()}
    assert ends["ours"] == ends["hf"]


def _assert_loads_bit_exact(out: Path, trained: torch.nn.Module) -> None:
    """``from_pretrained(out)`` builds the trained model's architecture, every tensor equal."""
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded) is type(trained)
    want, got = trained.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for name, t in want.items():
        assert t.dtype == got[name].dtype and torch.equal(t, got[name]), name


def test_cli_export_of_a_trainer_checkpoint_loads_with_from_pretrained(tmp_path: Path) -> None:
    """``ckptfmt export checkpoint-N/ckptfmt OUT`` carries the ``config.json`` beside it, so
    ``from_pretrained(OUT)`` builds the trained model, bit-exact; a checkpoint with no config
    beside it is exported with a note saying how to add one, and ``--config`` does."""
    trainer = run(tmp_path / "run", max_steps=SAVE, save_steps=SAVE)
    trained = trainer.accelerator.unwrap_model(trainer.model)
    ck = tmp_path / "run" / f"checkpoint-{SAVE}"
    near = run_cli("export", ck, tmp_path / "hf")  # checkpoint-N/ given: the CLI says where
    assert near.exit_code == 3 and f"its ckptfmt checkpoint is {ck / 'ckptfmt'}" in near.output
    result = run_cli("export", ck / "ckptfmt", tmp_path / "hf")
    assert result.exit_code == 0, result.output
    assert f"config.json from {ck / 'config.json'}" in result.output
    assert (tmp_path / "hf" / "config.json").read_bytes() == (ck / "config.json").read_bytes()
    _assert_loads_bit_exact(tmp_path / "hf", trained)

    bare = tmp_path / "bare"  # the ckptfmt data alone, as copied elsewhere
    shutil.copytree(ck / "ckptfmt", bare)
    result = run_cli("export", bare, tmp_path / "hf2")
    assert result.exit_code == 0, result.output
    assert "no config.json" in result.output and "--config PATH" in result.output
    assert not (tmp_path / "hf2" / "config.json").exists()
    with pytest.raises((OSError, ValueError)):  # no config: nothing to build the model from
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2")
    # the note's way: --config PATH, with --overwrite over that export
    result = run_cli(
        "export", bare, tmp_path / "hf2", "--config", ck / "config.json", "--overwrite"
    )
    assert result.exit_code == 0, result.output
    _assert_loads_bit_exact(tmp_path / "hf2", trained)
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    result = run_cli("export", bare, tmp_path / "hf3", "--config", bad)
    assert result.exit_code == 2 and "not a JSON object" in result.output
    assert not (tmp_path / "hf3").exists()


@pytest.mark.slow
def test_torchrun_resume_on_fewer_ranks_continues_the_data(tmp_path: Path) -> None:
    """Stopped at step 4 under ``torchrun`` with 2 ranks (32 of the epoch's 64 samples: 2 x 4
    batches of 4), resumed with 1 rank to step 12: the resumed run skips exactly the 32 samples
    consumed (8 of its own batches, not HF's ``global_step`` 4), says so, and trains on the 32
    left, so that every sample of the epoch is seen once; the per-rank RNG streams of 2 ranks
    are left out with a warning. Then the same from 1 rank to 2 refuses a position that is no
    whole number of the new steps (12 samples, 8 a step) with ``DataPositionError``."""

    def plan(name: str, **kw: Any) -> Path:
        spec = {"max_steps": 12, "save_steps": 4, "result": str(tmp_path / name), "record": True}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({**spec, **kw}))
        return path

    out = str(tmp_path / "run")
    assert_ok(run_torchrun(2, WORKER, str(plan("two", out=out, stop_at=4)), timeout=300))
    resumed = run_torchrun(1, WORKER, str(plan("one", out=out, resume=True)), timeout=300)
    assert_ok(resumed)
    said = resumed.stdout + resumed.stderr
    assert (
        "ckptfmt: resumed at sample 32 of epoch 0 (the epoch's global order), saved by 2 rank(s),"
        " continued by 1: 8 -> 4 samples per optimizer step; skipping 8 step(s)" in said
    ), said[-4000:]
    assert "per-rank entries saved by 2 ranks, loaded by 1" in said
    two = [json.loads((tmp_path / f"two.seen.rank{r}.json").read_text()) for r in range(2)]
    one = json.loads((tmp_path / "one.seen.rank0.json").read_text())
    assert [len(r) for r in two] == [4, 4] and len(one) == 8
    seen = [i for r in two for b in r for i in b] + [i for b in one for i in b]
    assert sorted(seen) == list(range(64))  # every sample of the epoch once
    state = json.loads((tmp_path / "run" / "checkpoint-12" / "trainer_state.json").read_text())
    assert state["global_step"] == 12  # optimizer steps, whatever their size

    # 1 rank -> 2: stopped after 3 steps of 4 samples, 12 is no multiple of 2 x 4
    out2 = str(tmp_path / "run2")
    assert_ok(
        run_torchrun(1, WORKER, str(plan("a", out=out2, stop_at=3, save_steps=3)), timeout=300)
    )
    refused = run_torchrun(
        2, WORKER, str(plan("b", out=out2, resume=True, save_steps=3)), timeout=300
    )
    assert refused.returncode != 0
    said = refused.stdout + refused.stderr
    assert "DataPositionError" in said and "12 samples of epoch 0 consumed" in said, said[-4000:]


def test_newest_checkpoint_on_no_level_names_the_older_one_that_restores(tmp_path: Path) -> None:
    """Level 1 flushed every second save, saves at 4 (level 1 only), 8 (flushed) and 12 (level 1
    only); then the node's level 1 is lost. ``resume_from_checkpoint=True`` takes the newest
    complete checkpoint, 12, whose step is on no level now: the ``UsageError`` names
    ``checkpoint-8`` (on level 3) and the call that resumes from it, and nothing is trained or
    written (never an older step taken silently: the steps since would be trained again, and the
    newer checkpoint overwritten). Following the hint resumes from step 8."""
    levels = {"local_dir": str(tmp_path / "local" / "{node}"), "shared_dir": str(tmp_path / "l3")}
    levels.update(flush_every=2, async_save=False)
    out = tmp_path / "out"
    plan = {"max_steps": 16, "save_steps": SAVE, "out": str(out), "options": levels}
    killed = _run_worker(tmp_path, "killed", {**plan, "kill_at": 12})  # no exit flush
    assert killed.returncode == -9, killed.stderr[-2000:]
    kw: dict[str, Any] = {"max_steps": 16, "save_steps": SAVE}
    kw["options"] = CheckpointOptions(**levels)
    assert not (out / "checkpoint-12" / "ckptfmt").exists()  # on level 1 only
    assert (out / "checkpoint-8" / "ckptfmt").is_symlink()  # flushed
    shutil.rmtree(tmp_path / "local")  # the node's disk lost
    before = _fingerprint(out)
    with pytest.raises(UsageError) as got:
        run(out, resume=True, **kw)
    text = str(got.value)
    assert str(out / "checkpoint-12") in text and "step 12" in text, text
    assert f"resume_from_checkpoint={str(out / 'checkpoint-8')!r}" in text, text
    assert "local_dir" in text, text  # or give the level that holds it
    assert _fingerprint(out) == before
    trainer = run(out, resume=str(out / "checkpoint-8"), **kw)
    assert trainer.state.global_step == 16
    assert trainer.checkpoint_manager.last_restore.step == 8


_FAILED_SAVE = """
import json, sys
from pathlib import Path
sys.path.insert(0, {workers!r})
from _hf_worker import build
from ckptfmt_torch.hf import CheckpointOptions
from ckptfmt.errors import CkptError

root, l1, l3 = (Path(a) for a in sys.argv[1:4])
result = {{}}
for name in ("fresh", "there"):
    out = root / name
    if name == "there":  # the step's directory was there before this save
        (out / "checkpoint-{save}").mkdir(parents=True)
        (out / "checkpoint-{save}" / "mine.txt").write_text("not the save's")
    options = CheckpointOptions(
        hf_weights=True, async_save=True, local_dir=str(l1), shared_dir=str(l3)
    )
    trainer = build(out, max_steps={save}, save_steps={save}, options=options)
    raised = None
    try:
        trainer.train()
    except CkptError as exc:
        raised = type(exc).__name__
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    result[name] = {{"raised": raised, "names": names}}
print(json.dumps(result))
"""


def test_a_failed_managed_save_removes_the_directory_it_made(tmp_path: Path) -> None:
    """Both levels too small (tmpfs in a child mount namespace): the managed background save
    fails after ``save`` returned. The ``checkpoint-N/`` it made, holding only HF's files
    (``model.safetensors`` with ``hf_weights``) written before the commit, is removed: the
    rotation counts complete checkpoints only and would never remove it. One that was there
    before the save is left."""
    script = tmp_path / "child.py"
    script.write_text(_FAILED_SAVE.format(save=SAVE, workers=str(WORKER.parent)))
    argv = [sys.executable, str(script), str(tmp_path), str(tmp_path / "l1"), str(tmp_path / "l3")]
    proc, _ = run_in_tmpfs_mounts(tmp_path, {"l1": "size=8k", "l3": "size=8k"}, argv)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["fresh"]["raised"] is not None, result  # the save did fail
    assert result["fresh"]["names"] == [], result  # made by the failed save: removed
    assert result["there"]["raised"] is not None, result
    left = result["there"]["names"]
    assert f"checkpoint-{SAVE}/mine.txt" in left, result  # there before: left, torn
    assert f"checkpoint-{SAVE}/trainer_state.json" not in left, result
