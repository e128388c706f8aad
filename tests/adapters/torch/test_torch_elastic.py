"""An elastic job under ``torchrun`` (gloo, CPU): one epoch of 37 samples, per-rank batch 2,
trained in five stretches at 1, 4, 2, 3 and 2 ranks (DDP, DDP, FSDP2, FSDP2, DDP), each resuming
from the checkpoint the one before saved, with one ``ckptfmt_torch.load`` for the tensors and
the data position. The transitions 1->4, 4->2, 2->3 and 3->2 cover DDP (replicated) and FSDP2
(sharded) on both sides.

Checked: every sample of the epoch is seen exactly once across the stretches, plus only the
end-of-epoch padding of ``DistributedSampler`` (37 is not a multiple of the last stretch's 2
ranks); read in global order the indices are the epoch's permutation; the model and Adam state
right after each load are bitwise the state the stretch before held when it saved; the step
counter counts optimizer steps across the changes of global batch. Worker:
``tests/workers/_torch_elastic_worker.py``."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ckptfmt_torch import ResumableSampler  # noqa: E402
from kit import REPO  # noqa: E402
from kit.launch import describe, run_torchrun  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

WORKER = str(REPO / "tests" / "workers" / "_torch_elastic_worker.py")
N_SAMPLES, BATCH, SEED = 37, 2, 11
# (ranks, parallelism, optimizer steps; None: to the epoch's end)
CHAIN = [(1, "ddp", 3), (4, "ddp", 2), (2, "fsdp", 1), (3, "fsdp", 1), (2, "ddp", None)]
JOB_TIMEOUT = 150


def stretch(tmp: Path, i: int) -> list[dict[str, Any]]:
    n, parallel, steps = CHAIN[i]
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    plan = tmp / f"s{i}.plan.json"
    plan.write_text(
        json.dumps(
            {
                "out": str(out),
                "name": f"s{i}",
                "parallel": parallel,
                "load": str(tmp / f"ckpt{i - 1}") if i else None,
                "save": str(tmp / f"ckpt{i}") if i < len(CHAIN) - 1 else None,
                "steps": steps,
            }
        )
    )
    result = run_torchrun(n, WORKER, str(plan), timeout=JOB_TIMEOUT)
    assert result.returncode == 0, describe(result)
    got = [json.loads((out / f"s{i}.rank{r}.json").read_text()) for r in range(n)]
    assert [(g["rank"], g["size"]) for g in got] == [(r, n) for r in range(n)]
    return got


def test_one_epoch_over_changing_world_sizes(tmp_path: Path) -> None:
    order = ResumableSampler(N_SAMPLES, seed=SEED).global_order(0)
    seen: list[int] = []
    glob: list[int] = []  # the indices in the job's global order: step by step, rank by rank
    consumed, step = 0, 0
    for i, (n, _, steps) in enumerate(CHAIN):
        ranks = stretch(tmp_path, i)
        for r in ranks:
            assert r["position_at_start"]["consumed"] == consumed, (i, r["rank"])
            assert r["position_at_start"]["world_size"] == n
            if i:
                assert r["loaded_step"] == step
            assert len(r["batches"]) == len(ranks[0]["batches"])  # lock step
        k = len(ranks[0]["batches"])
        if steps is not None:
            assert k == steps
            ends = {json.dumps(r["position_at_end"]) for r in ranks}
            assert len(ends) == 1, ends  # one global position, saved once
            assert ranks[0]["position_at_end"]["consumed"] == consumed + n * BATCH * steps
        for s in range(k):
            for j in range(BATCH):
                glob += [r["batches"][s][j] for r in ranks if j < len(r["batches"][s])]
            seen += [x for r in ranks for x in r["batches"][s]]
        consumed += n * BATCH * k
        step += k
        assert all(r["step"] == step for r in ranks)  # optimizer steps, whatever the batch

        if i:  # the tensors the load gave, bitwise what the stretch before saved
            saved = np.load(tmp_path / "out" / f"s{i - 1}.at_save.npz")
            loaded = np.load(tmp_path / "out" / f"s{i}.at_load.npz")
            assert sorted(loaded.files) == sorted(saved.files)
            assert len(saved.files) == 4 + 4 * 3  # 4 parameters; Adam's step, exp_avg(_sq)
            for key in saved.files:
                a, b = saved[key], loaded[key]
                assert (a.dtype, a.shape) == (b.dtype, b.shape), key
                assert a.tobytes() == b.tobytes(), f"stretch {i}: {key} not bitwise the saved"

    # the last stretch took the 5 samples left over 2 ranks: 3 each, one of them padding
    counts = Counter(seen)
    assert set(counts) == set(range(N_SAMPLES))
    repeated = {x: c for x, c in counts.items() if c > 1}
    assert repeated == {order[0]: 2}, repeated  # DistributedSampler's padding: the first index
    assert len(seen) == N_SAMPLES + 1
    assert glob == [*order, order[0]]
