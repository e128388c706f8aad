"""FSDP2 training saved on 4 ranks, continued on 2 (``torchrun``, gloo, CPU): the continuation
follows the 4-rank run that never changed size.

Two jobs of ``tests/workers/_torch_reshard_worker.py``:

1. ``ref``, 4 ranks: a two-layer MLP under ``fully_shard``, AdamW, a deterministic global batch per
   step split over the ranks; trains steps 1..STEPS without a pause and, after step SAVE_AT, saves
   model, optimizer, step counter and each rank's RNG states with ``ckptfmt_torch.save``;
2. ``resume``, a fresh 2-rank job: loads that checkpoint into an FSDP2 model on 2 ranks (built from
   other initial weights) and trains steps SAVE_AT+1..STEPS on the same global batches.

Checked:

- right after the load (before any step) the 2-rank job's unsharded model and optimizer state is
  bitwise the checkpoint's, as this process reads it whole with ``ckptfmt.load``, and bitwise what
  the 4-rank job held when it saved;
- per-rank entries (``train/rng/*``, one row per saved rank): a load that says nothing about them
  fails with ``PerRankError`` naming them and the ranks, touching nothing; the job then maps saved
  ranks 0 and 1 to its ranks 0 and 1 (``rank_map={0: 0, 1: 1}``) and drops saved ranks 2 and 3
  (``per_rank="drop"``), which the load reports with one ``PerRankWarning`` naming the entries and
  those ranks; each rank's torch generator is then saved rank r's;
- the 2-rank continuation's loss of the global batch at every step SAVE_AT+1..STEPS equals the
  4-rank reference's within rtol ``LOSS_RTOL``.

Why not bitwise: the parameters and optimizer state at the start of step SAVE_AT+1 are the same
bits, but the arithmetic afterwards is not the same sequence of float32 operations. Each rank's
forward/backward runs on 8 rows instead of 4 (the matmul and the loss mean add in another order
and grouping), FSDP2's gradient reduce-scatter then averages 2 partial gradients instead of 4, and
the logged global loss adds 2 partial means instead of 4. Float32 addition is
not associative, so each of these differs in the last bits (relative ~1e-7); AdamW carries that
into the parameters at the same relative size, and over a few steps of a smooth (tanh) model it
stays there: measured at most ~5e-8 relative. ``LOSS_RTOL = 1e-5`` is ~200x that, and still
~1000x below the change of the loss from one step to the next (so an off-by-one step, a lost
optimizer state or wrong shards would fail it; the test asserts that margin).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kit import REPO  # noqa: E402
from kit.arrays import flat  # noqa: E402
from kit.launch import describe, run_torchrun  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

WORKER = str(REPO / "tests" / "workers" / "_torch_reshard_worker.py")
SAVED_RANKS, LOADED_RANKS = 4, 2
STEPS, SAVE_AT = 8, 4
LOSS_RTOL = 1e-5
JOB_TIMEOUT = 120
RNG_ENTRIES = [
    "train/rng/torch",
    "train/rng/numpy/key",
    "train/rng/numpy/meta",
    "train/rng/python/words",
    "train/rng/python/meta",
]


def job(tmp: Path, task: str, n: int) -> None:
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    plan = tmp / f"{task}.plan.json"
    plan.write_text(
        json.dumps(
            {
                "out": str(out),
                "ckpt": str(tmp / "ckpt"),
                "task": task,
                "steps": STEPS,
                "save_at": SAVE_AT,
            }
        )
    )
    result = run_torchrun(n, WORKER, str(plan), timeout=JOB_TIMEOUT)
    assert result.returncode == 0, describe(result)


def results(tmp: Path, task: str, n: int) -> list[dict[str, Any]]:
    got = []
    for r in range(n):
        res = json.loads((tmp / "out" / f"{task}.rank{r}.json").read_text())
        assert (res["rank"], res["size"]) == (r, n)
        got.append(res)
    return got


def test_fsdp2_saved_on_4_ranks_continues_on_2(tmp_path: Path) -> None:
    import ckptfmt

    job(tmp_path, "ref", SAVED_RANKS)
    job(tmp_path, "resume", LOADED_RANKS)
    ref = results(tmp_path, "ref", SAVED_RANKS)
    resumed = results(tmp_path, "resume", LOADED_RANKS)

    # --- the state right after the load: bitwise the checkpoint's, as one process reads it ---
    ckpt = flat(ckptfmt.load(tmp_path / "ckpt")["train"])
    at_save = np.load(tmp_path / "out" / "ref_at_save.npz")
    at_load = np.load(tmp_path / "out" / "resumed_at_load.npz")
    assert sorted(at_load.files) == sorted(at_save.files)
    assert {k.split("/")[0] for k in at_load.files} == {"model", "optim"}
    assert len(at_load.files) == 4 + 4 * 3  # 4 parameters; step, exp_avg, exp_avg_sq of each
    for key in at_load.files:
        kind, rest = key.split("/", 1)
        saved = np.asarray(ckpt[f"model/{rest}" if kind == "model" else f"optim/state/{rest}"])
        got = at_load[key]
        assert got.dtype == saved.dtype and got.shape == saved.shape, key
        assert got.tobytes() == saved.tobytes(), f"{key}: loaded on 2 ranks != checkpoint"
        assert at_save[key].tobytes() == saved.tobytes(), f"{key}: checkpoint != 4-rank state"
    assert ckpt["counters/step"] == SAVE_AT

    # --- per-rank entries: refused unless asked, then rows 0, 1 mapped, rows 2, 3 dropped ---
    torch_rows = np.asarray(ckpt["rng/torch"])
    assert torch_rows.shape[0] == SAVED_RANKS
    row_digests = [hashlib.sha256(row.tobytes()).hexdigest() for row in torch_rows]
    assert row_digests == [r["rng_at_save"] for r in ref]
    assert len(set(row_digests)) == SAVED_RANKS, "the saved ranks' RNG streams must differ"
    for r, res in enumerate(resumed):
        err = res["unmapped"]
        assert err is not None, f"rank {r}: a load without rank_map/per_rank must fail"
        assert err["entries"] == RNG_ENTRIES
        assert (err["dropped"], err["missing"]) == ([0, 1, 2, 3], [0, 1])
        assert "saved by 4 ranks, loaded by 2" in err["error"]
        assert res["untouched_by_error"] and res["rng_untouched_by_error"], f"rank {r}"
        assert len(res["warnings"]) == 1, res["warnings"]
        kind, text = res["warnings"][0]
        assert kind == "PerRankWarning"
        assert text == (
            "per-rank entries saved by 4 ranks, loaded by 2: "
            + ", ".join(RNG_ENTRIES)
            + ": the items of saved rank(s) 2, 3 are not carried over (dropped)"
        )
        assert res["loaded_step"] == SAVE_AT and res["counters"] == {"step": SAVE_AT}
        assert res["rng_before"] != res["rng_after_load"]
        assert res["rng_after_load"] == row_digests[r], f"rank {r}: not saved rank {r}'s RNG"

    # --- the loss curve: the 2-rank continuation follows the 4-rank reference ---
    ref_losses = ref[0]["losses"]
    for r, res in enumerate(ref):
        assert sorted(map(int, res["losses"])) == list(range(1, STEPS + 1))
        assert res["losses"] == ref_losses, f"ref rank {r}: the global loss is every rank's"
    for res in resumed:
        assert sorted(map(int, res["losses"])) == list(range(SAVE_AT + 1, STEPS + 1))
        assert res["losses"] == resumed[0]["losses"]
    worst = 0.0
    for s in range(SAVE_AT + 1, STEPS + 1):
        want, got = ref_losses[str(s)][0], resumed[0]["losses"][str(s)][0]
        assert math.isfinite(got)
        assert got == pytest.approx(want, rel=LOSS_RTOL, abs=0), f"step {s}: {got} != {want}"
        worst = max(worst, abs(got - want) / abs(want))
        # the tolerance discriminates: a step's loss moves far more than it allows
        prev = ref_losses[str(s - 1)][0]
        assert abs(want - prev) > 100 * LOSS_RTOL * abs(want), f"step {s}: the loss hardly moved"
    print(f"max relative loss difference, 2-rank continuation vs 4-rank reference: {worst:.2e}")
