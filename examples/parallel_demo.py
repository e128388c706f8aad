"""One rank of the multi-node demo: data-parallel training of a small numpy MLP with
multi-level checkpoints (run under ``mpiexec -n 4 python -m mpi4py``; ``examples/demo.py``
drives it).

Each rank holds a replica of the model, computes gradients on its quarter of a deterministic
batch, and the gradients are summed with MPI allreduce. ``CheckpointManager`` saves every
``--save-every`` steps to node-local level 1 (two simulated nodes, ``n0`` and ``n1``) and flushes
every ``--flush-every``-th checkpoint to shared level 3. ``--crash-after N`` ends the job abruptly
after step N's checkpoint is on level 1 (no exit flush), as a failed node would.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ckptfmt import CheckpointManager
from ckptfmt.parallel.mpi import MpiComm

D_IN, D_HID, BATCH, LR = 64, 256, 512, 0.02


def init_model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1234)
    return {
        "w1": (rng.standard_normal((D_IN, D_HID)) / np.sqrt(D_IN)).astype(np.float32),
        "b1": np.zeros(D_HID, np.float32),
        "w2": (rng.standard_normal((D_HID, 1)) / np.sqrt(D_HID)).astype(np.float32),
        "b2": np.zeros(1, np.float32),
    }


def batch(step: int, rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    x = rng.standard_normal((BATCH, D_IN)).astype(np.float32)
    y = np.sin(x[:, :4].sum(axis=1, keepdims=True)).astype(np.float32)
    part = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    return x[part], y[part]


def train_step(m: dict[str, np.ndarray], step: int, comm: MPI.Intracomm) -> float:
    x, y = batch(step, comm.rank, comm.size)
    h = np.maximum(x @ m["w1"] + m["b1"], 0)
    out = h @ m["w2"] + m["b2"]
    err = (out - y) / BATCH
    grads = {"w2": h.T @ err, "b2": err.sum(0)}
    dh = (err @ m["w2"].T) * (h > 0)
    grads |= {"w1": x.T @ dh, "b1": dh.sum(0)}
    local_loss = np.array([float(((out - y) ** 2).sum() / BATCH)])
    loss = np.zeros(1)
    comm.Allreduce(local_loss, loss)
    for k in ("w1", "b1", "w2", "b2"):
        total = np.empty_like(grads[k])
        comm.Allreduce(np.ascontiguousarray(grads[k]), total)
        m[k] -= LR * total
    return float(loss[0])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--flush-every", type=int, default=2)
    p.add_argument("--crash-after", type=int, default=0)
    p.add_argument("--result", default="")
    a = p.parse_args()
    world = MPI.COMM_WORLD
    node = f"n{world.rank * 2 // world.size}"
    comm = MpiComm()
    mgr = CheckpointManager(
        f"{a.root}/level1/{{node}}",
        f"{a.root}/level3",
        comm=comm,
        node=node,
        flush_every=a.flush_every,
        keep_local=2,
        keep_shared=2,
    )
    state = {"model": init_model(), "loss_history": []}
    restored = mgr.restore(state)
    say = print if world.rank == 0 else (lambda *args, **kw: None)
    if restored is None:
        say("  no checkpoint: starting from scratch", flush=True)
        start = 1
    else:
        r = mgr.last_restore
        assert r is not None
        say(f"  restored step {restored} from level {r.level} ({len(r.tried)} newer copies "
            "refused, see the log above)", flush=True)
        start = restored + 1
    for step in range(start, a.steps + 1):
        loss = train_step(state["model"], step, world)
        state["loss_history"].append(loss)
        if step % a.save_every == 0:
            mgr.save(step, state)
            say(
                f"  step {step:3d}  loss {loss:.6f}  checkpoint saved (level 1; every "
                f"{a.flush_every}nd one also flushed to level 3)",
                flush=True,
            )
        if a.crash_after and step == a.crash_after:
            mgr.wait()
            say(
                f"  step {step}: node n1 fails now (processes die, its level-1 directory is lost)",
                flush=True,
            )
            sys.stdout.flush()
            world.Barrier()
            os._exit(1)
    mgr.close()
    if world.rank == 0 and a.result:
        Path(a.result).write_text(
            json.dumps(
                {
                    "loss": state["loss_history"][-1],
                    "params": {k: v.tobytes().hex() for k, v in state["model"].items()},
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
