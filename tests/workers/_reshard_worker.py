"""A rank of a resharding test job: ``_reshard_worker.py PLAN.json`` under ``mpiexec ... python -m
mpi4py`` (``MpiComm``), run by ``tests/reshard/test_load_other_size_mpi.py``. ``PLAN.json``::

    {"out": DIR, "tasks": [{"name": ..., "action": "save" | "load" | "restore", ...}, ...]}

* ``save``: a ``CheckpointManager`` saves step 1 of the test state (FSDP-like uneven row blocks
  of this job's size, replicated tensors, values, per-rank RNG and loader state unless
  ``per_rank`` is false) to ``<root>/l1/{node}`` and flushes it to ``<root>/l3``.
* ``load``: ``load_collective`` of ``path`` (``{node}`` replaced by this rank's node; ``node``
  passed when ``pass_node``; ``host`` always, the simulated node) with this job's row blocks as
  wants and the task's ``rank_map``, ``per_rank`` and ``replicas``; reads are recorded
  (``storage.chunk_reads.record_reads``) and every ``open`` of this process is watched by an
  audit hook.
* ``restore``: ``CheckpointManager.restore`` at this job's size, into a template of this job's
  layout (the manager chooses the level).

Each rank writes ``<out>/<task>.rank<r>.json``: SHA-256 of every tensor it got, its values, the
error it raised (type and message), the inner chunks it read (root, file, slots) and the files
it opened. The parent test checks all of it against the expected state, which the functions
below define for both sides. Rank ``r`` of ``n`` is on node ``n{r * 2 // n}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from kit.arrays import random_array as bits
from kit.worker import node_of

SHARD_BYTES = 64 << 10
CHUNK_BYTES = 8 << 10
ROWS: dict[str, tuple[Any, tuple[int, ...]]] = {
    "w13": (np.float32, (13, 700)),
    "w10": (ml_dtypes.bfloat16, (10, 3, 500)),
    "w3": (np.int16, (3, 4000)),
}


def rows_of(n_rows: int, rank: int, size: int) -> tuple[int, int]:
    """``(start, count)`` of a rank's rows (``numpy.array_split``'s split)."""
    base, extra = divmod(n_rows, size)
    return rank * base + min(rank, extra), base + (rank < extra)


def full_tensors() -> dict[str, np.ndarray]:
    """Every tensor whole, by '/'-joined name."""
    rng = np.random.default_rng(11)
    out = {f"shards/{n}": bits(rng, dt, shape) for n, (dt, shape) in ROWS.items()}
    out["model/rep"] = bits(rng, np.float32, (300, 200))
    out["model/rep16"] = bits(rng, ml_dtypes.bfloat16, (7777,))
    out["model/scalar"] = bits(rng, np.float64, ())
    out["empty"] = np.zeros((0, 4), np.float32)
    return out


def rng_of(rank: int) -> np.ndarray:
    return np.arange(6, dtype=np.uint32) + 100 * rank


def loader_of(rank: int) -> dict[str, int]:
    return {"epoch": 1, "index": 10 * rank}


def wants_of(rank: int, size: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    out = {}
    for n, (_, shape) in ROWS.items():
        start, count = rows_of(shape[0], rank, size)
        out[f"shards/{n}"] = ((start,) + (0,) * (len(shape) - 1), (count, *shape[1:]))
    return out


def rank_state(rank: int, size: int, per_rank: bool = True, template: bool = False) -> Any:
    from ckptfmt import PerRank, Shard

    full = full_tensors()
    shards = {}
    for name, (off, shape) in wants_of(rank, size).items():
        data = full[name][off[0] : off[0] + shape[0]].copy()
        if template:
            data.reshape(-1).view(np.uint8)[...] = 0
        shards[name.split("/")[1]] = Shard(data, off, full[name].shape)
    model = {k: full[f"model/{k}"].copy() for k in ("rep", "rep16", "scalar")}
    if template:
        for v in model.values():
            v.reshape(-1).view(np.uint8)[...] = 0
    state: dict[str, Any] = {
        "shards": shards,
        "model": model,
        "empty": full["empty"],
        "opt": {"step": -1 if template else 1, "lr": 0.25},
        "group": {},
    }
    if per_rank:
        state["rng"] = PerRank(rng_of(rank))
        state["loader"] = PerRank(loader_of(rank))
    return state


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def digest(state: Any, prefix: str = "") -> dict[str, Any]:
    from ckptfmt import PerRank, Shard

    out: dict[str, Any] = {}
    for key, leaf in state.items():
        name = f"{prefix}{key}"
        if isinstance(leaf, PerRank):
            leaf = leaf.value
        if isinstance(leaf, dict) and leaf:
            out.update(digest(leaf, name + "/"))
        elif isinstance(leaf, (Shard, np.ndarray, np.generic)):
            arr = leaf.data if isinstance(leaf, Shard) else np.asarray(leaf)
            out[name] = [str(arr.dtype), list(arr.shape), sha(arr)]
        else:
            out[name] = leaf
    return out


class Opens:
    """Every file this process opens while ``on`` (audit hook on ``open``)."""

    def __init__(self) -> None:
        self.on = False
        self.paths: list[str] = []
        sys.addaudithook(self.hook)

    def hook(self, event: str, args: tuple[Any, ...]) -> None:
        if self.on and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            self.paths.append(os.path.abspath(os.fsdecode(args[0])))


def do_save(comm: Any, task: dict[str, Any], node: str) -> dict[str, Any]:
    from ckptfmt import CheckpointManager, WriteOptions

    root = task["root"]
    mgr = CheckpointManager(
        local_dir=f"{root}/l1/{{node}}",
        shared_dir=f"{root}/l3",
        comm=comm,
        node=node,
        on_error="raise",
        write=WriteOptions(shard_bytes=SHARD_BYTES, chunk_bytes=CHUNK_BYTES, fsync=False),
    )
    mgr.save(1, rank_state(comm.rank, comm.size, task.get("per_rank", True)))
    mgr.close(flush=True)
    return {"failed_saves": [f"{s}: {e}" for s, e in mgr.failed_saves]}


def do_load(comm: Any, task: dict[str, Any], node: str, opens: Opens) -> dict[str, Any]:
    from ckptfmt.format.chunk_reads import record_reads
    from ckptfmt.parallel.collective.load import load_collective
    from ckptfmt.plan.options import ReadOptions

    path = task["path"].replace("{node}", node)
    rank_map = task.get("rank_map")
    if isinstance(rank_map, list):
        rank_map = {int(k): int(v) for k, v in rank_map}
    res: dict[str, Any] = {"error": None}
    opens.paths, opens.on = [], True
    with record_reads() as log, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            state, _ = load_collective(
                comm,
                path,
                wants_of(comm.rank, comm.size),
                node=node if task.get("pass_node") else None,
                read=ReadOptions(
                    rank_map, task.get("per_rank", "error"), task.get("replicas", "node")
                ),
                host=node,  # the simulated node: its ranks share their reads of replicas
            )
            res["digest"] = digest(state)
        except Exception as exc:
            res["error"] = [type(exc).__name__, str(exc)]
    opens.on = False
    res["warnings"] = [str(w.message) for w in caught]
    res["reads"] = [[root, p, list(slots)] for _, root, p, slots in log.reads]
    res["bytes_read"] = log.bytes
    res["opened"] = opens.paths
    return res


def do_restore(comm: Any, task: dict[str, Any], node: str) -> dict[str, Any]:
    from ckptfmt import CheckpointManager, WriteOptions

    root = task["root"]
    mgr = CheckpointManager(
        local_dir=f"{root}/l1/{{node}}",
        shared_dir=f"{root}/l3",
        comm=comm,
        node=node,
        on_error="raise",
        write=WriteOptions(fsync=False),
    )
    state = rank_state(comm.rank, comm.size, per_rank=False, template=True)
    res: dict[str, Any] = {"error": None}
    try:
        rep = mgr.restore(state)
        step = rep.step
        res.update(
            step=step,
            level=None if rep is None else rep.level,
            tried=None if rep is None else rep.tried,
            digest=digest(state),
        )
    except Exception as exc:
        res["error"] = [type(exc).__name__, str(exc)]
    mgr.close(flush=False)
    return res


def main(argv: list[str]) -> int:
    from ckptfmt.transport.mpi import MpiComm

    plan = json.loads(Path(argv[0]).read_text())
    out = Path(plan["out"])
    opens = Opens()
    comm = MpiComm()
    node = node_of(comm.rank, comm.size)
    for task in plan["tasks"]:
        if task["action"] == "save":
            res = do_save(comm, task, node)
        elif task["action"] == "load":
            res = do_load(comm, task, node, opens)
        elif task["action"] == "restore":
            res = do_restore(comm, task, node)
        else:
            raise SystemExit(f"unknown action {task['action']!r}")
        res.update(rank=comm.rank, size=comm.size, node=node)
        (out / f"{task['name']}.rank{comm.rank}.json").write_text(json.dumps(res))
        comm.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
