"""What the scripts run under mpiexec / torchrun share: building the communicator."""

from __future__ import annotations

from typing import Any


def make_comm(kind: str) -> Any:
    """``mpi``: MpiComm over COMM_WORLD; ``torch``: TorchComm after a gloo process group."""
    if kind == "mpi":
        from ckptfmt.parallel.mpi import MpiComm

        return MpiComm()
    if kind == "torch":
        import torch.distributed as dist
        from ckptfmt_torch.comm import TorchComm

        dist.init_process_group("gloo")
        return TorchComm()
    raise SystemExit(f"unknown comm kind {kind!r}")
