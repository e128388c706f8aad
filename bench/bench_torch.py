#!/usr/bin/env python3
"""PyTorch checkpointing, same model, same world size, same run: ckptfmt_torch against
``torch.save`` on rank 0 and ``torch.distributed.checkpoint`` (DCP).

A GPT-like model (float32 parameters and AdamW state, ~250 MB by default) trained data-parallel
(DDP) on 2 ranks over gloo; the state is ``get_state_dict(model, optimizer)``, the same dict for
every method. Each round runs every method once, the order rotating by one each round:

* save: ``ckptfmt_torch.save`` (collective; each rank writes its share), ``torch.save`` on rank
  0 (the others wait), ``dcp.save``;
* training-loop blocked time of an asynchronous save: ``CheckpointManager.save`` of
  ``ckptfmt_torch.to_state(sd)`` against ``dcp.async_save`` (its default thread mode), with a
  plain copy of the state into pre-touched buffers as the floor; the rest of each save is waited
  for outside the timed region (and reported);
* load (in place into the same state dict): ``ckptfmt_torch.load``, ``torch.load`` on every
  rank + copy into the tensors, ``dcp.load``.

Run it as ``.venv/bin/python bench/bench_torch.py`` (it launches itself under ``torchrun`` with 2
ranks, under ``timeout``); results go to ``bench/results/torch.json`` and a Markdown table to
stdout. See bench/README.md (``bench_torch.py``).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchrun_self import WARM_MALLOC, launch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent

METHODS = {  # key -> (kind, label)
    "save_ckptfmt": ("save", "ckptfmt_torch.save (every rank its share)"),
    "save_torch": ("save", "torch.save on rank 0"),
    "save_dcp": ("save", "torch.distributed.checkpoint.save"),
    "async_ckptfmt": ("async", "CheckpointManager.save (async)"),
    "async_dcp": ("async", "dcp.async_save (thread)"),
    "memcpy": ("async", "memcpy of the state (floor)"),
    "load_ckptfmt": ("load", "ckptfmt_torch.load (in place)"),
    "load_ckptfmt_alone": ("load", "ckptfmt_torch.load, each rank alone (comm=SingleComm())"),
    "load_torch": ("load", "torch.load on every rank + copy in"),
    "load_dcp": ("load", "torch.distributed.checkpoint.load (in place)"),
}


# --- the model --------------------------------------------------------------------------------


def gpt(d: int, layers: int, vocab: int, ctx: int) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, max(1, d // 64), batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.ln_1(x)
            mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
            self.h = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for block in self.h:
                x = block(x)
            return self.head(self.ln_f(x))

    return GPT()


def tensors_of(tree: Any, prefix: str = "") -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    for k, v in tree.items():
        name = f"{prefix}/{k}"
        if isinstance(v, torch.Tensor):
            out[name] = v
        elif isinstance(v, dict):
            out.update(tensors_of(v, name))
    return out


def digest(sd: Any) -> str:
    import ckptfmt_torch

    h = hashlib.sha256()
    for name, t in sorted(tensors_of(sd).items()):
        h.update(name.encode())
        h.update(ckptfmt_torch.tensor_to_numpy(t).tobytes())
    return h.hexdigest()


def copy_in(sd: Any, loaded: Any) -> None:
    """torch.load's result copied into the live tensors (what load_state_dict does)."""
    import torch

    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            with torch.no_grad():
                v.copy_(loaded[k])
        elif isinstance(v, dict):
            copy_in(v, loaded[k])


# --- one rank ---------------------------------------------------------------------------------


def rank_main(args: argparse.Namespace) -> int:
    import ckptfmt_torch
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ckptfmt import CheckpointManager, ExitPolicy, SingleComm

    dist.init_process_group("gloo")
    comm = ckptfmt_torch.TorchComm()
    dcp_bg = dist.new_group(backend="gloo")  # DCP's async save talks on a group of its own
    rank, size = comm.rank, comm.size
    node = f"n{rank * 2 // size}"
    base = Path(args.dir)
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
    dist.barrier()

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(gpt(args.width, args.layers, args.vocab, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, args.vocab, (2, 32), generator=torch.Generator().manual_seed(rank))
    logits = model(idx)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    flat = tensors_of(sd)
    nbytes = sum(t.numel() * t.element_size() for t in flat.values())
    want = digest(sd)
    copy_buf = {k: torch.empty_like(t) for k, t in flat.items()}
    mgr = CheckpointManager(
        local_dir=base / "{node}" / "mgr",
        comm=comm,
        node=node,
        flush_every=10**9,
        keep_local=1,
        on_error="raise",
        at_exit=ExitPolicy(flush=False, sigterm=False),
    )
    if rank == 0:
        print(
            f"# ranks={size} d={args.width} layers={args.layers} vocab={args.vocab} "
            f"tensors={len(flat)} bytes={nbytes} ({nbytes / 1e6:.0f} MB) per rank",
            flush=True,
        )

    def timed(body: Callable[[], Any]) -> tuple[float, Any]:
        dist.barrier()
        t0 = time.perf_counter()
        out = body()
        dist.barrier()
        return time.perf_counter() - t0, out

    def scramble() -> None:  # so that a load that did nothing cannot pass the check
        with torch.no_grad():
            for t in flat.values():
                t.zero_()

    outputs: dict[str, Path] = {}

    def run(key: str, rnd: int) -> dict[str, float]:
        ck, pt, dc = base / f"ck-{rnd}", base / f"torch-{rnd}.pt", base / f"dcp-{rnd}"
        if key == "save_ckptfmt":
            dt, _ = timed(lambda: ckptfmt_torch.save(sd, ck, comm=comm, step=rnd))
            outputs["ck"] = ck
        elif key == "save_torch":
            dt, _ = timed(lambda: torch.save(sd, pt) if rank == 0 else None)
            outputs["pt"] = pt
        elif key == "save_dcp":
            dt, _ = timed(lambda: dcp.save(sd, checkpoint_id=dc))
            outputs["dcp"] = dc
        elif key == "async_ckptfmt":
            dist.barrier()
            t0 = time.perf_counter()
            mgr.save(1000 + rnd, ckptfmt_torch.to_state(sd))
            dt = time.perf_counter() - t0
            mgr.wait()  # the training loop would compute meanwhile
            total = time.perf_counter() - t0
            dist.barrier()
            return {"s": dt, "total_s": total}
        elif key == "async_dcp":
            dist.barrier()
            t0 = time.perf_counter()
            fut = dcp.async_save(sd, checkpoint_id=base / f"dcp-async-{rnd}", process_group=dcp_bg)
            dt = time.perf_counter() - t0
            (fut.result() if hasattr(fut, "result") else fut.upload_completion.result())
            total = time.perf_counter() - t0
            dist.barrier()
            if rank == 0:
                shutil.rmtree(base / f"dcp-async-{rnd}", ignore_errors=True)
            return {"s": dt, "total_s": total}
        elif key == "memcpy":
            dist.barrier()
            t0 = time.perf_counter()
            with torch.no_grad():
                for k, t in flat.items():
                    copy_buf[k].copy_(t)
            dt = time.perf_counter() - t0
            dist.barrier()
        else:
            src = {
                "load_ckptfmt": outputs["ck"],
                "load_ckptfmt_alone": outputs["ck"],
                "load_torch": outputs["pt"],
                "load_dcp": outputs["dcp"],
            }[key]
            scramble()
            if key == "load_ckptfmt":
                dt, _ = timed(lambda: ckptfmt_torch.load(sd, src, comm=comm))
            elif key == "load_ckptfmt_alone":  # every rank reads the whole shared copy itself
                dt, _ = timed(lambda: ckptfmt_torch.load(sd, src, comm=SingleComm()))
            elif key == "load_torch":
                dt, _ = timed(lambda: copy_in(sd, torch.load(src, weights_only=True)))
            else:
                dt, _ = timed(lambda: dcp.load(sd, checkpoint_id=src))
            if digest(sd) != want:  # checked every round, outside the timed region
                raise SystemExit(f"rank {rank}: {key} did not give back the saved state")
        return {"s": dt}

    saves = [k for k, (kind, _) in METHODS.items() if kind != "load"]
    loads = [k for k, (kind, _) in METHODS.items() if kind == "load"]
    samples: dict[str, list[list[dict[str, float]]]] = {k: [] for k in METHODS}
    rounds = args.warmup + args.reps
    for rnd in range(rounds):
        rot = rnd % len(saves)
        order = saves[rot:] + saves[:rot]
        rot = rnd % len(loads)
        order += loads[rot:] + loads[:rot]
        for t in flat.values():  # re-touch the state
            if t.numel():
                float(t.reshape(-1)[:: max(1, 4096 // t.element_size())].sum())
        for key in order:
            gc.collect()
            res = run(key, rnd)
            got = comm.allgather_json(res)
            if rnd >= args.warmup:
                samples[key].append(got)
        dist.barrier()
        if rank == 0:  # this round's outputs go; the next round writes afresh
            for p in list(outputs.values()):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            print(
                f"# round {rnd + 1}/{rounds} done ({'warm-up' if rnd < args.warmup else 'timed'})",
                flush=True,
            )
        outputs.clear()
        dist.barrier()
    mgr.close(flush=False)
    if rank == 0:
        Path(args.part).write_text(
            json.dumps(
                {
                    "samples": samples,
                    "nbytes": nbytes,
                    "tensors": len(flat),
                    "ranks": size,
                    "model": {"width": args.width, "layers": args.layers, "vocab": args.vocab},
                }
            )
        )
        shutil.rmtree(base, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


# --- the report --------------------------------------------------------------------------------


def report(part: dict[str, Any], args: argparse.Namespace, wall_s: float) -> dict[str, Any]:
    import torch

    samples = part["samples"]

    def med(key: str, field: str = "s") -> float:
        return statistics.median(max(r[field] for r in rnd) for rnd in samples[key])

    def mn(key: str) -> float:
        return min(max(r["s"] for r in rnd) for rnd in samples[key])

    rows = []
    for key, (kind, label) in METHODS.items():
        m = med(key)
        ref = {"save": "save_ckptfmt", "async": "async_ckptfmt", "load": "load_ckptfmt"}[kind]
        row = {
            "key": key,
            "kind": kind,
            "label": label,
            "median_s": m,
            "min_s": mn(key),
            "gb_s": part["nbytes"] / m / 1e9,
            "vs_ckptfmt": m / med(ref),
            "samples_s": [max(r["s"] for r in rnd) for rnd in samples[key]],
        }
        if key.startswith("async_"):
            row["until_written_median_s"] = med(key, "total_s")
        rows.append(row)
    lines = [
        f"ranks {part['ranks']} (torchrun, gloo, DDP), state {part['nbytes'] / 1e6:.0f} MB per "
        f"rank ({part['tensors']} tensors: float32 parameters and AdamW state), tmpfs, "
        f"medians of {len(samples['save_ckptfmt'])} rounds",
        "",
        "| | method | median s | min s | GB/s | time / ckptfmt's |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kind']} | {r['label']} | {r['median_s']:.3f} | {r['min_s']:.3f} | "
            f"{r['gb_s']:.2f} | {r['vs_ckptfmt']:.2f}x |"
        )
    lines += [
        "",
        "Until the asynchronous save is written (outside the blocked time): "
        + ", ".join(
            f"{r['label']} {r['until_written_median_s']:.3f} s"
            for r in rows
            if "until_written_median_s" in r
        ),
    ]
    table = "\n".join(lines)
    print(table)
    return {
        "bench": "bench_torch.py",
        "args": vars(args),
        "wall_s": wall_s,
        "ranks": part["ranks"],
        "bytes_per_rank": part["nbytes"],
        "tensors": part["tensors"],
        "model": part["model"],
        "rows": rows,
        "table_md": table,
        "samples": samples,
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "git_head": subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip(),
        "loadavg_end": os.getloadavg(),
        "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7, help="timed rounds (default 7)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--dir", default="/dev/shm/ckptfmt-bench-torch")
    ap.add_argument("--out", default=str(BENCH / "results" / "torch.json"))
    ap.add_argument("--timeout", type=int, default=900, help="seconds for the whole launch")
    ap.add_argument("--part", help=argparse.SUPPRESS)  # set when running as a rank
    args = ap.parse_args(argv)
    if "RANK" in os.environ:  # a rank under torchrun
        return rank_main(args)
    data, wall, load_start = launch(
        __file__,
        argv if argv is not None else sys.argv[1:],
        args.ranks,
        args.timeout,
        Path(args.dir + ".part.json"),
        {**WARM_MALLOC, "OMP_NUM_THREADS": "1"},
    )
    if data is None:
        return 1
    result = report(data, args, wall)
    result["loadavg_start"] = load_start
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"# written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
