"""One stretch of an elastic job: ``_torch_elastic_worker.py PLAN.json``, under ``torchrun`` (gloo,
CPU), started by ``tests/adapters/torch/test_torch_elastic.py`` once per world size of a chain.

``PLAN.json`` is ``{"out": DIR, "name": S, "parallel": "ddp" | "fsdp", "load": DIR | null,
"save": DIR | null, "steps": K | null}``. The job trains a small MLP (DDP, or FSDP2 with every
layer and the root sharded over all ranks) with Adam on a 37-sample dataset, per-rank batch 2,
read through a ``ResumableSampler``; model, optimizer, step counter and data position are one
``TrainingState`` (no RNG: nothing in training is random, and RNG streams are per rank).

1. ``load``: ``ckptfmt_torch.load`` of that checkpoint, one call for tensors and data position;
   rank 0 writes the unsharded model and optimizer state it then holds to ``<name>.at_load.npz``.
2. trains ``steps`` optimizer steps (null: to the end of the epoch), each rank noting the
   sample indices of each of its batches.
3. ``save``: rank 0 writes the unsharded state to ``<name>.at_save.npz`` and every rank calls
   ``ckptfmt_torch.save`` (collective) at the step counter.

Each rank writes ``<out>/<name>.rank<r>.json``: its batches, the sampler's state before and
after, the step counter.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from kit.worker import end_torch_job

N_SAMPLES, BATCH, SEED = 37, 2, 11


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 12)
        self.fc2 = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(N_SAMPLES, 4, generator=g), torch.randn(N_SAMPLES, 3, generator=g)
    return torch.utils.data.TensorDataset(torch.arange(N_SAMPLES), x, y)


def build(parallel: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(dist.get_rank() + 100)  # not the saved weights: the load must set them
    net: nn.Module = MLP()
    if parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(net.fc1, mesh=mesh)
        fully_shard(net.fc2, mesh=mesh)
        fully_shard(net, mesh=mesh)
    else:
        net = nn.parallel.DistributedDataParallel(net)
    return net, torch.optim.Adam(net.parameters(), lr=1e-2)


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    """Collective: the unsharded model and optimizer state, flat, as numpy copies."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"model/{k}": v.detach().cpu().numpy().copy() for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim/{fqn}/{k}"] = torch.as_tensor(v).detach().cpu().numpy().copy()
    return out


def run(plan: dict[str, Any]) -> dict[str, Any]:
    import ckptfmt_torch

    rank = dist.get_rank()
    out, name = Path(plan["out"]), plan["name"]
    model, opt = build(plan["parallel"])
    data = dataset()
    sampler = ckptfmt_torch.ResumableSampler(data, shuffle=True, seed=SEED)
    ts = ckptfmt_torch.TrainingState(model, opt, sampler=sampler, rng=False, counters={"step": 0})
    res: dict[str, Any] = {"rank": rank, "size": dist.get_world_size(), "batches": []}
    if plan["load"] is not None:
        res["loaded_step"] = ckptfmt_torch.load({"train": ts}, plan["load"]).step
        full = full_state(model, opt)
        if rank == 0:
            np.savez(out / f"{name}.at_load.npz", **full)
    res["position_at_start"] = sampler.state_dict()
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler)
    for idx, x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ts.counters["step"] += 1
        res["batches"].append(idx.tolist())
        if plan["steps"] is not None and len(res["batches"]) == plan["steps"]:
            break
    res["position_at_end"] = sampler.state_dict()
    res["step"] = ts.counters["step"]
    if plan["save"] is not None:
        full = full_state(model, opt)
        if rank == 0:
            np.savez(out / f"{name}.at_save.npz", **full)
        ckptfmt_torch.save({"train": ts}, plan["save"], step=ts.counters["step"])
    return res


def main(argv: list[str]) -> int:
    (plan_file,) = argv
    plan = json.loads(Path(plan_file).read_text())
    dist.init_process_group("gloo")
    res = run(plan)
    path = Path(plan["out"]) / f"{plan['name']}.rank{dist.get_rank()}.json"
    path.write_text(json.dumps(res, indent=1))
    end_torch_job()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
