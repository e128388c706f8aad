"""A rank of a PyTorch training job checkpointed with ckptfmt: ``_torch_worker.py PLAN.json``,
run under ``torchrun`` (gloo, CPU) by ``tests/adapters/torch/test_torch_parallel.py``.

``PLAN.json`` is ``{"out": DIR, "tasks": [...]}``; the tasks run in order in this one job. Each
trains the same small model data-parallel (``mode``: ``"ddp"``, or ``"fsdp"``: FSDP2's
``fully_shard``) on deterministic synthetic data, with dropout and per-rank randomness from
torch, numpy and Python's ``random`` (every rank seeded differently), an AdamW optimizer, an LR
schedule, a ``ResumableSampler`` and (DDP) a ``GradScaler``, all in one ``TrainingState``:

- it restores from its ``CheckpointManager`` (``<root>/l1/{node}``, ``<root>/l3``; two simulated
  nodes) if there is anything there, then trains up to ``steps``, saving every ``save_every``
  steps (asynchronously) and logging every step's loss on every rank;
- ``kill``: ``{"rank": r, "after": s}``: rank ``r`` ends its process with ``os._exit`` right after
  step ``s`` (its save of that step may still be in flight);
- ``final``: at the end, ``ckptfmt_torch.save`` of the whole state to that directory;
  ``dcp``: also ``torch.distributed.checkpoint.save`` of the model and optimizer there;
- ``check_final``/``check_dcp``: before training, load those (saved by an earlier job) into
  fresh models with ``ckptfmt_torch.load`` and ``torch.distributed.checkpoint.load``.

Each rank writes ``<out>/<task>.rank<r>.json``: losses (``float.hex``), digests of its whole
state at every save, what it restored and the digests of what it loaded. The test compares them
across jobs.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from kit.worker import end_torch_job, node_of

N_SAMPLES = 96
D_IN, D_HID, D_OUT = 16, 32, 6  # D_OUT rows split 2/2/2/0 over 4 FSDP ranks: an empty shard
BATCH = 4
KILL_EXIT = 9


class Net(nn.Module):
    """A small MLP with dropout, a LayerNorm and a bfloat16 buffer (replicated under FSDP)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, D_HID)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(D_HID, D_HID)
        self.norm = nn.LayerNorm(D_HID)
        self.head = nn.Linear(D_HID, D_OUT)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, D_OUT).to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.nn.functional.gelu(self.fc1(x)))
        h = self.norm(torch.nn.functional.gelu(self.fc2(h)))
        return self.head(h) * self.scale.float()


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N_SAMPLES, D_IN, generator=g)
    y = torch.randn(N_SAMPLES, D_OUT, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def seed_rank(rank: int, salt: int = 0) -> None:
    torch.manual_seed(1000 + rank + salt)
    np.random.seed(2000 + rank + salt)
    random.seed(3000 + rank + salt)


def build(mode: str, init_seed: int) -> tuple[nn.Module, Any, Any, Any]:
    """Model (wrapped for ``mode``), optimizer, scheduler, scaler (DDP only)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(init_seed)
    net = Net()
    if mode == "ddp":
        # without unused-parameter search DDP rebuilds its gradient buckets after its first
        # iteration; a restarted job's first iteration would then sum in another order
        model: nn.Module = nn.parallel.DistributedDataParallel(net, find_unused_parameters=True)
    elif mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (net.fc1, net.fc2, net.head):
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        model = net
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if mode == "ddp" else None
    return model, opt, sched, scaler


def training_state(mode: str, init_seed: int, rng: bool = True) -> Any:
    from ckptfmt_torch import ResumableSampler, TrainingState

    model, opt, sched, scaler = build(mode, init_seed)
    sampler = ResumableSampler(N_SAMPLES, shuffle=True, seed=7)
    return TrainingState(
        model,
        opt,
        scheduler=sched,
        scaler=scaler,
        sampler=sampler,
        rng=rng,
        counters={"step": 0},
    )


def digest(state: Any) -> str:
    """SHA-256 of a ckptfmt state (names, array bytes and shapes, shard offsets, values)."""
    from ckptfmt.tree.state import PerRank, Shard, flatten

    h = hashlib.sha256()
    for name, leaf in flatten(state):
        h.update("/".join(name).encode() + b"\0")
        if isinstance(leaf, PerRank):
            leaf = leaf.value
        if isinstance(leaf, Shard):
            h.update(json.dumps([leaf.offset, leaf.global_shape]).encode())
            leaf = leaf.data
        if isinstance(leaf, np.ndarray):
            h.update(f"{leaf.dtype}{leaf.shape}".encode())
            h.update(np.ascontiguousarray(leaf).tobytes())
        else:
            h.update(json.dumps(leaf, sort_keys=True, default=str).encode())
    return h.hexdigest()


def tensors_digest(ts: Any) -> str:
    """Digest of the model and optimizer state only (what DCP saves too)."""
    from ckptfmt_torch import to_state

    sd = to_state({"train": ts})["train"]
    return digest({"model": sd["model"], "optim": sd["optim"]})


def full_model_digest(model: nn.Module) -> str:
    """Collective under FSDP: digest of the unsharded model parameters and buffers."""
    from ckptfmt_torch import to_state
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return digest(to_state(full))


def train_batch(ts: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    """One optimizer step; the loss before it. Every random source of the rank takes part."""
    noise = torch.from_numpy(np.random.standard_normal(x.shape).astype(np.float32))
    x = x + 0.05 * noise
    y = y * (1.0 + 0.1 * random.random())
    model, opt = ts.model, ts.optimizers[0]
    loss = torch.nn.functional.mse_loss(model(x), y)
    if ts.scaler is not None:
        ts.scaler.scale(loss).backward()
        ts.scaler.step(opt)
        ts.scaler.update()
    else:
        loss.backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    ts.scheduler.step()
    return float(loss.detach())


def run_task(task: dict[str, Any], comm: Any, out: Path) -> dict[str, Any] | None:
    import ckptfmt_torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ckptfmt import CheckpointManager, WriteOptions

    rank, size = comm.rank, comm.size
    mode = task["mode"]
    res: dict[str, Any] = {"rank": rank, "size": size, "losses": {}, "digests": {}}
    # anything loaded before training replaces RNG state: the run's own seeding comes after
    if "check_final" in task:
        probe = training_state(mode, init_seed=99)
        before = tensors_digest(probe)
        ckptfmt_torch.load({"train": probe}, task["check_final"])
        res["final_loaded"] = {
            "digest": digest(ckptfmt_torch.to_state({"train": probe})),
            "tensors": tensors_digest(probe),
            "changed": tensors_digest(probe) != before,
        }
    if "check_dcp" in task:
        probe = training_state(mode, init_seed=98)
        msd, osd = get_state_dict(probe.model, probe.optimizers)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=task["check_dcp"])
        set_state_dict(probe.model, probe.optimizers, model_state_dict=msd, optim_state_dict=osd)
        res["dcp_loaded"] = {"tensors": tensors_digest(probe)}

    seed_rank(rank)
    ts = training_state(mode, init_seed=task.get("init_seed", 0))
    node = node_of(rank, size)
    root = Path(task["root"])
    mgr = CheckpointManager(
        local_dir=root / "l1" / "{node}",
        shared_dir=root / "l3",
        comm=comm,
        node=node,
        flush_every=2,
        keep_local=3,
        keep_shared=3,
        write=WriteOptions(fsync=False),
        on_error="raise",
    )
    state = {"train": ts}
    rep = ckptfmt_torch.restore(state, mgr)
    restored = rep.step
    res["restored"] = restored
    res["report"] = {"step": rep.step, "level": rep.level, "tried": rep.tried}
    if restored is not None:
        res["restored_digest"] = digest(ckptfmt_torch.to_state(state))
        if ts.counters["step"] != restored:
            res.setdefault("problems", []).append(f"counters {ts.counters} after step {restored}")
    # a generator of its own: starting an iterator draws a seed from it, which from the global
    # one would shift every later random number of a run that restarted mid-epoch
    loader = torch.utils.data.DataLoader(
        dataset(),
        batch_size=BATCH,
        sampler=ts.sampler,
        num_workers=0,
        generator=torch.Generator(),
    )
    step = ts.counters["step"]
    kill = task.get("kill")
    while step < task["steps"]:
        ts.sampler.set_epoch(ts.sampler.epoch)
        for x, y in loader:
            step += 1
            res["losses"][str(step)] = train_batch(ts, x, y).hex()
            ts.counters["step"] = step
            if step % task["save_every"] == 0:
                snapshot = ckptfmt_torch.to_state(state)
                res["digests"][str(step)] = digest(snapshot)
                mgr.save(step, snapshot)
            if kill and rank == kill["rank"] and step == kill["after"]:
                (out / f"{task['name']}.killed").write_text(f"{rank} {step}")
                sys.stdout.flush()
                os._exit(KILL_EXIT)
            if step >= task["steps"]:
                break
    mgr.close(flush=True)
    if "final" in task:
        ckptfmt_torch.save(state, task["final"], step=step)
        res["final"] = {
            "digest": digest(ckptfmt_torch.to_state(state)),
            "tensors": tensors_digest(ts),
            "full_model": full_model_digest(ts.model),
        }
    if "dcp" in task:
        msd, osd = get_state_dict(ts.model, ts.optimizers)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=task["dcp"])
    return res


def main(argv: list[str]) -> int:
    (plan_file,) = argv
    plan = json.loads(Path(plan_file).read_text())
    out = Path(plan["out"])
    from ckptfmt_torch import TorchComm

    dist.init_process_group("gloo")
    comm = TorchComm()
    for task in plan["tasks"]:
        res = run_task(task, comm, out)
        path = out / f"{task['name']}.rank{comm.rank}.json"
        path.write_text(json.dumps(res, indent=1))
        comm.barrier()
    end_torch_job()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
