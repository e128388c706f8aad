"""A rank of a ``torch.distributed.checkpoint`` job through ckptfmt's storage plugin:
``_dcp_worker.py PLAN.json``, run under ``torchrun`` (gloo, CPU) by
``tests/adapters/torch/test_dcp_parallel.py``.

``PLAN.json`` is ``{"task": "save" | "load", "ckpt": DIR, "ckpt_async": DIR, "out": DIR}``.
The state (``state``) holds a data-parallel replica (``ddp``: a module's state dict, the same
tensors on every rank), tensor-parallel DTensors sharded on dim 0 over all ranks of the job
(``tp``: float32 and bfloat16), an int (``step``) and a tuple (``meta/betas``, which DCP
serialises as an object).

- ``save``: ``dcp.save(state, storage_writer=Writer(ckpt, step=5))`` of the values
  ``expected()`` gives, then ``dcp.async_save`` of them to ``ckpt_async``; rank 0 writes them
  whole to ``<out>/expected.pt``.
- ``load``: a state of zeros laid out for this job's ranks, filled with
  ``dcp.load(state, storage_reader=Reader(ckpt))``; rank 0 writes what was loaded, DTensors
  gathered whole, to ``<out>/loaded-<ranks>.pt``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ckptfmt_torch.dcp import Reader, Writer
from kit.counting import counting_torch_collectives
from kit.worker import end_torch_job
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


def expected() -> dict[str, Any]:
    """The saved values, whole (the same on every rank)."""
    g = torch.Generator().manual_seed(27)
    return {
        "ddp": {
            "fc.weight": torch.randn(6, 5, generator=g),
            "fc.bias": torch.randn(6, generator=g),
            "count": torch.tensor(11, dtype=torch.int64),
        },
        "tp": {
            "w": torch.randn(8, 6, generator=g),
            "b": torch.randn(12, generator=g).to(torch.bfloat16),
        },
        "step": 5,
        "meta": {"betas": (0.9, 0.99)},
    }


def state(values: dict[str, Any], mesh: Any) -> dict[str, Any]:
    """``values`` laid out as the job holds them: ``tp`` sharded on dim 0 over ``mesh``."""
    return {
        "ddp": dict(values["ddp"]),
        "tp": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in values["tp"].items()},
        "step": values["step"],
        "meta": dict(values["meta"]),
    }


def whole(x: Any) -> Any:
    if isinstance(x, DTensor):
        return x.full_tensor()
    if isinstance(x, dict):
        return {k: whole(v) for k, v in x.items()}
    return x


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,))
    out = Path(plan["out"])
    if plan["task"] == "save":
        values = expected()
        dcp.save(state(values, mesh), storage_writer=Writer(plan["ckpt"], step=5))
        pending = dcp.async_save(state(values, mesh), storage_writer=Writer(plan["ckpt_async"]))
        pending.result()
        if rank == 0:
            torch.save(values, out / "expected.pt")
    elif plan["task"] == "count":
        count(state(expected(), mesh), out, rank, size)
    else:
        zeros = expected()
        for group in ("ddp", "tp"):
            zeros[group] = {k: torch.zeros_like(v) for k, v in zeros[group].items()}
        zeros["step"], zeros["meta"] = 0, {"betas": None}
        target = state(zeros, mesh)
        dcp.load(target, storage_reader=Reader(plan["ckpt"]))
        loaded = whole(target)
        if rank == 0:
            torch.save(loaded, out / f"loaded-{size}.pt")
    end_torch_job()


def count(saved: dict[str, Any], out: Path, rank: int, size: int, repeats: int = 5) -> None:
    """The torch.distributed collectives (and the seconds, median of ``repeats``) of one
    ``dcp.save`` with ckptfmt's ``Writer`` and with DCP's ``FileSystemWriter``; then a save
    whose object rank 0 cannot serialise (in ``write_data``, on rank 0 alone): it fails on every
    rank and leaves nothing; then a save onto the first checkpoint, refused on every rank with
    the coordinator's error (pickled by DCP). Rank 0 writes ``<out>/count-<size>.json``."""
    report: dict[str, Any] = {}
    for kind in ("ckptfmt", "filesystem"):
        counts, times = [], []
        for i in range(repeats):
            where = out / f"count-{kind}-{i}"
            writer = Writer(where, step=i) if kind == "ckptfmt" else FileSystemWriter(where)
            dist.barrier()
            with counting_torch_collectives() as seen:
                t0 = time.perf_counter()
                dcp.save(saved, storage_writer=writer)
                times.append(time.perf_counter() - t0)
            counts.append(dict(seen))
        report[kind] = {"counts": counts, "median_s": statistics.median(times)}
    bad = dict(saved, hook={"fn": lambda: None})  # torch.save cannot pickle a lambda
    failed = out / "count-failed"
    outcome: Any = None
    try:
        dcp.save(bad, storage_writer=Writer(failed))
    except CheckpointException as exc:
        outcome = sorted(f"{type(e).__name__}: {e}" for e, _tb in exc.failures.values())
    outcomes: list[Any] = [None] * size
    dist.all_gather_object(outcomes, outcome)  # every rank's, for rank 0's report
    report["failed"] = outcomes
    taken: Any = None  # a save onto a committed checkpoint: refused on every rank, clearly
    try:
        dcp.save(saved, storage_writer=Writer(out / "count-ckptfmt-0", step=99))
    except CheckpointException as exc:
        taken = sorted(f"{type(e).__name__}: {e}" for e, _tb in exc.failures.values())
    outcomes = [None] * size
    dist.all_gather_object(outcomes, taken)
    report["onto_existing"] = outcomes
    report["failed_left"] = sorted(p.name for p in out.iterdir() if "count-failed" in p.name)
    if rank == 0:
        (out / f"count-{size}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
