#!/usr/bin/env python3
"""Level-1 write speed: a ``CheckpointManager`` level-1 save against raw writes of the same bytes,
``torch.save`` and DCP, the same run, medians.

Every rank holds its own ``--mib`` MiB (default 256) of float32 tensors of a few to tens of MiB
(``SIZES_MIB``, scaled), a ``Shard`` of a global tensor each, so that every rank writes all of
its bytes. One launch measures, per round, in an order that rotates from round to round:

* ``raw``: the same bytes as new files (``O_CREAT|O_EXCL`` + ``write``), each tensor cut into
  files of at most one shard (16 MiB), as ckptfmt lays them out; with the same writer threads
  per rank as ckptfmt (``WriteOptions.threads`` shared by the ranks of a node);
* ``prealloc``: the same files, already there at their size, overwritten with ``pwrite`` (what a
  write into a reused slot can reach);
* ``ckptfmt``: ``CheckpointManager.save(step, state, donate=True)`` with ``async_save=False``,
  ``keep_local=2``, level 1 only, default ``WriteOptions`` (fsync on, CRC32C of every chunk):
  returns once the step is committed and retention ran; the first rounds (warm-up) make the
  recycled slots exist, the timed ones are the steady state;
* ``torch_save``: ``torch.save`` of each rank's state to a file of its own;
* ``dcp``: ``torch.distributed.checkpoint.save`` with ``FileSystemWriter`` (its defaults: one
  file per rank, fsync), each rank's tensors under keys of its own.

Each method's time is the wall time of the slowest rank, between two barriers. The state's pages
are touched just before every timed window: this VM hands memory idle for about 2 s back to the
host, and touching it again costs up to 4x (bench/README.md). Outputs of the one-shot methods
are removed just before the next method runs.

    python bench/bench_level1.py                        # 1 process and 2 ranks, 9 rounds
    python bench/bench_level1.py --ranks 1 --rounds 3 --mib 32   # a smoke run

Results: ``bench/results/level1.json`` and a Markdown table (stdout, ``level1.md``).
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))

MIB = 1 << 20
SIZES_MIB = [32, 48, 16, 8, 4, 24, 40, 12, 20, 36, 16]  # 256 MiB, a few to tens of MiB each
METHODS = ["raw", "prealloc", "ckptfmt", "torch_save", "dcp"]
LABELS = {
    "raw": "(a) raw new-file write (O_CREAT|O_EXCL + write)",
    "prealloc": "(b) pwrite into preallocated files",
    "ckptfmt": "(c) ckptfmt level 1 (CheckpointManager, sync, keep=2)",
    "torch_save": "(d) torch.save, a file per rank",
    "dcp": "(e) DCP dcp.save, FileSystemWriter",
}


def sizes_for(mib: float) -> list[int]:
    """Tensor sizes in bytes summing to about ``mib`` MiB, in the proportions of SIZES_MIB."""
    scale = mib / sum(SIZES_MIB)
    return [max(1, round(m * scale * 256)) * 4096 for m in SIZES_MIB]  # rows of 1024 float32


def touch(arrays: list[np.ndarray]) -> None:
    """Write one byte of every page (the pages may have gone back to the host; bench/README.md).
    Adding 0 keeps the values: a write fault, not just a read."""
    for a in arrays:
        v = a.reshape(-1).view(np.uint8)
        v[::4096] += 0


class Rank:
    """One rank's side: its communicators, its state in the forms the methods take."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.mpi: Any = None
        if args.ranks > 1:
            from mpi4py import MPI

            from ckptfmt.transport.mpi import MpiComm

            self.mpi = MPI.COMM_WORLD
            self.comm: Any = MpiComm(self.mpi)
        else:
            from ckptfmt.transport.comm import SingleComm

            self.comm = SingleComm()
        self.rank, self.size = self.comm.rank, self.comm.size
        self.base = Path(args.dir)
        self.mine = self.base / f"r{self.rank}"
        rng = np.random.default_rng(1234 + self.rank)
        self.arrays = []
        for nbytes in sizes_for(args.mib):
            a = np.empty(nbytes // 4, np.float32)
            a.view(np.uint32)[:] = rng.integers(0, 2**32, a.size, dtype=np.uint32)
            self.arrays.append(a.reshape(-1, 1024))
        self.nbytes = sum(a.nbytes for a in self.arrays)
        self.pieces = [
            memoryview(a.reshape(-1).view(np.uint8))[i : i + 16 * MIB]
            for a in self.arrays
            for i in range(0, a.nbytes, 16 * MIB)
        ]
        self.threads = max(1, 2 // self.size)  # WriteOptions.threads = 2 per node, split
        self.step = 0
        self.mgr: Any = None
        self.pending: list[Path] = []
        self.inodes: dict[int, set[int]] = {}

    # --- collective helpers ----------------------------------------------------------------

    def barrier(self) -> None:
        if self.mpi is None:
            return
        req = self.mpi.Ibarrier()  # sleeps while waiting: MPICH's barrier spins on a core
        while not req.Test():
            time.sleep(0.0002)

    def timed(self, body: Callable[[], None]) -> float:
        """The slowest rank's wall time of ``body``, between two barriers."""
        touch(self.arrays)
        self.barrier()
        t0 = time.perf_counter()
        body()
        self.barrier()
        dt = time.perf_counter() - t0
        return max(self.comm.allgather_json(dt)) if self.size > 1 else dt

    def clear_pending(self) -> None:
        for p in self.pending:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        self.pending = []

    # --- methods ---------------------------------------------------------------------------

    def write_files(self, root: Path, prealloc: bool) -> None:
        def one(job: tuple[int, memoryview]) -> None:
            i, piece = job
            if prealloc:
                fd = os.open(root / str(i), os.O_WRONLY)
                try:
                    view = piece
                    at = 0
                    while at < len(view):
                        at += os.pwrite(fd, view[at:], at)
                finally:
                    os.close(fd)
                return
            fd = os.open(root / str(i), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = piece
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)

        jobs = list(enumerate(self.pieces))
        if self.threads > 1:
            with ThreadPoolExecutor(self.threads) as pool:
                list(pool.map(one, jobs))
        else:
            for j in jobs:
                one(j)

    def run_raw(self) -> float:
        root = self.mine / f"raw-{self.step}"
        root.mkdir(parents=True)
        self.pending.append(root)
        return self.timed(lambda: self.write_files(root, prealloc=False))

    def run_prealloc(self) -> float:
        root = self.mine / "prealloc"
        if not root.is_dir():  # made once, outside any timed window
            root.mkdir(parents=True)
            self.write_files(root, prealloc=False)
        return self.timed(lambda: self.write_files(root, prealloc=True))

    def state(self) -> dict[str, Any]:
        from ckptfmt import Shard

        out = {}
        for i, a in enumerate(self.arrays):
            rows = a.shape[0]
            out[f"t{i:02d}"] = Shard(a, (self.rank * rows, 0), (self.size * rows, a.shape[1]))
        return {"model": out}

    def run_ckptfmt(self) -> float:
        state = self.state()
        self.step += 1
        step = self.step
        dt = self.timed(lambda: self.mgr.save(step, state, donate=True))
        if self.rank == 0:  # the node's directory: which inodes the step's data files have
            where = self.mgr.local_root / f"step-{step:010d}"
            self.inodes[step] = {
                p.stat().st_ino for p in where.rglob("*") if p.is_file() and "/c/" in str(p)
            }
        return dt

    def run_torch_save(self) -> float:
        import torch

        path = self.mine / f"torch-{self.step}.pt"
        self.pending.append(path)
        state = {f"t{i:02d}": torch.from_numpy(a) for i, a in enumerate(self.arrays)}
        return self.timed(lambda: torch.save(state, path))

    def run_dcp(self) -> float:
        import torch
        import torch.distributed.checkpoint as dcp

        path = self.base / f"dcp-{self.step}"
        if self.rank == 0:
            self.pending.append(path)
        state = {f"r{self.rank}.t{i:02d}": torch.from_numpy(a) for i, a in enumerate(self.arrays)}
        writer = dcp.FileSystemWriter(str(path))
        return self.timed(lambda: dcp.save(state, storage_writer=writer))

    # --- set-up and the check ------------------------------------------------------------

    def start(self) -> None:
        from ckptfmt import CheckpointManager, ExitPolicy

        if self.rank == 0:
            shutil.rmtree(self.base, ignore_errors=True)
            self.base.mkdir(parents=True)
        self.barrier()
        self.mine.mkdir(parents=True, exist_ok=True)
        if self.size > 1:
            import torch.distributed as dist

            port = self.comm.bcast_json(_free_port() if self.rank == 0 else None)
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=self.rank,
                world_size=self.size,
            )
        self.mgr = CheckpointManager(
            local_dir=str(self.base / "level1"),
            comm=self.comm,
            node="n0",
            keep_local=2,
            async_save=False,
            on_error="raise",
            at_exit=ExitPolicy(flush=False, sigterm=False),
        )

    def check(self) -> None:
        """The newest step restores bit-exact (after the timed rounds)."""
        report = self.mgr.restore(self.state(), apply=False)
        loaded = report.state["model"]
        for i, a in enumerate(self.arrays):
            got = np.asarray(loaded[f"t{i:02d}"])
            if got.tobytes() != a.tobytes():
                raise SystemExit(f"rank {self.rank}: t{i:02d} differs after restore")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_main(args: argparse.Namespace) -> int:
    r = Rank(args)
    r.start()
    runners = {
        "raw": r.run_raw,
        "prealloc": r.run_prealloc,
        "ckptfmt": r.run_ckptfmt,
        "torch_save": r.run_torch_save,
        "dcp": r.run_dcp,
    }
    methods = [m for m in METHODS if m in args.methods]
    times: dict[str, list[float]] = {m: [] for m in methods}
    for rnd in range(args.warmup + args.rounds):
        rot = rnd % len(methods)
        for m in methods[rot:] + methods[:rot]:
            r.clear_pending()
            dt = runners[m]()
            if rnd >= args.warmup:
                times[m].append(dt)
        if r.rank == 0:
            print(
                f"# round {rnd} {'(warm-up)' if rnd < args.warmup else ''}: "
                + " ".join(f"{m}={times[m][-1]:.3f}" for m in methods if rnd >= args.warmup),
                flush=True,
            )
    r.clear_pending()
    slot_inodes = None
    if "ckptfmt" in methods:
        r.check()
        slot_inodes = reuse_seen(r)
    r.mgr.close()
    if r.rank == 0:
        Path(args.part).write_text(
            json.dumps(
                {
                    "ranks": r.size,
                    "bytes_per_rank": r.nbytes,
                    "threads_per_rank": r.threads,
                    "times": times,
                    "slot_reuse": slot_inodes,
                },
                indent=1,
            )
        )
    return 0


def reuse_seen(r: Rank) -> dict[str, int]:
    """How many ckptfmt saves wrote every data file into a file of the step three saves before
    (recycled with keep_local=2): the same inodes. Evidence that the saves wrote in place."""
    steps = sorted(r.inodes)
    reused = sum(1 for s in steps if s - 3 in r.inodes and r.inodes[s] == r.inodes[s - 3])
    return {"saves": len(steps), "into_a_slot": reused}


def git_head() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return ""


def summarize(parts: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for part in parts:
        med = {m: statistics.median(v) for m, v in part["times"].items() if v}
        gib = part["bytes_per_rank"] * part["ranks"] / (1 << 30)
        row: dict[str, Any] = {
            "ranks": part["ranks"],
            "bytes_per_rank": part["bytes_per_rank"],
            "median_s": med,
            "gib_per_s": {m: gib / t for m, t in med.items()},
            "rounds": len(next(iter(part["times"].values()))),
            "slot_reuse": part.get("slot_reuse"),
        }
        row["range_s"] = {m: [min(v), max(v)] for m, v in part["times"].items() if v}
        if "ckptfmt" in med:
            ck = part["times"]["ckptfmt"]
            row["ckptfmt_speedup"] = {
                m: med[m] / med["ckptfmt"] for m in med if m != "ckptfmt"
            }  # > 1: ckptfmt faster
            # the median of the same round's ratios: two methods timed seconds apart
            row["ckptfmt_speedup_paired"] = {
                m: statistics.median(a / b for a, b in zip(part["times"][m], ck))
                for m in med
                if m != "ckptfmt"
            }
        rows.append(row)
    return {
        "commit": git_head(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.release()}",
        "loadavg_end": os.getloadavg(),
        "dir": args.dir,
        "rows": rows,
    }


def table(summary: dict[str, Any]) -> str:
    out = [
        f"commit {summary['commit']}, {summary['when']}, {summary['machine']}, "
        f"load average at the end {summary['loadavg_end'][0]:.1f}",
        "",
        "| ranks | method | median s (min-max) | GiB/s (all ranks) | ckptfmt faster by (paired) |",
        "|---|---|---|---|---|",
    ]
    for row in summary["rows"]:
        for m, t in row["median_s"].items():
            lo, hi = row["range_s"][m]
            speed = row.get("ckptfmt_speedup", {}).get(m)
            paired = row.get("ckptfmt_speedup_paired", {}).get(m)
            out.append(
                f"| {row['ranks']} | {LABELS[m]} | {t:.3f} ({lo:.3f}-{hi:.3f}) | "
                f"{row['gib_per_s'][m]:.2f} | "
                + (f"{speed:.2f}x ({paired:.2f}x)" if speed is not None else "")
                + " |"
            )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mib", type=float, default=256, help="MiB per rank (default 256)")
    ap.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=3, help="rounds before timing (slots made)")
    ap.add_argument("--methods", type=lambda s: s.split(","), default=METHODS)
    ap.add_argument("--dir", default="/dev/shm/ckptfmt-bench-level1")
    ap.add_argument("--out", default=str(BENCH / "results" / "level1.json"))
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--part", help=argparse.SUPPRESS)  # set when running as a rank
    args = ap.parse_args(argv)
    if args.part:
        args.ranks = int(os.environ.get("BENCH_RANKS", "1"))
        return rank_main(args)
    parts = []
    venv = Path(sys.executable).parent
    for n in args.ranks:
        part = Path(args.dir + f"-part{n}.json")
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--part",
            str(part),
            "--mib",
            str(args.mib),
            "--rounds",
            str(args.rounds),
            "--warmup",
            str(args.warmup),
            "--methods",
            ",".join(args.methods),
            "--dir",
            f"{args.dir}-{n}",
        ]
        if n > 1:
            cmd = [str(venv / "mpiexec"), "-n", str(n), sys.executable, "-m", "mpi4py", *cmd[1:]]
        env = {**os.environ, "BENCH_RANKS": str(n), "OMP_NUM_THREADS": "1"}
        subprocess.run(["timeout", str(args.timeout), *cmd], check=True, env=env)
        parts.append(json.loads(part.read_text()))
        part.unlink()
        shutil.rmtree(f"{args.dir}-{n}", ignore_errors=True)
    summary = summarize(parts, args)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    md = table(summary)
    Path(args.out).with_suffix(".md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
