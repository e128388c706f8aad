"""``dcp.save`` with ckptfmt's ``Writer`` on the code of two commits, in alternating launches: the
seconds of a save and the ``torch.distributed`` collectives it makes (DCP's own plus the
writer's), with DCP's ``FileSystemWriter`` in the same launch for reference.

Two ranks (``torchrun``, gloo, CPU) hold ~32 MiB each: 16 MiB of replicated tensors (data
parallel: the plan splits their writes) and 16 MiB of DTensors sharded on dim 0 (each rank its
half); a tmpfs, fsync off. Each launch saves ``--saves`` times with each writer (the first of each
untimed), from a barrier to a barrier (rank 0's clock). The code is chosen by ``PYTHONPATH`` (a
git worktree of each commit), as ``bench_boundary.py`` does.

    python bench/bench_dcp_plan.py run --before ../wt-before --after ../wt-after
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
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
COLLECTIVES = (
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
)


def launch(args: argparse.Namespace) -> None:
    """One launch (every rank, under torchrun): the timed saves of both writers."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from ckptfmt_torch.dcp import Writer
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import ckptfmt
    from ckptfmt import WriteOptions

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(1)
    state = {
        "ddp": {f"l{i}.w": torch.randn(256, 1024, generator=g) for i in range(16)},
        "tp": {
            f"t{i}": distribute_tensor(torch.randn(512, 1024, generator=g), mesh, [Shard(0)])
            for i in range(8)
        },
        "step": 3,
        "meta": {"betas": (0.9, 0.99)},
    }
    counts: Counter[str] = Counter()
    real = {n: getattr(dist, n) for n in COLLECTIVES}

    def counted(name: str) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            counts[name] += 1
            return real[name](*a, **k)

        return call

    root = Path(args.dir)
    out: dict[str, Any] = {"code": ckptfmt.__file__}
    for kind in ("ckptfmt", "filesystem"):
        times, per_save = [], []
        for i in range(args.saves):
            path = root / f"{kind}-{i % 2}"
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            if kind == "ckptfmt":
                writer: Any = Writer(path, write=WriteOptions(fsync=False, overwrite=True))
            else:
                writer = FileSystemWriter(path, sync_files=False, overwrite=True)
            dist.barrier()
            counts.clear()
            for n in COLLECTIVES:
                setattr(dist, n, counted(n))
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=writer)
            for n, f in real.items():
                setattr(dist, n, f)
            dist.barrier()
            if i:
                times.append(time.perf_counter() - t0)
            per_save.append(sum(counts.values()))
        out[kind] = {
            "median_s": statistics.median(times),
            "samples": times,
            "collectives": per_save,
        }
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> None:
    """Alternate launches before/after; combine each version's launch medians; write results."""
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
    tmp = Path(args.dir).parent / "bench_dcp_plan_out"
    tmp.mkdir(parents=True, exist_ok=True)
    for i in range(args.launches):
        for v, p in versions.items():
            out = tmp / f"{v}-{i}.json"
            env = dict(os.environ, PYTHONPATH=f"{p}:{p}/adapters:{p}/tools", OMP_NUM_THREADS="1")
            cmd = ["timeout", str(args.timeout), sys.executable, "-m", "torch.distributed.run"]
            cmd += ["--standalone", "--nproc-per-node", "2", str(Path(__file__).resolve())]
            cmd += ["launch", "--out", str(out), "--dir", args.dir, "--saves", str(args.saves)]
            subprocess.run(cmd, env=env, cwd="/tmp", check=True, capture_output=True)
            res = json.loads(out.read_text())
            assert res["code"].startswith(str(p)), res["code"]
            launches[v].append(res)
            print(f"launch {i} {v}: ckptfmt {res['ckptfmt']['median_s']:.4f} s", flush=True)
    rows = {}
    for v in versions:
        for kind in ("ckptfmt", "filesystem"):
            meds = [la[kind]["median_s"] for la in launches[v]]
            seen = sorted({c for la in launches[v] for c in la[kind]["collectives"]})
            rows[(v, kind)] = {
                "median_s": statistics.median(meds),
                "launch_medians": meds,
                "collectives_per_save": seen,
            }
    result = {
        "commits": commits,
        "setup": f"2 ranks (torchrun, gloo, CPU), ~32 MiB each (16 MiB replicated, 16 MiB DTensor "
        f"shards), tmpfs, fsync off; {args.launches} launches per version alternating, "
        f"{args.saves - 1} timed saves each",
        "rows": {f"{v}/{k}": r for (v, k), r in rows.items()},
        "ratio_ckptfmt_after_before": rows[("after", "ckptfmt")]["median_s"]
        / rows[("before", "ckptfmt")]["median_s"],
    }
    (HERE / "results" / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# dcp.save with ckptfmt's Writer, before ({commits['before']}) and after "
        f"({commits['after']})",
        "",
        result["setup"] + "; median of the launch medians (a shared, noisy machine).",
        "",
        "| version | writer | median s | launch medians | torch.distributed collectives/save |",
        "|---|---|---|---|---|",
    ]
    for (v, k), r in rows.items():
        meds = " ".join(f"{m:.4f}" for m in r["launch_medians"])
        lines.append(f"| {v} | {k} | {r['median_s']:.4f} | {meds} | {r['collectives_per_save']} |")
    lines += ["", f"ckptfmt Writer after/before: {result['ratio_ckptfmt_after_before']:.2f}"]
    (HERE / "results" / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    la = sub.add_parser("launch")
    la.add_argument("--out", required=True)
    ru = sub.add_parser("run")
    ru.add_argument("--before", required=True, help="worktree of the old commit")
    ru.add_argument("--after", required=True, help="worktree of the new commit")
    ru.add_argument("--launches", type=int, default=3, help="launches per version")
    ru.add_argument("--timeout", type=int, default=300, help="seconds per launch")
    ru.add_argument("--name", default="dcp_plan", help="results file stem in bench/results")
    for p in (la, ru):
        p.add_argument("--dir", default="/dev/shm/ckptfmt-bench-dcp-plan/root")
        p.add_argument("--saves", type=int, default=8)
    args = ap.parse_args()
    launch(args) if args.cmd == "launch" else run(args)


if __name__ == "__main__":
    main()
