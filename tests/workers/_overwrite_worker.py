"""One overwrite, in a process the test kills part way: ``_overwrite_worker.py ROUTE TARGET SEED
[POINT [noexchange|mpi]]`` (``kit.overwrite`` has the routes; ``mpi``: the ``collective`` route
by every rank of an ``mpiexec`` job, ``POINT`` then ``-``).

The bucket routes are stopped from outside: the test's S3 proxy holds a request and the test
kills this process. The ``fs`` route kills itself (SIGKILL) when its commit reaches the named
``POINT`` (``committing``, ``swapped``, ``aside``, ``committed``: the fault hook of the
collective save); ``noexchange`` takes the file system to have no ``RENAME_EXCHANGE``, so the
commit renames in two steps (the fallback).
"""

from __future__ import annotations

import os
import signal
import sys

from kit.overwrite import save


def main() -> None:
    route, target, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    point = sys.argv[4] if len(sys.argv) > 4 else None
    if "noexchange" in sys.argv[5:]:
        from ckptfmt.storage import commit

        commit.exchange = lambda a, b: False  # type: ignore[assignment]

    def hook(at: str) -> None:
        if at == point:
            os.kill(os.getpid(), signal.SIGKILL)

    comm = None
    if "mpi" in sys.argv[5:]:
        from kit.worker import make_comm

        comm = make_comm("mpi")
    save(route, target, seed, fault=hook, comm=comm)


if __name__ == "__main__":
    main()
