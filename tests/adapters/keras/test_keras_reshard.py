"""A data-parallel Keras checkpoint saved by 4 workers, restored by 2, under real
``mpiexec``, through ``BackupAndRestore`` and the core's ``CheckpointManager``.

Two jobs of ``tests/workers/_keras_reshard_worker.py`` (two launches: TensorFlow's import is the
slow part):

1. ``save``, 4 workers on 2 simulated nodes (ranks 0, 1 on ``n0``, 2, 3 on ``n1``): the model of
   ``_keras_worker.py`` (a bfloat16 layer, batch normalization, dropout) with Adam averaging the
   gradients (``distributed_optimizer``), 2 epochs of 5 steps, a checkpoint at each epoch's end
   on level 1 (``l1/{node}``) flushed to level 3 (``l3``);
2. ``restore``, a fresh 2-worker job on the same 2 nodes (rank 0 on ``n0``, 1 on ``n1``):
   restores from level 3 alone, then with level 1 tried first (each worker sees only its node's
   level-1 files; the other node's reach it through the communicator), each time into a model
   and optimizer whose every variable was first set to random values.

Checked, for both levels:

- the model and optimizer variables right after the restore are bitwise the checkpoint's, as
  this process reads the level-3 copy with ``ckptfmt.load``, and bitwise what every one of the
  4 workers held when it saved; the counters are those of the save (epoch 2, step 0, global
  step 10, 10 optimizer iterations);
- the per-rank entries (each worker's metric accumulators): a restore that says nothing about
  them fails on both workers with ``PerRankError`` naming every accumulator, saved ranks
  0-3 not carried over and current ranks 0, 1 without one, and leaves the model and optimizer
  untouched; with ``rank_map={0: 0, 1: 1}`` and ``per_rank="drop"`` it succeeds with one
  ``PerRankWarning`` naming them and saved ranks 2, 3, and worker r receives saved worker r's
  accumulators (compared by SHA-256 with what that worker held at the save).

The checkpoint is at an epoch's end on purpose: the batches of an epoch depend on the number of
workers, so resuming in the middle of one at another size is not defined.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _keras_reshard_worker import digest
from kit import REPO
from kit.arrays import flat
from kit.launch import describe, run_mpi

import ckptfmt
from ckptfmt.container.reader import read_manifest
from ckptfmt.storage.steps import step_dir_name

pytestmark = [pytest.mark.mpi, pytest.mark.tf, pytest.mark.slow]

WORKER = str(REPO / "tests" / "workers" / "_keras_reshard_worker.py")
SAVED, LOADED = 4, 2
EPOCHS = 2
STEPS = 160 // SAVED // 8  # _keras_worker: 160 samples, 8 a batch on each worker
JOB_TIMEOUT = 150
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}


def launch(tmp: Path, task: str, n: int) -> None:
    plan = tmp / f"{task}.plan.json"
    plan.write_text(
        json.dumps(
            {"out": str(tmp / "out"), "root": str(tmp / "run"), "task": task, "epochs": EPOCHS}
        )
    )
    result = run_mpi(n, WORKER, str(plan), timeout=JOB_TIMEOUT, env=ENV)
    if result.returncode != 0:
        pytest.fail(f"{task}: exit status {result.returncode}\n{describe(result)}", pytrace=False)


def results(tmp: Path, task: str, n: int) -> list[dict[str, Any]]:
    got = []
    for r in range(n):
        res = json.loads((tmp / "out" / f"{task}.rank{r}.json").read_text())
        assert (res["rank"], res["size"], res["node"]) == (r, n, f"n{r * 2 // n}")
        got.append(res)
    return got


def tensors(path: Path, kinds: tuple[str, ...] = ("model", "optimizer")) -> dict[str, Any]:
    return {k: v for k, v in flat(ckptfmt.load(path)).items() if k.split("/")[0] in kinds}


def assert_bit_equal(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: different names"
    for name, w in want.items():
        g = got[name]
        assert isinstance(g, np.ndarray) and isinstance(w, np.ndarray), f"{what}: {name}"
        assert (g.dtype, g.shape) == (w.dtype, w.shape), f"{what}: {name} dtype/shape"
        assert g.tobytes() == w.tobytes(), f"{what}: {name} differs"


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("tensorflow")
    tmp = tmp_path_factory.mktemp("keras_reshard")
    launch(tmp, "save", SAVED)
    launch(tmp, "restore", LOADED)
    return tmp


def test_saved_by_4_workers(jobs: Path) -> None:
    saved = results(jobs, "save", SAVED)
    l3 = jobs / "run" / "l3" / step_dir_name(EPOCHS * STEPS)
    m = read_manifest(l3)
    assert m.world_size == SAVED and m.step == EPOCHS * STEPS
    assert [r.node for r in m.ranks] == ["n0", "n0", "n1", "n1"]
    assert ckptfmt.verify(l3).healthy
    for node in ("n0", "n1"):  # level 1: each node's copy, the same save
        assert read_manifest(jobs / "run" / "l1" / node / l3.name).save_id == m.save_id
    ckpt = ckptfmt.load(l3)
    assert ckpt["counters"] == {
        "epoch": EPOCHS,
        "step": 0,
        "global_step": EPOCHS * STEPS,
        "optimizer_iterations": EPOCHS * STEPS,
    }
    on_disk = tensors(l3)
    assert sum(k.endswith(("_momentum", "_velocity")) for k in on_disk) == 16, sorted(on_disk)
    for r, res in enumerate(saved):
        assert res["steps_per_epoch"] == STEPS
        assert res["counters_at_save"] == {
            "epoch": EPOCHS,
            "global_step": EPOCHS * STEPS,
            "optimizer_iterations": EPOCHS * STEPS,
        }
        assert_bit_equal(on_disk, tensors(jobs / "out" / f"saved.rank{r}"), f"saved rank {r}")
    # each worker's metric accumulators: one row per saved worker, and they differ
    for name, rows in flat(ckpt["metrics"]).items():
        assert rows.shape[0] == SAVED, name
    assert len({json.dumps(res["metrics"], sort_keys=True) for res in saved}) == SAVED
    for r, res in enumerate(saved):  # row r is what worker r held
        assert {n: digest(a[r]) for n, a in flat(ckpt["metrics"]).items()} == res["metrics"]


@pytest.mark.parametrize("level", ["l3", "l1"])
def test_restored_by_2_workers(jobs: Path, level: str) -> None:
    saved = results(jobs, "save", SAVED)
    restored = results(jobs, "restore", LOADED)
    step = EPOCHS * STEPS
    l3 = jobs / "run" / "l3" / step_dir_name(step)
    want = tensors(l3)
    entries = sorted(f"metrics/{n}" for n in saved[0]["metrics"])
    assert entries, "no metric accumulators saved"
    for r, res in enumerate(restored):
        got = res[level]
        # --- without rank_map / per_rank: the explicit error, nothing touched ---
        refused = got["refused"]
        assert refused is not None, f"rank {r}: a restore without rank_map/per_rank must fail"
        assert sorted(refused["entries"]) == entries
        assert (refused["dropped"], refused["missing"]) == ([0, 1, 2, 3], [0, 1])
        assert "saved by 4 ranks, loaded by 2" in refused["error"]
        assert got["untouched"], f"rank {r}: the refused restore changed the model"
        # --- mapped 0 -> 0, 1 -> 1, saved ranks 2, 3 dropped: one warning listing them ---
        per_rank = [w for w in got["warnings"] if w[0] == "PerRankWarning"]
        assert len(per_rank) == 1, got["warnings"]
        text = per_rank[0][1]
        assert text.startswith("per-rank entries saved by 4 ranks, loaded by 2: "), text
        assert text.endswith(": the items of saved rank(s) 2, 3 are not carried over (dropped)")
        for e in entries:
            assert e in text, e
        assert got["report"]["step"] == step
        assert got["report"]["level"] == (1 if level == "l1" else 3), got["report"]
        assert got["report"]["tried"] == []
        assert got["restored"] == {
            "epoch": EPOCHS,
            "step": 0,
            "global_step": step,
            "optimizer_iterations": step,
        }
        assert got["trained_epochs"] == 0
        # worker r got saved worker r's accumulators, none of another's
        assert got["per_rank_rows"] == saved[r]["metrics"], f"rank {r}"
        # --- bitwise the checkpoint and the 4 workers' state at the save ---
        after = tensors(jobs / "out" / f"restored-{level}.rank{r}")
        assert_bit_equal(after, want, f"rank {r} from {level} vs the level-3 copy")
        for s in range(SAVED):
            assert_bit_equal(after, tensors(jobs / "out" / f"saved.rank{s}"), f"vs saved {s}")
        # every variable held other values before: the restore is what made them equal
        initial = got["initial"]
        assert sorted(k for k in initial if k.startswith("model/")) == sorted(
            k for k in after if k.startswith("model/")
        )
        if level == "l1":  # the optimizer was built (by the first restore) and scrambled too
            assert sorted(initial) == sorted(after)
        for k, a in after.items():  # (on l3 the optimizer was not built yet: not scrambled)
            if k in initial and (level == "l1" or k.startswith("model/")):
                assert initial[k] != digest(a), f"rank {r}: {k} held the saved value already"
