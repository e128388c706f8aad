"""What the launcher says about the job, read once where a manager is built.

A ``CheckpointManager`` without a ``comm`` is a one-process job. Started by ``mpiexec``,
``srun`` or ``torchrun`` with several ranks, every rank would then save as "rank 0 of 1" into the
same directories and the last writer would win; the launcher's environment variables say that
this is so, and the manager refuses (:func:`refuse_implicit_single`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ckptfmt.errors import ImplicitSingleProcessError

# (variable, launcher) in the order they are looked at; the first one set and > 1 wins
_WORLD_SIZE_VARS = (
    ("PMI_SIZE", "mpiexec (PMI: MPICH/Hydra, Intel MPI)"),
    ("PMIX_SIZE", "mpiexec (PMIx)"),
    ("OMPI_COMM_WORLD_SIZE", "mpiexec (Open MPI)"),
    ("MV2_COMM_WORLD_SIZE", "mpiexec (MVAPICH2)"),
    ("SLURM_NTASKS", "srun"),
    ("WORLD_SIZE", "torchrun"),
)


def launcher_world_size(env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """(number of ranks, launcher) as the environment says; (1, "") when it says nothing.
    ``SLURM_NTASKS`` counts only inside a step (``SLURM_STEP_ID`` set): an ``sbatch`` script's
    own single process sees the allocation's task count too."""
    env = os.environ if env is None else env
    for var, launcher in _WORLD_SIZE_VARS:
        if var == "SLURM_NTASKS" and "SLURM_STEP_ID" not in env:
            continue
        try:
            n = int(env.get(var, ""))
        except ValueError:
            continue
        if n > 1:
            return n, launcher
    return 1, ""


def refuse_implicit_single(found: tuple[int, str]) -> None:
    """Raise :class:`ImplicitSingleProcessError` when the launcher started several ranks."""
    n, launcher = found
    if n > 1:
        raise ImplicitSingleProcessError(n, launcher)
