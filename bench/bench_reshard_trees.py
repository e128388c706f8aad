"""``ckptfmt reshard`` on a directory, two code trees in the same run (medians): ``before`` (a
tree given with ``--before``, e.g. ``git worktree add /tmp/before <commit>``) and ``after`` (this
tree). The source, saved once by 4 thread-ranks with this tree (``--mb`` MB of float32 tensors
held in row blocks), is rewritten for 2 ranks (rows split, fsync off) into ``--dir``; each tree
runs in its own process per round (the order alternating), timing ``--reps`` reshards after one
untimed one that is verified bit for bit: the wall time, and the process's CPU time (user +
system, every thread; steadier than the wall time on a shared machine).

    python bench/bench_reshard_trees.py --before /tmp/before [--mb 128] [--rounds 4] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TENSORS, COLS = 4, 4096


def full(rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {f"w{t}": rng.standard_normal((rows, COLS), dtype=np.float32) for t in range(TENSORS)}


def make_source(src: Path, rows: int) -> None:
    from ckptfmt import Shard, WriteOptions
    from ckptfmt.parallel.collective.save import save_collective
    from ckptfmt.transport.threads import run_threads

    whole = full(rows)

    def rank(comm: Any) -> None:
        per = rows // comm.size
        state = {
            k: Shard(v[comm.rank * per : (comm.rank + 1) * per], (comm.rank * per, 0), v.shape)
            for k, v in whole.items()
        }
        save_collective(comm, state, src, step=1, node="n0", write=WriteOptions(fsync=False))

    run_threads(4, rank)


def one(args: argparse.Namespace) -> None:
    """One tree's reshards (this process imports the tree on ``PYTHONPATH``)."""
    import ckptfmt
    from ckptfmt.format.options import WriteOptions
    from ckptfmt.maintenance.reshard import reshard

    src, out = Path(args.src), Path(args.out)
    times, cpus = [], []
    for i in range(args.reps + 1):
        shutil.rmtree(out, ignore_errors=True)
        t0, c0 = time.perf_counter(), time.process_time()
        reshard(src, out, 2, rows=["*"], write=WriteOptions(fsync=False))
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        if i:
            times.append(dt)
            cpus.append(cpu)
        else:
            got = ckptfmt.load(out)
            for k, v in full(args.rows).items():
                assert got[k].tobytes() == v.tobytes(), k
    shutil.rmtree(out, ignore_errors=True)
    doc = {"times": times, "cpu": cpus, "module": ckptfmt.__file__}
    Path(args.part).write_text(json.dumps(doc))


def run(args: argparse.Namespace) -> None:
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rows = max(4, round(args.mb * 1e6 / (TENSORS * COLS * 4) / 4) * 4)
    src = root / "src"
    make_source(src, rows)
    trees = {"before": Path(args.before).resolve(), "after": REPO}
    got: dict[str, list[float]] = {k: [] for k in trees}
    cpu: dict[str, list[float]] = {k: [] for k in trees}
    part = root / "part.json"
    for rnd in range(args.rounds):
        for name in list(trees) if rnd % 2 == 0 else list(reversed(trees)):
            cmd = [sys.executable, __file__, "one", "--src", str(src), "--out", str(root / "out")]
            cmd += ["--reps", str(args.reps), "--rows", str(rows), "--part", str(part)]
            env = {**os.environ, "PYTHONPATH": str(trees[name])}
            subprocess.run(["timeout", "900", *cmd], env=env, check=True, cwd=trees[name])
            doc = json.loads(part.read_text())
            assert doc["module"].startswith(str(trees[name])), (name, doc["module"])
            got[name] += doc["times"]
            cpu[name] += doc["cpu"]
    shutil.rmtree(root, ignore_errors=True)
    mb = rows * COLS * 4 * TENSORS / 1e6
    print(f"reshard 4 -> 2 ranks (rows split, fsync off), {mb:.0f} MB on {args.dir}, medians:")
    for name, times in got.items():
        med, c = statistics.median(times), statistics.median(cpu[name])
        print(
            f"  {name:7s} {med:7.3f} s  {mb / med:7.1f} MB/s  CPU {c:6.3f} s  "
            f"({len(times)} samples)"
        )
    ratio = statistics.median(got["after"]) / statistics.median(got["before"])
    c_ratio = statistics.median(cpu["after"]) / statistics.median(cpu["before"])
    print(f"  after/before ratio: time {ratio:.3f}, CPU {c_ratio:.3f}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", nargs="?", default="run", choices=["run", "one"])
    p.add_argument("--before", default="")
    p.add_argument("--mb", type=float, default=128)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default="/dev/shm/ckptfmt-bench-reshard-trees")
    p.add_argument("--src", default="")
    p.add_argument("--out", default="")
    p.add_argument("--rows", type=int, default=0)
    p.add_argument("--part", default="")
    args = p.parse_args()
    (run if args.mode == "run" else one)(args)


if __name__ == "__main__":
    main()
