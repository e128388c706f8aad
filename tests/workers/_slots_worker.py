"""A manager that dies in the middle of rewriting a recycled level-1 slot, and the restore after:
``_slots_worker.py ROOT save N [single|mpi]`` / ``_slots_worker.py ROOT restore N [single|mpi]``.

``save``: level 1 under ``ROOT/{node}`` (a node per rank under MPI), ``keep_local=2``, steps
``1 .. N`` of :func:`state` (its bytes differ from step to step; one tensor's shape too). By step
``N`` the slots exist (retention recycled step ``N - 3``), so step ``N`` is written in place. The
process kills itself (SIGKILL) inside the real writer (``storage.files._write_gather``) while
writing step ``N`` into the slot: the first data file it rewrites is written whole, the second
only its first half, then the kill (under MPI: rank ``size - 1``; the other ranks die with the
job). ``ROOT/killed-<rank>.json`` records the staging directory and the paths written.

``restore``: a fresh manager restores and checks bit for bit that the state is step ``N - 1``'s
(``ROOT/restored-<rank>.json``: the step and the check).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ckptfmt import CheckpointManager, ExitPolicy, WriteOptions
from ckptfmt.storage import files


def state(step: int, rank: int) -> dict[str, Any]:
    """Step ``step``'s state (the same on every rank, each writing its share): many small shard
    files (64 KiB shards), new bytes at every step; ``b`` changes shape with the step."""
    rng = np.random.default_rng(1000 * step)
    return {
        "a": rng.random((64, 4096), dtype=np.float32),
        "b": rng.integers(0, 1 << 30, (100 + step, 300), dtype=np.int64),
        "c": {"d": rng.random(50_000)},
    }


def manager(root: Path, comm: Any) -> CheckpointManager:
    return CheckpointManager(
        local_dir=str(root / "{node}"),
        node=f"n{comm.rank}" if comm is not None else "n0",
        comm=comm,
        keep_local=2,
        async_save=False,
        on_error="raise",
        write=WriteOptions(chunk_bytes=1 << 14, shard_bytes=1 << 16, threads=1),
        at_exit=ExitPolicy(flush=False, sigterm=False),
    )


def kill_mid_rewrite(root: Path, rank: int) -> None:
    """Make the real writer kill this process part way through its second in-place file."""
    real = files._write_gather
    seen: list[str] = []

    def writer(path: Path, pieces: Any, fsync: bool = True, copy_to: Any = None, in_place=False):  # type: ignore[no-untyped-def]
        if not (in_place and path.exists() and path.name != "zarr.json"):
            return real(path, pieces, fsync, copy_to, in_place)
        seen.append(str(path))
        if len(seen) == 1:
            return real(path, pieces, fsync, copy_to, in_place)
        batches = pieces.batches() if isinstance(pieces, files.Stream) else [pieces]
        data = b"".join(bytes(memoryview(p).cast("B")) for batch in batches for p in batch)
        staging = next(p for p in Path(path).parents if p.name.startswith(".step-"))
        record = {"staging": str(staging), "written": seen}
        (root / f"killed-{rank}.json").write_text(json.dumps(record))
        fd = os.open(path, os.O_WRONLY)
        os.pwrite(fd, data[: len(data) // 2], 0)  # half of the file rewritten, then the end
        os.fsync(fd)
        os.kill(os.getpid(), signal.SIGKILL)
        return 0

    files._write_gather = writer  # type: ignore[assignment]


def main() -> None:
    root, what, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    comm = None
    if sys.argv[4:] == ["mpi"]:
        from kit.worker import make_comm

        comm = make_comm("mpi")
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    mgr = manager(root, comm)
    if what == "save":
        for step in range(1, n + 1):
            if step == n and rank == size - 1:
                slots = mgr.local_root / ".slots"
                assert slots.is_dir() and any(slots.iterdir()), "no slot to rewrite"
                kill_mid_rewrite(root, rank)
            mgr.save(step, state(step, rank))
        raise SystemExit("the save of the last step was not killed")
    report = mgr.restore()  # no state given: whatever step it finds, it loads
    got, want = report.state or {}, state(n - 1, rank)
    same = report.step == n - 1 and all(
        np.array_equal(x, y)
        for x, y in ((got["a"], want["a"]), (got["b"], want["b"]), (got["c"]["d"], want["c"]["d"]))
    )
    (root / f"restored-{rank}.json").write_text(
        json.dumps({"step": report.step, "level": report.level, "same": bool(same)})
    )
    mgr.close()


if __name__ == "__main__":
    main()
