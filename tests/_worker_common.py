"""What the scripts run under mpiexec / torchrun share: building the communicator."""

from __future__ import annotations

from typing import Any


def make_comm(kind: str) -> Any:
    """``mpi``: MpiComm over COMM_WORLD (waits sleep between tests); ``mpi-block``: the same with
    MPI's own blocking waits; ``torch``: TorchComm after a gloo process group."""
    if kind in ("mpi", "mpi-block"):
        from ckptfmt.parallel.mpi import MpiComm

        return MpiComm(wait="block" if kind == "mpi-block" else "polite")
    if kind == "torch":
        import torch.distributed as dist
        from ckptfmt_torch.comm import TorchComm

        dist.init_process_group("gloo")
        return TorchComm()
    raise SystemExit(f"unknown comm kind {kind!r}")
