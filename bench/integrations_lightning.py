#!/usr/bin/env python3
"""PyTorch Lightning, same process, same model: ``ckptfmt_torch.lightning.CheckpointIO`` against
Lightning's default ``TorchCheckpointIO`` (``torch.save``), both also inside
``AsyncCheckpointIO``.

1. ``trainer.save_checkpoint(path)`` and ``trainer.strategy.load_checkpoint(path)``: an MLP of
   ``--params-mib`` float32 parameters with its Adam state (3x that on disk, plus Lightning's
   loops, callbacks and hyper-parameters), after one training step. Each round saves (then
   loads) through both IOs, the order alternating, into fresh paths under ``--dir``
   (``/dev/shm``: what the IO itself costs, not the disk); the first ``--warmup`` rounds are
   not timed and check the loads bit for bit against the trainer's own dict. ckptfmt runs
   with ``fsync=False``, as ``torch.save`` does not make its file durable either (``--fsync``
   adds a timed ckptfmt row with it).
2. A short ``trainer.fit`` (``--steps`` steps of batch ``--batch``) with a ``ModelCheckpoint``
   every ``--every`` steps (every one kept, ``save_last=True``: ``last.ckpt`` rewritten; no
   top-k deletions, which ``AsyncCheckpointIO`` makes while the write may still be queued),
   for: no checkpoints, the default, ``AsyncCheckpointIO()`` (the default in a thread),
   ckptfmt, ``AsyncCheckpointIO(ckptfmt)``; ``--fit-reps`` rounds, the order rotating; the
   wall time of ``fit`` (teardown included: the async writes are waited for).

``run(args)`` returns the results; ``bench/bench_integrations.py --part lightning`` calls it,
and ``python bench/integrations_lightning.py`` runs it alone, writing
``bench/results/integrations_lightning.{json,md}``. See bench/README.md.
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

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
FIT_KINDS = {
    "none": "no checkpoints",
    "torch": "TorchCheckpointIO (default)",
    "async_torch": "AsyncCheckpointIO(TorchCheckpointIO)",
    "ckptfmt": "ckptfmt CheckpointIO",
    "async_ckptfmt": "AsyncCheckpointIO(ckptfmt CheckpointIO)",
}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--params-mib", type=int, default=128, help="float32 parameters (MiB)")
    ap.add_argument("--reps", type=int, default=7, help="timed save/load rounds")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--fsync", action="store_true", help="also time ckptfmt with fsync")
    ap.add_argument("--steps", type=int, default=24, help="steps of the timed fits")
    ap.add_argument("--every", type=int, default=4, help="a checkpoint every N steps")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--fit-reps", type=int, default=3, help="timed fits of each kind")
    ap.add_argument("--parts", default="save_load,fit", help="save_load, fit or both")
    ap.add_argument("--dir", default="/dev/shm/ckptfmt-bench-lightning")
    ap.add_argument("--out", default=str(BENCH / "results" / "integrations_lightning.json"))
    return ap


def _model(params_mib: int) -> Any:
    import pytorch_lightning as L
    import torch

    width = 2048
    layers = max(1, round(params_mib * (1 << 20) / 4 / (width * width + width)))

    class Net(L.LightningModule):
        def __init__(self, width: int = width, layers: int = layers, lr: float = 1e-4) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(
                *(torch.nn.Linear(width, width) for _ in range(layers)), torch.nn.Tanh()
            )

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            (x,) = batch
            loss = self.net(x).pow(2).mean()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

    return Net()


def _data(args: argparse.Namespace, steps: int) -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch * steps, 2048, generator=g)
    return DataLoader(TensorDataset(x), batch_size=args.batch)


def _trainer(plugin: Any, max_steps: int, callbacks: list[Any]) -> Any:
    import pytorch_lightning as L

    return L.Trainer(
        plugins=[plugin] if plugin is not None else None,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _io(kind: str) -> Any:
    import ckptfmt_torch.lightning
    import pytorch_lightning as L

    import ckptfmt

    fast = ckptfmt.WriteOptions(fsync=False)
    if kind in ("torch", "async_torch"):
        base: Any = L.plugins.TorchCheckpointIO()
    elif kind == "ckptfmt_fsync":
        base = ckptfmt_torch.lightning.CheckpointIO()
    else:
        base = ckptfmt_torch.lightning.CheckpointIO(write=fast)
    return L.plugins.AsyncCheckpointIO(base) if kind.startswith("async") else base


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(b, dict):
        return isinstance(a, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in b)
    if isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def save_load(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Part 1: ``trainer.save_checkpoint`` / ``strategy.load_checkpoint`` medians."""
    import pytorch_lightning as L

    L.seed_everything(0, verbose=False)
    model = _model(args.params_mib)
    trainer = _trainer(None, 1, [])
    trainer.fit(model, _data(args, 1))
    kinds = ["torch", "ckptfmt"] + (["ckptfmt_fsync"] if args.fsync else [])
    ios = {k: _io(k) for k in kinds}
    want = trainer._checkpoint_connector.dump_checkpoint()
    samples: dict[str, dict[str, list[float]]] = {k: {"save": [], "load": []} for k in kinds}
    size: dict[str, int] = {}
    for rnd in range(args.warmup + args.reps):
        order = kinds if rnd % 2 == 0 else kinds[::-1]
        for kind in order:
            trainer.strategy.checkpoint_io = ios[kind]
            path = root / f"{kind}-{rnd}.ckpt"
            t0 = time.perf_counter()
            trainer.save_checkpoint(path)
            t1 = time.perf_counter()
            got = trainer.strategy.load_checkpoint(path)
            t2 = time.perf_counter()
            if rnd < args.warmup:
                if not _same(got, want):
                    raise SystemExit(f"{kind}: the load is not the saved checkpoint")
                size[kind] = _bytes(path)
            else:
                samples[kind]["save"].append(t1 - t0)
                samples[kind]["load"].append(t2 - t1)
            del got
            ios[kind].remove_checkpoint(path)
    params = sum(p.numel() * 4 for p in model.parameters())
    med = {k: {op: statistics.median(v) for op, v in s.items()} for k, s in samples.items()}
    return {"param_bytes": params, "file_bytes": size, "samples": samples, "median_s": med}


def _bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fits(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Part 2: the wall time of a short fit with checkpoints every ``--every`` steps."""
    import pytorch_lightning as L

    kinds = list(FIT_KINDS)
    samples: dict[str, list[float]] = {k: [] for k in kinds}
    for rnd in range(args.fit_reps + 1):  # round 0 warms up (allocations, page cache)
        shift = rnd % len(kinds)
        for kind in kinds[shift:] + kinds[:shift]:
            L.seed_everything(0, verbose=False)
            model, data = _model(args.params_mib), _data(args, args.steps)
            callbacks = []
            if kind != "none":
                callbacks.append(
                    L.callbacks.ModelCheckpoint(
                        root / f"fit-{kind}-{rnd}",
                        save_top_k=-1,  # AsyncCheckpointIO deletes before its writes end
                        save_last=True,
                        every_n_train_steps=args.every,
                    )
                )
            trainer = _trainer(_io(kind) if kind != "none" else None, args.steps, callbacks)
            t0 = time.perf_counter()
            trainer.fit(model, data)
            elapsed = time.perf_counter() - t0
            if rnd > 0:
                samples[kind].append(elapsed)
            shutil.rmtree(root / f"fit-{kind}-{rnd}", ignore_errors=True)
    med = {k: statistics.median(v) for k, v in samples.items()}
    # each fit against the same round's fit without checkpoints: robust to a load that drifts
    # from round to round on a shared machine
    paired = {
        k: statistics.median(a / b for a, b in zip(v, samples["none"])) for k, v in samples.items()
    }
    return {"samples": samples, "median_s": med, "median_vs_none_same_round": paired}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both parts; returns everything measured (also what ``main`` writes)."""
    import torch

    import ckptfmt

    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    parts = args.parts.split(",")
    try:
        part1 = save_load(args, root) if "save_load" in parts else None
        part2 = fits(args, root) if "fit" in parts else None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    import pytorch_lightning as L

    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    m = part1["median_s"] if part1 else None
    return {
        "bench": "integrations_lightning",
        "save_load": part1,
        "fit": part2,
        "save_speedup": m["torch"]["save"] / m["ckptfmt"]["save"] if m else None,
        "load_speedup": m["torch"]["load"] / m["ckptfmt"]["load"] if m else None,
        "args": vars(args),
        "wall_s": time.perf_counter() - t0,
        "versions": {
            "ckptfmt": ckptfmt.__version__,
            "torch": torch.__version__,
            "pytorch_lightning": L.__version__,
        },
        "python": platform.python_version(),
        "git": git.stdout.strip(),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
    }


def markdown(res: dict[str, Any]) -> str:
    a = res["args"]
    head = (
        f"Lightning {res['versions']['pytorch_lightning']}, torch {res['versions']['torch']}; "
        f"an MLP of {a['params_mib']} MiB float32 parameters + Adam, {a['dir']}; load average "
        f"{res['loadavg_start'][0]:.1f} at the start, {res['loadavg_end'][0]:.1f} at the end"
    )
    out = [head]
    if res["save_load"]:
        out += ["", *_save_load_md(res["save_load"], a["reps"])]
    if res["fit"]:
        out += ["", *_fit_md(res["fit"], a)]
    return "\n".join(out)


def _save_load_md(sl: dict[str, Any], reps: int) -> list[str]:
    m = sl["median_s"]
    labels = {
        "torch": "TorchCheckpointIO (torch.save)",
        "ckptfmt": "ckptfmt CheckpointIO (fsync=False)",
        "ckptfmt_fsync": "ckptfmt CheckpointIO (fsync=True)",
    }
    rows = [
        f"| {labels[k]} | {sl['file_bytes'].get(k, 0) / 1e6:.0f} MB | {v['save']:.3f} s | "
        f"{m['torch']['save'] / v['save']:.2f}x | {v['load']:.3f} s | "
        f"{m['torch']['load'] / v['load']:.2f}x |"
        for k, v in m.items()
    ]
    return [
        f"medians of {reps} alternating rounds:",
        "",
        "| IO | on disk | trainer.save_checkpoint | vs default | strategy.load_checkpoint "
        "| vs default |",
        "|---|---|---|---|---|---|",
        *rows,
    ]


def _fit_md(fit: dict[str, Any], a: dict[str, Any]) -> list[str]:
    paired = fit["median_vs_none_same_round"]
    rows = [
        f"| {FIT_KINDS[k]} | {v:.2f} s | {(paired[k] - 1) * 100:+.1f}% | "
        f"{paired['torch'] / paired[k]:.2f}x |"
        for k, v in fit["median_s"].items()
    ]
    return [
        f"`trainer.fit`, {a['steps']} steps of batch {a['batch']}, ModelCheckpoint every "
        f"{a['every']} steps (all kept + last); medians of {a['fit_reps']} rotating "
        "rounds (overhead: each fit against the same round's fit without checkpoints):",
        "",
        "| checkpoint IO | fit | overhead | vs default |",
        "|---|---|---|---|",
        *rows,
    ]


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    res = run(args)
    md = markdown(res)
    print(md)
    out = Path(args.out)
    out.write_text(json.dumps(res, indent=1) + "\n")
    out.with_suffix(".md").write_text(md + "\n")
    print(f"# written {out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "adapters"))
    sys.exit(main())
