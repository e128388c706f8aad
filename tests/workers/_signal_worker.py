"""Under mpiexec / torchrun: SIGKILL or SIGTERM on one rank during a save or a restore
(tests/faults/test_rank_failures.py).

Usage: ``_signal_worker.py KIND OUT_DIR ROOT PHASE SCENARIO[,SCENARIO...]`` (KIND ``mpi`` or
``torch``; PHASE ``fault`` or ``check``). Every scenario has its own folder ``ROOT/SCENARIO``:
level 1 on 2 simulated nodes (``ROOT/SCENARIO/l1/n0``, ``n1``) with XOR parity, level 3 in
``ROOT/SCENARIO/l3``, ``on_error="warn"``, ``flush_every=1``. The signal goes to the last rank
only; ``OUT_DIR/SCENARIO.signal`` records when it was sent.

``fault`` (one launch per scenario: the job is expected to end with the signalled rank):

- ``save-sigkill`` / ``save-sigterm``: steps 1 and 2 are saved (committed and flushed); while
  step 3 is being saved, the last rank sends itself the signal right after writing its data
  (rank 0 has recorded the files' digests before, ``OUT_DIR/SCENARIO.before.json``).
  Every rank then goes on saving steps 4, 5, 6, writing what it was told after each
  (``OUT_DIR/SCENARIO.rank<r>.told.json``), then sleeps: the launcher must end the job long
  before this rank writes ``SCENARIO.rank<r>.survived``.
- ``restore-sigkill`` / ``restore-sigterm``: steps 1 and 2 are saved, the manager closed; rank 0
  records the SHA-256 of every file under the scenario's folder
  (``OUT_DIR/SCENARIO.before.json``); a fresh manager restores, and the last rank sends itself
  the signal when it starts reading the restore's chunks. What a rank was told (the error, or
  the step restored) goes to ``told.json``; then it sleeps as above.

``check`` (one launch for all scenarios, a restarted job): for each scenario, every rank
restores with a fresh manager into zeroed buffers (reporting the step, the level and whether
the state is bit-exact), rank 0 records the files' digests right after the restore
(``SCENARIO.after-restore.json``) and the leftovers it finds, then every rank saves step 10 (it
must commit) and closes. Results: ``OUT_DIR/SCENARIO.check.rank<r>.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from kit.files import leftover_dirs, tree_digests
from kit.worker import end_torch_job, make_comm, node_of

from ckptfmt import CheckpointManager, PerRank
from ckptfmt.errors import CkptError, CollectiveError
from ckptfmt.parallel.collective import load as load_module

DEADLINE_S = 8.0  # the manager's roll-call deadline: a rank left alone is told within it
LINGER_S = 60.0  # a rank still alive this long after the signal was not ended by the launcher
SIGNALS = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM}


def state_of(step: int, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s state at ``step``: data-parallel weights plus a rank's own array."""
    rng = np.random.default_rng([step, 17])
    own = np.random.default_rng([step, rank, 5]).integers(0, 1 << 30, 33, dtype=np.int64)
    return {
        "model": {
            "w": rng.standard_normal((128, 96)).astype(np.float32),
            "b": rng.integers(0, 1 << 30, 97, dtype=np.int64),
        },
        "own": PerRank(own),
        "step": step,
    }


def zeros(rank: int) -> dict[str, Any]:
    s = state_of(0, rank)
    return {
        "model": {k: np.zeros_like(v) for k, v in s["model"].items()},
        "own": PerRank(np.zeros_like(s["own"].value)),
        "step": 0,
    }


def digest(state: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for k in ("w", "b"):
        h.update(np.ascontiguousarray(state["model"][k]).tobytes())
    own = state["own"]
    h.update(np.ascontiguousarray(own.value if isinstance(own, PerRank) else own).tobytes())
    h.update(repr(state["step"]).encode())
    return h.hexdigest()


def manager(comm: Any, root: Path, fault: Any = None) -> CheckpointManager:
    return CheckpointManager(
        local_dir=f"{root}/l1/{{node}}",
        shared_dir=f"{root}/l3",
        comm=comm,
        node=node_of(comm.rank, comm.size),
        redundancy="xor",
        on_error="warn",
        flush_every=1,
        keep_local=10,  # retention must not change the steps saved before the fault
        keep_shared=10,
        deadline_s=DEADLINE_S,
        fault=fault,
        fallback_to_shared=False,
    )


def write_json(path: Path, doc: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, default=str))
    os.replace(tmp, path)


def send_signal(out: Path, name: str, sig: int) -> None:
    write_json(out / f"{name}.signal", {"time": time.time(), "pid": os.getpid(), "sig": sig})
    os.kill(os.getpid(), sig)


def failures(mgr: CheckpointManager) -> list[dict[str, Any]]:
    out = []
    for step, exc in mgr.failed_saves:
        entry: dict[str, Any] = {"step": step, "error": type(exc).__name__, "message": str(exc)}
        if isinstance(exc, CollectiveError):
            entry["ranks"] = {str(r): f.type for r, f in exc.rank_failures.items()}
        entry["missing"] = list(getattr(exc, "missing", ()))
        out.append(entry)
    return out


def fault_save(comm: Any, out: Path, root: Path, name: str, sig: int) -> None:
    rank, last = comm.rank, comm.size - 1
    armed = {"on": False}

    def fault(point: str) -> None:
        if armed["on"] and rank == last and point == "written":
            armed["on"] = False
            send_signal(out, name, sig)

    mgr = manager(comm, root, fault)
    for step in (1, 2):
        mgr.save(step, state_of(step, rank))
    mgr.wait()
    comm.barrier()
    if rank == 0:
        write_json(out / f"{name}.before.json", tree_digests(root))
    comm.barrier()
    armed["on"] = True
    told = out / f"{name}.rank{rank}.told.json"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (3, 4, 5, 6):
            try:
                mgr.save(step, state_of(step, rank))
                mgr.wait()
            except CkptError as exc:  # ManagerBrokenError once the manager gave up
                write_json(
                    told,
                    {
                        "time": time.time(),
                        "raised": type(exc).__name__,
                        "message": str(exc),
                        "failed": failures(mgr),
                    },
                )
                break
            write_json(
                told,
                {
                    "time": time.time(),
                    "after": step,
                    "failed": failures(mgr),
                    "warnings": [str(w.message) for w in caught],
                },
            )


def fault_restore(comm: Any, out: Path, root: Path, name: str, sig: int) -> None:
    rank = comm.rank
    mgr = manager(comm, root)
    for step in (1, 2):
        mgr.save(step, state_of(step, rank))
    mgr.close(flush=False)
    comm.barrier()
    if rank == 0:
        write_json(out / f"{name}.before.json", tree_digests(root))
    comm.barrier()
    real = load_module.read_local

    def signalled_read(*args: Any, **kwargs: Any) -> Any:
        load_module.read_local = real  # type: ignore[assignment]
        send_signal(out, name, sig)
        return real(*args, **kwargs)

    if rank == comm.size - 1:
        load_module.read_local = signalled_read  # type: ignore[assignment]
    mgr2 = manager(comm, root)
    told = out / f"{name}.rank{rank}.told.json"
    got = zeros(rank)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            restored = mgr2.restore(got).step
        doc: dict[str, Any] = {
            "restored": restored,
            "bitwise": digest(got) == digest(state_of(2, rank)),
        }
    except CkptError as exc:
        doc = {"error": type(exc).__name__, "message": str(exc)}
        if isinstance(exc, CollectiveError):
            doc["ranks"] = {str(r): f.type for r, f in exc.rank_failures.items()}
    except Exception as exc:  # a transport error that escaped the boundary: recorded as such
        doc = {"error": type(exc).__name__, "message": str(exc), "escaped": True}
    doc["time"] = time.time()
    write_json(told, doc)


def check(comm: Any, out: Path, root: Path, name: str) -> None:
    rank = comm.rank
    mgr = manager(comm, root)
    got = zeros(rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = mgr.restore(got)
    step = report.step
    res: dict[str, Any] = {
        "rank": rank,
        "step": step,
        "level": report.level if report else None,
        "tried": report.tried if report else [],
        "rebuilt": report.rebuilt if report else [],
        "bitwise": step is not None and digest(got) == digest(state_of(step, rank)),
        "warnings": [str(w.message) for w in caught],
    }
    comm.barrier()
    if rank == 0:
        write_json(out / f"{name}.after-restore.json", tree_digests(root))
        res["leftovers"] = leftover_dirs(root)
    comm.barrier()
    mgr.save(10, state_of(10, rank))
    mgr.wait()
    res["failed_after"] = failures(mgr)
    mgr.close(flush=False)
    write_json(out / f"{name}.check.rank{rank}.json", res)


def main(argv: list[str]) -> int:
    kind, out_s, root_s, phase, names = argv
    out, comm = Path(out_s), make_comm(kind)
    for name in names.split(","):
        root = Path(root_s) / name
        if phase == "check":
            check(comm, out, root, name)
            comm.barrier()
            continue
        what, sig_name = name.split("-")
        sig = SIGNALS[sig_name]
        if what == "save":
            fault_save(comm, out, root, name, sig)
        else:
            fault_restore(comm, out, root, name, sig)
        time.sleep(LINGER_S)  # the launcher ends the job meanwhile; getting past is a failure
        (out / f"{name}.rank{comm.rank}.survived").write_text("")
    sys.stdout.flush()
    if kind == "torch" and phase == "check":
        end_torch_job()
    if kind != "torch":
        return 0  # MPI: a normal exit (kit/worker.py says why not os._exit)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
