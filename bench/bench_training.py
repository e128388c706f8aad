#!/usr/bin/env python3
"""Training-loop overhead of checkpointing: the same DDP job, the same run, every
checkpointer in interleaved rounds, medians.

Two loops, both DDP over gloo on ``--ranks`` ranks (torchrun), an MLP with Adam whose state is
``--state-mb`` MB per rank (parameters + both moments):

* ``cpu``: real compute (forward, backward with DDP's allreduce, ``optimizer.step()``): every core
  is busy, so any background work competes (the worst case);
* ``gpu``: a GPU-like step: the step's device time is a sleep of ``--gpu-step-ms`` (the host is
  idle, as while kernels run), then a little host work, a small allreduce and the "optimizer
  step" (an in-place update of every parameter's first element and a sleep of a tenth of the
  step, its kernel time).

A checkpoint every ``--every`` steps after the optimizer step (``--ckpts`` of them, then
``--every`` more steps, so that the last save overlaps steps too). Variants (``--variants``):

* ``none``: no checkpointing, the baseline;
* ``memcpy``: a synchronous copy of the state into pre-touched buffers (the floor of a blocked
  staging copy; nothing written);
* ``ckptfmt``: ``CheckpointManager.save`` (level 1, copy before returning);
* ``ckptfmt_bg``: ``save(..., background_copy=True)`` and ``handle.wait_staged()`` before the next
  optimizer step (the copy overlaps the forward/backward);
* ``ckptfmt_bg_xor``: the same with ``redundancy="xor"`` over 2 simulated nodes (rank r on node
  ``n{r}``, ``local_dir=.../{node}``);
* ``ckptfmt_fenced``: ``ckptfmt_torch.FencedSaver``: the wait is the step pre-hook it places on
  the optimizer (the loop's update runs as a ``torch.optim.Optimizer`` whose parameters are the
  state's tensors), with the version-counter check of what it copies behind the loop;
* ``dcp``/``dcp_proc``: ``torch.distributed.checkpoint.async_save``, thread / process checkpointer;
* ``tc``: torch-checkpointing 0.1.1's async ``CheckpointManager`` (pinned memory off without
  CUDA, ``use_direct_io=False``), the optimizer step inside ``manager.lock()``;
* ``torch_save``: ``torch.save`` of the whole state on rank 0 (root checkpointing), the others at
  a barrier: synchronous.

``--in-flight N`` and ``--when-busy wait|skip`` set the ckptfmt variants'
``ManagerSettings.saves_in_flight`` and ``when_busy`` (default 1 and ``wait``: the manager's
defaults). With ``skip``, a save that finds no slot free is skipped on every rank, and the loop
gives up a background save whose copy has not begun (``SaveHandle.abandon``) instead of waiting
for it; the skipped saves are counted per run (``skipped``) and in the table. ``--every 1``
checkpoints at every step.

Per variant: blocked time per checkpoint (in ``save`` plus waiting before the optimizer step for
the state to be free), slowdown of the steps that overlap the background save (their median
against the baseline's median step of the same round), total overhead (loop time against the
baseline's, same round), and time until committed (from the save call). ``--device cuda`` puts
the model on the GPU (``gpu`` loop: real kernels instead of the sleep) and adds ``ckptfmt_torch``
staging (``ckptfmt_pinned``: ``save_async`` through pinned buffers on a side stream) and the
``to_pinned`` floor (``tensor.to('cpu', non_blocking=True)`` into pinned buffers).

Run ``.venv/bin/python bench/bench_training.py`` (it launches itself under torchrun, under
``timeout``). Results: ``bench/results/training.json`` and a Markdown table on stdout and in
``bench/results/training.md``. See bench/README.md (``bench_training.py``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent

VARIANTS = {
    "none": "no checkpointing (baseline)",
    "memcpy": "memcpy into pre-touched buffers (floor)",
    "ckptfmt": "ckptfmt CheckpointManager (level 1)",
    "ckptfmt_bg": "ckptfmt, background_copy",
    "ckptfmt_bg_xor": "ckptfmt, background_copy, level 1 + xor (2 nodes)",
    "ckptfmt_fenced": "ckptfmt_torch.FencedSaver (optimizer-step fence)",
    "dcp": "dcp.async_save (thread)",
    "dcp_proc": "dcp.async_save (process)",
    "tc": "torch-checkpointing 0.1.1 (async)",
    "torch_save": "torch.save on rank 0 (sync)",
    "ckptfmt_pinned": "ckptfmt_torch.save_async (pinned, side stream)",
    "to_pinned": "to('cpu', non_blocking) into pinned (floor)",
}
CUDA_ONLY = ("ckptfmt_pinned", "to_pinned")
DEFAULT_VARIANTS = [v for v in VARIANTS if v not in CUDA_ONLY]


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class Job:
    """One rank's model, optimizer and checkpointers, shared by every round."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist

        self.args = args
        self.torch, self.dist = torch, dist
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.device = torch.device(args.device)
        width = args.width
        per_layer = 12 * (width * width + width)  # bytes: param + exp_avg + exp_avg_sq
        layers = max(1, round(args.state_mb * 1e6 / per_layer))
        torch.manual_seed(0)
        body = []
        for _ in range(layers):
            body += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        self.model = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Sequential(*body).to(self.device)
        )
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-5)
        g = torch.Generator().manual_seed(self.rank)
        self.x = torch.randn(args.batch, width, generator=g).to(self.device)
        self.layers = layers
        self.compute_step()  # the optimizer's state exists from here on
        self.opt.step()
        self.flat = self.flat_state()
        self.nbytes = sum(t.numel() * t.element_size() for t in self.flat.values())
        self.small = torch.zeros(1024, device=self.device)
        self.base = Path(args.dir)
        self._floor_bufs: dict[str, Any] = {}

    def flat_state(self) -> dict[str, Any]:
        """The state every checkpointer gets: parameters and Adam moments by name."""
        out: dict[str, Any] = {}
        named = dict(self.model.module.named_parameters())
        for name, p in named.items():
            out[f"model.{name}"] = p
        index = {id(p): name for name, p in named.items()}
        for p, st in self.opt.state.items():
            for slot, v in st.items():
                if self.torch.is_tensor(v) and v.dim() > 0:
                    out[f"optim.{index[id(p)]}.{slot}"] = v
        return out

    def compute_step(self) -> None:
        out = self.model(self.x)
        out.float().pow(2).mean().backward()

    def gpu_like_step(self) -> None:
        """The device part of a GPU step: the host sleeps, then does a little work."""
        if self.device.type == "cuda":
            self.compute_step()
            return
        time.sleep(self.args.gpu_step_ms / 1000 * 0.9)
        host = sum(range(2000))  # a little Python on the host (data loading, logging)
        self.small.add_(float(host % 7))
        self.dist.all_reduce(self.small)  # the ranks stay in step, as DDP's allreduce keeps them

    def optimizer_step(self, loop: str) -> None:
        if loop == "cpu" or self.device.type == "cuda":
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            return
        with self.torch.no_grad():  # the update's kernels: the state changes in place
            for p in self.model.parameters():
                p.view(-1)[0] += 1e-6
        time.sleep(self.args.gpu_step_ms / 1000 * 0.1)

    def floor_copy(self) -> None:
        """A synchronous copy of the state into pre-touched buffers (made once)."""
        if not self._floor_bufs:
            for k, t in self.flat.items():
                self._floor_bufs[k] = self.torch.empty(t.shape, dtype=t.dtype).fill_(0)
        for k, t in self.flat.items():
            self._floor_bufs[k].copy_(t)


def loop_update_optimizer(torch: Any, params: list[Any]) -> Any:
    """A ``torch.optim.Optimizer`` over the state's tensors whose step runs the loop's own
    update (``body``): where ``FencedSaver`` places its fence."""

    class LoopUpdate(torch.optim.Optimizer):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(params, {})
            self.body: Callable[[], None] = lambda: None

        def step(self, closure: Any = None) -> None:
            self.body()

    return LoopUpdate()


class Checkpointer:
    """One variant: ``save`` (returns the blocked seconds), ``before_update`` (the seconds spent
    waiting before the optimizer step may write the state), ``drain`` (wait for everything)."""

    def __init__(self, job: Job, variant: str) -> None:
        self.job, self.variant = job, variant
        self.commits: list[tuple[float, float]] = []  # (save called, committed)
        self._pending: Any = None
        self._lock: Any = None
        self._setup()

    def _setup(self) -> None:
        job, v = self.job, self.variant
        root = job.base / v
        self.root = root
        if job.rank == 0:
            root.mkdir(parents=True, exist_ok=True)
        job.dist.barrier()
        if v.startswith("ckptfmt"):
            import ckptfmt_torch

            from ckptfmt import CheckpointManager, ExitPolicy

            self.mgr = CheckpointManager(
                local_dir=root / "l1" / "{node}",
                comm=ckptfmt_torch.default_comm(),  # gloo (a gloo group beside nccl on CUDA)
                node=f"n{job.rank}",
                redundancy="xor" if v.endswith("xor") else None,
                keep_local=2,
                on_error="raise",
                at_exit=ExitPolicy(flush=False, sigterm=False),
                saves_in_flight=job.args.in_flight,
                when_busy=job.args.when_busy,
            )
            from ckptfmt_torch.staging import TorchStager

            self.stager = TorchStager() if v == "ckptfmt_pinned" else None
            if v == "ckptfmt_fenced":
                self.opt = loop_update_optimizer(job.torch, list(job.flat.values()))
                self.fenced = ckptfmt_torch.FencedSaver(self.mgr, self.opt)
        elif v == "tc":
            from torch_checkpointing import (
                AsyncCheckpointSaverConfig,
                CheckpointManager,
                CheckpointStagerConfig,
            )
            from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

            pinned = job.device.type == "cuda"
            cfg = CheckpointManager.Config(
                save=AsyncCheckpointSaverConfig(
                    staging_config=CheckpointStagerConfig(
                        use_pinned_memory=pinned, use_non_blocking_copy=pinned
                    )
                ),
                storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
            )
            self.tc = CheckpointManager(cfg)
        elif v.startswith("dcp"):
            self.dcp_group = job.dist.new_group(backend="gloo")
        elif v == "to_pinned":
            t = job.torch
            self.pinned = {
                k: t.empty(x.shape, dtype=x.dtype, pin_memory=True) for k, x in job.flat.items()
            }

    def _committed(self, called: float) -> Callable[[Any], None]:
        def done(f: Any) -> None:
            if f.exception() is None:  # a skipped save (when_busy="skip") is counted apart
                self.commits.append((called, time.perf_counter()))

        return done

    @property
    def skipped(self) -> int:
        """Saves skipped so far (ckptfmt with ``--when-busy skip``)."""
        return self.mgr.saves_skipped if self.variant.startswith("ckptfmt") else 0

    def save(self, step: int) -> float:
        job, v = self.job, self.variant
        t0 = time.perf_counter()
        if v == "memcpy":
            job.floor_copy()
        elif v == "to_pinned":
            for k, x in job.flat.items():
                self.pinned[k].copy_(x, non_blocking=True)
            job.torch.cuda.synchronize()
        elif v.startswith("ckptfmt"):
            import ckptfmt_torch
            from ckptfmt_torch.staging import save_async

            if v == "ckptfmt_pinned":
                h = save_async(self.mgr, step, job.flat, self.stager)
            elif v == "ckptfmt_fenced":
                h = self.fenced.save(step, job.flat)
            else:
                state = ckptfmt_torch.to_state(job.flat)
                h = self.mgr.save(step, state, background_copy=v.startswith("ckptfmt_bg"))
            h.committed.add_done_callback(self._committed(t0))
            self._pending = h
        elif v.startswith("dcp"):
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            if self._pending is not None:
                self._pending.result()  # one save at a time, as the managers do
            kind = (
                AsyncCheckpointerType.PROCESS if v == "dcp_proc" else AsyncCheckpointerType.THREAD
            )
            f = dcp.async_save(
                job.flat,
                checkpoint_id=str(self.root / f"step-{step}"),
                process_group=self.dcp_group,
                async_checkpointer_type=kind,
            )
            f = getattr(f, "upload_completion", f)
            f.add_done_callback(self._committed(t0))
            self._pending = f
        elif v == "tc":
            if self._pending is not None:
                self._pending.result()
            f = self.tc.save(str(self.root / f"step-{step}"), {"state": job.flat})
            assert f is not None
            f.add_done_callback(self._committed(t0))
            self._pending = f
        elif v == "torch_save":
            if job.rank == 0:
                job.torch.save(job.flat, self.root / f"step-{step}.pt")
            job.dist.barrier()
            self.commits.append((t0, time.perf_counter()))
        return time.perf_counter() - t0

    def update(self, body: Callable[[], None]) -> float:
        """Run the optimizer step ``body`` once the state may change; returns the seconds
        waited for that."""
        t0 = time.perf_counter()
        waited = 0.0
        if self.variant == "ckptfmt_fenced":
            before = sum(self.fenced.blocked_s)
            self.opt.body = body
            self.opt.step()  # the pre-hook waits for the copy
            waited = sum(self.fenced.blocked_s) - before
        elif self.variant.startswith("ckptfmt") and self._pending is not None:
            if not (self.job.args.when_busy == "skip" and self._pending.abandon()):
                self._pending.wait_staged()  # its copy must be done before the update
            self._pending = None
            waited = time.perf_counter() - t0
            body()
        elif self.variant == "tc":
            with self.tc.lock():
                waited = time.perf_counter() - t0
                body()
        else:
            body()
        return waited

    def drain(self) -> None:
        if self.variant == "ckptfmt_fenced":
            self.fenced.wait()
        elif self.variant.startswith("ckptfmt"):
            self.mgr.wait()
        elif self._pending is not None:
            self._pending.result()
        self._pending = None

    def clean(self) -> None:
        """Between runs (untimed): remove what the previous run wrote, except ckptfmt's (its
        retention keeps two steps)."""
        if self.job.rank == 0 and not self.variant.startswith("ckptfmt"):
            for p in self.root.glob("step-*"):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()

    def close(self) -> None:
        if self.variant == "ckptfmt_fenced":
            self.fenced.close()
        if self.variant.startswith("ckptfmt"):
            self.mgr.close()
        elif self.variant == "tc":
            self.tc.close()


def run_loop(job: Job, ck: Checkpointer, loop: str) -> dict[str, Any]:
    """One run of ``loop``: ``(ckpts + 1) * every`` steps, a checkpoint every ``every``."""
    args = job.args
    ck.commits.clear()
    steps = (args.ckpts + 1) * args.every
    step_s: list[float] = []
    starts: list[float] = []
    blocked: list[float] = []
    saves_at: list[float] = []  # when each save returned
    saves_called: list[float] = []  # when each save was called
    waited_total = 0.0
    skipped_before = ck.skipped
    job.dist.barrier()
    t_loop = time.perf_counter()
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        starts.append(t0)
        if loop == "cpu":
            job.compute_step()
        else:
            job.gpu_like_step()
        waited = ck.update(lambda: job.optimizer_step(loop))
        waited_total += waited
        if blocked and waited:
            blocked[-1] += waited  # the save's share: the state was not free yet
        if ck.variant != "none" and step % args.every == 0 and step < steps:
            saves_called.append(time.perf_counter())
            blocked.append(ck.save(step))
            saves_at.append(time.perf_counter())
        step_s.append(time.perf_counter() - t0)
    loop_s = time.perf_counter() - t_loop
    ck.drain()
    job.dist.barrier()
    ck.clean()
    skipped = ck.skipped - skipped_before
    commits = sorted(ck.commits)
    # steps overlapping a background save: those that start after it returned and before it
    # committed, without the save call itself
    overlap: list[float] = []
    returned_at = dict(zip(saves_called, saves_at))
    for called, committed in commits:  # the committed saves (skipped ones: none)
        returned = returned_at.get(called, called)
        for t, s in zip(starts, step_s):
            if returned <= t < committed:
                overlap.append(s)
    return {
        "loop_s": loop_s,
        "step_s": step_s,
        "blocked_s": blocked,
        "commit_s": [c - a for a, c in commits],
        "overlap_step_s": overlap,
        "waited_s": waited_total,
        "saves": len(blocked),
        "skipped": skipped,
    }


def rank_main(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group(backend)
    torch.set_num_threads(1)
    job = Job(args)
    if job.rank == 0:
        shutil.rmtree(job.base, ignore_errors=True)
        job.base.mkdir(parents=True)
    dist.barrier()
    variants = ["none", *[v for v in args.variants if v != "none"]]
    cks = {v: Checkpointer(job, v) for v in variants}
    if job.rank == 0:
        print(
            f"# ranks={job.size} width={args.width} layers={job.layers} tensors={len(job.flat)} "
            f"state={job.nbytes / 1e6:.0f} MB per rank, device={args.device}",
            flush=True,
        )
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {loop: {} for loop in args.loops}
    for rnd in range(args.warmup + args.rounds):
        for loop in args.loops:
            order = variants[rnd % len(variants) :] + variants[: rnd % len(variants)]
            for v in order:
                gc.collect()
                r = run_loop(job, cks[v], loop)
                r["round"] = rnd - args.warmup
                r["loadavg"] = os.getloadavg()[0]
                if rnd >= args.warmup:
                    runs[loop].setdefault(v, []).append(r)
                if job.rank == 0:
                    print(
                        f"# round {rnd - args.warmup} {loop} {v}: loop {r['loop_s']:.2f} s, "
                        f"blocked {[round(b * 1e3) for b in r['blocked_s']]} ms, "
                        f"commit {[round(c, 2) for c in r['commit_s']]} s, "
                        f"skipped {r['skipped']} of {r['saves']}, load {r['loadavg']:.1f}",
                        flush=True,
                    )
    for ck in cks.values():
        ck.close()
    if job.rank == 0:
        part = {
            "runs": runs,
            "ranks": job.size,
            "layers": job.layers,
            "tensors": len(job.flat),
            "nbytes": job.nbytes,
        }
        Path(args.part).write_text(json.dumps(part))
        shutil.rmtree(job.base, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def summarize(part: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Medians over rounds; every ratio against the baseline of the same round."""
    out: dict[str, Any] = {}
    for loop, by_variant in part["runs"].items():
        base = {r["round"]: r for r in by_variant["none"]}
        rows: dict[str, Any] = {}
        for v, runs in by_variant.items():
            overhead, slow, blocked, commit, skipped, saves = [], [], [], [], 0, 0
            for r in runs:
                b = base[r["round"]]
                overhead.append((r["loop_s"] - b["loop_s"]) / b["loop_s"])
                base_step = med(b["step_s"])
                if r["overlap_step_s"]:
                    slow.append(med(r["overlap_step_s"]) / base_step - 1)
                blocked += r["blocked_s"]
                commit += r["commit_s"]
                skipped += r.get("skipped", 0)
                saves += r.get("saves", len(r["blocked_s"]))
            rows[v] = {
                "label": VARIANTS[v],
                "overhead_pct": 100 * med(overhead),
                "overhead_pct_all": [100 * x for x in overhead],
                "overlap_slowdown_pct": 100 * med(slow) if slow else None,
                "blocked_ms": 1e3 * med(blocked) if blocked else None,
                "commit_s": med(commit) if commit else None,
                "skipped": skipped,
                "saves": saves,
                "base_step_ms": 1e3 * med([s for r in runs for s in base[r["round"]]["step_s"]]),
            }
        out[loop] = rows
    return out


def table(summary: dict[str, Any], part: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"ranks {part['ranks']} (torchrun, DDP, {args.device}), state "
        f"{part['nbytes'] / 1e6:.0f} MB per rank ({part['tensors']} tensors), a checkpoint every "
        f"{args.every} steps, {args.ckpts} per run, {args.rounds} rounds (medians), "
        f"dir {args.dir}; ckptfmt: {args.in_flight} save(s) in flight, when busy: {args.when_busy}",
        "",
    ]
    for loop, rows in summary.items():
        floor = rows.get("memcpy", rows.get("to_pinned", {})).get("blocked_ms")
        base_ms = rows["none"]["base_step_ms"]
        lines += [
            f"### loop `{loop}` (baseline step {base_ms:.0f} ms"
            + (f", GPU step {args.gpu_step_ms} ms as a sleep" if loop == "gpu" else "")
            + ")",
            "",
            "| variant | blocked / ckpt (ms) | x memcpy floor | overlapped steps slower | "
            "total overhead | committed after (s) | skipped |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for v, row in rows.items():
            if v == "none":
                continue
            b = row["blocked_ms"]
            ratio = f"{b / floor:.2f}x" if b is not None and floor else "—"
            sl = row["overlap_slowdown_pct"]
            c = row["commit_s"]
            lines.append(
                f"| {row['label']} | {b:.1f} | {ratio} | "
                f"{'—' if sl is None else f'{sl:+.1f}%'} | {row['overhead_pct']:+.1f}% | "
                f"{'—' if c is None else f'{c:.2f}'} | {row['skipped']} of {row['saves']} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--state-mb", type=float, default=120, help="state per rank (default 120)")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--every", type=int, default=4, help="steps between checkpoints (1: every)")
    ap.add_argument("--in-flight", type=int, default=1, help="ckptfmt: saves_in_flight")
    ap.add_argument(
        "--when-busy", default="wait", choices=["wait", "skip"], help="ckptfmt: when_busy"
    )
    ap.add_argument("--ckpts", type=int, default=2, help="checkpoints per run")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--gpu-step-ms", type=float, default=200.0)
    ap.add_argument("--loops", type=lambda s: s.split(","), default=["gpu", "cpu"])
    ap.add_argument("--variants", type=lambda s: s.split(","), default=DEFAULT_VARIANTS)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dir", default="/tmp/ckptfmt-bench-training")
    ap.add_argument("--out", default=str(BENCH / "results" / "training.json"))
    ap.add_argument("--timeout", type=int, default=900, help="seconds for the whole launch")
    ap.add_argument("--part", help=argparse.SUPPRESS)  # set when running as a rank
    args = ap.parse_args(argv)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    if "RANK" in os.environ:  # a rank under torchrun
        return rank_main(args)
    if args.device == "cuda" and "ckptfmt_pinned" not in args.variants:
        args.variants = [*args.variants, *CUDA_ONLY]
        argv = [
            *(argv if argv is not None else sys.argv[1:]),
            "--variants",
            ",".join(args.variants),
        ]
    part = Path(args.dir + ".part.json")
    part.unlink(missing_ok=True)
    cmd = [
        "timeout",
        "-k",
        "5",
        str(args.timeout),
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(args.ranks),
        __file__,
        *(argv if argv is not None else sys.argv[1:]),
        "--part",
        str(part),
    ]
    t0 = time.perf_counter()
    load_start = os.getloadavg()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}:{REPO / 'adapters'}"}
    done = subprocess.run(cmd, cwd=REPO, env=env)
    if done.returncode != 0:
        print(f"torchrun failed with exit status {done.returncode}", file=sys.stderr)
        return done.returncode
    data = json.loads(part.read_text())
    part.unlink()
    summary = summarize(data, args)
    md = table(summary, data, args)
    print(md)
    result = {
        "args": {k: v for k, v in vars(args).items() if k != "part"},
        "summary": summary,
        "runs": data["runs"],
        "ranks": data["ranks"],
        "nbytes": data["nbytes"],
        "tensors": data["tensors"],
        "wall_s": time.perf_counter() - t0,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "git": subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
        ).stdout.strip(),
        "threads": threading.active_count(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(md + "\n")
    print(f"# written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
