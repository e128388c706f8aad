#!/usr/bin/env python3
"""Parallel save of a data-parallel job: ckptfmt's collective save against root checkpointing,
and the time an asynchronous ``CheckpointManager.save`` blocks the training loop.

Every rank holds the whole state (data parallelism). One launch measures, for its rank count,
every method interleaved round-robin per repetition (the order rotates from one repetition to the
next), like ``bench_save_load.py``:

* ``ckptfmt parallel``: ``save_collective`` on every rank, into its simulated node's directory
  (two nodes when ranks >= 2: ``n{rank * 2 // size}``); the plan splits the bytes among ranks;
  with 2 writer threads per rank (the default) and with 1;
* ``raw parallel``: the same bytes per rank as plain files, nothing else (this machine's ceiling);
* ``root ckptfmt`` / ``root torch.save``: rank 0 alone writes the whole state while the others
  wait at a barrier (the usual root checkpointing);
* ``memcpy`` and ``CheckpointManager.save`` (async, level 1 only): how long ``save()`` blocks
  the training loop, against a plain copy of the state into pre-touched buffers.

Run it under MPI, one launch per rank count, then combine the parts (``bench/run_parallel.sh``
does all of it)::

    mpiexec -n 2 python -m mpi4py bench/bench_parallel.py --part /tmp/p/r2.json
    python bench/bench_parallel.py --combine /tmp/p/r1.json /tmp/p/r2.json /tmp/p/r4.json

See bench/README.md (``bench_parallel.py``) for what each row means and how it is measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from bench_save_load import (  # noqa: E402
    GIB,
    Model,
    bits_equal,
    flatten_nested,
    git_info,
    loadavg,
    model_for,
    nest,
    pretouch,
    remove,
)

import ckptfmt  # noqa: E402
from ckptfmt import ExitPolicy  # noqa: E402
from ckptfmt.checkpoint import writer_threads  # noqa: E402

DEFAULT_DIR = "/dev/shm/ckptfmt-bench-parallel"
NODES = 2  # simulated nodes when ranks >= 2
METHODS = {  # key -> label, in the order of the tables
    "par": "ckptfmt parallel (threads=2, default)",
    "par_t1": "ckptfmt parallel (threads=1)",
    "raw": "raw parallel: each rank writes its plan share, 16 MiB files, 2 threads (ceiling)",
    "root_ckptfmt": "root: ckptfmt.save on rank 0 ({t} writer threads, default)",
    "root_torch": "root: torch.save on rank 0",
    "memcpy": "memcpy into pre-touched buffers (every rank)",
    "async": "CheckpointManager.save, async (every rank)",
}


# --- the state ------------------------------------------------------------------------------------


def make_state(model: Model, seed: int) -> dict[str, np.ndarray]:
    """Flat ``name -> float32 array``, the same on every rank (replicas). Random N(0, 0.02) bits
    tiled from a 16 MiB block: generating 1 GiB of normals takes ~14 s per rank here, and the
    writers neither compress nor look at the values. Every page is written (touched)."""
    rng = np.random.default_rng(seed)
    block = rng.standard_normal(1 << 22, dtype=np.float32) * np.float32(0.02)
    state = {}
    for name, shape in model.shapes().items():
        a = np.empty(shape, np.float32)
        flat = a.reshape(-1)
        for i in range(0, flat.size, block.size):
            n = min(block.size, flat.size - i)
            flat[i : i + n] = block[:n]
        state[name] = a
    return state


# --- timing under MPI -----------------------------------------------------------------------------


def quiet_barrier(mpi_comm: Any) -> None:
    """A barrier that sleeps while it waits. MPICH's blocking barrier spins on a core; on this
    2-core machine the ranks that only wait would take CPU from the ranks that write (on a real
    cluster they spin on cores of their own). ckptfmt's ``MpiComm`` waits the same way
    (``ckptfmt.transport.mpi.polite_wait``)."""
    req = mpi_comm.Ibarrier()
    while not req.Test():
        time.sleep(0.0002)


@dataclass
class Env:
    """What every method needs: communicators, this rank's node, the state in its forms."""

    mpi: Any  # mpi4py communicator
    comm: Any  # ckptfmt MpiComm over the same ranks
    rank: int
    size: int
    node: str
    node_leader: bool
    base: Path
    flat: dict[str, np.ndarray]
    nested: dict[str, Any]
    torch_state: dict[str, Any] | None  # rank 0 only: torch.from_numpy views (zero copy)
    copy_buf: dict[str, np.ndarray]  # memcpy baseline's destination, touched once
    mgr: Any  # CheckpointManager
    nbytes: int
    raw_pieces: list[memoryview]  # this rank's planned regions as <= 16 MiB byte views

    def node_dir(self) -> Path:
        return self.base / self.node


@dataclass
class Sample:
    """One timed run of one method on this rank: seconds and what to delete before the next."""

    seconds: float
    outputs: list[Path]
    extra: dict[str, Any]


def timed_collective(env: Env, body: Callable[[], list[Path]]) -> Sample:
    """Wall time from a barrier before to a barrier after, on this rank."""
    quiet_barrier(env.mpi)
    t0 = time.perf_counter()
    outputs = body()
    quiet_barrier(env.mpi)
    return Sample(time.perf_counter() - t0, outputs, {})


def run_par(env: Env, rep: int, threads: int) -> Sample:
    from ckptfmt.format.options import WriteOptions
    from ckptfmt.parallel.collective.save import save_collective

    path = env.node_dir() / f"par-t{threads}-{rep}"
    plan_box: list[Any] = []
    marks: dict[str, float] = {}

    def body() -> list[Path]:
        marks["start"] = time.perf_counter()
        _, plan = save_collective(
            env.comm,
            env.nested,
            path,
            step=rep,
            node=env.node,
            fault=lambda point: marks.__setitem__(point, time.perf_counter()),  # phase clock
            write=WriteOptions(threads=threads),
        )
        plan_box.append(plan)
        return [path] if env.node_leader else []

    s = timed_collective(env, body)
    s.extra["bytes_per_rank"] = plan_box[0].bytes_per_rank()
    # this rank's own data writes (from the call: declarations, plan, staging, shard files),
    # its wait for the slowest rank (vote, file lists), and the commit after it (metadata
    # documents, manifest, fsync of every directory, rename; leaders)
    s.extra["phases"] = {
        "data_s": marks["written"] - marks["start"],
        "vote_wait_s": marks["manifest"] - marks["written"],
        "commit_s": marks["committed"] - marks["manifest"],
    }
    return s


def run_raw(env: Env, rep: int) -> Sample:
    """The same bytes each rank writes under ckptfmt's plan, as plain files of at most one
    shard (16 MiB) with the same 2 threads and fsync, nothing else: what this machine allows."""
    from concurrent.futures import ThreadPoolExecutor

    from ckptfmt.storage.files import write_gather

    root = env.node_dir() / f"raw-{rep}" / f"r{env.rank}"

    def body() -> list[Path]:
        root.mkdir(parents=True)
        jobs = [(root / f"{i}", piece) for i, piece in enumerate(env.raw_pieces)]
        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(lambda j: write_gather(j[0], [j[1]], True), jobs))
        return [root.parent] if env.node_leader else []

    return timed_collective(env, body)


def run_root_ckptfmt(env: Env, rep: int) -> Sample:
    path = env.node_dir() / f"root-ckptfmt-{rep}"

    def body() -> list[Path]:
        if env.rank != 0:
            return []
        ckptfmt.save(env.nested, path, step=rep)
        return [path]

    return timed_collective(env, body)


def run_root_torch(env: Env, rep: int) -> Sample:
    path = env.node_dir() / f"root-torch-{rep}.pt"

    def body() -> list[Path]:
        if env.rank != 0:
            return []
        import torch

        torch.save(env.torch_state, path)
        return [path]

    return timed_collective(env, body)


def copy_state(env: Env) -> None:
    for k, a in env.flat.items():
        np.copyto(env.copy_buf[k], a, casting="no")


def run_memcpy(env: Env, rep: int) -> Sample:
    """Each rank's own copy time (started together after a barrier)."""
    quiet_barrier(env.mpi)
    t0 = time.perf_counter()
    copy_state(env)
    dt = time.perf_counter() - t0
    quiet_barrier(env.mpi)
    return Sample(dt, [], {})


def run_async(env: Env, rep: int) -> Sample:
    """Each rank's time inside ``mgr.save()``; the background save is waited for outside it."""
    step = 1000 + rep
    quiet_barrier(env.mpi)
    t0 = time.perf_counter()
    env.mgr.save(step, env.nested)
    dt = time.perf_counter() - t0
    env.mgr.wait()  # not part of the blocked time: the training loop would be computing here
    background = time.perf_counter() - t0 - dt
    quiet_barrier(env.mpi)
    path = env.mgr.local_root / f"step-{step:010d}"
    return Sample(dt, [path] if env.node_leader else [], {"background_s": background})


RUNNERS: dict[str, Callable[[Env, int], Sample]] = {
    "par": lambda env, rep: run_par(env, rep, 2),
    "par_t1": lambda env, rep: run_par(env, rep, 1),
    "raw": run_raw,
    "root_ckptfmt": run_root_ckptfmt,
    "root_torch": run_root_torch,
    "memcpy": run_memcpy,
    "async": run_async,
}


def planned_pieces(env: Env) -> list[memoryview]:
    """This rank's share under ckptfmt's plan (the same plan ``save_collective`` makes), cut
    into byte views of at most one default shard."""
    from ckptfmt.format.shard_io import byte_view
    from ckptfmt.manifest.grid import DEFAULT_SHARD_BYTES
    from ckptfmt.parallel.collective.save_state import check_state
    from ckptfmt.plan.ownership import make_plan

    holdings = check_state(env.nested).holdings()
    plan = make_plan([holdings] * env.size)
    pieces = []
    for t, r in plan.for_rank(env.rank):
        arr = env.flat[".".join(t.name)]
        box = tuple(slice(o, o + n) for o, n in zip(r.offset, r.shape))
        b = byte_view(np.ascontiguousarray(arr[box]))
        pieces += [b[i : i + DEFAULT_SHARD_BYTES] for i in range(0, len(b), DEFAULT_SHARD_BYTES)]
    return pieces


# --- correctness (once, before anything is timed) -------------------------------------------------


def check_parallel_save(env: Env) -> None:
    """A collective save, loaded back collectively from each node's directory, is bit-exact."""
    from ckptfmt.parallel.collective.load import load_collective
    from ckptfmt.parallel.collective.save import save_collective

    path = env.node_dir() / "check"
    save_collective(env.comm, env.nested, path, step=0, node=env.node)
    loaded, _ = load_collective(env.comm, path)
    got = flatten_nested(loaded)
    bad = [k for k, a in env.flat.items() if k not in got or not bits_equal(a, got[k])]
    del loaded, got
    quiet_barrier(env.mpi)
    if env.node_leader:
        remove(path)
    if bad:
        raise AssertionError(f"rank {env.rank}: parallel save/load differs for {bad[:3]}")


# --- one launch -----------------------------------------------------------------------------------


def cpu_times_s() -> tuple[float, float]:
    """(busy, stolen) CPU seconds of the whole machine since boot (/proc/stat). Busy leaves out
    idle, iowait and steal; steal is time the hypervisor gave this VM's CPUs to someone else."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    steal = fields[7] if len(fields) > 7 else 0
    busy = sum(fields[:8]) - fields[3] - fields[4] - steal
    return busy / hz, steal / hz


def own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this rank
    return r.ru_utime + r.ru_stime


class RoundClock:
    """One benchmark round's wall time and the CPU other processes took meanwhile. Every rank
    makes one at the start of the round; :meth:`record` is collective (a sleeping barrier and an
    allgather of the ranks' own CPU time) and returns the round's trace entry."""

    def __init__(self) -> None:
        self.t0, (self.busy0, self.steal0), self.own0 = (
            time.perf_counter(),
            cpu_times_s(),
            own_cpu_s(),
        )

    def record(
        self, mpi_comm: Any, comm: Any, rnd: int, timed: bool, order: Any, max_foreign: float
    ) -> dict[str, Any]:
        quiet_barrier(mpi_comm)
        ours = sum(comm.allgather_json(own_cpu_s() - self.own0))
        round_s = time.perf_counter() - self.t0
        busy1, steal1 = cpu_times_s()
        foreign = max(0.0, busy1 - self.busy0 - ours)
        cpus = round_s * (os.cpu_count() or 1)
        return {
            "round": rnd,
            "timed": timed,
            "quiet": foreign / cpus <= max_foreign,
            "order": order,
            "round_s": round_s,
            "foreign_cpu_s": foreign,
            "foreign_cpu_share": foreign / cpus,
            "steal_share": (steal1 - self.steal0) / cpus,
            "loadavg": loadavg(),
        }


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def run_launch(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    from ckptfmt.parallel.manager.checkpoint_manager import CheckpointManager
    from ckptfmt.transport.mpi import MpiComm

    mpi = MPI.COMM_WORLD
    comm = MpiComm(mpi)
    rank, size = comm.rank, comm.size
    node = f"n{rank * NODES // size}" if size >= 2 else "n0"
    nodes = comm.allgather_json(node)
    node_leader = nodes.index(node) == rank
    base = Path(args.dir)
    model = model_for(int(args.size_gib * GIB), 4)
    need = size * 3 * int(args.size_gib * GIB) + 2 * GIB  # state, copy, staging; + outputs
    if rank == 0:
        if mem_available() < need:
            print(
                f"# warning: MemAvailable {mem_available() / GIB:.1f} GiB < ~{need / GIB:.1f} "
                "GiB this launch needs",
                flush=True,
            )
        if base.exists():
            shutil.rmtree(base)
        base.mkdir(parents=True)
    quiet_barrier(mpi)
    (base / node).mkdir(exist_ok=True)

    t0 = time.perf_counter()
    flat = make_state(model, seed=0)
    nbytes = sum(a.nbytes for a in flat.values())
    torch_state = None
    if rank == 0:
        import torch

        torch_state = {k: torch.from_numpy(a) for k, a in flat.items()}
    env = Env(
        mpi=mpi,
        comm=comm,
        rank=rank,
        size=size,
        node=node,
        node_leader=node_leader,
        base=base,
        flat=flat,
        nested=nest(flat),
        torch_state=torch_state,
        copy_buf={},  # allocated after the check, which needs a loaded copy for a moment
        mgr=None,
        nbytes=nbytes,
        raw_pieces=[],
    )
    env.raw_pieces = planned_pieces(env)
    if rank == 0:
        print(
            f"# ranks={size} nodes={sorted(set(nodes))} state: d={model.d} "
            f"layers={model.layers} tensors={len(flat)} bytes={nbytes} "
            f"({nbytes / GIB:.3f} GiB) per rank, built in {time.perf_counter() - t0:.1f}s",
            flush=True,
        )
    if not args.no_check:
        check_parallel_save(env)
        if rank == 0:
            print("# check: collective save -> collective load is bit-exact", flush=True)
    env.copy_buf = {k: np.empty_like(a) for k, a in flat.items()}
    copy_state(env)  # touch the baseline's buffers once
    env.mgr = CheckpointManager(
        local_dir=str(base / "{node}" / "mgr"),
        comm=comm,
        node=node,
        flush_every=10**9,
        async_save=True,
        on_error="raise",
        at_exit=ExitPolicy(flush=False, sigterm=False),
    )

    keys = list(METHODS)
    rec: dict[str, list[list[float]]] = {k: [] for k in keys}  # [rep][rank] seconds
    background: list[list[float]] = []
    phases: dict[str, list[list[dict[str, float]]]] = {"par": [], "par_t1": []}
    bytes_per_rank: list[int] = []
    trace = []
    pending: list[Path] = []
    started = time.perf_counter()
    r, go_on = 0, True
    try:
        while go_on:
            timed = r >= args.warmup
            rot = r % len(keys)
            order = keys[rot:] + keys[:rot]
            pretouch(flat)
            quiet_barrier(mpi)
            clock = RoundClock()
            for key in order:
                # free the previous output just before the next run needs the pages again
                # (tmpfs pages left free for ~2 s go back to the hypervisor; bench/README.md)
                for p in pending:
                    remove(p)
                gc.collect()
                s = RUNNERS[key](env, r)
                pending = s.outputs
                per_rank = [float(x) for x in comm.allgather_json(s.seconds)]
                if "bytes_per_rank" in s.extra:
                    bytes_per_rank = s.extra["bytes_per_rank"]
                if "phases" in s.extra:
                    ph = comm.allgather_json(s.extra["phases"])
                    if timed:
                        phases[key].append(ph)
                if key == "async":
                    bg = [float(x) for x in comm.allgather_json(s.extra["background_s"])]
                    if timed:
                        background.append(bg)
                if timed:
                    rec[key].append(per_rank)
            # CPU time other processes (and the hypervisor) took during the round: the machine
            # is shared; the JSON keeps both per round
            trace.append(clock.record(mpi, comm, r, timed, order, args.max_foreign))
            r += 1
            # at least --reps timed rounds; more (within the budget) until --reps of them were
            # quiet. Rank 0 decides: the ranks read /proc/stat at slightly different times.
            n_timed = r - args.warmup
            n_quiet = sum(t["quiet"] for t in trace if t["timed"])
            elapsed = time.perf_counter() - started
            slowest = max(t["round_s"] for t in trace)
            go_on = comm.bcast_json(
                n_timed < args.reps
                or (n_quiet < args.reps and elapsed + slowest <= args.budget_min * 60),
                root=0,
            )
            if rank == 0:
                print(
                    f"# round {r} ({'timed' if timed else 'warm-up'}"
                    f"{', quiet' if trace[-1]['quiet'] else ''}) done at {elapsed:.0f}s; other "
                    f"processes took {100 * trace[-1]['foreign_cpu_share']:.0f}% of the CPUs, "
                    f"the hypervisor {100 * trace[-1]['steal_share']:.0f}%",
                    flush=True,
                )
    finally:
        for p in pending:
            remove(p)
        env.mgr.close(flush=False)
        quiet_barrier(mpi)
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)

    if rank == 0:
        doc = {
            "ranks": size,
            "nodes": nodes,
            "nbytes_per_rank_state": nbytes,
            "plan_bytes_per_rank": bytes_per_rank,
            "model": {**vars(model), "params": model.params(), "tensors": len(flat)},
            "samples_s": rec,  # [rep][rank]; wall-clock methods are barrier to barrier
            "async_background_s": background,
            "par_phases_s": phases,  # [rep][rank] {data_s, vote_wait_s, commit_s}
            "quiet_rounds": [t["quiet"] for t in trace if t["timed"]],  # per timed round
            "config": {
                "size_gib": args.size_gib,
                "reps": args.reps,
                "warmup": args.warmup,
                "max_foreign": args.max_foreign,
                "budget_min": args.budget_min,
                "dir": str(base),
                "ckptfmt_writer_threads": writer_threads(),
                "check": not args.no_check,
            },
            "loadavg_per_round": trace,
            "wall_s": round(time.perf_counter() - started, 1),
            "command": " ".join(
                ["mpiexec", "-n", str(size), Path(sys.executable).name, "-m", "mpi4py", *sys.argv]
            ),
        }
        out = Path(args.part)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"# wrote {out} ({doc['wall_s']}s)", flush=True)
    return 0


# --- combining the launches -----------------------------------------------------------------------


def per_rep(samples: list[list[float]]) -> list[float]:
    """One number per repetition: the slowest rank (wall-clock methods agree to a barrier)."""
    return [max(x) for x in samples]


def rounds_used(part: dict[str, Any]) -> list[int]:
    """The timed rounds the summary uses: the quiet ones if there are --reps of them, else all
    (the JSON says which)."""
    quiet = [i for i, q in enumerate(part["quiet_rounds"]) if q]
    return quiet if len(quiet) >= part["config"]["reps"] else list(range(len(part["quiet_rounds"])))


def summarize(part: dict[str, Any]) -> dict[str, Any]:
    """Medians (and the rest) over the rounds :func:`rounds_used` picks."""
    use = rounds_used(part)
    part = {
        **part,
        "samples_s": {k: [v[i] for i in use] for k, v in part["samples_s"].items()},
        "async_background_s": [part["async_background_s"][i] for i in use],
        "par_phases_s": {k: [v[i] for i in use] for k, v in part["par_phases_s"].items()},
    }
    nbytes = part["nbytes_per_rank_state"]
    size = part["ranks"]
    plan_max = max(part["plan_bytes_per_rank"])
    med = {k: statistics.median(per_rep(v)) for k, v in part["samples_s"].items()}
    rows = {}
    for key, xs in part["samples_s"].items():
        reps = per_rep(xs)
        written = {
            "par": plan_max,
            "par_t1": plan_max,
            "root_ckptfmt": nbytes,
            "root_torch": nbytes,
            "raw": plan_max,
            "memcpy": nbytes,
            "async": plan_max,
        }[key]
        row: dict[str, Any] = {
            "samples_s": [round(x, 5) for x in reps],
            "median_s": med[key],
            "min_s": min(reps),
            "max_s": max(reps),
            "per_rank_bytes_max": written,
            # a checkpoint's bytes (one copy of the state) over the wall time
            "gb_per_s": nbytes / med[key] / 1e9,
        }
        if key.startswith("root"):
            row["root_over_par"] = med[key] / med["par"]
            row["root_over_par_t1"] = med[key] / med["par_t1"]
            row["root_over_par_min"] = min(reps) / min(per_rep(part["samples_s"]["par"]))
        rows[key] = row
    blocked = {
        "save_blocked_ms": med["async"] * 1e3,
        "memcpy_ms": med["memcpy"] * 1e3,
        "ratio": med["async"] / med["memcpy"],
        "background_save_s_median": statistics.median(per_rep(part["async_background_s"])),
        "per_rank_blocked_ms_median": [
            statistics.median(r[i] for r in part["samples_s"]["async"]) * 1e3 for i in range(size)
        ],
        "per_rank_memcpy_ms_median": [
            statistics.median(r[i] for r in part["samples_s"]["memcpy"]) * 1e3 for i in range(size)
        ],
    }
    phases = {
        key: {
            ph: statistics.median(max(rk[ph] for rk in rep) for rep in reps)
            for ph in ("data_s", "vote_wait_s", "commit_s")
        }
        for key, reps in part["par_phases_s"].items()
    }
    return {
        "rounds": {
            "timed": len(part["quiet_rounds"]),
            "quiet": sum(part["quiet_rounds"]),
            "used": use,
        },
        "methods": rows,
        "blocked": blocked,
        "par_phases_s": phases,
    }


def markdown(results: dict[str, Any], threads: int) -> str:
    def oversub(n: int) -> str:
        cores = os.cpu_count() or 1
        return f"{n} (oversubscribed: {cores} cores)" if n > cores else str(n)

    lines = [
        "| ranks | method | per-rank bytes (max) | wall s (median) | wall s (min) | GB/s "
        "| root time / ckptfmt time |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, res in results.items():
        for key, row in res["methods"].items():
            if key in ("memcpy", "async"):
                continue
            label = METHODS[key].format(t=threads)
            ratio = "—"
            if "root_over_par" in row:
                ratio = (
                    f"{row['root_over_par']:.2f}x (vs threads=1: {row['root_over_par_t1']:.2f}x)"
                )
            lines.append(
                f"| {oversub(int(n))} | {label} | {row['per_rank_bytes_max'] / 2**20:.0f} MiB | "
                f"{row['median_s']:.3f} | {row['min_s']:.3f} | {row['gb_per_s']:.2f} | {ratio} |"
            )
    lines += [
        "",
        "| ranks | save() blocked ms | memcpy ms | ratio | background save s |",
        "|---|---|---|---|---|",
    ]
    for n, res in results.items():
        b = res["blocked"]
        lines.append(
            f"| {oversub(int(n))} | {b['save_blocked_ms']:.0f} | {b['memcpy_ms']:.0f} | "
            f"{b['ratio']:.2f}x | {b['background_save_s_median']:.2f} |"
        )
    lines += [
        "",
        "| ranks | method | own data written s | wait for the slowest rank s | commit s |",
        "|---|---|---|---|---|",
    ]
    for n, res in results.items():
        for key, ph in res["par_phases_s"].items():
            lines.append(
                f"| {oversub(int(n))} | {METHODS[key]} | {ph['data_s']:.3f} | "
                f"{ph['vote_wait_s']:.3f} | {ph['commit_s']:.3f} |"
            )
    lines += [
        "",
        "| ranks | timed rounds | quiet rounds | rounds in the medians |",
        "|---|---|---|---|",
    ]
    for n, res in results.items():
        k = res["rounds"]
        used = "the quiet ones" if len(k["used"]) == k["quiet"] else "all (too few quiet)"
        lines.append(f"| {oversub(int(n))} | {k['timed']} | {k['quiet']} | {used} |")
    return "\n".join(lines)


def run_combine(args: argparse.Namespace) -> int:
    import torch

    parts = sorted(
        (json.loads(Path(p).read_text()) for p in args.combine), key=lambda d: d["ranks"]
    )
    results = {str(p["ranks"]): summarize(p) for p in parts}
    threads = parts[0]["config"]["ckptfmt_writer_threads"]
    table = markdown(results, threads)
    print(table)
    doc = {
        "benchmark": "parallel",
        "commands": [p["command"] for p in parts],
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": {
            **parts[0]["config"],
            "nodes": NODES,
            "methods": {k: v.format(t=threads) for k, v in METHODS.items()},
        },
        "environment": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "numpy": np.__version__,
            "torch": torch.__version__,
            "mpi4py": __import__("mpi4py").__version__,
            "ckptfmt": ckptfmt.__version__,
            "git": git_info(),
        },
        "definitions": {
            "wall": "seconds from a barrier before to a barrier after, slowest rank; median over "
            "repetitions",
            "per_rank_bytes_max": "tensor bytes the busiest rank writes (plan.bytes_per_rank() for "
            "ckptfmt parallel; the whole state for root methods)",
            "gb_per_s": "bytes of one copy of the state / median wall seconds / 1e9",
            "root_over_par": "median wall of the root method / median wall of ckptfmt parallel "
            "(default threads=2); > 1: ckptfmt parallel is faster",
            "save_blocked_ms": "time inside CheckpointManager.save() (async), slowest rank, "
            "median over repetitions (after a warm-up save: staging reused)",
            "root_over_par_min": "the same ratio of the fastest repetitions (less sensitive to "
            "other load on the machine)",
            "memcpy_ms": "np.copyto of the state into buffers touched before, slowest rank, median",
            "background_save_s": "from save() returning to mgr.wait() returning (the write of "
            "level 1 behind the training loop), slowest rank, median",
            "par_phases_s": "ckptfmt parallel per phase, slowest rank, median: own data (from the "
            "call to the last own shard file), wait for the slowest rank (vote), commit "
            "(zarr.json documents, manifest, fsync of every directory, rename)",
        },
        "results": results,
        "runs": {str(p["ranks"]): p for p in parts},
        "markdown": table,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(table + "\n")
    print(f"\n# wrote {out} and {out.with_suffix('.md')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0, help="float32 state per rank (1.0)")
    ap.add_argument(
        "--reps",
        type=int,
        default=7,
        help="timed rounds, and the quiet rounds wanted (default 7; see --max-foreign)",
    )
    ap.add_argument(
        "--max-foreign",
        type=float,
        default=0.15,
        help="a round is quiet when other processes took at most this share of the CPUs "
        "(default 0.15); the summary uses only quiet rounds when there are --reps of them",
    )
    ap.add_argument(
        "--budget-min",
        type=float,
        default=3.0,
        help="per launch: add timed rounds beyond --reps, until --reps were quiet, only while "
        "the next would end within this many minutes (default 3)",
    )
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    ap.add_argument("--dir", default=DEFAULT_DIR, help=f"output root (default {DEFAULT_DIR})")
    ap.add_argument(
        "--no-check", action="store_true", help="skip the bit-exact check of a collective save/load"
    )
    ap.add_argument(
        "--part", default=None, help="under mpiexec: write this launch's samples to this JSON file"
    )
    ap.add_argument(
        "--combine",
        nargs="+",
        default=None,
        metavar="PART",
        help="no MPI: combine launches' parts into --out (and a .md beside it)",
    )
    ap.add_argument("--out", default=str(BENCH / "results" / "parallel.json"))
    args = ap.parse_args(argv)
    if args.combine:
        return run_combine(args)
    if not args.part:
        ap.error("give --part FILE (under mpiexec) or --combine PART...")
    if args.reps < 1 or args.warmup < 1:
        ap.error("--reps and --warmup must be >= 1 (the warm-up save allocates the staging)")
    return run_launch(args)


if __name__ == "__main__":
    raise SystemExit(main())
