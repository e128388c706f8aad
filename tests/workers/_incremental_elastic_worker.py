"""An incremental manager whose job changes size while a node is lost, under ``mpiexec``.

Every rank is its own simulated node (``n<rank>``); level 1 has xor redundancy in sets of two,
level 3 is a shared directory, every save is flushed. The state: a frozen replicated table, a
sharded weight of which one row changes per step, a bfloat16 tensor, a 0-d and an empty tensor.

Run with ``ROOT PHASE ...``:

- ``save K0 K1 [restore]``: (restore first, then) save steps K0..K1;
- ``restore [STEP]``: a fresh manager restores (that step) and checks the bits.

Each rank writes ``ROOT/<phase>-<size>-<rank>.json``: what was restored (step, level, the
reasons newer copies were refused, whether every tensor is bit for bit the expected one) and
every save's report.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ckptfmt import CheckpointManager, ExitPolicy, Shard, WriteOptions
from ckptfmt.transport.mpi import MpiComm

ROWS, COLS = 96, 32


def whole(k: int) -> dict[str, np.ndarray]:
    """Every tensor of step ``k``, whole."""
    frozen = np.random.default_rng(1).standard_normal((256, 64), dtype=np.float32)
    w = np.random.default_rng(2).standard_normal((ROWS, COLS), dtype=np.float32)
    for j in range(1, k + 1):
        w[(j * 7) % ROWS] += j
    bf = (np.random.default_rng(3).standard_normal((40, 8)) + k).astype(ml_dtypes.bfloat16)
    return {
        "frozen": frozen,
        "w": w,
        "bf": bf,
        "z": np.array(k, np.float64),
        "e": np.zeros((0, 3), np.float32),
    }


def rows(rank: int, size: int) -> tuple[int, int]:
    base, extra = divmod(ROWS, size)
    return rank * base + min(rank, extra), base + (rank < extra)


def state(rank: int, size: int, k: int) -> dict[str, Any]:
    g = whole(k)
    start, n = rows(rank, size)
    return {**g, "w": Shard(g["w"][start : start + n].copy(), (start, 0), (ROWS, COLS))}


def exact(got: dict[str, Any], rank: int, size: int, k: int) -> bool:
    want = state(rank, size, k)
    for name, value in want.items():
        a = got[name].data if isinstance(got[name], Shard) else got[name]
        b = value.data if isinstance(value, Shard) else value
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            return False
    return True


def manager(comm: MpiComm, root: Path) -> CheckpointManager:
    return CheckpointManager(
        f"{root}/l1/{{node}}",
        root / "l3",
        comm=comm,
        node=f"n{comm.rank}",
        redundancy={"scheme": "xor", "set_size": 2},
        keep_local=3,
        keep_shared=3,
        incremental=True,
        async_save=False,
        write=WriteOptions(fsync=False, chunk_bytes=1 << 10, shard_bytes=4 << 10, threads=1),
        at_exit=ExitPolicy(flush=False, sigterm=False),
    )


def restore(m: CheckpointManager, comm: MpiComm, step: int | None) -> dict[str, Any]:
    target = state(comm.rank, comm.size, 0)
    got = m.restore(target, step=step)
    ok = got.step is not None and exact(target, comm.rank, comm.size, got.step)
    return {"step": got.step, "level": got.level, "tried": got.tried, "exact": ok}


def main() -> None:
    root, phase, args = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    comm = MpiComm()
    m = manager(comm, root)
    out: dict[str, Any] = {"rank": comm.rank, "size": comm.size, "saves": []}
    try:
        if phase == "save":
            if args[2:] == ["restore"]:
                out["restored"] = restore(m, comm, None)
            for k in range(int(args[0]), int(args[1]) + 1):
                m.save(k, state(comm.rank, comm.size, k))
                assert m.last_save is not None
                out["saves"].append(m.last_save.to_json())
        else:
            out["restored"] = restore(m, comm, int(args[0]) if args else None)
    finally:
        m.close(flush=False)
    name = f"{phase}{'-' + args[0] if phase == 'restore' and args else ''}-{comm.size}-{comm.rank}"
    (root / f"{name}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
