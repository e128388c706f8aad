#!/usr/bin/env python3
"""Resharding: loading at M ranks a checkpoint saved by N ranks, against loading a checkpoint of
the same state saved by M ranks; and the throughput of ``ckptfmt reshard``.

The state is FSDP-like: 2-D float32 tensors (~256 MB in all by default, rows a multiple of 4)
that each rank holds in row blocks (``numpy.array_split``'s split of its job's size); a second,
data-parallel state (~128 MB, ``--dp-mb``) every rank holds whole. The driver (this script
without ``--worker``) does everything:

1. saves the state with N = 4 and N = 2 ranks (``save_collective`` under ``mpiexec``), each into
   a level-3 directory (shared by all ranks) and level-1 directories (two simulated nodes,
   ``n{rank * 2 // size}``);
2. under ``mpiexec -n M`` for M = 2 and 4: ``load_collective`` of the N-rank checkpoint and of the
   M-rank one (``4->2`` vs ``2->2``, ``2->4`` vs ``4->4``), each rank wanting its own rows of the
   M-rank split (DP: everything, with the default ``replicas="node"``, and from level 3 also
   with ``"read"`` and ``"bcast"``), from level 3 and from level 1 (``host``: the simulated
   node); rounds interleaved, the order rotating (the N-rank and the M-rank case of a
   comparison back to back, each first in every other round); a round's time is the slowest
   rank's (barrier before, all-gather of the times after); the first round also checks every
   loaded byte;
3. in this process: ``ckptfmt.maintenance.reshard.reshard`` (what ``ckptfmt reshard`` runs) of the
4-rank
   checkpoint for 2 ranks and of the 2-rank one for 4 (rows split, fsync off and on), against
   ``ckptfmt.load`` + ``ckptfmt.save`` of the same state (read everything, write everything) and
   a plain copy of the directory tree (``shutil.copytree``: the bytes, no checks).

Everything lies on ``/dev/shm`` (tmpfs): the numbers are memory bandwidth and CPU (CRC32C,
copies), not a disk. Medians of ``--reps`` rounds (>= 5) after one warm-up round. Results:
``bench/results/reshard.json`` (every sample) and a Markdown table on stdout and in
``bench/results/reshard.md``::

    .venv/bin/python bench/bench_reshard.py                  # ~256 MB, 7 rounds (a few minutes)
    .venv/bin/python bench/bench_reshard.py --size-mb 64 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))

COLS = 8192  # float32 columns: 32 KiB rows
TENSORS = 8
STEP = "step-0000000001"


# --- the state (both sides) -----------------------------------------------------------------------


def rows_for(size_mb: float) -> int:
    """Rows per tensor for about ``size_mb`` MB in all: a multiple of 4, so that 2 and 4 ranks
    split evenly and the grids are those of real FSDP shapes (an uneven split gives a grid of
    one-row shards, ``spec/PROTOCOL.md`` §3, which would measure the grid, not the resharding)."""
    return max(4, round(size_mb * 1e6 / (TENSORS * COLS * 4) / 4) * 4)


def rows_of(n_rows: int, rank: int, size: int) -> tuple[int, int]:
    base, extra = divmod(n_rows, size)
    return rank * base + min(rank, extra), base + (rank < extra)


def block(t: int, start: int, count: int) -> np.ndarray:
    """Rows ``[start, start + count)`` of tensor ``t``: random bytes, one generator per row (so
    any rank makes any rows without making the whole tensor)."""
    out = np.empty((count, COLS), np.float32)
    for i in range(count):
        g = np.random.default_rng([t, start + i])
        out[i] = g.integers(0, 2**32, COLS, dtype=np.uint32).view(np.float32)
    return out


def wants(rows: int, rank: int, size: int) -> dict[str, Any]:
    start, count = rows_of(rows, rank, size)
    return {f"w{t}": ((start, 0), (count, COLS)) for t in range(TENSORS)}


def state(rows: int, rank: int, size: int) -> dict[str, Any]:
    from ckptfmt import Shard

    start, count = rows_of(rows, rank, size)
    return {
        f"w{t}": Shard(block(t, start, count), (start, 0), (rows, COLS)) for t in range(TENSORS)
    }


def dp_state(rows: int) -> dict[str, Any]:
    """The data-parallel variant: every rank holds every tensor whole."""
    return {f"w{t}": block(t, 0, rows) for t in range(TENSORS)}


# --- MPI workers --------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> int:
    from ckptfmt.format.chunk_reads import record_reads
    from ckptfmt.format.options import WriteOptions
    from ckptfmt.parallel.collective.load import load_collective
    from ckptfmt.parallel.collective.save import save_collective
    from ckptfmt.plan.options import ReadOptions
    from ckptfmt.transport.mpi import MpiComm

    comm = MpiComm()
    node = f"n{comm.rank * 2 // comm.size}"
    root = Path(args.dir)
    rows = args.rows
    if args.worker == "save":
        kinds = [("c", state(rows, comm.rank, comm.size))]
        if args.dp_rows:
            kinds.append(("d", dp_state(args.dp_rows)))
        for kind, st in kinds:
            for level in (3, 1):
                where = root / f"{kind}{comm.size}" / ("l3" if level == 3 else f"l1/{node}") / STEP
                save_collective(
                    comm, st, where, step=1, node=node, write=WriteOptions(fsync=False),
                    group="shared" if level == 3 else node,
                )  # fmt: skip
        return 0
    # load: every (source, level) case, rounds interleaved with a rotating order
    # "d4b", "d4r": the checkpoint d4 loaded with replicas="bcast" / "read" (level 3 only);
    # without a suffix the default, replicas="node"
    srcs = args.sources.split(",")  # in pairs: the N-rank checkpoint, then the M-rank one
    cases = [
        (src, level)
        for a, b in zip(srcs[::2], srcs[1::2])
        for level in (3, 1)
        if not (a[-1] in "br" and level == 1)
        for src in (a, b)
    ]
    times: dict[str, list[float]] = {f"{s}-l{lv}": [] for s, lv in cases}
    read_bytes: dict[str, int] = {}
    read_ratio: dict[str, float] = {}  # the most any rank read / what it holds
    # the N-rank and the M-rank case of a comparison run back to back, each first in every
    # other round, the pairs in a rotating order: both follow the same case as often (a case
    # run after a heavy one, a broadcast say, was measurably slower on the loaded machine)
    pairs = [(cases[i], cases[i + 1]) for i in range(0, len(cases) - 1, 2)]
    if len(cases) % 2:
        pairs.append((cases[-1], cases[-1]))
    for rep in range(args.reps + 1):
        order: list[tuple[str, int]] = []
        for a, b in pairs[rep % len(pairs) :] + pairs[: rep % len(pairs)]:
            order += [a, b] if rep % 2 else [b, a]
        for src, level in dict.fromkeys(order):
            mode = {"b": "bcast", "r": "read"}.get(src[-1], "node")
            path = root / src.rstrip("br") / ("l3" if level == 3 else f"l1/{node}") / STEP
            comm.barrier()
            dp = src.startswith("d")
            my_wants = {} if dp else wants(rows, comm.rank, comm.size)
            with record_reads() as log:
                t0 = time.perf_counter()
                out, _ = load_collective(
                    comm,
                    path,
                    my_wants,
                    node=node if level == 1 else None,
                    host=node,  # the simulated node: its ranks share their reads of replicas
                    read=ReadOptions(replicas=mode),  # type: ignore[arg-type]
                )
                dt = time.perf_counter() - t0
            slowest = max(comm.allgather_json(dt))
            key = f"{src}-l{level}"
            if rep == 0:  # warm-up round: check every byte, count what was read
                start, count = (0, args.dp_rows) if dp else rows_of(rows, comm.rank, comm.size)
                ok = all(
                    np.array_equal(out[f"w{t}"].view(np.uint32),
                                   block(t, start, count).view(np.uint32))
                    for t in range(TENSORS)
                )  # fmt: skip
                if not comm.all_true(ok):
                    raise SystemExit(f"{key}: loaded data differ")
                read_bytes[key] = sum(comm.allgather_json(log.bytes))
                held = sum(a.nbytes for a in out.values())
                read_ratio[key] = max(comm.allgather_json(log.bytes / held))
            else:
                times[key].append(slowest)
            del out
    if comm.rank == 0:
        part = {"times": times, "read_bytes": read_bytes, "read_ratio": read_ratio}
        Path(args.part).write_text(json.dumps(part))
    return 0


def mpi(n: int, *args: str, timeout: int = 900) -> None:
    exe = Path(sys.executable).parent / "mpiexec"
    cmd = ["timeout", "-k", "5", str(timeout), str(exe), "-n", str(n), sys.executable,
           "-m", "mpi4py", __file__, *args]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=REPO)


# --- in-process: ckptfmt reshard ---------------------------------------------------------------


def time_reshard(root: Path, rows: int, reps: int) -> dict[str, Any]:
    import ckptfmt
    from ckptfmt.format.options import WriteOptions
    from ckptfmt.maintenance.reshard import reshard

    data_bytes = rows * COLS * 4 * TENSORS
    out = root / "out"
    cases: dict[str, Any] = {
        "reshard 4->2": lambda: reshard(
            root / "c4/l3" / STEP, out, 2, rows=["*"], write=WriteOptions(fsync=False)
        ),
        "reshard 2->4": lambda: reshard(
            root / "c2/l3" / STEP, out, 4, rows=["*"], write=WriteOptions(fsync=False)
        ),
        "reshard 4->2 (fsync)": lambda: reshard(root / "c4/l3" / STEP, out, 2, rows=["*"]),
        "load + save (one process)": lambda: ckptfmt.save(
            ckptfmt.load(root / "c4/l3" / STEP), out, write=WriteOptions(fsync=False)
        ),
        "copytree (bytes only, no checks)": lambda: shutil.copytree(root / "c4/l3" / STEP, out),
    }  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in cases}
    keys = list(cases)
    for rep in range(reps + 1):
        for key in keys[rep % len(keys) :] + keys[: rep % len(keys)]:
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.perf_counter()
            cases[key]()
            dt = time.perf_counter() - t0
            if rep:
                times[key].append(dt)
            elif key.startswith("reshard"):  # warm-up: the rewrite verifies and is bit-exact
                report = ckptfmt.verify(out)
                assert report.healthy, report.problems
                got = ckptfmt.load(out)
                for t in range(TENSORS):
                    assert np.array_equal(got[f"w{t}"].view(np.uint32),
                                          block(t, 0, rows).view(np.uint32)), key  # fmt: skip
    shutil.rmtree(out, ignore_errors=True)
    return {"times": times, "data_bytes": data_bytes}


# --- driver ---------------------------------------------------------------------------------------


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def markdown(res: dict[str, Any]) -> str:
    """Medians, with the fastest round in parentheses (the cost without interference: this
    machine is shared, and M = 4 ranks oversubscribe its 2 cores)."""
    mb = res["data_bytes"] / 1e6

    def cell(xs: list[float]) -> str:
        return f"{med(xs):.3f} s ({min(xs):.3f})"

    lines = [
        f"State: {TENSORS} float32 tensors of {res['rows']} x {COLS} ({mb:.0f} MB) in row blocks "
        f"per rank (FSDP), and {TENSORS} of {res['dp_rows']} x {COLS} held whole by every rank "
        f"(DP); /dev/shm; medians of {res['reps']} rounds (fastest in parentheses); "
        f"{res['cpus']} CPU cores; load average {res['loadavg_end'][0]:.1f} at the end.",
        "",
        "| state | load at M ranks | level | from the N-rank checkpoint | from the M-rank one "
        "| ratio (medians, fastest) |",
        "|---|---|---|---|---|---|",
    ]
    kinds = [("FSDP rows", "c", "", mb, (3, 1))]
    if res["dp_rows"]:
        dp_mb = res["dp_bytes"] / 1e6
        kinds.append(("DP whole", "d", "", dp_mb, (3, 1)))
        kinds.append(("DP whole, read", "d", "r", dp_mb, (3,)))
        kinds.append(("DP whole, bcast", "d", "b", dp_mb, (3,)))
    for label, k, suffix, size, levels in kinds:
        for m, n in ((2, 4), (4, 2)):
            part = res["load"][str(m)]
            for level in levels:
                a = part["times"][f"{k}{n}{suffix}-l{level}"]
                b = part["times"][f"{k}{m}{suffix}-l{level}"]
                lines.append(
                    f"| {label} ({size:.0f} MB) | {n}->{m} vs {m}->{m} | {level} | {cell(a)} "
                    f"| {cell(b)} | {med(a) / med(b):.2f}x, {min(a) / min(b):.2f}x |"
                )
    lines += [
        "",
        "Bytes read (first round; chunks with their CRCs and the indexes): by all ranks together,"
        " and the most one rank read against what it holds.",
        "",
        "| state | load at M ranks | level | N-rank: MB read, most per rank / held "
        "| M-rank: MB read, most per rank / held |",
        "|---|---|---|---|---|",
    ]
    for label, k, suffix, _, levels in kinds:
        for m, n in ((2, 4), (4, 2)):
            part = res["load"][str(m)]
            for level in levels:
                cells = []
                for src in (n, m):
                    key = f"{k}{src}{suffix}-l{level}"
                    ratio = part.get("read_ratio", {}).get(key)
                    tail = f", {ratio:.3f}x" if ratio is not None else ""
                    cells.append(f"{part['read_bytes'][key] / 1e6:.1f}{tail}")
                lines.append(
                    f"| {label} | {n}->{m} vs {m}->{m} | {level} | {cells[0]} | {cells[1]} |"
                )
    lines += [
        "",
        "| rewrite (one process) | median (fastest) | MB/s (median) | vs load + save |",
        "|---|---|---|---|",
    ]
    base = med(res["reshard"]["times"]["load + save (one process)"])
    for key, xs in res["reshard"]["times"].items():
        t = med(xs)
        lines.append(f"| {key} | {cell(xs)} | {mb / t:.0f} | {base / t:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=256)
    ap.add_argument("--dp-mb", type=float, default=128, help="data-parallel variant (0: none)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dir", default="/dev/shm/ckptfmt-bench-reshard")
    ap.add_argument("--out", default=str(BENCH / "results" / "reshard.json"))
    ap.add_argument("--worker", choices=["save", "load"], help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--dp-rows", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--sources", help=argparse.SUPPRESS)
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--table", metavar="JSON", help="only print the tables of a results file")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.table:
        print(markdown(json.loads(Path(args.table).read_text())))
        return 0
    if args.reps < 5:
        ap.error("--reps: at least 5 rounds")
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rows = rows_for(args.size_mb)
    dp_rows = rows_for(args.dp_mb) if args.dp_mb else 0
    common = ["--dir", str(root), "--rows", str(rows), "--dp-rows", str(dp_rows)]
    started = time.time()
    try:
        for n in (4, 2):
            mpi(n, "--worker", "save", *common)
        load: dict[str, Any] = {}
        for m, n in ((2, 4), (4, 2)):
            part = root / f"part{m}.json"
            sources = f"c{n},c{m}" + (f",d{n},d{m},d{n}r,d{m}r,d{n}b,d{m}b" if dp_rows else "")
            mpi(m, "--worker", "load", *common, "--sources", sources,
                "--reps", str(args.reps), "--part", str(part))  # fmt: skip
            load[str(m)] = json.loads(part.read_text())
        rewrite = time_reshard(root, rows, args.reps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    res = {
        "rows": rows,
        "cols": COLS,
        "tensors": TENSORS,
        "data_bytes": rows * COLS * 4 * TENSORS,
        "dp_rows": dp_rows,
        "dp_bytes": dp_rows * COLS * 4 * TENSORS,
        "reps": args.reps,
        "cpus": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
        "seconds": round(time.time() - started, 1),
        "python": platform.python_version(),
        "git_head": git.stdout.strip(),
        "load": load,
        "reshard": rewrite,
    }
    res["medians"] = {
        **{
            f"load {key} at {m}": med(v)
            for m, part in load.items()
            for key, v in part["times"].items()
        },
        **{k: med(v) for k, v in rewrite["times"].items()},
    }
    table = markdown(res)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    out.with_suffix(".md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
