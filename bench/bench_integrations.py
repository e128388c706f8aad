#!/usr/bin/env python3
"""Framework integrations, same state, same run: ``torch.distributed.checkpoint`` through
ckptfmt's storage plugin (``ckptfmt_torch.dcp.Writer``/``Reader``) against DCP's own
``FileSystemWriter``/``FileSystemReader``.

The state is a data-parallel replica (``--size-mib`` of float32 in ``--tensors`` tensors, the
same on every rank, as DDP holds it, plus an int step) on ``--ranks`` ranks over gloo. Each round
runs both methods, the order alternating: ``dcp.save(state, storage_writer=...)`` into a fresh
directory, then ``dcp.load(state, storage_reader=...)`` in place, each between barriers and timed
on rank 0. The first ``--warmup`` rounds are not timed and check the load bit for bit (the state
zeroed first). DCP deduplicates the replicated tensors (each written by one rank), ckptfmt
spreads them evenly over the ranks: both write the state once.

Run it as ``.venv/bin/python bench/bench_integrations.py`` (it launches itself under
``torchrun``); ``--framework lightning`` and ``--framework hf`` run the Lightning and Hugging Face
Trainer measurements instead (``integrations_lightning.py``, ``integrations_hf.py``). DCP's
results go to ``bench/results/integrations.json`` and a Markdown table to stdout and
``bench/results/integrations.md``. See bench/README.md (``bench_integrations.py``).
"""

from __future__ import annotations

import argparse
import hashlib
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

from torchrun_self import WARM_MALLOC, launch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
METHODS = {
    "dcp_fs": "DCP FileSystemWriter / FileSystemReader",
    "dcp_ckptfmt": "DCP with ckptfmt_torch.dcp.Writer / Reader",
}


def rank_main(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from ckptfmt_torch.dcp import Reader, Writer

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    numel = args.size_mib * (1 << 20) // 4 // args.tensors
    state: dict[str, Any] = {
        "model": {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(args.tensors)},
        "step": 100,
    }
    digest = _digest(state)
    root = Path(args.dir)

    def writer(key: str, path: Path) -> Any:
        return Writer(path) if key == "dcp_ckptfmt" else dcp.FileSystemWriter(path)

    def reader(key: str, path: Path) -> Any:
        return Reader(path) if key == "dcp_ckptfmt" else dcp.FileSystemReader(path)

    samples: dict[str, dict[str, list[float]]] = {k: {"save": [], "load": []} for k in METHODS}
    for rnd in range(args.warmup + args.reps):
        timed = rnd >= args.warmup
        order = list(METHODS) if rnd % 2 == 0 else list(reversed(METHODS))
        for key in order:
            path = root / f"{key}-{rnd}"
            dist.barrier()
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=writer(key, path))
            dist.barrier()
            t1 = time.perf_counter()
            if not timed:
                for t in state["model"].values():
                    t.zero_()
                state["step"] = 0
            dist.barrier()
            t2 = time.perf_counter()
            dcp.load(state, storage_reader=reader(key, path))
            dist.barrier()
            t3 = time.perf_counter()
            if not timed and _digest(state) != digest:
                raise SystemExit(f"{key}: the load is not bit for bit the saved state")
            if timed:
                samples[key]["save"].append(t1 - t0)
                samples[key]["load"].append(t3 - t2)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path)
    if rank == 0:
        nbytes = sum(t.numel() * 4 for t in state["model"].values())
        part = {"ranks": size, "nbytes": nbytes, "tensors": args.tensors, "samples": samples}
        Path(args.part).write_text(json.dumps(part))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _digest(state: dict[str, Any]) -> str:
    h = hashlib.sha256(str(state["step"]).encode())
    for k, t in state["model"].items():
        h.update(k.encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def report(part: dict[str, Any], args: argparse.Namespace, wall: float) -> dict[str, Any]:
    import torch

    import ckptfmt

    gb = part["nbytes"] / 1e9
    rows = []
    med: dict[str, dict[str, float]] = {}
    for key, label in METHODS.items():
        s = part["samples"][key]
        med[key] = {op: statistics.median(s[op]) for op in ("save", "load")}
        rows.append(
            f"| {label} | {med[key]['save']:.3f} s ({gb / med[key]['save']:.2f} GB/s) | "
            f"{med[key]['load']:.3f} s ({gb / med[key]['load']:.2f} GB/s) |"
        )
    ratio = {op: med["dcp_fs"][op] / med["dcp_ckptfmt"][op] for op in ("save", "load")}
    md = "\n".join(
        [
            f"state {part['nbytes'] / 1e6:.0f} MB float32 ({part['tensors']} tensors, replicated) "
            f"on {part['ranks']} ranks (torchrun, gloo), {args.dir}; medians of {args.reps} "
            "interleaved rounds",
            "",
            "| method | dcp.save | dcp.load |",
            "|---|---|---|",
            *rows,
            f"| ckptfmt plugin speed-up | {ratio['save']:.2f}x | {ratio['load']:.2f}x |",
        ]
    )
    print(md)
    (Path(args.out).with_suffix(".md")).write_text(md + "\n")
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return {
        "bench": "integrations",
        "part": part,
        "median_s": med,
        "speedup_vs_filesystem": ratio,
        "args": {k: v for k, v in vars(args).items() if k != "part"},
        "wall_s": wall,
        "versions": {"ckptfmt": ckptfmt.__version__, "torch": torch.__version__},
        "python": platform.python_version(),
        "git": git.stdout.strip(),
        "loadavg_end": os.getloadavg(),
    }


FRAMEWORKS = ("dcp", "lightning", "hf")
"""``--framework``: DCP's plugin (this module), Lightning's CheckpointIO
(``integrations_lightning.py``) or the Hugging Face Trainer (``integrations_hf.py``); each of the
other two takes its own flags (``--framework lightning --help``)."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pick = argparse.ArgumentParser(add_help=False)
    pick.add_argument("--framework", choices=FRAMEWORKS, default="dcp")
    chosen, rest = pick.parse_known_args(argv)
    if chosen.framework == "lightning":
        import integrations_lightning

        return integrations_lightning.main(rest)
    if chosen.framework == "hf":
        import integrations_hf

        return integrations_hf.main(rest)
    return main_dcp(rest)


def main_dcp(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-mib", type=int, default=256, help="state size (default 256 MiB)")
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7, help="timed rounds (default 7)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--dir", default="/dev/shm/ckptfmt-bench-integrations")
    ap.add_argument("--out", default=str(BENCH / "results" / "integrations.json"))
    ap.add_argument("--timeout", type=int, default=900, help="seconds for the whole launch")
    ap.add_argument("--part", help=argparse.SUPPRESS)  # set when running as a rank
    args = ap.parse_args(argv)
    if "RANK" in os.environ:  # a rank under torchrun
        return rank_main(args)
    shutil.rmtree(args.dir, ignore_errors=True)
    Path(args.dir).mkdir(parents=True)
    data, wall, load_start = launch(
        __file__,
        argv,
        args.ranks,
        args.timeout,
        Path(args.dir + ".part.json"),
        {**WARM_MALLOC, "OMP_NUM_THREADS": "1"},
    )
    if data is None:
        return 1
    result = report(data, args, wall)
    result["loadavg_start"] = load_start
    shutil.rmtree(args.dir, ignore_errors=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"# written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
