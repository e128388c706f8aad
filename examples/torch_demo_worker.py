"""One rank of the PyTorch demo: a small transformer trained data-parallel (DDP over gloo) with
multi-level, redundant checkpoints. Run under ``torchrun --nproc-per-node 4``;
``examples/torch_demo.py`` drives it.

Rank r of 4 lives on simulated node ``n{r * 2 // 4}`` (``CKPTFMT_NODE``, as a cluster's launcher
would set per node). Every ``--save-every`` steps the whole training state (model, AdamW state,
LR schedule, every rank's RNG states, the data-loader position, the step counter) goes to the
node-local level 1 with XOR parity across the two nodes; every ``--flush-every``-th checkpoint
is also copied to the shared level 3 in the background. ``--kill-node-after N``: once step N's
checkpoint is committed, every process dies at once (``os._exit``), as when node n1 fails and
the scheduler ends the job; nothing is flushed on the way out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

VOCAB, SEQ, D, HEADS, LAYERS, BATCH, N_SEQ = 32, 24, 64, 4, 2, 8, 512


class TinyGPT(nn.Module):
    """A two-layer causal transformer with dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)
        layer = nn.TransformerEncoderLayer(
            D, HEADS, 4 * D, dropout=0.1, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ - 1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x, mask=self.mask, is_causal=True)))


def dataset() -> torch.utils.data.TensorDataset:
    """Deterministic synthetic sequences: x[t+1] = (a * x[t] + b) mod VOCAB, a and b per row."""
    g = torch.Generator().manual_seed(2024)
    a = torch.randint(1, VOCAB, (N_SEQ, 1), generator=g)
    b = torch.randint(0, VOCAB, (N_SEQ, 1), generator=g)
    x = [torch.randint(0, VOCAB, (N_SEQ, 1), generator=g)]
    for _ in range(SEQ - 1):
        x.append((a * x[-1] + b) % VOCAB)
    return torch.utils.data.TensorDataset(torch.cat(x, dim=1))


def params_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode() + p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--flush-every", type=int, default=3)
    ap.add_argument("--kill-node-after", type=int, default=0)
    ap.add_argument("--result", default="")
    a = ap.parse_args()

    import ckptfmt_torch

    from ckptfmt import CheckpointManager

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    os.environ["CKPTFMT_NODE"] = f"n{rank * 2 // size}"  # what each node's launcher would set
    say = print if rank == 0 else (lambda *args, **kw: None)
    torch.manual_seed(1000 + rank)  # every rank its own random streams (dropout, noise)
    np.random.seed(2000 + rank)
    random.seed(3000 + rank)

    torch.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts them)
    # find_unused_parameters: DDP then never re-orders its gradient buckets after the first
    # iteration; a restarted job's first iteration would otherwise sum in another order on
    # more than two ranks and the runs would differ in the last bits
    model = nn.parallel.DistributedDataParallel(TinyGPT(), find_unused_parameters=True)
    torch.manual_seed(1000 + rank)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.steps)
    sampler = ckptfmt_torch.ResumableSampler(N_SEQ, shuffle=True, seed=5)
    loader = torch.utils.data.DataLoader(
        dataset(), batch_size=BATCH, sampler=sampler, generator=torch.Generator()
    )
    ts = ckptfmt_torch.TrainingState(
        model, opt, scheduler=sched, sampler=sampler, counters={"step": 0}
    )
    state = {"train": ts}
    mgr = CheckpointManager(
        local_dir=f"{a.root}/level1/{{node}}",
        shared_dir=f"{a.root}/level3",
        comm=ckptfmt_torch.TorchComm(),
        redundancy="xor",
        flush_every=a.flush_every,
        keep_local=2,
        keep_shared=2,
    )
    r = ckptfmt_torch.restore(state, mgr)
    if not r.restored:
        say("  no checkpoint anywhere: starting from scratch", flush=True)
    else:
        for line in r.tried:
            say(f"  refused: {line}", flush=True)
        for line in r.rebuilt:
            say(f"  REBUILT from parity: {line}", flush=True)
        took = f" (rebuilt in {r.rebuild_seconds:.2f} s)" if r.rebuilt else ""
        say(
            f"  restored step {r.step} from level {r.level}{took}: model, optimizer, LR "
            f"schedule, RNG of every rank, data position {sampler.state_dict()}",
            flush=True,
        )
    step = ts.counters["step"]
    losses: dict[str, str] = {}
    saves = 0  # the manager flushes every flush_every-th save of this job
    while step < a.steps:
        for (seq,) in loader:
            step += 1
            x, y = seq[:, :-1], seq[:, 1:]
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            ts.counters["step"] = step
            losses[str(step)] = float(loss.detach()).hex()
            note = ""
            if step % a.save_every == 0:
                mgr.save(step, ckptfmt_torch.to_state(state))
                saves += 1
                flushed = saves % a.flush_every == 0
                note = "  -> checkpoint on level 1 (xor parity)" + (
                    " + flushed to level 3" if flushed else ""
                )
            say(f"  step {step:3d}  loss {float(loss.detach()):.6f}{note}", flush=True)
            if a.kill_node_after and step == a.kill_node_after:
                mgr.wait()  # step N's checkpoint is committed everywhere, with its parity
                dist.barrier()
                say(f"  step {step}: node n1 fails; the scheduler ends the job", flush=True)
                sys.stdout.flush()
                os._exit(1)
            if step >= a.steps:
                break
    mgr.close()  # waits, and flushes the newest checkpoint to level 3
    if rank == 0 and a.result:
        Path(a.result).write_text(
            json.dumps(
                {
                    "final_loss": losses[str(a.steps)],
                    "losses": losses,
                    "params_sha256": params_digest(model),
                },
                indent=1,
            )
        )
    dist.barrier()  # nobody tears its process groups down while another rank still works
    dist.destroy_process_group()
    # everything is written: leave without interpreter finalization, where torch's gloo teardown
    # can abort a finished rank ("terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
