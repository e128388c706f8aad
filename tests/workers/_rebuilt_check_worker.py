"""MPI worker of ``tests/redundancy/test_rebuilt_check_mpi.py``: a load from a rebuild whose
bytes are wrong on ONE rank fails on every rank before anything lands, under real ``mpiexec``.

    mpiexec -n 4 python -m mpi4py _rebuilt_check_worker.py <out> <root>

4 ranks on 4 simulated nodes (``n<rank>``), xor over all four:
every rank saves its ``kit.level1.rank_state`` collectively, then ``n1``'s directory is
deleted (the lost node). Each rank rebuilds in memory (``rebuild_in_memory``); rank 1, whose
data was rebuilt, has one byte of its member flipped (as a wrong parity would make it); every
rank then loads from the rebuild with its arrays offered to land in and the member check first
(``check_first=MemberFiles.verify``), as a restore does. Every rank must get
``LoadFailedError`` naming rank 1 and keep its arrays untouched. The same rebuild, made again
without the flip, then loads every rank's rows bit for bit. Each rank writes
``rank<r>.json``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
from kit.level1 import rank_state, rows_of, whole
from kit.worker import make_comm

from ckptfmt.container.metadata import ManifestMeta
from ckptfmt.errors import LoadFailedError
from ckptfmt.format.options import WriteOptions
from ckptfmt.parallel.collective.load import load_collective
from ckptfmt.parallel.collective.rebuild import rebuild_in_memory
from ckptfmt.parallel.collective.save import save_collective
from ckptfmt.redundancy.config import Redundancy

LOST = 1


def load(comm: Any, root: Path, flip: bool) -> dict[str, Any]:
    """Rebuild ``root``'s step on this rank's node, flip a byte of rank LOST's member when
    ``flip``, and load with the caller's arrays offered: what happened, and whether they hold
    zeros or the saved rows."""
    node = f"n{comm.rank}"
    rebuilt = rebuild_in_memory(comm, root / node, node, fsync=False)
    if flip and comm.rank == LOST:
        rebuilt.bufs.data[5] ^= 0x10  # inside the first chunk of its first data file
    memory = rebuilt.files(comm.rank)
    start, count = rows_of(comm.rank, comm.size)
    embed = np.zeros((30, 7), np.float32)
    w = np.zeros((count, 5), np.float32)
    out: dict[str, Any] = {"lost_data": rebuilt.report.lost_data}
    try:
        load_collective(
            comm,
            root / node,
            {"model/w": ((start, 0), (count, 5))},
            node=node,
            into={"model/embed": embed, "model/w": w},
            source=memory,
            own_only=range(comm.size),
            check_first=memory.verify,
        )
        out["error"] = None
    except LoadFailedError as exc:
        out["error"] = type(exc).__name__
        out["failed_ranks"] = list(exc.failed_ranks)
        out["cause"] = type(exc.cause).__name__ if exc.cause is not None else None
    want = whole(comm.size)
    out["untouched"] = not embed.any() and not w.any()
    out["exact"] = np.array_equal(embed, want["model/embed"]) and np.array_equal(
        w, want["model/w"][start : start + count]
    )
    return out


def main() -> None:
    out, root = Path(sys.argv[1]), Path(sys.argv[2])
    comm = make_comm("mpi")
    node = f"n{comm.rank}"
    save_collective(
        comm,
        rank_state(comm.rank, comm.size),
        root / node,
        step=5,
        node=node,
        redundancy=Redundancy.of({"scheme": "xor", "set_size": comm.size}),
        write=WriteOptions(fsync=False, chunk_bytes=40, shard_bytes=160, threads=1),
        meta=ManifestMeta(levels={"1": {}}),
    )
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(root / f"n{LOST}")
    comm.barrier()
    result = {
        "rank": comm.rank,
        "flipped": load(comm, root, True),
        "again": load(comm, root, False),
    }
    (out / f"rank{comm.rank}.json").write_text(json.dumps(result))
    comm.barrier()


if __name__ == "__main__":
    main()
