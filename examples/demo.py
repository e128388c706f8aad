"""ckptfmt demo, in two parts.

1. PyTorch (``examples/torch_demo.py``): a small transformer trained with DDP on 4 ranks over 2
   simulated nodes, checkpointed to node-local level 1 with XOR parity and to shared level 3;
   a node dies, the job restarts, rebuilds the lost node's data from parity and ends bitwise
   where an uninterrupted run ends.
2. The format: save a model-sized training state, inspect it, verify it, damage it, verify again.

Run through ``scripts/demo.sh`` (which sets up .venv first). Writes under ``demo-output/`` (or the
directory given as the first argument). Every step prints what it did; the CLI steps run the real
``ckptfmt`` command.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import ml_dtypes
import numpy as np

import ckptfmt
from ckptfmt.errors import DamagedError


def model_state(d: int = 1024, layers: int = 6, vocab: int = 32000, seed: int = 0) -> dict:
    """A GPT-like model in float32 with bfloat16 Adam moments, counters and config (~400 MB)."""
    rng = np.random.default_rng(seed)
    model: dict[str, np.ndarray] = {"embed.weight": rng.standard_normal((vocab, d), np.float32)}
    for i in range(layers):
        p = f"layers.{i}"
        model[f"{p}.attn.qkv.weight"] = rng.standard_normal((3 * d, d), np.float32)
        model[f"{p}.attn.out.weight"] = rng.standard_normal((d, d), np.float32)
        model[f"{p}.mlp.up.weight"] = rng.standard_normal((4 * d, d), np.float32)
        model[f"{p}.mlp.down.weight"] = rng.standard_normal((d, 4 * d), np.float32)
        model[f"{p}.ln.weight"] = np.ones(d, np.float32)
        model[f"{p}.ln.bias"] = np.zeros(d, np.float32)
    moments = {
        name: {
            "exp_avg": (a * 0.01).astype(ml_dtypes.bfloat16),
            "exp_avg_sq": (a * a * 0.001).astype(ml_dtypes.bfloat16),
            "step": np.float32(1000.0),
        }
        for name, a in model.items()
    }
    return {
        "model": model,
        "optimizer": {
            "state": moments,
            "param_groups": [{"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}],
        },
        "step": 1000,
        "best_loss": float("inf"),
        "config": {
            "d_model": d,
            "layers": layers,
            "vocab": vocab,
            "precision": "fp32+bf16 moments",
        },
    }


def banner(text: str) -> None:
    print(f"\n=== {text} " + "=" * max(0, 90 - len(text)), flush=True)


def cli(*args: str) -> int:
    """Run the real ``ckptfmt`` command and show its output."""
    cmd = [sys.executable, "-m", "ckptfmt_cli", *args]
    print("$ ckptfmt " + " ".join(args), flush=True)
    return subprocess.run(cmd, check=False).returncode


def flip_bit(file: Path, offset: int, bit: int = 3) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "demo-output").absolute()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    import torch_demo  # beside this script

    print("PART 1: PyTorch training that loses a node and resumes bitwise")
    if torch_demo.run(out / "torch") != 0:
        print("the PyTorch part failed")
        return 1
    print("\n\nPART 2: the format: a model-sized state saved, inspected, verified, damaged")
    return format_part(out)


def format_part(out: Path) -> int:
    path = out / ckptfmt.step_dir_name(1000)

    banner("1. build a model-sized training state")
    state = model_state()
    nbytes = sum(
        a.nbytes
        for group in (state["model"], *state["optimizer"]["state"].values())
        for a in group.values()
    )
    print(
        f"{len(state['model'])} parameters, {nbytes / 1e6:.0f} MB of tensors "
        "(float32 weights, bfloat16 Adam moments, JSON config and counters)"
    )

    banner("2. save it (one process here; part 1 saved in parallel, every rank its share)")
    t0 = time.perf_counter()
    manifest = ckptfmt.save(state, path, step=1000)
    dt = time.perf_counter() - t0
    files = len(manifest.files())
    print(
        f"saved to {path} in {dt:.2f} s ({nbytes / 1e9 / dt:.2f} GB/s), {files} shard files, "
        f"a CRC32C on every 1 MiB chunk, manifest written last, committed by rename"
    )

    banner("3. inspect")
    cli("inspect", str(path))

    banner("4. read it back: ckptfmt.load, ckptfmt.open, and plain zarr without ckptfmt")
    loaded = ckptfmt.load(path)
    same = all(
        np.array_equal(loaded["model"][k].view(np.uint8), v.view(np.uint8))
        for k, v in state["model"].items()
    )
    print(f"ckptfmt.load: every parameter bit-identical: {same}; best_loss={loaded['best_loss']}")
    ck = ckptfmt.open(path)
    view = ck["model/embed.weight"]
    print(
        f"ckptfmt.open: {view.name} {view.shape} {view.dtype}; rows 5..7 read lazily: "
        f"{np.array_equal(view[5:7], state['model']['embed.weight'][5:7])}"
    )
    reader = textwrap.dedent(f"""
        import zarr
        g = zarr.open_group({str(path)!r}, mode="r")
        a = g["optimizer/state/embed.weight/exp_avg"]
        print("plain zarr-python:", a.shape, a.dtype, a[0, :3])
    """)
    subprocess.run([sys.executable, "-c", reader], check=True, cwd="/")

    banner("5. verify (re-reads every byte)")
    status = cli("verify", str(path))
    if status != 0:
        print("unexpected: a fresh checkpoint should verify healthy")
        return 1

    banner("6. damage it: flip one bit in one shard file of one tensor")
    victim = manifest.files()[len(manifest.files()) // 2][1]
    flip_bit(path / victim.path, offset=victim.size // 3)
    print(f"flipped bit 3 of byte {victim.size // 3} in {victim.path}")

    banner("7. verify again")
    status = cli("verify", str(path))
    print(f"exit status {status} (1 = damaged)")

    banner("8. load refuses the damaged data and says where it is")
    try:
        ckptfmt.load(path)
    except DamagedError as exc:
        print(f"{type(exc).__name__}: {exc}")
    else:
        print("unexpected: the damage went unnoticed")
        return 1
    if status != 1:
        return 1
    print(
        "\ndemo finished: a lost node rebuilt from parity and training resumed bitwise; damage "
        "detected and named; nothing unpickled."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
