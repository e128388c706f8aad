"""Under mpiexec / torchrun: the fault matrix of the error boundary
(tests/faults/test_rank_failures.py).

Usage: ``_fault_worker.py KIND OUT_DIR ROOT SCENARIO [SCENARIO ...]`` (KIND ``mpi`` or ``torch``).
For each scenario, on a fresh pair of levels (level 1 on 2 simulated nodes with XOR parity,
level 3 shared), every rank:

1. saves step 1 (committed, flushed);
2. saves step 2 with the scenario's fault armed on the last rank only;
3. saves step 3 (no fault): it must commit;
4. restores with a fresh manager: step 3, bit for bit;
5. writes what it saw (the failure it was told of, the leftovers it finds, the digests) to
   ``OUT_DIR/<scenario>.rank<r>.json``.

The restore scenario (``restore-memory``) saves steps 1 and 2, then restores with an allocation
failure on the last rank: every rank must raise the same error, within the deadline.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from kit.files import leftover_dirs
from kit.worker import end_torch_job, make_comm

from ckptfmt import CheckpointManager, WriteOptions
from ckptfmt.errors import CkptError, CollectiveError
from ckptfmt.parallel.collective import load as load_module
from ckptfmt.parallel.manager.checkpoint_manager import CheckpointWarning

SHARD_BYTES = 1 << 16
CHUNK_BYTES = 1 << 12

# scenario -> (fault point of the manager's hook, exception to raise there)
HOOKED = {
    "data-value": ("written", ValueError),
    "parity-value": ("encoded", ValueError),
    "manifest-value": ("manifest", ValueError),
    "commit-value": ("committing", ValueError),
    "flush-value": ("flush-copied", ValueError),
    "data-enospc": ("written", OSError),  # a full node-local disk
    "manifest-erofs": ("manifest", OSError),  # a file system gone read-only
    "stage-memory": (None, MemoryError),  # raised while the manager copies the state
    "plan-usage": (None, None),  # a shape disagreement: found while planning
}


def failing_rank(name: str, size: int) -> int:
    """The rank the fault is armed on: the last rank, or for the commit (which only a node's
    leader does) the last node's leader."""
    return size // 2 if name == "commit-value" else size - 1


def state_of(
    step: int, rank: int, size: int, bad_shape: bool = False, big: bool = False
) -> dict[str, Any]:
    rng = np.random.default_rng([step, 11])
    w = rng.standard_normal((512, 256) if big else (64, 48)).astype(np.float32)
    if bad_shape:
        w = w[:, :40].copy()
    return {
        "model": {"w": w, "b": rng.integers(0, 1 << 30, 97, dtype=np.int64)},
        "step": step,
    }


def digest(state: dict[str, Any]) -> dict[str, str]:
    import hashlib

    return {
        k: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()
        for k, v in state["model"].items()
    }


def manager(comm: Any, root: Path, node: str, fault: Any = None) -> CheckpointManager:
    return CheckpointManager(
        local_dir=f"{root}/l1/{{node}}",
        shared_dir=f"{root}/l3",
        comm=comm,
        node=node,
        redundancy="xor",
        on_error="warn",
        flush_every=1,
        keep_local=3,
        fault=fault,
        fallback_to_shared=False,  # the boundary is tested here; the fallback elsewhere
        write=WriteOptions(shard_bytes=SHARD_BYTES, chunk_bytes=CHUNK_BYTES),
    )


def told(mgr: CheckpointManager, caught: list[warnings.WarningMessage]) -> dict[str, Any]:
    """The failure this rank was told of: the newest failed save (or, when no save failed,
    the newest failed flush: its step is safe on level 1) and the warnings."""
    out: dict[str, Any] = {"warnings": [str(w.message) for w in caught]}
    out["flush_failed"] = [s for s, _ in mgr.failed_flushes]
    failures = mgr.failed_saves or mgr.failed_flushes
    if failures:
        step, exc = failures[-1]
        out["step"] = step
        out["error"] = type(exc).__name__
        out["message"] = str(exc)
        if isinstance(exc, CollectiveError):
            out["ranks"] = {str(r): f.type for r, f in exc.rank_failures.items()}
            out["phases"] = {str(r): f.phase for r, f in exc.rank_failures.items()}
    return out


def run_save_scenario(comm: Any, root: Path, name: str) -> dict[str, Any]:
    rank, size = comm.rank, comm.size
    node = f"n{rank * 2 // size}"
    point, exc_type = HOOKED[name]
    armed = {"on": False}

    def fault(p: str) -> None:
        if armed["on"] and rank == failing_rank(name, size) and p == point and exc_type:
            armed["on"] = False
            if exc_type is OSError:
                code = errno.ENOSPC if name == "data-enospc" else errno.EROFS
                raise OSError(code, f"{os.strerror(code)} (injected at {p} on rank {rank})")
            raise exc_type(f"injected at {p} on rank {rank}")

    mgr = manager(comm, root, node, fault)
    mgr.save(1, state_of(1, rank, size))
    mgr.wait()
    armed["on"] = True
    if name == "stage-memory" and rank == size - 1:
        real = mgr._stager.stage

        def failing_stage(*args: Any, **kwargs: Any) -> Any:
            mgr._stager.stage = real  # type: ignore[method-assign]
            raise MemoryError("injected while staging")

        mgr._stager.stage = failing_stage  # type: ignore[method-assign]
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointWarning)
        raised = None
        try:
            mgr.save(
                2, state_of(2, rank, size, bad_shape=name == "plan-usage" and rank == size - 1)
            )
            mgr.wait()
        except CkptError as exc:  # on_error="warn": nothing should be raised
            raised = f"{type(exc).__name__}: {exc}"
    seconds = time.perf_counter() - started
    result = told(mgr, caught)
    result.update(raised=raised, seconds=seconds)
    comm.barrier()
    # the failed step is committed nowhere: no node, no level (no half-committed step)
    result["step2_committed"] = sorted(
        str(p.parent.relative_to(root)) for p in root.glob("*/**/step-0000000002/ckptfmt.json")
    )
    armed["on"] = False
    mgr.save(3, state_of(3, rank, size))
    mgr.wait()
    result["after"] = [s for s, _ in mgr.failed_saves if s == 3]
    mgr.close(flush=False)
    comm.barrier()
    result["leftovers"] = leftover_dirs(root) if rank == 0 else []
    restored: dict[str, Any] = {
        "model": {"w": np.zeros((64, 48), np.float32), "b": np.zeros(97, np.int64)},
        "step": 0,
    }
    mgr2 = manager(comm, root, node)
    report = mgr2.restore(restored)
    result["restored_step"] = report.step
    result["restored_level"] = report.level
    result["bitwise"] = digest(restored) == digest(state_of(3, rank, size))
    import ckptfmt

    one = ckptfmt.load(root / "l3" / "step-0000000001")
    result["step1_bitwise"] = digest(one) == digest(state_of(1, rank, size))
    result["step1_healthy"] = ckptfmt.verify(root / "l3" / "step-0000000001").healthy
    mgr2.close(flush=False)
    return result


def run_restore_scenario(comm: Any, root: Path) -> dict[str, Any]:
    rank, size = comm.rank, comm.size
    node = f"n{rank * 2 // size}"
    mgr = manager(comm, root, node)
    mgr.save(1, state_of(1, rank, size))
    mgr.save(2, state_of(2, rank, size))
    mgr.close(flush=False)
    real = load_module.allocate

    def failing(*args: Any, **kwargs: Any) -> Any:
        load_module.allocate = real  # type: ignore[assignment]
        raise MemoryError("injected while allocating the restore's buffers")

    if rank == size - 1:
        load_module.allocate = failing  # type: ignore[assignment]
    mgr2 = manager(comm, root, node)
    started = time.perf_counter()
    result: dict[str, Any] = {}
    try:
        result["restored_step"] = mgr2.restore(state_of(0, rank, size)).step
    except CollectiveError as exc:
        result["error"] = type(exc).__name__
        result["ranks"] = {str(r): f.type for r, f in exc.rank_failures.items()}
        result["message"] = str(exc)
    result["seconds"] = time.perf_counter() - started
    load_module.allocate = real  # type: ignore[assignment]
    restored = state_of(0, rank, size)
    result["again"] = mgr2.restore(restored).step
    result["bitwise"] = digest(restored) == digest(state_of(2, rank, size))
    mgr2.close(flush=False)
    return result


def run_replace_scenario(comm: Any, root: Path, scheme: str) -> dict[str, Any]:
    """One rank per node. Save step 7 on nodes h0..h3 (level 1 only); then three restarts:
    (a) node h3 lost and replaced by a spare of the same name; (b) h3 lost again, replaced by a
    spare named s3 (a new name); (c) h0 lost, replaced by s0 (two hosts replaced over two
    restarts). Each restart must restore step 7 from level 1, bit for bit, rebuilt from parity."""
    import shutil

    rank, size = comm.rank, comm.size
    red: Any = {"scheme": "rs", "m": 2} if scheme == "rs" else scheme

    def mgr_on(node: str) -> CheckpointManager:
        return CheckpointManager(
            local_dir=f"{root}/l1/{{node}}",
            comm=comm,
            node=node,
            redundancy=red,
            on_error="raise",
            write=WriteOptions(shard_bytes=SHARD_BYTES, chunk_bytes=CHUNK_BYTES),
        )

    nodes = [f"h{r}" for r in range(size)]
    mgr = mgr_on(nodes[rank])
    mgr.save(7, state_of(7, rank, size, big=True))  # 512 KiB: every rank writes a part
    mgr.close(flush=False)
    out: dict[str, Any] = {}
    for label, lost, spare in (
        ("same", size - 1, f"h{size - 1}"),
        ("new", size - 1, "s3"),
        ("second", 0, "s0"),
    ):
        comm.barrier()
        if rank == lost:
            shutil.rmtree(root / "l1" / nodes[lost])  # the host and its node-local storage
            nodes[lost] = spare
        comm.barrier()
        nodes = [n for n in comm.allgather_json(nodes[rank])]
        m = mgr_on(nodes[rank])
        restored = state_of(0, rank, size, big=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = m.restore(restored)
        step = report.step
        out[label] = {
            "step": step,
            "level": report.level if report else None,
            "rebuilt": bool(report and report.rebuilt),
            "bitwise": digest(restored) == digest(state_of(7, rank, size, big=True)),
            "tried": report.tried if report else [],
        }
        m.close(flush=False)
    return out


def run_rebuild_scenario(comm: Any, root: Path) -> dict[str, Any]:
    """One rank per node, level 1 only, xor. Save step 7; node h3 is lost (its directory
    wiped); the restore rebuilds it in memory and returns step 7, then the write of the rebuilt
    files (on the saver thread) fails on rank 3 with a ValueError. Every rank must record the
    same SaveFailedError naming rank 3 in ``last_restore.rewrite_error``, no staging directory
    may be left, and a second restore must rebuild step 7 again, bit-exact, and write it."""
    import shutil

    from ckptfmt.engine import rebuild as rebuild_module  # where the rebuilt files are written

    rank, size = comm.rank, comm.size

    def mgr_on() -> CheckpointManager:
        return CheckpointManager(
            local_dir=f"{root}/l1/{{node}}",
            comm=comm,
            node=f"h{rank}",
            redundancy="xor",
            on_error="raise",
            write=WriteOptions(shard_bytes=SHARD_BYTES, chunk_bytes=CHUNK_BYTES),
        )

    mgr = mgr_on()
    mgr.save(7, state_of(7, rank, size, big=True))
    mgr.close(flush=False)
    comm.barrier()
    if rank == size - 1:
        shutil.rmtree(root / "l1" / f"h{rank}")
    comm.barrier()
    real = rebuild_module.write_member

    def failing(*args: Any, **kwargs: Any) -> Any:
        rebuild_module.write_member = real  # type: ignore[assignment]
        raise ValueError("injected while writing the rebuilt files")

    if rank == size - 1:
        rebuild_module.write_member = failing  # type: ignore[assignment]
    result: dict[str, Any] = {}
    m = mgr_on()
    started = time.perf_counter()
    first = state_of(0, rank, size, big=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = m.restore(first)
    result["seconds"] = time.perf_counter() - started
    result["restored_step"] = rep.step
    result["first_bitwise"] = digest(first) == digest(state_of(7, rank, size, big=True))
    m.wait()  # the rebuilt files' write, on the saver thread
    exc = rep.rewrite_error
    result["rewrite"] = rep.rewrite.split(":")[0]
    if isinstance(exc, CollectiveError):
        result["error"] = type(exc).__name__
        result["ranks"] = {str(r): [f.type, f.phase] for r, f in exc.rank_failures.items()}
    rebuild_module.write_member = real  # type: ignore[assignment]
    comm.barrier()
    result["leftovers"] = leftover_dirs(root) if rank == 0 else []
    restored = state_of(0, rank, size, big=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = m.restore(restored)
    m.wait()
    result["again"], result["again_rebuilt"] = again.step, bool(again.rebuilt)
    result["again_rewrite"] = again.rewrite
    result["bitwise"] = digest(restored) == digest(state_of(7, rank, size, big=True))
    m.close(flush=False)
    return result


def main(argv: list[str]) -> int:
    kind, out, root, *scenarios = argv
    comm = make_comm(kind)
    for name in scenarios:
        where = Path(root) / name
        if name == "restore-memory":
            res = run_restore_scenario(comm, where)
        elif name == "rebuild-value":
            res = run_rebuild_scenario(comm, where)
        elif name.startswith("replace-"):
            res = run_replace_scenario(comm, where, name.split("-", 1)[1])
        else:
            res = run_save_scenario(comm, where, name)
        res["rank"], res["size"] = comm.rank, comm.size
        Path(out, f"{name}.rank{comm.rank}.json").write_text(json.dumps(res))
        comm.barrier()
    sys.stdout.flush()
    if kind == "torch":
        end_torch_job()
    return 0  # MPI: a normal exit (kit/worker.py says why not os._exit)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
