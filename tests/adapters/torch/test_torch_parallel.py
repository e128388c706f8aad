"""PyTorch training under ``torchrun`` (gloo, CPU), checkpointed with ckptfmt_torch: DDP and
FSDP2 (``fully_shard``) on 2 and 4 ranks.

Per configuration, two jobs of ``tests/workers/_torch_worker.py``:

1. an uninterrupted reference run (``ref``: losses of every step on every rank, digests of the
   whole state at every save, a final ``ckptfmt_torch.save`` and a ``torch.distributed.checkpoint``
   save), then the same run again in another directory, killed (``os._exit``) on the last rank
   after step ``KILL_AFTER`` while its asynchronous save may be in flight;
2. a fresh job (new process group) that restores the killed run from its last checkpoint and
   trains to the end; it also loads the reference's final checkpoint with ``ckptfmt_torch.load``
   and its DCP checkpoint with ``torch.distributed.checkpoint.load`` into fresh models.

Checked: the restored state (parameters, optimizer state, schedule, scaler, counters, every
rank's RNG states, data-loader position) is bitwise the reference's at that step, every later
loss of every rank is bitwise the reference's, the two loads give the reference's final tensors,
and a single process (this one) loads the multi-rank checkpoint into a plain model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from _torch_worker import Net, full_model_digest  # noqa: E402
from kit import REPO  # noqa: E402
from kit.launch import describe, run_torchrun  # noqa: E402

pytestmark = pytest.mark.torch

WORKER = str(REPO / "tests" / "workers" / "_torch_worker.py")
STEPS = 10
SAVE_EVERY = 2
KILL_AFTER = 7
JOB_TIMEOUT = 150


def job(tmp: Path, name: str, n: int, tasks: list[dict[str, Any]]) -> Any:
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    plan = tmp / f"{name}.plan.json"
    plan.write_text(json.dumps({"out": str(out), "tasks": tasks}))
    return run_torchrun(n, WORKER, str(plan), timeout=JOB_TIMEOUT)


def results(tmp: Path, task: str, n: int) -> list[dict[str, Any]]:
    got = []
    for r in range(n):
        path = tmp / "out" / f"{task}.rank{r}.json"
        assert path.exists(), f"rank {r} wrote no results for {task}"
        res = json.loads(path.read_text())
        assert (res["rank"], res["size"]) == (r, n)
        got.append(res)
    return got


@pytest.mark.parametrize(
    ("mode", "n"),
    [
        ("ddp", 2),
        ("fsdp", 2),
        pytest.param("ddp", 4, marks=pytest.mark.slow),
        pytest.param("fsdp", 4, marks=pytest.mark.slow),
    ],
)
def test_killed_run_restores_to_the_same_training(tmp_path: Path, mode: str, n: int) -> None:
    ref_root, run_root = tmp_path / "ref", tmp_path / "run"
    base = {"mode": mode, "steps": STEPS, "save_every": SAVE_EVERY}
    first = job(
        tmp_path,
        "first",
        n,
        [
            {
                **base,
                "name": "ref",
                "root": str(ref_root),
                "final": str(tmp_path / "final"),
                "dcp": str(tmp_path / "dcp"),
            },
            {
                **base,
                "name": "run",
                "root": str(run_root),
                "kill": {"rank": n - 1, "after": KILL_AFTER},
            },
        ],
    )
    assert (tmp_path / "out" / "run.killed").exists(), describe(first)
    assert first.returncode != 0, "the job went on although a rank was killed"
    lost_node = None
    if n == 4:  # the killed rank's node is lost with its level-1 copies: restore from level 3
        lost_node = "n1"
        shutil.rmtree(run_root / "l1" / lost_node)
    second = job(
        tmp_path,
        "second",
        n,
        [
            {
                **base,
                "name": "resume",
                "root": str(run_root),
                "check_final": str(tmp_path / "final"),
                "check_dcp": str(tmp_path / "dcp"),
                "init_seed": 5,
            }
        ],
    )
    assert second.returncode == 0, describe(second)

    ref, resumed = results(tmp_path, "ref", n), results(tmp_path, "resume", n)
    assert len({r["losses"]["1"] for r in ref}) == n, "ranks must see different data and noise"
    for r, (a, b) in enumerate(zip(ref, resumed)):
        assert sorted(map(int, a["losses"])) == list(range(1, STEPS + 1))
        step = b["restored"]
        assert step is not None and step % SAVE_EVERY == 0, b["report"]
        # at most the save in flight when the rank died (and, on a lost node, the unflushed
        # ones) is lost
        oldest = KILL_AFTER - 2 * SAVE_EVERY if lost_node is None else KILL_AFTER - 4 * SAVE_EVERY
        assert oldest <= step <= KILL_AFTER, b["report"]
        assert b["report"]["level"] == (1 if lost_node is None else 3), b["report"]
        assert b.get("problems", []) == []
        assert b["restored_digest"] == a["digests"][str(step)], f"rank {r}: restored state"
        assert sorted(map(int, b["losses"])) == list(range(step + 1, STEPS + 1))
        for s, loss in b["losses"].items():
            assert loss == a["losses"][s], f"rank {r} step {s}: {loss} != {a['losses'][s]}"
        # the final checkpoint of the reference, loaded by ckptfmt and by DCP into fresh models
        assert b["final_loaded"]["changed"]
        assert b["final_loaded"]["tensors"] == a["final"]["tensors"], f"rank {r}"
        assert b["final_loaded"]["digest"] == a["final"]["digest"], f"rank {r}: whole state"
        assert b["dcp_loaded"]["tensors"] == a["final"]["tensors"], f"rank {r}: DCP"
    check_single_process_load(tmp_path / "final", ref[0]["final"]["full_model"])
    check_writers(tmp_path / "final", mode, n)


def check_writers(path: Path, mode: str, n: int) -> None:
    """Who wrote what: DDP replicas once, spread over every rank; an FSDP2 parameter by the
    ranks holding its shards, each at its global offset; RNG states one row per rank."""
    import ckptfmt

    m = ckptfmt.open(path).manifest
    tensors = {t.path: t for t in m.tensors()}
    shared = [t for t in tensors.values() if not t.per_rank]
    assert {r.rank for t in shared for r in t.regions} == set(range(n))
    w = tensors["train/model/fc1.weight"]
    if mode == "fsdp":  # 32 rows, Shard(0): rank r writes rows [32 r / n, 32 (r + 1) / n)
        assert sorted((r.offset[0], r.rank) for r in w.regions) == [
            (32 * k // n, k) for k in range(n)
        ]
    else:  # small enough for one shard: one replica writes it
        assert len(w.regions) == 1
    rows = tensors["train/rng/torch"]
    assert rows.per_rank and rows.shape[0] == n
    assert sorted((r.offset[0], r.rank) for r in rows.regions) == [(k, k) for k in range(n)]


def check_single_process_load(path: Path, full_model: str) -> None:
    """This process alone loads the multi-rank checkpoint into a plain model (no process
    group): whole tensors, bitwise the reference's unsharded model. The ranks' own RNG states
    and data positions have no place in one process: dropped only when asked."""
    import ckptfmt_torch

    from ckptfmt import ReadOptions
    from ckptfmt.errors import PerRankError

    torch.manual_seed(77)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    ts = ckptfmt_torch.TrainingState(model, opt, rng=False)
    before = full_model_digest(model)
    with pytest.raises(PerRankError):
        ckptfmt_torch.load({"train": ts}, path)
    assert full_model_digest(model) == before
    step = ckptfmt_torch.load({"train": ts}, path, read=ReadOptions(per_rank="drop")).step
    assert step == STEPS
    assert before != full_model
    assert full_model_digest(model) == full_model
    assert ts.counters == {"step": STEPS}
    assert opt.state_dict()["state"][0]["step"].item() == STEPS
