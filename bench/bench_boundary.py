"""The error-boundary redesign, before and after: the same collective operations timed on the
code of two commits, in alternating launches, to show no operation got slower beyond noise.

Every rank holds the same ~32 MiB state (data parallel: the plan splits the writes); 4 ranks on
2 simulated nodes (``n0``: ranks 0-1, ``n1``: ranks 2-3), level-1 directories ``ROOT/n0`` and
``ROOT/n1`` on a tmpfs, fsync off. Per round, each timed from a barrier to a barrier (the slowest
rank):

* ``save``: ``save_collective`` level 1, no redundancy;
* ``load``: ``load_collective`` of that step (every rank reads the whole state);
* ``redundancy_save``: ``save_collective`` level 1 with XOR parity;
* ``rebuild``: ``rebuild_collective`` after node ``n1``'s step directory was deleted (untimed);
* ``manager_save_blocked``: the time ``CheckpointManager.save`` (async, level 1) blocks; then
  ``wait()`` (untimed);
* ``restore``: ``CheckpointManager.restore(state)`` of that step (level 1, nothing lost);
* ``manager_save_flush``: a second, synchronous ``CheckpointManager`` with a level 3
  (``ROOT/shared``) and ``flush_every=1``: its ``save`` (level 1, then the flush of every rank's
  files to level 3).

Only APIs present in both versions are called. The code is chosen by ``PYTHONPATH`` (a git
worktree of each commit); ``run`` starts the launches, alternating before/after so that the
noise of a shared machine falls on both alike, and combines the medians.

    python bench/bench_boundary.py run --before ../wt-before --after ../wt-after
"""

# ruff: noqa: B023 (each round's closures are called in the round that defines them)
from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

OPS = [
    "save",
    "load",
    "redundancy_save",
    "rebuild",
    "restore",
    "manager_save_blocked",
    "manager_save_flush",
]
HERE = Path(__file__).resolve().parent


def quiet_barrier(mpi: Any) -> None:
    """A barrier that sleeps while it waits (MPICH's spins; this machine has 2 cores)."""
    req = mpi.Ibarrier()
    while not req.Test():
        time.sleep(0.0002)


def timed(mpi: Any, fn: Any) -> tuple[float, Any]:
    """``fn()`` between two barriers; the slowest rank's seconds (the same on every rank)."""
    quiet_barrier(mpi)
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    quiet_barrier(mpi)
    return float(mpi.allreduce(dt, op=__import__("mpi4py.MPI").MPI.MAX)), out


def count_collectives(comm: Any) -> dict[str, float]:
    """Count this rank's metadata collectives (``allgather_bytes``, ``bcast_buffer``, ``barrier``:
    what votes, broadcasts and roll calls are made of) and the seconds spent in them (waiting for
    the slowest rank included). Reset by the caller per operation."""
    tally = {"n": 0.0, "s": 0.0}
    for name in ("allgather_bytes", "bcast_buffer", "barrier"):
        orig = getattr(comm, name)

        def wrapped(*a: Any, _orig: Any = orig, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _orig(*a, **k)
            finally:
                tally["n"] += 1
                tally["s"] += time.perf_counter() - t0

        setattr(comm, name, wrapped)
    return tally


def time_repair() -> dict[str, float]:
    """Seconds in ``repair_collective`` (the metadata repair the rebuild runs first: in
    ``ckptfmt.engine.copies`` after the layout move, ``ckptfmt.copies`` before; absent before
    the error boundary: stays 0)."""
    spent = {"s": 0.0}
    # it imports the name: patch it where it is called
    try:
        import ckptfmt.parallel.collective.rebuild as rebuild
    except ImportError:
        import ckptfmt.parallel.rebuild as rebuild  # type: ignore[no-redef]

    orig = getattr(rebuild, "repair_collective", None)
    if orig is None:
        return spent

    def wrapped(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            spent["s"] += time.perf_counter() - t0

    rebuild.repair_collective = wrapped  # type: ignore[attr-defined]
    return spent


def import_mpi_comm() -> Any:
    """``MpiComm`` from either side of the move into ``ckptfmt.transport``:
    ``ckptfmt.transport.mpi`` after, ``ckptfmt.parallel.mpi`` before."""
    try:
        from ckptfmt.transport.mpi import MpiComm
    except ImportError:
        from ckptfmt.parallel.mpi import MpiComm  # type: ignore[no-redef]
    return MpiComm


def import_collectives() -> tuple[Any, Any, Any]:
    """``load_collective``, ``rebuild_collective``, ``save_collective`` from either side of
    ``parallel/`` by role (``ckptfmt.parallel.collective.*`` after, ``ckptfmt.parallel.*``
    before)."""
    try:
        from ckptfmt.parallel.collective.load import load_collective
        from ckptfmt.parallel.collective.rebuild import rebuild_collective
        from ckptfmt.parallel.collective.save import save_collective
    except ImportError:
        from ckptfmt.parallel.load import load_collective  # type: ignore[no-redef]
        from ckptfmt.parallel.protocol import save_collective  # type: ignore[no-redef]
        from ckptfmt.parallel.rebuild import rebuild_collective  # type: ignore[no-redef]
    return load_collective, rebuild_collective, save_collective


def save_options() -> dict[str, Any]:
    """Level 1, fsync off, as keywords of ``save_collective`` on either side of the options
    objects (``write=WriteOptions(...)``, ``meta=ManifestMeta(levels=...)``;
    before: ``fsync=``, ``levels=``)."""
    try:
        from ckptfmt.container.metadata import ManifestMeta
        from ckptfmt.format.options import WriteOptions
    except ImportError:
        return {"levels": {"1": {}}, "fsync": False}
    return {"write": WriteOptions(fsync=False), "meta": ManifestMeta(levels={"1": {}})}


def manager_options() -> dict[str, Any]:
    """No exit flush, no SIGTERM handler, fsync off, as keywords of ``CheckpointManager`` on
    either side of its options objects (``write=WriteOptions(...)``,
    ``at_exit=ExitPolicy(...)``; before: ``fsync=``, ``exit_flush=``, ``handle_sigterm=``)."""
    try:
        from ckptfmt import ExitPolicy, WriteOptions
    except ImportError:
        return {"exit_flush": False, "handle_sigterm": False, "fsync": False}
    return {"write": WriteOptions(fsync=False), "at_exit": ExitPolicy(flush=False, sigterm=False)}


def make_state(mib: int) -> dict[str, Any]:
    """The same arrays on every rank: 8 float32 tensors of ``mib/8`` MiB each."""
    import numpy as np

    rng = np.random.default_rng(0)
    n = mib * 2**20 // 8 // 4
    return {f"layer{i}": {"w": rng.standard_normal(n, dtype=np.float32)} for i in range(8)}


def flat(state: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out |= flat(v, f"{prefix}{k}/")
        else:
            out[f"{prefix}{k}"] = v
    return out


def launch(args: argparse.Namespace) -> None:
    """One MPI launch: ``args.rounds`` timed rounds (after one warm-up), this version's code."""
    import numpy as np
    from mpi4py import MPI

    import ckptfmt
    from ckptfmt import CheckpointManager

    load_collective, rebuild_collective, save_collective = import_collectives()
    from ckptfmt.redundancy.config import Redundancy
    from ckptfmt.storage import commit

    mpi = MPI.COMM_WORLD
    comm = import_mpi_comm()(mpi)
    rank, size = mpi.rank, mpi.size
    node = f"n{rank * 2 // size}"
    root = Path(args.dir)
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        for n in ("n0", "n1", "shared"):
            (root / n).mkdir(parents=True)
    quiet_barrier(mpi)
    here = root / node
    state = make_state(args.mib)
    ref = flat(state)
    xor = Redundancy.of("xor")
    mgr = CheckpointManager(
        local_dir=str(root / "{node}" / "mgr"),
        comm=comm,
        node=node,
        flush_every=10**9,
        async_save=True,
        on_error="raise",
        **manager_options(),
    )
    flusher = CheckpointManager(
        local_dir=str(root / "{node}" / "flush"),
        shared_dir=str(root / "shared"),
        comm=comm,
        node=node,
        flush_every=1,
        async_save=False,
        on_error="raise",
        **manager_options(),
    )
    samples: dict[str, list[float]] = {k: [] for k in OPS}
    tally = count_collectives(comm)
    repair = time_repair()
    # rank 0's breakdown per round: collectives (count, s) per op, save phases, repair seconds
    detail: list[dict[str, Any]] = []
    for rnd in range(args.rounds + 1):
        got: dict[str, float] = {}
        info: dict[str, Any] = {"collectives": {}, "phases": {}}
        plain, red = here / f"plain-{rnd}", here / f"xor-{rnd}"

        def op(key: str, fn: Any) -> Any:
            tally["n"] = tally["s"] = 0.0
            got[key], out = timed(mpi, fn)
            info["collectives"][key] = [int(tally["n"]), tally["s"]]
            return out

        def phases(key: str, marks: dict[str, float]) -> None:
            """Intervals between the save's hook points (rank 0, a node leader)."""
            pts = sorted(marks.items(), key=lambda kv: kv[1])
            info["phases"][key] = {
                f"{a}->{b}": tb - ta for (a, ta), (b, tb) in itertools.pairwise(pts)
            }

        marks: dict[str, float] = {}

        def hook_into(m: dict[str, float]) -> Any:
            return lambda point: m.setdefault(point, time.perf_counter())

        def save_plain() -> Any:
            marks["start"] = time.perf_counter()
            out = save_collective(
                comm,
                state,
                plain,
                step=rnd,
                node=node,
                group=f"node:{node}",
                **save_options(),
                fault=hook_into(marks),
            )
            marks["end"] = time.perf_counter()
            return out

        op("save", save_plain)
        phases("save", marks)
        loaded, _ = op("load", lambda: load_collective(comm, plain, node=node, expect_step=rnd))
        if rnd == 0:  # bit-exact, once
            back = flat(loaded)
            assert back.keys() == ref.keys() and all(np.array_equal(back[k], ref[k]) for k in ref)
        del loaded
        rmarks: dict[str, float] = {}

        def save_red() -> Any:
            rmarks["start"] = time.perf_counter()
            out = save_collective(
                comm,
                state,
                red,
                step=rnd,
                node=node,
                group=f"node:{node}",
                **save_options(),
                redundancy=xor,
                fault=hook_into(rmarks),
            )
            rmarks["end"] = time.perf_counter()
            return out

        op("redundancy_save", save_red)
        phases("redundancy_save", rmarks)
        if rank == 2:  # node n1's leader deletes its step directory
            commit.remove(red)
        quiet_barrier(mpi)
        repair["s"] = 0.0
        report, _ = op("rebuild", lambda: rebuild_collective(comm, red, f"node:{node}", False))
        info["repair_s"] = repair["s"]
        assert report.repaired and commit.is_committed(red), report
        quiet_barrier(mpi)
        t0 = time.perf_counter()
        mgr.save(rnd, state)
        blocked = time.perf_counter() - t0
        mgr.wait()
        quiet_barrier(mpi)
        got["manager_save_blocked"] = float(mpi.allreduce(blocked, op=MPI.MAX))
        target = {k: {"w": np.zeros_like(v["w"])} for k, v in state.items()}
        got["restore"], restored = timed(mpi, lambda: mgr.restore(target))
        # a RestoreReport; the step itself on either side of that change
        step = getattr(restored, "step", restored)
        assert step == rnd, step
        if rnd == 0:
            assert all(np.array_equal(target[k]["w"], state[k]["w"]) for k in state)
        got["manager_save_flush"], _ = timed(mpi, lambda: flusher.save(rnd, state))
        if rank % 2 == 0:  # node leaders clean up (untimed)
            for p in (plain, red):
                shutil.rmtree(p, ignore_errors=True)
        quiet_barrier(mpi)
        if rnd > 0:
            for k in OPS:
                samples[k].append(got[k])
            detail.append(info)
    if rank == 0:
        out = {
            "version": args.label,
            "ckptfmt": ckptfmt.__file__,
            "rounds": args.rounds,
            "samples": samples,
            "median": {k: statistics.median(v) for k, v in samples.items()},
            "detail_rank0": detail,
        }
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(json.dumps({k: round(v, 4) for k, v in out["median"].items()}), flush=True)
        shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace) -> None:
    """Alternate launches before/after; combine each version's launch medians; write results."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    versions = {"before": Path(args.before), "after": Path(args.after)}
    commits = {
        v: subprocess.run(
            ["git", "-C", str(p), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for v, p in versions.items()
    }
    launches: dict[str, list[dict[str, Any]]] = {v: [] for v in versions}
    tmp = Path(args.dir).parent / "bench_boundary_out"
    tmp.mkdir(parents=True, exist_ok=True)
    started = time.time()
    for i in range(args.launches):
        for v, p in versions.items():
            out = tmp / f"{v}-{i}.json"
            env = dict(
                os.environ, PYTHONPATH=f"{p}:{p}/adapters:{p}/tools", TF_CPP_MIN_LOG_LEVEL="2"
            )
            cmd = [
                "timeout",
                str(args.timeout),
                str(mpiexec),
                "-n",
                "4",
                sys.executable,
                "-m",
                "mpi4py",
                str(Path(__file__).resolve()),
                "launch",
                "--label",
                v,
                "--out",
                str(out),
                "--dir",
                args.dir,
                "--rounds",
                str(args.rounds),
                "--mib",
                str(args.mib),
            ]
            t0 = time.time()
            subprocess.run(cmd, env=env, cwd="/tmp", check=True)  # cwd: not the main tree
            res = json.loads(out.read_text())
            assert res["ckptfmt"].startswith(str(p)), res["ckptfmt"]
            res["wall_s"] = time.time() - t0
            res["started_utc"] = time.strftime("%H:%M:%S", time.gmtime(t0))
            launches[v].append(res)
            print(f"launch {i} {v} ({res['wall_s']:.0f} s): {res['median']}", flush=True)
    table = []
    for k in OPS:
        row: dict[str, Any] = {"op": k}
        for v in versions:
            meds = [la["median"][k] for la in launches[v]]
            row[v] = statistics.median(meds)
            row[f"{v}_launch_medians"] = meds
            row[f"{v}_pooled"] = statistics.median(
                s for la in launches[v] for s in la["samples"][k]
            )
        row["ratio"] = row["after"] / row["before"]
        table.append(row)
    paired = {
        k: statistics.median(
            a["median"][k] / b["median"][k]
            for a, b in zip(launches["after"], launches["before"], strict=True)
        )
        for k in OPS
    }
    for row in table:
        row["paired_ratio"] = paired[row["op"]]

    def rank0(v: str, get: Any) -> float:
        return statistics.median(get(d) for la in launches[v] for d in la["detail_rank0"])

    breakdown: dict[str, Any] = {}
    for v in versions:
        b: dict[str, Any] = {
            f"collectives_{k}": rank0(v, lambda d, k=k: d["collectives"][k][0])
            for k in ("save", "load", "redundancy_save", "rebuild")
        }
        b["rebuild_repair_collective_s"] = rank0(v, lambda d: d["repair_s"])
        for k in ("save", "redundancy_save"):
            names = launches[v][0]["detail_rank0"][0]["phases"][k]
            b[f"{k}_phases_s"] = {
                n: rank0(v, lambda d, k=k, n=n: d["phases"][k].get(n, 0.0)) for n in names
            }
        breakdown[v] = b
    result = {
        "commits": commits,
        "ranks": 4,
        "nodes": 2,
        "mib_per_rank": args.mib,
        "rounds_per_launch": args.rounds,
        "launches_per_version": args.launches,
        "order": "before, after alternating",
        "fsync": False,
        "dir": args.dir,
        "total_s": time.time() - started,
        "table": table,
        "breakdown_rank0_medians": breakdown,
        "launches": launches,
    }
    res_dir = HERE / "results"
    (res_dir / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# bench_boundary.py: before {commits['before']} / after {commits['after']}",
        "",
        f"4 ranks, 2 simulated nodes, {args.mib} MiB per rank (data parallel), tmpfs, fsync off; "
        f"{args.launches} launches per version alternating, {args.rounds} rounds each "
        "(+1 warm-up); median of the launch medians, slowest rank per round.",
        "",
        "| operation | before median s | after median s | after/before | paired after/before | "
        "before launch medians | after launch medians |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in table:
        lines.append(
            f"| {r['op']} | {r['before']:.4f} | {r['after']:.4f} | {r['ratio']:.2f} | "
            f"{r['paired_ratio']:.2f} | "
            + " ".join(f"{x:.4f}" for x in r["before_launch_medians"])
            + " | "
            + " ".join(f"{x:.4f}" for x in r["after_launch_medians"])
            + " |"
        )
    lines += [
        "",
        "Rank 0, medians over all rounds (collectives: allgather/bcast/barrier calls):",
        "",
    ]
    lines += ["| quantity | before | after |", "|---|---|---|"]
    for key in breakdown["before"]:
        bv, av = breakdown["before"][key], breakdown["after"][key]
        if isinstance(bv, dict):
            for n in bv.keys() | av.keys():
                lines.append(f"| {key} {n} | {bv.get(n, 0):.4f} | {av.get(n, 0):.4f} |")
        else:
            lines.append(f"| {key} | {bv:.4f} | {av:.4f} |")
    (res_dir / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    la = sub.add_parser("launch", help="one MPI launch (run under mpiexec -n 4)")
    la.add_argument("--label", required=True)
    la.add_argument("--out", required=True)
    ru = sub.add_parser("run", help="alternate launches of two versions; write bench/results")
    ru.add_argument("--before", required=True, help="worktree of the old commit")
    ru.add_argument("--after", required=True, help="worktree of the new commit")
    ru.add_argument("--launches", type=int, default=3, help="launches per version")
    ru.add_argument("--timeout", type=int, default=300, help="seconds per launch")
    ru.add_argument("--name", default="boundary", help="results file stem in bench/results")
    for p in (la, ru):
        p.add_argument("--dir", default="/dev/shm/ckptfmt-bench-boundary/root")
        p.add_argument("--rounds", type=int, default=7)
        p.add_argument("--mib", type=int, default=32)
    args = ap.parse_args()
    launch(args) if args.cmd == "launch" else run(args)


if __name__ == "__main__":
    main()
