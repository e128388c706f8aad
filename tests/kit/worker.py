"""What the scripts run under mpiexec / torchrun share: building the communicator, the simulated
node of a rank, the end of a torchrun rank."""

from __future__ import annotations

from typing import Any


def make_comm(kind: str) -> Any:
    """``mpi``: MpiComm over COMM_WORLD (waits sleep between tests); ``mpi-block``: the same with
    MPI's own blocking waits; ``torch``: TorchComm after a gloo process group."""
    if kind in ("mpi", "mpi-block"):
        from ckptfmt.transport.mpi import MpiComm

        return MpiComm(wait="block" if kind == "mpi-block" else "polite")
    if kind == "torch":
        import torch.distributed as dist
        from ckptfmt_torch.comm import TorchComm

        dist.init_process_group("gloo")
        return TorchComm()
    raise SystemExit(f"unknown comm kind {kind!r}")


def node_of(rank: int, size: int, n_nodes: int = 2) -> str:
    """The simulated node of rank ``rank`` of ``size``: ``n0`` .. ``n{n_nodes - 1}``, the ranks
    split into equal consecutive blocks (as a launcher fills hosts)."""
    return f"n{rank * n_nodes // size}"


# MPI jobs end with a normal interpreter exit after their last barrier, never ``os._exit``: a
# rank that leaves with ``os._exit`` (no MPI_Finalize) while another has not left yet makes Hydra
# kill that one ("BAD TERMINATION ... Killed (signal 9)", mpiexec's exit status 9), even when every
# result was written; measured here, one launch in four of 4 ranks, one of them 0.5 s late. In a
# normal exit mpi4py's MPI_Finalize waits for every rank: 0 failures in 8 such launches.


def end_torch_job() -> None:
    """End a torchrun rank whose results are written: leave the process groups together, then
    exit without interpreter finalization. Finalizing after a gloo job can abort the process
    ("terminate called without an active exception", SIGABRT) when torch's C++ threads and
    objects holding tensors are torn down with the interpreter (pytorch/pytorch PR 179291 has
    the analysis); it happened in about one full-suite run in three here, always after every
    rank had written its results."""
    import os
    import sys

    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
