#!/usr/bin/env python3
"""The Hugging Face ``Trainer``: time spent saving over a short run, HF's default checkpoints
against ``ckptfmt_torch.hf.Trainer`` (blocking, and background saves), same run, same disk.

A GPT-2 built from a config (``--layers``, ``--embd``, ``--vocab``: about 35 M parameters,
140 MB of float32 weights by default; AdamW, so a checkpoint holds about three times that)
trains ``--steps`` steps on CPU and saves every ``--save-every`` steps into a fresh
``output_dir`` on the local disk. Per run, the time spent saving is what the training loop
waited for: the sum of ``_save_checkpoint`` calls (HF's own: ``model.safetensors``,
``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``, ``trainer_state.json``, no fsync), plus,
for background saves, the wait for the last one when ``train`` ends. Methods:

- ``hf``: ``transformers.Trainer`` (its defaults);
- ``ckptfmt``: ``ckptfmt_torch.hf.Trainer``, blocking (its defaults: fsync before the commit);
- ``ckptfmt_nofsync``: the same with ``WriteOptions(fsync=False)``, HF's durability;
- ``ckptfmt_async``: ``CheckpointOptions(async_save=True)`` (the manager's background save);
- ``ckptfmt_async_nofsync``: the same with ``fsync=False``.

The order of the methods rotates from one round to the next; medians over ``--reps`` rounds.
Bytes on disk: one checkpoint directory (links followed), and the whole ``output_dir``.

``run(args) -> dict`` is what ``bench/bench_integrations.py --part hf`` calls; alone:
``.venv/bin/python bench/integrations_hf.py`` writes ``bench/results/integrations_hf.json``
and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
METHODS = {
    "hf": "transformers.Trainer (HF's default checkpoints)",
    "ckptfmt": "ckptfmt_torch.hf.Trainer, blocking save (fsync)",
    "ckptfmt_nofsync": "ckptfmt_torch.hf.Trainer, blocking, WriteOptions(fsync=False)",
    "ckptfmt_async": "ckptfmt_torch.hf.Trainer, CheckpointOptions(async_save=True)",
    "ckptfmt_async_nofsync": "ckptfmt_torch.hf.Trainer, async_save=True, fsync=False",
}
DEFAULTS: dict[str, Any] = {
    "layers": 6,
    "embd": 512,
    "vocab": 32000,
    "steps": 32,
    "save_every": 4,
    "reps": 3,
    "hf_dir": "/tmp/ckptfmt-bench-hf",
    "methods": ",".join(METHODS),
}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--layers", type=int, default=DEFAULTS["layers"])
    ap.add_argument("--embd", type=int, default=DEFAULTS["embd"])
    ap.add_argument("--vocab", type=int, default=DEFAULTS["vocab"])
    ap.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    ap.add_argument("--save-every", type=int, default=DEFAULTS["save_every"])
    ap.add_argument("--reps", type=int, default=DEFAULTS["reps"], help="rounds (default 3)")
    ap.add_argument("--hf-dir", default=DEFAULTS["hf_dir"], help="scratch directory (disk)")
    ap.add_argument("--methods", default=DEFAULTS["methods"])


def _opt(args: argparse.Namespace, name: str) -> Any:
    return getattr(args, name, DEFAULTS[name])


def _bytes(path: Path, follow: bool) -> int:
    """The bytes of the files under ``path`` (``follow``: through links, for one checkpoint
    whose ``ckptfmt`` is a link to the manager's step; else each file once)."""
    total = 0
    for root, _, files in os.walk(path, followlinks=follow):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def one_run(method: str, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers
    from ckptfmt_torch.hf import CheckpointOptions, Trainer
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from ckptfmt import WriteOptions

    base = transformers.Trainer if method == "hf" else Trainer
    saves: list[float] = []
    waits: list[float] = []

    class Timed(base):  # type: ignore[misc,valid-type]
        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            t = time.perf_counter()
            super()._save_checkpoint(model, trial)
            saves.append(time.perf_counter() - t)

        def wait_for_checkpoint(self) -> None:  # ours: train() waits for the save in flight
            t = time.perf_counter()
            super().wait_for_checkpoint()
            waits.append(time.perf_counter() - t)

    seq = 32
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=_opt(args, "layers"),
        n_embd=_opt(args, "embd"),
        n_head=8,
        vocab_size=_opt(args, "vocab"),
        n_positions=seq,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    x = torch.randint(0, config.vocab_size, (64, seq), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": r, "labels": r} for r in x]
    targs = TrainingArguments(
        str(out),
        max_steps=_opt(args, "steps"),
        save_steps=_opt(args, "save_every"),
        save_strategy="steps",
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        logging_steps=1000,
    )
    kw: dict[str, Any] = {}
    if method == "ckptfmt_nofsync":
        kw["ckptfmt"] = CheckpointOptions(write=WriteOptions(fsync=False))
    elif method == "ckptfmt_async":
        kw["ckptfmt"] = CheckpointOptions(async_save=True)
    elif method == "ckptfmt_async_nofsync":
        kw["ckptfmt"] = CheckpointOptions(async_save=True, write=WriteOptions(fsync=False))
    trainer = Timed(model=model, args=targs, train_dataset=data, **kw)
    params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    trainer.train()  # ours waits for the save in flight before it returns
    t1 = time.perf_counter()
    mgr = getattr(trainer, "checkpoint_manager", None)
    if mgr is not None:
        mgr.close()
    last = max(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return {
        "save_s": sum(saves) + sum(waits),
        "per_save_s": saves,
        "final_wait_s": sum(waits),
        "train_s": t1 - t0,
        "checkpoint_bytes": _bytes(last, True),
        "output_dir_bytes": _bytes(out, False),
        "checkpoint_files": sorted(p.name for p in last.iterdir()),
        "params": params,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    methods = [m for m in str(_opt(args, "methods")).split(",") if m]
    root = Path(_opt(args, "hf_dir"))
    shutil.rmtree(root, ignore_errors=True)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    for r in range(_opt(args, "reps")):
        order = methods[r % len(methods) :] + methods[: r % len(methods)]
        for m in order:
            out = root / f"{m}-{r}"
            runs[m].append(one_run(m, out, args))
            shutil.rmtree(out, ignore_errors=True)
            print(f"# round {r} {m}: saving {runs[m][-1]['save_s']:.3f} s", file=sys.stderr)
    shutil.rmtree(root, ignore_errors=True)
    summary = {
        m: {
            "label": METHODS[m],
            "save_s_median": statistics.median(x["save_s"] for x in rs),
            "train_s_median": statistics.median(x["train_s"] for x in rs),
            "checkpoint_bytes": rs[-1]["checkpoint_bytes"],
            "output_dir_bytes": rs[-1]["output_dir_bytes"],
            "checkpoint_files": rs[-1]["checkpoint_files"],
            "runs": rs,
        }
        for m, rs in runs.items()
    }
    base = summary.get("hf", {}).get("save_s_median")
    for s in summary.values():
        s["hf_over_this"] = (base / s["save_s_median"]) if base and s["save_s_median"] else None
    first = next(iter(runs.values()))[0]
    return {
        "bench": "integrations_hf",
        "model": {
            "layers": _opt(args, "layers"),
            "embd": _opt(args, "embd"),
            "vocab": _opt(args, "vocab"),
            "params": first["params"],
        },
        "steps": _opt(args, "steps"),
        "save_every": _opt(args, "save_every"),
        "reps": _opt(args, "reps"),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "loadavg_start": os.getloadavg(),
        "methods": summary,
    }


def markdown(result: dict[str, Any]) -> str:
    m = result["model"]
    lines = [
        f"HF Trainer, GPT-2 {m['layers']} layers x {m['embd']} ({m['params'] / 1e6:.1f} M "
        f"parameters), {result['steps']} steps, a save every {result['save_every']}, "
        f"medians of {result['reps']} rounds; CPU, local disk.",
        "",
        "| method | time spent saving (s) | HF / this | train() wall (s) | one checkpoint (MB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for s in result["methods"].values():
        ratio = "" if s["hf_over_this"] is None else f"{s['hf_over_this']:.2f}x"
        lines.append(
            f"| {s['label']} | {s['save_s_median']:.3f} | {ratio} | {s['train_s_median']:.2f} "
            f"| {s['checkpoint_bytes'] / 1e6:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(ap)
    ap.add_argument("--out", default=str(BENCH / "results" / "integrations_hf.json"))
    args = ap.parse_args(argv)
    result = run(args)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    md = markdown(result)
    Path(args.out).with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
