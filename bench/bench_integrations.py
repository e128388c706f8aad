#!/usr/bin/env python3
"""Framework integrations, same state, same run: ``torch.distributed.checkpoint`` through
ckptfmt's storage plugin (``ckptfmt_torch.dcp.Writer``/``Reader``) against DCP's own
``FileSystemWriter``/``FileSystemReader``.

The state is a data-parallel replica (``--size-mib`` of float32 in ``--tensors`` tensors, the
same on every rank, as DDP holds it, plus an int step) on ``--ranks`` ranks over gloo. For each
``--dir`` (by default tmpfs and the local disk), each round runs both methods, the order
alternating: ``dcp.save(state, storage_writer=...)`` into a fresh directory, then
``dcp.load(state, storage_reader=...)`` in place. Each call is timed whole on every rank, from a
barrier to its return, with the buffers touched just before (the state's pages, and as many
free pages as the state holds: this VM returns memory idle for about 2 s to its host, and
touching it again costs up to 4x). The first ``--warmup`` rounds are not timed and check the
load bit for bit (the state zeroed first). A round's time is its slowest rank's; the table
gives the medians. DCP deduplicates the replicated tensors (each written by one rank), ckptfmt
spreads them evenly over the ranks: both write the state once.

Run it as ``.venv/bin/python bench/bench_integrations.py`` (it launches itself under
``torchrun``); ``--framework lightning`` and ``--framework hf`` run the Lightning and Hugging Face
Trainer measurements instead (``integrations_lightning.py``, ``integrations_hf.py``). DCP's
results go to ``bench/results/integrations.json`` (every rank's every sample) and a Markdown
table to stdout and ``bench/results/integrations.md``. See bench/README.md
(``bench_integrations.py``).
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
from functools import partial
from pathlib import Path
from typing import Any

from torchrun_self import WARM_MALLOC, launch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
DEFAULT_DIRS = ("/dev/shm/ckptfmt-bench-integrations", "/tmp/ckptfmt-bench-integrations")
"""tmpfs, and the local disk (``/tmp`` is not tmpfs on the development machine: check ``df``)."""
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
    nbytes = sum(t.numel() * 4 for t in state["model"].values())

    def writer(key: str, path: Path) -> Any:
        return Writer(path) if key == "dcp_ckptfmt" else dcp.FileSystemWriter(path)

    def reader(key: str, path: Path) -> Any:
        return Reader(path) if key == "dcp_ckptfmt" else dcp.FileSystemReader(path)

    def timed(call: Any) -> float:
        """The call's wall time on this rank, the buffers touched first (the state, and as
        many free pages as the state holds: the page cache and the reads' buffers are made
        from them), then a barrier so every rank starts together."""
        _touch(state, nbytes)
        dist.barrier()
        t0 = time.perf_counter()
        call()
        return time.perf_counter() - t0

    # samples[dir][method][op]: per round, every rank's seconds
    samples: dict[str, dict[str, dict[str, list[list[float]]]]] = {}
    for where in args.dir:
        root = Path(where)
        got = samples[where] = {k: {"save": [], "load": []} for k in METHODS}
        for rnd in range(args.warmup + args.reps):
            warm = rnd < args.warmup
            order = list(METHODS) if rnd % 2 == 0 else list(reversed(METHODS))
            for key in order:
                path = root / f"{key}-{rnd}"
                save_s = timed(partial(dcp.save, state, storage_writer=writer(key, path)))
                dist.barrier()
                if warm:
                    for t in state["model"].values():
                        t.zero_()
                    state["step"] = 0
                load_s = timed(partial(dcp.load, state, storage_reader=reader(key, path)))
                dist.barrier()
                if warm and _digest(state) != digest:
                    raise SystemExit(f"{key}: the load is not bit for bit the saved state")
                every: list[Any] = [None] * size
                dist.all_gather_object(every, (save_s, load_s))
                if not warm:
                    got[key]["save"].append([s for s, _ in every])
                    got[key]["load"].append([x for _, x in every])
                if rank == 0:
                    shutil.rmtree(path)
                dist.barrier()
    if rank == 0:
        part = {"ranks": size, "nbytes": nbytes, "tensors": args.tensors, "samples": samples}
        Path(args.part).write_text(json.dumps(part))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _touch(state: dict[str, Any], nbytes: int) -> None:
    """Touch what the timed call is about to use: the state's pages, and ``nbytes`` of fresh
    anonymous memory, unmapped again at once, so the free pages the kernel hands the call
    (its files' page cache, its buffers) are ones this VM has not returned to the host (it does
    after about 2 s idle, and touching them again costs up to 4x: bench/README.md, "Memory")."""
    import mmap

    import numpy as np

    for t in state["model"].values():
        float(t.view(-1)[::1024].sum())
    scratch = mmap.mmap(-1, nbytes)
    np.frombuffer(scratch, np.uint8)[:: mmap.PAGESIZE] = 1
    scratch.close()


def _digest(state: dict[str, Any]) -> str:
    h = hashlib.sha256(str(state["step"]).encode())
    for k, t in state["model"].items():
        h.update(k.encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def _is_tmpfs(path: str) -> bool:
    """Whether ``path`` is on tmpfs (``/proc/mounts``: the longest mount point above it)."""
    best, kind = "", ""
    real = os.path.realpath(path)
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, fs = line.split()[:3]
            if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) > len(
                best
            ):
                best, kind = mount, fs
    return kind == "tmpfs"


def report(part: dict[str, Any], args: argparse.Namespace, wall: float) -> dict[str, Any]:
    import torch

    import ckptfmt

    gb = part["nbytes"] / 1e9
    lines = [
        f"state {part['nbytes'] / 1e6:.0f} MB float32 ({part['tensors']} tensors, replicated) "
        f"on {part['ranks']} ranks (torchrun, gloo); each call timed on every rank, buffers "
        f"touched first; medians of {args.reps} rounds, the order alternating, of the slowest "
        "rank's time (every rank's median in brackets)",
        "",
        "| storage | method | dcp.save | dcp.load |",
        "|---|---|---|---|",
    ]
    med: dict[str, dict[str, dict[str, float]]] = {}
    ratio: dict[str, dict[str, float]] = {}
    for where, by_method in part["samples"].items():
        kind = "tmpfs" if _is_tmpfs(where) else "disk"
        med[where] = {}
        for key, label in METHODS.items():
            s = by_method[key]
            med[where][key] = {op: statistics.median(max(r) for r in s[op]) for op in s}
            cells = []
            for op in ("save", "load"):
                ranks = [statistics.median(r[q] for r in s[op]) for q in range(part["ranks"])]
                m = med[where][key][op]
                shown = " / ".join(f"{x:.3f}" for x in ranks)
                cells.append(f"{m:.3f} s ({gb / m:.2f} GB/s) [{shown}]")
            lines.append(f"| {kind} `{where}` | {label} | {cells[0]} | {cells[1]} |")
        fs, ck = med[where]["dcp_fs"], med[where]["dcp_ckptfmt"]
        ratio[where] = {op: fs[op] / ck[op] for op in ("save", "load")}
        lines.append(
            f"| {kind} | ckptfmt plugin speed-up | **{ratio[where]['save']:.2f}x** | "
            f"**{ratio[where]['load']:.2f}x** |"
        )
    md = "\n".join(lines)
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
    ap.add_argument(
        "--dir",
        action="append",
        help="where to save, repeatable (default: /dev/shm/ckptfmt-bench-integrations and, on "
        "disk, /tmp/ckptfmt-bench-integrations)",
    )
    ap.add_argument("--out", default=str(BENCH / "results" / "integrations.json"))
    ap.add_argument("--timeout", type=int, default=900, help="seconds for the whole launch")
    ap.add_argument("--part", help=argparse.SUPPRESS)  # set when running as a rank
    args = ap.parse_args(argv)
    args.dir = args.dir or list(DEFAULT_DIRS)
    if "RANK" in os.environ:  # a rank under torchrun
        return rank_main(args)
    for where in args.dir:
        shutil.rmtree(where, ignore_errors=True)
        Path(where).mkdir(parents=True)
    data, wall, load_start = launch(
        __file__,
        argv,
        args.ranks,
        args.timeout,
        Path(args.dir[0] + ".part.json"),
        {**WARM_MALLOC, "OMP_NUM_THREADS": "1"},
    )
    if data is None:
        return 1
    result = report(data, args, wall)
    result["loadavg_start"] = load_start
    for where in args.dir:
        shutil.rmtree(where, ignore_errors=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"# written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
