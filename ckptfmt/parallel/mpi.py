"""``MpiComm``: the ``Comm`` interface over mpi4py (the only module of the core that imports it).

Only the buffer-based (uppercase) mpi4py methods are used: nothing is pickled. Background
threads call MPI concurrently with the training loop, on a duplicated communicator; that needs
``MPI_THREAD_MULTIPLE``, which mpi4py requests by default and this module checks.
"""

from __future__ import annotations

from typing import Any, NoReturn

import numpy as np

from ckptfmt.errors import UsageError
from ckptfmt.parallel.comm import Comm


class MpiComm(Comm):
    """``Comm`` over an mpi4py communicator (``MPI.COMM_WORLD`` by default)."""

    def __init__(self, comm: Any = None) -> None:
        from mpi4py import MPI

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise UsageError(
                "ckptfmt needs MPI_THREAD_MULTIPLE (background saves talk MPI from a thread); "
                "do not lower mpi4py.rc.thread_level"
            )
        self._mpi = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = int(self.comm.Get_rank())
        self.size = int(self.comm.Get_size())

    def barrier(self) -> None:
        self.comm.Barrier()

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        sizes = np.empty(self.size, dtype=np.int64)
        self.comm.Allgather(np.array([len(data)], dtype=np.int64), sizes)
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        send = np.frombuffer(data, dtype=np.uint8) if data else np.empty(0, np.uint8)
        self.comm.Allgatherv(send, [out, sizes.tolist(), displs.tolist(), self._mpi.BYTE])
        return [out[d : d + s].tobytes() for d, s in zip(displs.tolist(), sizes.tolist())]

    def bcast_buffer(self, buf: np.ndarray, root: int) -> None:
        if buf.size:
            self.comm.Bcast([buf, self._mpi.BYTE], root=root)

    def send(self, buf: np.ndarray, dest: int, tag: int = 0) -> None:
        self.comm.Send([buf, self._mpi.BYTE], dest=dest, tag=tag)

    def recv(self, buf: np.ndarray, source: int, tag: int = 0) -> None:
        self.comm.Recv([buf, self._mpi.BYTE], source=source, tag=tag)

    def sendrecv(
        self, sendbuf: np.ndarray, dest: int, recvbuf: np.ndarray, source: int, tag: int = 0
    ) -> None:
        self.comm.Sendrecv(
            [sendbuf, self._mpi.BYTE], dest, tag, [recvbuf, self._mpi.BYTE], source, tag
        )

    def dup(self) -> MpiComm:
        return MpiComm(self.comm.Dup())

    def abort(self, code: int = 1) -> NoReturn:
        self.comm.Abort(code)
        raise SystemExit(code)  # not reached
