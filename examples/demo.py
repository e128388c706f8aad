"""ckptfmt demo: save a model-sized training state, inspect it, verify it, damage it, verify again.

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

    banner("2. save it (every rank's part in parallel comes with the MPI issue; one process here)")
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
    return parallel_part(out)


def mpi(*args: str, crash: bool = False) -> int:
    """Run the 4-rank training job under the venv's mpiexec, with a timeout. A job that is meant
    to crash has mpiexec's own report of the dead processes summarized in one line."""
    mpiexec = Path(sys.executable).with_name("mpiexec")
    script = str(Path(__file__).with_name("parallel_demo.py"))
    cmd = ["timeout", "-k", "5", "300", str(mpiexec), "-n", "4"]
    cmd += [sys.executable, "-m", "mpi4py", script, *args]
    if not crash:
        return subprocess.run(cmd, check=False).returncode
    done = subprocess.run(cmd, check=False, stderr=subprocess.PIPE, text=True)
    print(f"  (mpiexec: the job ended with status {done.returncode}, as a lost node ends it)")
    return done.returncode


def parallel_part(out: Path) -> int:
    root, ref = out / "cluster", out / "reference"
    banner("9. four ranks on two simulated nodes: level 1 per node, level 3 shared")
    print(
        "training a small MLP data-parallel (MPI allreduce); checkpoint every 2 steps to each "
        "node's level-1 directory, every 2nd checkpoint flushed to level 3 in the background"
    )
    mpi("--root", str(root), "--steps", "16", "--crash-after", "10", crash=True)
    banner("10. node n1 is lost: its processes died and its level-1 directory is gone")
    shutil.rmtree(root / "level1" / "n1")
    cli("list", str(root / "level3"))
    banner("11. restart the job: all ranks agree on the newest checkpoint they can all load")
    status = mpi("--root", str(root), "--steps", "16", "--result", str(out / "resumed.json"))
    if status != 0:
        return 1
    banner("12. the same training without interruption, for comparison")
    mpi("--root", str(ref), "--steps", "16", "--result", str(out / "reference.json"))
    import json

    resumed = json.loads((out / "resumed.json").read_text())
    reference = json.loads((out / "reference.json").read_text())
    same = resumed == reference
    print(
        f"final loss resumed {resumed['loss']:.9f} vs uninterrupted {reference['loss']:.9f}; "
        f"parameters and loss bitwise identical: {same}"
    )
    banner("13. what is on each level now, and the level-3 copy checked")
    cli("list", str(root / "level3"))
    newest = max(p for p in (root / "level3").iterdir() if p.name.startswith("step-"))
    status = cli("verify", str(newest))
    print(
        "\ndemo finished: damage detected and named; a lost node survived through level 3; "
        "nothing unpickled."
    )
    return 0 if same and status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
