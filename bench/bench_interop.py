#!/usr/bin/env python3
"""Interop: ``ckptfmt export`` (a checkpoint saved by 4 ranks -> Hugging Face safetensors) against
reading it with ``ckptfmt.load`` + ``safetensors.numpy.save_file`` and against DCP's own
consolidation of a DCP checkpoint of the same state saved by 4 ranks; and ``ckptfmt import`` of
one safetensors file against a raw copy of the same bytes.

The state: ``--tensors`` 2-D float32 tensors (~``--size-gib`` GiB in all), each held by 4 ranks
in row blocks (FSDP-like, ``numpy.array_split``'s split). Set up once, untimed:

1. ckptfmt: the collective save of 4 ranks (``save_collective`` over an in-process comm whose
   ranks are threads, ``ckptfmt/transport/threads.py``), into one level-3 directory;
2. DCP, 4 real processes (``torch.multiprocessing``, gloo), each rank its row blocks as a
   ``DTensor`` sharded on dim 0: ``dcp.save`` with the default ``FileSystemWriter`` and with
   ``HuggingFaceStorageWriter(save_distributed=True)`` (every rank its own safetensors shard).

Timed, rounds interleaved (the order rotating), ``fsync`` off everywhere (tmpfs; the baselines do
not fsync), outputs removed between rounds:

- ``export``: ``ckptfmt.interop.export_safetensors`` (what ``ckptfmt export`` runs; one file);
- ``load+save_file``: ``ckptfmt.load`` then ``safetensors.numpy.save_file`` of the same tensors;
- ``dcp hf consolidate``: ``torch.distributed.checkpoint._consolidate_hf_safetensors.
  consolidate_safetensors_files`` of the HF-writer checkpoint (2 threads) -> safetensors;
- ``dcp_to_torch_save``: ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` of the
  ``FileSystemWriter`` checkpoint -> one torch.save file (DCP's other consolidation);
- ``import``: ``ckptfmt.interop.import_safetensors`` of the exported file (one 1 GiB file);
- ``copyfile``: ``shutil.copyfile`` of that file (copy_file_range/sendfile: the kernel copies);
- ``read+write``: the file read into memory and written out (``numpy.fromfile`` + ``tofile``).

Everything on ``/dev/shm``. Medians of ``--reps`` rounds after one warm-up round; the load
average is recorded per round (the machine is shared). Results: ``bench/results/interop.json``
and a Markdown table on stdout and in ``bench/results/interop.md``::

    .venv/bin/python bench/bench_interop.py                 # ~1 GiB, 5 rounds (~3 minutes)
    .venv/bin/python bench/bench_interop.py --size-gib 0.25 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO / "tests"))
RANKS = 4
COLS = 4096


def rows_of(n_rows: int, rank: int, size: int) -> tuple[int, int]:
    base, extra = divmod(n_rows, size)
    return rank * base + min(rank, extra), base + (rank < extra)


def block(t: int, rank: int, n_rows: int) -> np.ndarray:
    """Rank ``rank``'s rows of tensor ``t``: N(0, 0.02) float32 from a generator keyed by both,
    so every side (threads, DCP processes) makes the same state without the others."""
    _, count = rows_of(n_rows, rank, RANKS)
    g = np.random.default_rng([t, rank])
    return (g.standard_normal((count, COLS), dtype=np.float32) * 0.02).astype(np.float32)


def names(n: int) -> list[str]:
    return [f"layers.{t}.weight" for t in range(n)]


# --- set-up -------------------------------------------------------------------------------------


def save_ckptfmt(path: Path, n: int, n_rows: int) -> None:
    from ckptfmt import Shard
    from ckptfmt.format.options import WriteOptions
    from ckptfmt.parallel.collective.save import save_collective
    from ckptfmt.transport.threads import run_threads

    def body(comm: Any) -> None:
        model = {}
        for t, name in enumerate(names(n)):
            start, _ = rows_of(n_rows, comm.rank, RANKS)
            model[name] = Shard(block(t, comm.rank, n_rows), (start, 0), (n_rows, COLS))
        save_collective(
            comm, {"model": model}, path, step=1, node="n0",
            write=WriteOptions(fsync=False, threads=1),
        )  # fmt: skip

    run_threads(RANKS, body)


def _dcp_rank(rank: int, root: str, n: int, n_rows: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group(
        "gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=RANKS
    )
    mesh = init_device_mesh("cpu", (RANKS,))
    sd = {
        name: DTensor.from_local(
            torch.from_numpy(block(t, rank, n_rows)),
            mesh,
            [Shard(0)],
            run_check=False,
            shape=torch.Size((n_rows, COLS)),
            stride=(COLS, 1),
        )
        for t, name in enumerate(names(n))
    }
    dcp.save(sd, checkpoint_id=f"{root}/dcp_fs")
    writer = HuggingFaceStorageWriter(f"{root}/dcp_hf", save_distributed=True)
    dcp.save(sd, storage_writer=writer)
    dist.barrier()
    dist.destroy_process_group()


def save_dcp(root: Path, n: int, n_rows: int) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(
        _dcp_rank, args=(str(root), n, n_rows), nprocs=RANKS, start_method="spawn", join=True
    )


# --- the timed methods --------------------------------------------------------------------------


def m_export(ck: Path, out: Path) -> None:
    from ckptfmt import WriteOptions
    from ckptfmt.interop import export_safetensors

    export_safetensors(ck, out, write=WriteOptions(fsync=False))


def m_load_save_file(ck: Path, out: Path) -> None:
    import safetensors.numpy

    import ckptfmt

    state = ckptfmt.load(ck)
    out.mkdir()
    safetensors.numpy.save_file(state["model"], out / "model.safetensors", {"format": "pt"})


def m_dcp_hf(src: Path, out: Path, n: int) -> None:
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
    )

    out.mkdir()
    consolidate_safetensors_files(str(src), str(out), {k: 1 for k in names(n)}, num_threads=2)


def m_dcp_torch(src: Path, out: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out.mkdir()
    dcp_to_torch_save(src, out / "model.pt")


def m_import(src: Path, out: Path) -> None:
    from ckptfmt import WriteOptions
    from ckptfmt.interop import import_safetensors

    import_safetensors(src, out, write=WriteOptions(fsync=False))


def m_copyfile(src: Path, out: Path) -> None:
    out.mkdir()
    shutil.copyfile(src, out / "copy.safetensors")


def m_read_write(src: Path, out: Path) -> None:
    out.mkdir()
    np.fromfile(src, np.uint8).tofile(out / "copy.safetensors")


def cpu_s() -> float:
    """CPU seconds of this process (every thread) and its waited-for children."""
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def data_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def check(n: int, n_rows: int, files: dict[str, Path]) -> None:
    """The outputs hold the same tensors, bit for bit (first round only)."""
    from safetensors import safe_open

    for label, path in files.items():
        with safe_open(path, "numpy") as f:
            for t, name in enumerate(names(n)):
                got = f.get_tensor(name)
                for r in range(RANKS):
                    start, count = rows_of(n_rows, r, RANKS)
                    if got[start : start + count].tobytes() != block(t, r, n_rows).tobytes():
                        raise SystemExit(f"{label}: {name} rows of rank {r} differ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--root", default="/dev/shm/ckptfmt-bench-interop")
    ap.add_argument("--out", default=str(BENCH / "results" / "interop"))
    args = ap.parse_args()
    n = args.tensors
    n_rows = max(RANKS, round(args.size_gib * (1 << 30) / (n * COLS * 4) / RANKS) * RANKS)
    nbytes = n * n_rows * COLS * 4
    root = Path(args.root)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    t0 = time.perf_counter()
    save_ckptfmt(root / "ck", n, n_rows)
    save_dcp(root, n, n_rows)
    setup_s = time.perf_counter() - t0
    print(
        f"state: {n} tensors [{n_rows}, {COLS}] float32, {nbytes / 2**30:.3f} GiB; "
        f"set-up {setup_s:.1f} s",
        flush=True,
    )
    (root / "hf_src").mkdir()
    m_export(root / "ck", root / "hf_src" / "x")
    st_file = root / "hf_src" / "x" / "model.safetensors"
    methods: dict[str, Callable[[Path], None]] = {
        "export": lambda o: m_export(root / "ck", o),
        "load+save_file": lambda o: m_load_save_file(root / "ck", o),
        "dcp hf consolidate": lambda o: m_dcp_hf(root / "dcp_hf", o, n),
        "dcp_to_torch_save": lambda o: m_dcp_torch(root / "dcp_fs", o),
        "import": lambda o: m_import(st_file, o),
        "copyfile": lambda o: m_copyfile(st_file, o),
        "read+write": lambda o: m_read_write(st_file, o),
    }
    keys = list(methods)
    samples: dict[str, list[float]] = {k: [] for k in keys}
    cpu_samples: dict[str, list[float]] = {k: [] for k in keys}
    rounds = []
    for rnd in range(args.warmup + args.reps):
        order = keys[rnd % len(keys) :] + keys[: rnd % len(keys)]
        load = os.getloadavg()[0]
        times = {}
        cpus = {}
        for k in order:
            out = root / "out"
            shutil.rmtree(out, ignore_errors=True)
            c = cpu_s()
            t = time.perf_counter()
            methods[k](out)
            times[k] = time.perf_counter() - t
            cpus[k] = cpu_s() - c
            if rnd == 0 and k in ("export", "load+save_file"):
                check(n, n_rows, {k: out / "model.safetensors"})
            if rnd == 0 and k == "dcp hf consolidate":
                check(n, n_rows, {k: next(out.glob("*.safetensors"))})
            shutil.rmtree(out, ignore_errors=True)
        rounds.append(
            {"round": rnd, "warmup": rnd < args.warmup, "load1": load, "s": times, "cpu_s": cpus}
        )
        if rnd >= args.warmup:
            for k, v in times.items():
                samples[k].append(v)
                cpu_samples[k].append(cpus[k])
        print(
            f"round {rnd}{' (warm-up)' if rnd < args.warmup else ''}, load {load:.1f}: "
            + ", ".join(f"{k} {v:.3f}" for k, v in times.items()),
            flush=True,
        )
    med = {k: statistics.median(v) for k, v in samples.items()}
    cmed = {k: statistics.median(v) for k, v in cpu_samples.items()}
    gb = nbytes / 1e9
    loads = [r["load1"] for r in rounds]
    rows = [
        ("export", "ckptfmt export (streaming, CRC-checked)", "load+save_file"),
        ("load+save_file", "ckptfmt.load + safetensors.numpy.save_file", "load+save_file"),
        ("dcp hf consolidate", "DCP: HF sharded safetensors -> consolidate", "load+save_file"),
        ("dcp_to_torch_save", "DCP: dcp_to_torch_save (torch.save file)", "load+save_file"),
        ("import", "ckptfmt import (one safetensors file)", "copyfile"),
        ("copyfile", "raw copy: shutil.copyfile", "copyfile"),
        ("read+write", "raw copy: read into memory + write", "copyfile"),
    ]
    lines = [
        f"{n} float32 tensors [{n_rows}, {COLS}] in row blocks of {RANKS} ranks, "
        f"{nbytes / 2**30:.3f} GiB, /dev/shm, medians of {args.reps} rounds "
        f"(load average {min(loads):.1f}-{max(loads):.1f})",
        "",
        "| method | median s | GB/s | speed vs baseline | CPU s (median) |",
        "|---|---|---|---|---|",
    ]
    for k, label, base in rows:
        lines.append(
            f"| {label} | {med[k]:.3f} | {gb / med[k]:.2f} | {med[base] / med[k]:.2f}x of "
            f"`{base}` | {cmed[k]:.3f} |"
        )
    lines += [
        "",
        f"export vs load+save_file: {med['load+save_file'] / med['export']:.2f}x (target >= 0.9x); "
        f"vs DCP HF consolidation: {med['dcp hf consolidate'] / med['export']:.2f}x, "
        f"vs dcp_to_torch_save: {med['dcp_to_torch_save'] / med['export']:.2f}x (target > 1x)",
        f"import vs copyfile: {med['copyfile'] / med['import']:.2f}x, vs read+write: "
        f"{med['read+write'] / med['import']:.2f}x (target >= 0.8x)",
    ]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text + "\n")
    git = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    import safetensors
    import torch

    doc = {
        "tensors": n,
        "shape": [n_rows, COLS],
        "bytes": nbytes,
        "ranks": RANKS,
        "reps": args.reps,
        "medians_s": med,
        "cpu_medians_s": cmed,
        "cpu_samples_s": cpu_samples,
        "samples_s": samples,
        "rounds": rounds,
        "setup_s": setup_s,
        "git": git,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "cpus": os.cpu_count(),
    }
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
