"""A rank of a ``CheckpointManager`` test job: ``_parallel_worker.py mpi|torch PLAN.json``.

Run under ``mpiexec ... python -m mpi4py`` (``mpi``: ``MpiComm``) or ``torchrun`` (``torch``:
``TorchComm`` over gloo) by ``tests/parallel/test_manager_mpi.py``. ``PLAN.json`` lists tasks, run
in order in this one job (a launch costs more than a task)::

    {"out": DIR, "tasks": [{"name": ..., "action": "save" | "restore" | "crash" | "sigterm",
                            "root": DIR, "state": "dp" | "fsdp", ...}, ...]}

Each task works on ``<root>/l1/{node}`` (level 1, one directory per simulated node) and
``<root>/l3`` (level 3). Rank ``r`` of ``n`` is on node ``n{r * k // n}`` with ``k`` simulated
nodes: the task's ``"nodes"``, default 2. A task may also name ``"redundancy"`` (passed to the
manager as it is). Each rank writes ``<out>/<task>.rank<r>.json``: what it restored (digests of
every tensor, the values, the step, ``mgr.last_restore``), the problems it found itself, the
paths under another node's level-1 directory that it touched (an audit hook watches every open,
listing, rename and removal of this process), and the paths inside level-3 step directories
that it touched. The parent test checks all of it again against the
expected states, which the functions below define for both sides.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from kit.arrays import random_array as bits
from kit.worker import end_torch_job, make_comm, node_of

SHARD_BYTES = 256 << 10  # small shards: every big tensor spans several shard files
CHUNK_BYTES = 64 << 10
CRASH_EXIT = 9
CRASH_DELAY_S = 0.5  # the crashing rank lingers so that the others run as far as they can


# --- expected states (shared with the parent test) ---------------------------------------------


def nodes(size: int, n_nodes: int = 2) -> list[str]:
    return sorted({node_of(r, size, n_nodes) for r in range(size)})


def dp_state(step: int) -> dict[str, Any]:
    """The data-parallel state of ``step`` (every rank holds all of it): ~8.4 MB in tensors of
    several shards each (partial last shards), small and 0-d tensors, values, an empty group.
    The sizes are ordinary ones, in a mix that a plan cutting the sequence of shards into runs
    by cumulative bytes shares out to 4 ranks more than one shard apart: the balance check must
    be able to fail."""
    rng = np.random.default_rng([step, 1])
    return {
        "model": {
            "head": bits(rng, ml_dtypes.bfloat16, (204, 1000)),
            "embed": bits(rng, np.float32, (806, 1000)),
            "ln": bits(rng, ml_dtypes.bfloat16, (436, 512)),
            "proj": bits(rng, ml_dtypes.bfloat16, (824, 777)),
            "out": bits(rng, np.float32, (274, 777)),
            "norm": bits(rng, np.float32, (1000,)),
            "bias": bits(rng, ml_dtypes.bfloat16, (33,)),
        },
        "scale": bits(rng, np.float32, ()),
        "opt": {"step": step, "lr": 1e-3 / (step + 1), "name": "adamw", "betas": [0.9, 0.999]},
        "empty": {},
    }


def big_state(step: int) -> dict[str, Any]:
    """A tensor larger than the default 16 MiB shard (saved with the default grid sizes)."""
    rng = np.random.default_rng([step, 4])
    return {
        "w": bits(rng, np.float32, (5120, 1024)),  # 20 MiB: a whole shard and a partial one
        "b": bits(rng, ml_dtypes.bfloat16, (3000,)),
        "step": step,
    }


# name -> (dtype, global shape); split along axis 0 over the ranks like np.array_split
FSDP_TENSORS: dict[str, tuple[Any, tuple[int, ...]]] = {
    "w16": (np.float32, (16, 5000)),  # even over 2 and 4 ranks; rows bigger than a shard
    "w10": (ml_dtypes.bfloat16, (10, 4099)),  # 5/5, 3/3/2/2
    "w11": (np.float32, (11, 3, 700)),  # 6/5, 3/3/3/2
    "w3": (np.float32, (3, 50)),  # 2/1, 1/1/1/0: one rank holds nothing
}


def split_rows(rows: int, size: int) -> list[tuple[int, int]]:
    """``(start, count)`` of each rank's rows: the first ``rows % size`` ranks get one more."""
    base, extra = divmod(rows, size)
    out, start = [], 0
    for r in range(size):
        count = base + (r < extra)
        out.append((start, count))
        start += count
    return out


def fsdp_full(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([step, 2])
    return {name: bits(rng, dt, shape) for name, (dt, shape) in FSDP_TENSORS.items()}


def fsdp_replicated(step: int) -> np.ndarray:
    return bits(np.random.default_rng([step, 3]), ml_dtypes.bfloat16, (300, 700))


def fsdp_state(step: int, rank: int, size: int, template: bool = False) -> dict[str, Any]:
    """Rank ``rank``'s part of the sharded state: a ``Shard`` of its rows of each tensor, plus a
    replicated tensor and values. ``template``: the same with zeroed data (what restore fills)."""
    from ckptfmt import Shard

    shards = {}
    for name, full in fsdp_full(step).items():
        start, count = split_rows(full.shape[0], size)[rank]
        data = full[start : start + count].copy()
        if template:
            data[...] = np.zeros((), dtype=data.dtype)
        shards[name] = Shard(data, (start,) + (0,) * (full.ndim - 1), full.shape)
    rep = fsdp_replicated(step)
    return {
        "shards": shards,
        "replicated": np.zeros_like(rep) if template else rep,
        "step": -1 if template else step,
    }


def per_rank_state(step: int, rank: int) -> dict[str, Any]:
    """Each rank's own RNG-like bytes and data position (``ckptfmt.PerRank`` leaves)."""
    from ckptfmt import PerRank

    rng = np.random.default_rng([step, rank, 7])
    return {
        "rng": PerRank(bits(rng, np.uint8, (64,))),
        "data": PerRank({"rank": rank, "index": step * 10 + rank, "seed": [rank, 1.5]}),
    }


def dp_whole(step: int, size: int) -> dict[str, Any]:
    """What one process loads from a whole copy of a ``dp`` save by ``size`` ranks: per-rank
    arrays stacked along a leading rank axis, per-rank values as a list in rank order."""
    mine = [per_rank_state(step, r) for r in range(size)]
    return {
        **dp_state(step),
        "per_rank": {
            "rng": np.stack([p["rng"].value for p in mine]),
            "data": [p["data"].value for p in mine],
        },
    }


def make_state(kind: str, step: int, rank: int, size: int) -> dict[str, Any]:
    if kind == "big":
        return big_state(step)
    if kind == "dp":
        return {**dp_state(step), "per_rank": per_rank_state(step, rank)}
    return fsdp_state(step, rank, size)


def template_of(kind: str, rank: int, size: int) -> dict[str, Any]:
    """A state of the right structure, shapes and dtypes with every byte zero and other values."""
    from ckptfmt import PerRank

    if kind == "fsdp":
        return fsdp_state(0, rank, size, template=True)
    if kind == "big":
        state = big_state(0)
        scribble(state, 0)
        state["step"] = -1
        return state
    state = make_state("dp", 0, rank, size)
    scribble(state, 0)
    state["opt"] = {"step": -1, "lr": 0.0, "name": "", "betas": []}
    state["per_rank"]["data"] = PerRank(None)
    return state


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def digest(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every leaf by '/'-joined name: tensors (a Shard's data) as dtype, shape and SHA-256 of
    their bytes; values as they are; empty mappings as ``{}``."""
    from ckptfmt import PerRank, Shard

    out: dict[str, Any] = {}
    for key, leaf in state.items():
        name = f"{prefix}{key}"
        if isinstance(leaf, PerRank):  # restored in place, or unwrapped by a load
            leaf = leaf.value
        if isinstance(leaf, dict) and leaf:
            out.update(digest(leaf, name + "/"))
        elif isinstance(leaf, (Shard, np.ndarray, np.generic)):
            arr = leaf.data if isinstance(leaf, Shard) else np.asarray(leaf)
            out[name] = {"dtype": str(arr.dtype), "shape": list(arr.shape), "sha256": sha(arr)}
        else:
            out[name] = {"value": leaf}
    return out


def scribble(state: dict[str, Any], byte: int = 0xA5) -> None:
    """Overwrite every tensor in place (training goes on after ``save`` returns)."""
    from ckptfmt import Shard

    for leaf in state.values():
        leaf = getattr(leaf, "value", leaf)  # a PerRank's array
        if isinstance(leaf, dict):
            scribble(leaf, byte)
        elif isinstance(leaf, (Shard, np.ndarray)):
            arr = leaf.data if isinstance(leaf, Shard) else leaf
            arr.reshape(-1).view(np.uint8)[...] = byte


# --- the audit of other nodes' level-1 directories ---------------------------------------------

_PATH_EVENTS = {
    "open": (0,),
    "os.listdir": (0,),
    "os.scandir": (0,),
    "os.mkdir": (0,),
    "os.remove": (0,),
    "os.rmdir": (0,),
    "os.rename": (0, 1),
    "os.replace": (0, 1),
    "os.truncate": (0,),
    "shutil.rmtree": (0,),
    "shutil.copyfile": (0, 1),
}


class Audit:
    """Records every path this process touches under another node's level-1 directory, and
    (so that a test can tell the hook is working) how many it touched under its own; also every
    path inside a level-3 step directory (``<root>/l3/step-*`` or a staging ``.step-*``), which
    a restore from level 1 must never read."""

    def __init__(self) -> None:
        self.forbidden: tuple[str, ...] = ()
        self.own: str | None = None
        self.l3: str | None = None
        self.violations: list[list[str]] = []
        self.own_events = 0
        self.l3_events: list[list[str]] = []
        sys.addaudithook(self.hook)

    def watch(self, root: str, node: str, all_nodes: list[str]) -> None:
        l1 = os.path.join(os.path.abspath(root), "l1")
        self.forbidden = tuple(os.path.join(l1, n) for n in all_nodes if n != node)
        self.own = os.path.join(l1, node)
        self.l3 = os.path.join(os.path.abspath(root), "l3") if self.forbidden else None
        self.violations = []
        self.own_events = 0
        self.l3_events = []

    def hook(self, event: str, args: tuple[Any, ...]) -> None:
        where = _PATH_EVENTS.get(event)
        if where is None or not self.forbidden:
            return
        for i in where:
            p = args[i] if i < len(args) else None
            if not isinstance(p, (str, bytes, os.PathLike)):
                continue  # file descriptors (dir_fd walks) follow a path already recorded
            path = os.path.abspath(os.fsdecode(p))
            if any(path == f or path.startswith(f + os.sep) for f in self.forbidden):
                self.violations.append([event, path, threading.current_thread().name])
            elif self.own and (path == self.own or path.startswith(self.own + os.sep)):
                self.own_events += 1
            elif self.l3 and path.startswith(self.l3 + os.sep):
                first = path[len(self.l3) + 1 :].split(os.sep, 1)[0]
                if first.startswith(("step-", ".step-")):
                    self.l3_events.append([event, path, threading.current_thread().name])


# --- tasks ---------------------------------------------------------------------------------------


def make_manager(comm: Any, task: dict[str, Any], node: str, fault: Any = None) -> Any:
    from ckptfmt import CheckpointManager, WriteOptions

    root = task["root"]
    grid = (
        {} if task.get("default_grid") else {"shard_bytes": SHARD_BYTES, "chunk_bytes": CHUNK_BYTES}
    )
    return CheckpointManager(
        local_dir=f"{root}/l1/{{node}}",
        shared_dir=f"{root}/l3",
        comm=comm,
        node=node,
        flush_every=task.get("flush_every", 1),
        keep_local=task.get("keep_local", 2),
        keep_shared=task.get("keep_shared", 3),
        on_error="raise",
        fault=fault,
        redundancy=task.get("redundancy"),
        write=WriteOptions(**grid),
    )


def check_restored(
    kind: str, step: int | None, state: dict[str, Any], rank: int, size: int
) -> list[str]:
    if step is None:
        return ["restore found nothing"]
    want, got = digest(make_state(kind, step, rank, size)), digest(state)
    return [f"{name}: {got.get(name)} != {w}" for name, w in want.items() if got.get(name) != w]


def save_steps(mgr: Any, task: dict[str, Any], rank: int, size: int, steps: list[int]) -> None:
    for step in steps:
        state = make_state(task["state"], step, rank, size)
        mgr.save(step, state)
        scribble(state)  # the checkpoint must hold what the state was when save returned


def do_save(comm: Any, task: dict[str, Any], node: str) -> dict[str, Any]:
    mgr = make_manager(comm, task, node)
    save_steps(mgr, task, comm.rank, comm.size, task["steps"])
    slots = Path(mgr.local_root) / ".slots" if mgr.local_root is not None else None
    held = len(list(slots.iterdir())) if slots is not None and slots.is_dir() else 0
    mgr.close(flush=task.get("close_flush", True))
    return {"failed_saves": [f"{s}: {e}" for s, e in mgr.failed_saves], "slots_held": held}


def do_restore(comm: Any, task: dict[str, Any], node: str) -> dict[str, Any]:
    mgr = make_manager(comm, task, node)
    state = template_of(task["state"], comm.rank, comm.size)
    rep = mgr.restore(state)
    step = rep.step
    problems = check_restored(task["state"], step, state, comm.rank, comm.size)
    if step is not None and digest(rep.state or {}) != digest(
        make_state(task["state"], step, comm.rank, comm.size)
    ):
        problems.append("the report's state differs from the state restored into")
    res = {
        "step": step,
        "report": None
        if rep is None
        else {
            "step": rep.step,
            "level": rep.level,
            "path": rep.path,
            "tried": rep.tried,
            "rebuilt": rep.rebuilt,
            "unrecoverable": rep.unrecoverable,
        },
        "digest": digest(state),
        "problems": problems,
    }
    save_steps(mgr, task, comm.rank, comm.size, task.get("then_save", []))
    mgr.close(flush=task.get("close_flush", False))
    res["failed_saves"] = [f"{s}: {e}" for s, e in mgr.failed_saves]
    return res


def do_crash(comm: Any, task: dict[str, Any], node: str, out: Path) -> dict[str, Any]:
    """Save the steps ``before`` (default: step 1, committed and flushed), then step
    ``crash_step`` (default 2) with ``os._exit`` on ``crash_rank`` at fault point ``point``.
    The crashing rank reaching the end means the fault never fired (a failure)."""
    armed = threading.Event()

    def fault(point: str) -> None:
        if armed.is_set() and point == task["point"] and comm.rank == task["crash_rank"]:
            (out / f"{task['name']}.crashed").write_text(f"{comm.rank} {point}")
            time.sleep(CRASH_DELAY_S)
            os._exit(CRASH_EXIT)

    mgr = make_manager(comm, task, node, fault)
    if task["point"] == "encode-sendrecv" and comm.rank == task["crash_rank"]:
        crash_in_encoding(fault, armed)
    save_steps(mgr, task, comm.rank, comm.size, task.get("before", [1]))
    mgr.wait()
    armed.set()
    save_steps(mgr, task, comm.rank, comm.size, [task.get("crash_step", 2)])
    mgr.wait()
    mgr.close(flush=False)
    return {"survived": True}


def crash_in_encoding(fault: Any, armed: threading.Event) -> None:
    """Once ``armed``, this rank calls ``fault("encode-sendrecv")`` right after its first round
    of redundancy-encoding messages (``encode.ENCODE_TAG``) has gone both ways: a crash with its
    parity not yet complete or written, the other ranks inside their own exchanges. A
    transport-level fault, patched on the class so that the manager's duplicated communicator
    has it too."""
    from ckptfmt.engine import encode
    from ckptfmt.transport.mpi import MpiComm

    plain = MpiComm.start_exchange

    class Faulty:
        def __init__(self, pending: Any) -> None:
            self.pending = pending

        def wait(self) -> None:
            self.pending.wait()
            fault("encode-sendrecv")

    def start_exchange(self: Any, pairs: Any, tag: int = 0) -> Any:
        pending = plain(self, pairs, tag)
        return Faulty(pending) if tag == encode.ENCODE_TAG and armed.is_set() else pending

    MpiComm.start_exchange = start_exchange  # type: ignore[method-assign]


def do_sigterm(comm: Any, task: dict[str, Any], node: str, out: Path) -> dict[str, Any]:
    """Save the steps to level 1 only, then every rank (after a barrier) sends itself SIGTERM
    while the last save may still be in flight; the manager's handler must flush the newest
    step to level 3 and then let the process die."""
    mgr = make_manager(comm, task, node)
    save_steps(mgr, task, comm.rank, comm.size, task["steps"])
    comm.barrier()
    (out / f"{task['name']}.rank{comm.rank}.killing").write_text("")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(2)  # the handler runs at once; the process must not get past here
    return {"survived": True}


def main(argv: list[str]) -> int:
    kind, plan_file = argv
    plan = json.loads(Path(plan_file).read_text())
    out = Path(plan["out"])
    audit = Audit()
    comm = make_comm(kind)
    for task in plan["tasks"]:
        node = node_of(comm.rank, comm.size, task.get("nodes", 2))
        audit.watch(task["root"], node, nodes(comm.size, task.get("nodes", 2)))
        action = task["action"]
        if action == "save":
            res = do_save(comm, task, node)
        elif action == "restore":
            res = do_restore(comm, task, node)
        elif action == "crash":
            res = do_crash(comm, task, node, out)
        elif action == "sigterm":
            res = do_sigterm(comm, task, node, out)
        else:
            raise SystemExit(f"unknown action {action!r}")
        res.update(
            rank=comm.rank,
            size=comm.size,
            node=node,
            audit_violations=audit.violations,
            audit_own_events=audit.own_events,
            l3_events=audit.l3_events,
        )
        audit.watch("", node, [])  # stop watching while writing results
        (out / f"{task['name']}.rank{comm.rank}.json").write_text(json.dumps(res))
        comm.barrier()
    if kind == "torch":
        end_torch_job()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
