"""``ckptfmt_torch.hf.Trainer`` resumed at another ``--nproc-per-node`` (``torchrun``, DDP on
CPU with gloo, the tiny GPT-2 of ``tests/workers/_hf_worker.py`` with dropout on), compared bit
for bit with a reference in which ckptfmt takes no part.

The reference: HF's own ``Trainer`` runs the same first stretch at N ranks and saves HF's own
files; HF's own ``Trainer`` at M ranks loads them (model, optimizer, LR schedule, trainer state:
HF's code throughout) and is handed the data position by hand, computed here from the documented
rule (skip ``samples consumed / (M x batch)`` of its optimizer steps, in the epoch it was in).
The per-rank random generators of N ranks mean nothing at M ranks: ckptfmt leaves them out with
a warning, so the reference's RNG files are removed and both runs keep the new run's seeding.
So the reference is "the same schedule, switched from N to M ranks at that step"; a process
cannot change its number of ranks in place, so the switch goes through HF's own files there and
through ckptfmt here, and everything else is HF's.

The rule for a step (``docs/hf.md``): ``global_step`` counts optimizer steps whatever their
size; a step at W ranks takes ``W x per_device_train_batch_size x gradient_accumulation_steps``
samples of the epoch's global order, which does not depend on W. Checked: the samples trained
on, read in global order (step by step, rank by rank), are exactly the batches of an
uninterrupted 1-process run (the global order, across the epoch boundary), so every sample of
the epoch is trained on once; the positions saved after the resume count samples at M ranks;
the final model, Adam state and every rank's RNG are bitwise the reference's; rank 0 says
N -> M and the position; the manager's route (``CheckpointOptions(local_dir=...)``) does the
same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _hf_worker import N_SAMPLES, run
from kit import REPO
from kit.launch import assert_ok, run_torchrun

import ckptfmt

pytestmark = [pytest.mark.torch, pytest.mark.slow]

WORKER = REPO / "tests" / "workers" / "_hf_worker.py"
BATCH = 4  # per_device_train_batch_size of the worker


@pytest.fixture(scope="module")
def global_batches(tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """The job's global order, batch by batch, over three epochs: what an uninterrupted
    1-process run (HF's own trainer) trains on."""
    seen: list[list[int]] = []
    out = tmp_path_factory.mktemp("order")
    run(out, seen=seen, mode="hf", max_steps=3 * N_SAMPLES // BATCH, save_steps=1000)
    assert len(seen) == 3 * N_SAMPLES // BATCH
    return seen


def _plan(tmp: Path, name: str, **kw: Any) -> str:
    spec = {"result": str(tmp / name), "record": True, **kw}
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(spec))
    return str(path)


def _seen(tmp: Path, name: str, world: int) -> list[list[list[int]]]:
    return [json.loads((tmp / f"{name}.seen.rank{r}.json").read_text()) for r in range(world)]


def _state(tmp: Path, name: str, world: int) -> list[dict[str, np.ndarray]]:
    return [dict(np.load(tmp / f"{name}.rank{r}.npz")) for r in range(world)]


def _in_global_order(ranks: list[list[list[int]]]) -> list[list[int]]:
    """Per-rank batches as the job's global batches: step s of rank r is batch s x W + r."""
    return [r[s] for s in range(len(ranks[0])) for r in ranks]


def _assert_bitwise(a: dict[str, np.ndarray], b: dict[str, np.ndarray], what: str) -> None:
    assert a.keys() == b.keys()
    assert sum(k.startswith("optim/") for k in a) > 2 and "rng/torch" in a
    differ = [k for k in a if a[k].tobytes() != b[k].tobytes()]
    assert not differ, f"{what}: not bitwise the reference: {differ[:5]}"


@pytest.mark.parametrize(
    ("n", "m", "stop", "steps"),
    [
        (2, 1, 4, 16),  # 32 samples at 8 a step; 8 steps of 4 end epoch 0, 4 more of epoch 1
        (1, 2, 4, 12),  # 16 samples at 4 a step; 6 steps of 8 end epoch 0, 2 more of epoch 1
    ],
)
def test_resume_at_another_size_is_bitwise_the_reference(
    tmp_path: Path, n: int, m: int, stop: int, steps: int, global_batches: list[list[int]]
) -> None:
    common = {"max_steps": steps, "save_steps": stop}  # the LR schedule spans all the steps
    levels = {"local_dir": str(tmp_path / "level1"), "shared_dir": str(tmp_path / "level3")}
    first = [
        _plan(tmp_path, "hf1", out=str(tmp_path / "hf"), mode="hf", stop_at=stop, **common),
        _plan(tmp_path, "ck1", out=str(tmp_path / "ck"), stop_at=stop, **common),
        _plan(tmp_path, "mg1", out=str(tmp_path / "mg"), stop_at=stop, options=levels, **common),
    ]
    assert_ok(run_torchrun(n, WORKER, *first, timeout=400))

    consumed = stop * n * BATCH  # samples of epoch 0's global order the first stretch took
    assert consumed % (m * BATCH) == 0
    skip = consumed // (m * BATCH)  # the documented rule, in the new size's optimizer steps
    per_epoch = N_SAMPLES // (m * BATCH)
    epochs = -(-(steps - stop + skip) // per_epoch)
    reference_ckpt = tmp_path / "hf" / f"checkpoint-{stop}"
    rng_files = sorted(reference_ckpt.glob("rng_state*.pth"))
    assert len(rng_files) == n
    for f in rng_files:  # per-rank streams of N ranks: left out at M, as ckptfmt does
        f.unlink()
    second = [
        _plan(
            tmp_path,
            "ref",
            out=str(tmp_path / "hf"),
            mode="reference",
            resume=str(reference_ckpt),
            position=[0, skip, epochs],
            **common,
        ),
        _plan(tmp_path, "ck2", out=str(tmp_path / "ck"), resume=True, **common),
        _plan(tmp_path, "mg2", out=str(tmp_path / "mg"), resume=True, options=levels, **common),
    ]
    resumed = run_torchrun(m, WORKER, *second, timeout=400)
    assert_ok(resumed)
    said = resumed.stdout + resumed.stderr

    # rank 0 says what it did with the data position, once for each of the two resumes
    line = (
        f"ckptfmt: resumed at sample {consumed} of epoch 0 (the epoch's global order), saved by "
        f"{n} rank(s), continued by {m}: {n * BATCH} -> {m * BATCH} samples per optimizer step; "
        f"skipping {skip} step(s) of this run's loader, the step counter goes on from {stop}"
    )
    assert said.count(line) == 2, said[-6000:]
    assert f"per-rank entries saved by {n} ranks, loaded by {m}" in said

    # the manager's route restored the step through the manager, not the plain directory
    for r in range(m):
        took = json.loads((tmp_path / f"mg2.restore.rank{r}.json").read_text())
        assert took["step"] == stop and took["level"] in (1, 3), took
    print(f"{n} -> {m}: the manager restored step {stop} from level {took['level']}: {took}")

    # the first stretch: ckptfmt's runs are HF's own run
    for name in ("ck1", "mg1"):
        assert _seen(tmp_path, name, n) == _seen(tmp_path, "hf1", n)
        for a, b in zip(_state(tmp_path, "hf1", n), _state(tmp_path, name, n), strict=True):
            _assert_bitwise(b, a, f"{name} at step {stop}")

    # the samples: the global order continued, across the epoch boundary
    before = _in_global_order(_seen(tmp_path, "hf1", n))
    for name in ("ref", "ck2", "mg2"):
        after = _seen(tmp_path, name, m)
        assert [len(r) for r in after] == [steps - stop] * m  # one batch per rank a step
        assert before + _in_global_order(after) == global_batches[: stop * n + (steps - stop) * m]
    epoch0 = [i for b in (before + _in_global_order(_seen(tmp_path, "ck2", m)))[:16] for i in b]
    assert sorted(epoch0) == list(range(N_SAMPLES))  # every sample of epoch 0 once

    # the final state: bitwise the reference's, on every rank
    for name in ("ck2", "mg2"):
        for r, (a, b) in enumerate(
            zip(_state(tmp_path, "ref", m), _state(tmp_path, name, m), strict=True)
        ):
            _assert_bitwise(b, a, f"{name} rank {r} at step {steps}")

    # a step after the resume: M x BATCH samples; the saved positions count them so
    for name in ("ck", "mg"):
        out = tmp_path / name
        state = json.loads((out / f"checkpoint-{steps}" / "trainer_state.json").read_text())
        assert state["global_step"] == steps
        for step in range(stop + stop, steps + 1, stop):
            total = consumed + (step - stop) * m * BATCH
            epoch, samples = divmod(total, N_SAMPLES)
            data = ckptfmt.load(out / f"checkpoint-{step}" / "ckptfmt")["trainer"]["data"]
            want = {"epoch": epoch, "samples": samples, "world_size": m, "per_step": m * BATCH}
            assert {k: int(v) for k, v in data.items()} == want, (name, step)


def test_a_run_given_in_epochs_ends_with_its_last_epoch(
    tmp_path: Path, global_batches: list[list[int]]
) -> None:
    """``num_train_epochs=3`` (no ``max_steps``): 4 steps at 2 ranks (32 samples), resumed at 1
    rank. HF would count ``max_steps`` as 3 epochs of 16 steps from step 0 (48) while the run's
    epochs now end at step 4 + 8 + 16 + 16 = 44: the run ends with its third epoch at step 44,
    which is ``max_steps`` in its trainer state, and the linear LR schedule reaches 0 there
    (it is stretched to the 44 steps: a schedule counted in steps cannot keep both its step
    count and its sample count when a step's size changes; give ``max_steps`` to keep it)."""
    common = {"max_steps": -1, "save_steps": 4}
    out = str(tmp_path / "ck")
    assert_ok(
        run_torchrun(2, WORKER, _plan(tmp_path, "e1", out=out, stop_at=4, **common), timeout=400)
    )
    resumed = run_torchrun(
        1, WORKER, _plan(tmp_path, "e2", out=out, resume=True, **common), timeout=400
    )
    assert_ok(resumed)
    before, after = _seen(tmp_path, "e1", 2), _seen(tmp_path, "e2", 1)
    assert [len(r) for r in before] == [4, 4] and [len(r) for r in after] == [40]
    assert _in_global_order(before) + _in_global_order(after) == global_batches  # 3 epochs
    state = json.loads((tmp_path / "ck" / "checkpoint-44" / "trainer_state.json").read_text())
    assert (state["global_step"], state["max_steps"], state["epoch"]) == (44, 44, 3.0)
    assert not (tmp_path / "ck" / "checkpoint-48").exists()
    end = ckptfmt.load(tmp_path / "ck" / "checkpoint-44" / "ckptfmt")
    assert {float(x) for x in end["scheduler"]["_last_lr"]} == {0.0}  # both param groups
    assert {k: int(v) for k, v in end["trainer"]["data"].items()} == {
        "epoch": 3,
        "samples": 0,
        "world_size": 1,
        "per_step": 4,
    }
