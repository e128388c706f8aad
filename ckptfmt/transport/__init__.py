"""Communicators: the :class:`Comm` interface every collective phase uses, one process
(:class:`SingleComm`) and MPI (:class:`MpiComm`, mpi4py imported when one is made)."""

from __future__ import annotations

from ckptfmt.transport.comm import Comm, SingleComm, roll_key, roll_token
from ckptfmt.transport.mpi import MpiComm
from ckptfmt.transport.threads import ThreadComm, run_threads

__all__ = [
    "ThreadComm",
    "run_threads",
    "Comm",
    "MpiComm",
    "SingleComm",
    "roll_key",
    "roll_token",
]
