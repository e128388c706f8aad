"""The PyTorch demo: a small transformer trained data-parallel on 4 ranks over 2 simulated
nodes, checkpointed with ckptfmt to node-local level 1 (XOR parity across the nodes) and to a
shared level 3; one node dies mid-run, the job restarts, rebuilds the lost node's part of the
newest checkpoint from parity, and ends bitwise where an uninterrupted run ends.

    .venv/bin/python examples/torch_demo.py [OUT_DIR]     # also part of examples/demo.py

Each job is ``torchrun --nproc-per-node 4 examples/torch_demo_worker.py`` (gloo, CPU) under
``timeout``. Exit status 0 only if every check holds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import ckptfmt

WORKER = Path(__file__).with_name("torch_demo_worker.py")
STEPS, KILL_AFTER = 24, 16


def banner(text: str) -> None:
    print(f"\n=== {text} " + "=" * max(0, 90 - len(text)), flush=True)


def cli(*args: str, head: int = 0, tail: int = 0) -> int:
    """Run the real ``ckptfmt`` command and show its output (with ``head``/``tail``: only its
    first and last lines)."""
    print("$ ckptfmt " + " ".join(args), flush=True)
    cmd = [sys.executable, "-m", "ckptfmt_cli", *args]
    if not head:
        return subprocess.run(cmd, check=False).returncode
    done = subprocess.run(
        cmd, check=False, stdout=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "120"}
    )
    lines = done.stdout.splitlines()
    if len(lines) > head + tail:
        lines = [*lines[:head], f"  ... ({len(lines) - head - tail} more lines)", *lines[-tail:]]
    print("\n".join(lines), flush=True)
    return done.returncode


def torchrun(*args: str, crash: bool = False) -> int:
    """One 4-rank job (rank 0 prints); a job meant to die has torchrun's report of the dead
    processes summarized in one line, another's shown only if it fails."""
    cmd = [
        "timeout",
        "-k",
        "5",
        "300",
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        "--monitor-interval",
        "0.2",
        str(WORKER),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, check=False, stderr=subprocess.PIPE, text=True, env=env)
    if crash:
        print(f"  (torchrun: the job ended with status {done.returncode}, as a lost node ends it)")
    elif done.returncode != 0:
        print(done.stderr[-6000:])
    return done.returncode


def run(out: Path) -> int:
    root, ref = out / "cluster", out / "reference"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    common = ["--steps", str(STEPS), "--save-every", "2", "--flush-every", "3"]
    banner("PyTorch, 4 ranks (DDP over gloo) on 2 simulated nodes, n0 and n1")
    print(
        "a small transformer on synthetic sequences; ckptfmt_torch.TrainingState holds the model,\n"
        "AdamW state, LR schedule, every rank's RNG states and the data-loader position. Every 2\n"
        "steps: level 1 (each node's own directory) with XOR parity across the nodes; every 3rd\n"
        "checkpoint also flushed to level 3 (shared) in the background"
    )
    torchrun("--root", str(root), *common, "--kill-node-after", str(KILL_AFTER), crash=True)

    banner(f"node n1 is lost after step {KILL_AFTER}: its processes and its level-1 directory")
    shutil.rmtree(root / "level1" / "n1")
    cli("list", str(root / "level3"))
    print(
        f"level 3's newest copy is older than step {KILL_AFTER}; level 1 has step "
        f"{KILL_AFTER} on n0 only, plus n0's share of the parity"
    )

    banner("restart the job on fresh processes (node n1 replaced by a new, empty one)")
    if torchrun("--root", str(root), *common, "--result", str(out / "resumed.json")) != 0:
        return 1

    banner("the same training without interruption, for comparison")
    if torchrun("--root", str(ref), *common, "--result", str(out / "reference.json")) != 0:
        return 1
    resumed = json.loads((out / "resumed.json").read_text())
    reference = json.loads((out / "reference.json").read_text())
    after = [s for s in map(int, resumed["losses"])]
    same_curve = all(resumed["losses"][str(s)] == reference["losses"][str(s)] for s in after)
    same = (
        same_curve
        and resumed["final_loss"] == reference["final_loss"]
        and resumed["params_sha256"] == reference["params_sha256"]
    )
    print(
        f"losses of steps {min(after)}..{max(after)} after the restart equal the uninterrupted "
        f"run's: {same_curve}\nfinal loss {float.fromhex(resumed['final_loss']):.9f} vs "
        f"{float.fromhex(reference['final_loss']):.9f}; parameters sha256 "
        f"{resumed['params_sha256'][:16]}... vs {reference['params_sha256'][:16]}...\n"
        f"final loss and parameters bitwise identical: {same}"
    )

    banner("what is on each level now; the result inspected and verified")
    cli("list", str(root / "level3"))
    final = root / "level3" / ckptfmt.step_dir_name(STEPS)
    cli("inspect", str(final), head=12, tail=22)
    status = cli("verify", str(final))
    print("\nlevel 1, node by node, with its parity:")
    status |= cli("verify", str(root / "level1" / "{node}" / ckptfmt.step_dir_name(STEPS)))
    print(
        "\nPyTorch demo finished: a lost node's checkpoint data rebuilt from parity; training "
        "resumed bitwise; nothing pickled."
    )
    return 0 if same and status == 0 else 1


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1] if len(sys.argv) > 1 else "demo-output/torch").absolute()))
