"""PyTorch adapter for ckptfmt: state dicts in and out, in place, nothing pickled.

    import ckptfmt_torch

    ckptfmt_torch.save({"model": model, "optim": optimizer, "step": 100}, "ckpt/step-100")
    ckptfmt_torch.load({"model": model, "optim": optimizer, "step": 0}, "ckpt/step-100")

    ts = ckptfmt_torch.TrainingState(model, optimizer, scheduler=sched, sampler=sampler)
    mgr = ckptfmt.CheckpointManager(local_dir=..., shared_dir=..., comm=ckptfmt_torch.TorchComm())
    report = ckptfmt_torch.restore({"train": ts}, mgr)  # collective; report.step None: fresh start
    ...
    mgr.save(step, ckptfmt_torch.to_state({"train": ts}))      # async: returns once staged

The protocol (who writes what, levels, redundancy) is the core's; this package only converts
(``convert``): tensors to numpy views without copies (bfloat16 and float8 included), DTensors to
``ckptfmt.Shard`` leaves at their global offsets, stateful objects through their
``state_dict()``, values to JSON.
"""

from __future__ import annotations

from ckptfmt.tree import PerRank, Shard
from ckptfmt_torch.checkpoint import default_comm, load, restore, save
from ckptfmt_torch.comm import TorchComm
from ckptfmt_torch.convert import (
    Stateful,
    from_state,
    numpy_to_tensor,
    tensor_to_numpy,
    to_state,
)
from ckptfmt_torch.fence import FencedSaver
from ckptfmt_torch.sampler import ResumableSampler
from ckptfmt_torch.training import TrainingState, rng_state, set_rng_state

__all__ = [
    "FencedSaver",
    "PerRank",
    "ResumableSampler",
    "Shard",
    "Stateful",
    "TorchComm",
    "TrainingState",
    "default_comm",
    "from_state",
    "load",
    "numpy_to_tensor",
    "restore",
    "rng_state",
    "save",
    "set_rng_state",
    "tensor_to_numpy",
    "to_state",
]
