"""A rank of an FSDP2 job saved on 4 ranks and continued on 2: ``_torch_reshard_worker.py
PLAN.json``, run under ``torchrun`` (gloo, CPU) by ``tests/adapters/torch/test_torch_reshard.py``.

``PLAN.json`` is ``{"out": DIR, "task": "ref" | "resume", "ckpt": DIR, "steps": S,
"save_at": K}``. Both tasks train the same two-layer MLP, every layer and the root wrapped with
FSDP2's ``fully_shard`` over all ranks of the job, with AdamW, on a deterministic global batch per
step (``global_batch(step)``): the job's ranks split its rows evenly, so every step's gradient is
that of the same global batch whatever the number of ranks (FSDP2 averages over the ranks).
Nothing in training is random.

- ``ref`` (4 ranks): trains steps 1..S without a pause; right after step K it saves the model,
  the optimizer, a step counter and each rank's RNG states (``TrainingState``, per-rank entries
  under ``train/rng``) with ``ckptfmt_torch.save`` to ``ckpt``, and rank 0 writes the unsharded
  model and optimizer state it holds then to ``<out>/ref_at_save.npz``.
- ``resume`` (2 ranks, a fresh job): builds the model from another seed, tries
  ``ckptfmt_torch.load`` of ``ckpt`` without saying what becomes of the per-rank entries (must
  raise ``PerRankError``, touching nothing), then with ``rank_map={0: 0, 1: 1}`` and
  ``per_rank="drop"`` (records the ``PerRankWarning``), writes the unsharded state right after
  the load to ``<out>/resumed_at_load.npz`` (rank 0), and trains steps K+1..S.

Each rank writes ``<out>/<task>.rank<r>.json``: the global loss of every step (float and
``float.hex``; the loss of the global batch, each rank's mean weighted by its rows) and, for
``resume``, what the loads did.
"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from kit.worker import end_torch_job

D_IN, D_HID, D_OUT = 16, 32, 6  # D_OUT rows split 2/2/2/0 over 4 FSDP ranks, 3/3 over 2
GLOBAL_BATCH = 16
LR = 1e-2


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, D_HID)
        self.fc2 = nn.Linear(D_HID, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of ``step`` (1-based), the same in every job."""
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(GLOBAL_BATCH, D_IN, generator=g)
    y = torch.randn(GLOBAL_BATCH, D_OUT, generator=g)
    return x, y


def build(init_seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(init_seed)
    net = MLP()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(net.fc1, mesh=mesh)
    fully_shard(net.fc2, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.01)
    return net, opt


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    """Collective: the unsharded model and optimizer state, flat ('model/fc1.weight',
    'optim/fc1.weight/exp_avg', ...), as numpy copies (all-gathered: bitwise the shards)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"model/{k}": v.detach().cpu().numpy().copy() for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim/{fqn}/{k}"] = torch.as_tensor(v).detach().cpu().numpy().copy()
    return out


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    """One optimizer step on this rank's rows of the global batch; the global batch's loss
    before it (the same number on every rank)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(step)
    rows = GLOBAL_BATCH // size
    x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    total = torch.tensor([float(loss.detach()) * rows / GLOBAL_BATCH], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total.item())


def rng_digest() -> str:
    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()


def run(plan: dict[str, Any]) -> dict[str, Any]:
    import ckptfmt_torch

    import ckptfmt
    from ckptfmt.errors import PerRankError

    rank, size = dist.get_rank(), dist.get_world_size()
    out, ckpt = Path(plan["out"]), plan["ckpt"]
    steps, save_at = plan["steps"], plan["save_at"]
    res: dict[str, Any] = {"rank": rank, "size": size, "losses": {}}
    if plan["task"] == "ref":
        model, opt = build(init_seed=0)
        torch.manual_seed(500 + rank)  # distinct per-rank RNG streams: what the checkpoint keeps
        ts = ckptfmt_torch.TrainingState(model, opt, counters={"step": 0})
        for step in range(1, steps + 1):
            loss = train_step(model, opt, step)
            res["losses"][str(step)] = [loss, loss.hex()]
            ts.counters["step"] = step
            if step == save_at:
                ckptfmt_torch.save({"train": ts}, ckpt, step=step)
                res["rng_at_save"] = rng_digest()
                full = full_state(model, opt)
                if rank == 0:
                    np.savez(out / "ref_at_save.npz", **full)
        return res

    model, opt = build(init_seed=1)  # not the reference's initial weights
    torch.manual_seed(900 + rank)
    ts = ckptfmt_torch.TrainingState(model, opt, counters={"step": 0})
    before = full_state(model, opt)  # a fresh optimizer has no state yet: model only
    res["rng_before"] = rng_digest()
    try:
        ckptfmt_torch.load({"train": ts}, ckpt)
        res["unmapped"] = None
    except PerRankError as exc:
        res["unmapped"] = {
            "error": str(exc),
            "entries": list(exc.entries),
            "dropped": list(exc.dropped),
            "missing": list(exc.missing),
        }
    after_error = full_state(model, opt)
    res["untouched_by_error"] = sorted(after_error) == sorted(before) and all(
        np.array_equal(after_error[k], before[k]) for k in before
    )
    res["rng_untouched_by_error"] = rng_digest() == res["rng_before"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        read = ckptfmt.ReadOptions(rank_map={0: 0, 1: 1}, per_rank="drop")
        step = ckptfmt_torch.load({"train": ts}, ckpt, read=read).step
    res["loaded_step"] = step
    res["counters"] = ts.counters
    res["warnings"] = [[type(w.message).__name__, str(w.message)] for w in caught]
    res["rng_after_load"] = rng_digest()
    full = full_state(model, opt)
    if rank == 0:
        np.savez(out / "resumed_at_load.npz", **full)
    for s in range(step + 1, steps + 1):
        loss = train_step(model, opt, s)
        res["losses"][str(s)] = [loss, loss.hex()]
    return res


def main(argv: list[str]) -> int:
    (plan_file,) = argv
    plan = json.loads(Path(plan_file).read_text())
    dist.init_process_group("gloo")
    res = run(plan)
    path = Path(plan["out"]) / f"{plan['task']}.rank{dist.get_rank()}.json"
    path.write_text(json.dumps(res, indent=1))
    end_torch_job()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
