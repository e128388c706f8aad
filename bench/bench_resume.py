#!/usr/bin/env python3
"""Time to resume (issue 36, "the fastest way back"): same state, same run, medians.

The state is an MLP of ``--params-mib`` MiB of float32 parameters (``--width`` wide) with its
Adam state after one step: 3x that in all (80 MiB -> 240 MiB of model + Adam), saved once by each
method into ``--dir`` (``/dev/shm``: warm tmpfs, what the load path itself costs). Parts:

* ``load`` (one process; process killed, node intact): from the start of the restore to the
  model and optimizer holding the state, for ``ckptfmt_torch.load`` (every chunk's CRC32C
  checked), ``torch.load`` + ``load_state_dict`` (``weights_only=True``) and ``dcp.load`` (in
  place, then ``load_state_dict``), and ``raw``: the ckptfmt checkpoint's files read with
  ``readinto`` into one preallocated buffer (what the storage gives). The order rotates each
  round. Just before each timed window the destination tensors (and the raw buffer) are
  written to and the method's files read once: this VM hands memory idle for ~2 s back to
  the host and touching it again costs up to 4x, so untouched buffers would time the host.
  The first round is not timed and checks each method bit for bit against the saved state.
  ``--cold`` (``--dir`` on a disk): each method's files are written back and evicted from the
  page cache before its window instead of read, a restart after the node rebooted.
* ``restart`` (a fresh ``python`` per round and method): process start to state in the model,
  imports, model and optimizer construction included; the parent's wall clock before
  ``Popen`` to the child's when the load returned (the child's exit is not counted). Each
  child then checks a digest of the whole state against the saved one.
* ``lost`` (``--ranks`` ranks under ``mpiexec``, run by the script itself): a
  ``CheckpointManager`` with ``local_dir=".../{node}"`` and XOR redundancy over ``--nodes``
  simulated nodes (``node = f"n{rank * nodes // ranks}"``), each rank its rows of the state
  (``Shard``); one save, then rounds of ``restore`` with nothing lost against ``restore`` after
  one node's level-1 step directory was deleted (the rebuild included; the order alternates).
  The state's arrays are written to just before each timed window; time is rank 0's between
  two barriers. ``--profile`` writes a cProfile of one lost-node restore per rank.
* ``lightning`` / ``hf``: ``trainer.fit(ckpt_path=...)`` start to the first training step with
  ``ckptfmt_torch.lightning.CheckpointIO`` against Lightning's default ``TorchCheckpointIO``;
  the HF ``Trainer``'s ``resume_from_checkpoint`` with ``ckptfmt_torch.hf.Trainer`` against
  ``transformers.Trainer``; in one process, the order alternating.

    .venv/bin/python bench/bench_resume.py --parts load,restart,lost,lightning,hf \
        --out bench/results/resume.json      # writes resume.md beside it

See bench/README.md, "Time to resume".
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
LOAD_METHODS = ("ckptfmt", "ckptfmt_into", "torch", "dcp", "raw")
RESTART_METHODS = ("ckptfmt", "ckptfmt_into", "torch", "dcp")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--parts", default="load,restart,lost")
    ap.add_argument("--params-mib", type=int, default=80, help="float32 parameters (MiB)")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds (>= 5)")
    ap.add_argument("--ranks", type=int, default=4, help="ranks of the lost-node part")
    ap.add_argument("--nodes", default="4,2", help="simulated node counts of the lost part")
    ap.add_argument("--lose", type=int, default=1, help="the node whose level 1 is deleted")
    ap.add_argument("--profile", default="", help="lost part: cProfile files prefix")
    ap.add_argument("--fit-rounds", type=int, default=5, help="rounds of lightning / hf")
    ap.add_argument(
        "--cold",
        action="store_true",
        help="load part: each method's files evicted from the page cache before its window "
        "(a restart after the node rebooted; --dir on a disk, not tmpfs)",
    )
    ap.add_argument("--dir", default="/dev/shm/ckptfmt-bench-resume")
    ap.add_argument("--out", default=str(BENCH / "results" / "resume.json"))
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--mpi-nodes", type=int, default=0, help=argparse.SUPPRESS)
    return ap


# --- the state ----------------------------------------------------------------------------------


def _layers(args: argparse.Namespace) -> int:
    w = args.width
    return max(1, round(args.params_mib * (1 << 20) / 4 / (w * w + w)))


def build(args: argparse.Namespace, step: bool) -> tuple[Any, Any]:
    """The model and its Adam (after one step when ``step``: the state a save holds)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *(torch.nn.Linear(args.width, args.width) for _ in range(_layers(args)))
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if step:
        model(torch.randn(8, args.width)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def tensors(model: Any, opt: Any) -> list[Any]:
    """Every tensor of the state, in a fixed order (parameters, then Adam's slots)."""
    out = [p.data for p in model.parameters()]
    for p in model.parameters():
        st = opt.state.get(p, {})
        out += [st[k] for k in sorted(st) if k != "step"]
    return out


def digest(model: Any, opt: Any) -> str:
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    for t in tensors(model, opt):
        h.update(t.detach().contiguous().view(-1).numpy().view("u1"))
    return h.hexdigest()


def state_bytes(model: Any, opt: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(model, opt))


def paths(root: Path) -> dict[str, Path]:
    return {"ckptfmt": root / "ckptfmt", "torch": root / "torch.pt", "dcp": root / "dcp"}


def save_all(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Save the state once by each method; its digest and byte counts."""
    import ckptfmt_torch
    import torch
    import torch.distributed.checkpoint as dcp

    import ckptfmt

    model, opt = build(args, step=True)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    p = paths(root)
    ckptfmt_torch.save(
        {"model": model, "optim": opt}, p["ckptfmt"], write=ckptfmt.WriteOptions(fsync=False)
    )
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, p["torch"])
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)  # DCP's own way (parameter names as keys)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=p["dcp"])
    return {
        "digest": digest(model, opt),
        "state_bytes": state_bytes(model, opt),
        "files_bytes": {k: _bytes(v) for k, v in p.items()},
        "layers": _layers(args),
    }


def _bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _files(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())


def _evict(path: Path) -> None:
    """Drop the pages of every file of ``path`` from the page cache (written back first), so
    that the next read comes from the device; tmpfs keeps them (it has no device)."""
    os.sync()
    for f in _files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _warm(path: Path) -> None:
    """Read every file of ``path`` once (its tmpfs pages touched just before the window)."""
    for f in _files(path):
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


# --- the loads ----------------------------------------------------------------------------------


def load_into(method: str, model: Any, opt: Any, p: dict[str, Path]) -> None:
    """Restore by ``method`` into ``model`` and ``opt`` (what each library's users write)."""
    if method in ("ckptfmt", "ckptfmt_into"):
        import ckptfmt_torch

        into = method == "ckptfmt_into"  # read straight into the tensors: no second copy
        ckptfmt_torch.load({"model": model, "optim": opt}, p["ckptfmt"], into=into)
    elif method == "torch":
        import torch

        sd = torch.load(p["torch"], weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
    elif method == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(model, opt)  # DCP's own way: Adam's slots made to load into
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=p["dcp"])
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    else:
        raise ValueError(method)


def raw_read(files: list[Path], buf: Any) -> int:
    """Read ``files`` into ``buf`` one after another with ``readinto``; the bytes read."""
    view = memoryview(buf).cast("B")
    at = 0
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while True:
                n = fh.readinto(view[at:])
                if not n:
                    break
                at += n
    return at


def part_load(args: argparse.Namespace, root: Path, saved: dict[str, Any]) -> dict[str, Any]:
    import warnings

    import numpy as np
    import torch

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    p = paths(root)
    model, opt = build(args, step=True)  # Adam's slots exist: every method loads in place
    ck_files = _files(p["ckptfmt"])
    buf = np.empty(saved["files_bytes"]["ckptfmt"], dtype=np.uint8)
    times: dict[str, list[float]] = {m: [] for m in LOAD_METHODS}
    cpu: dict[str, list[float]] = {m: [] for m in LOAD_METHODS}  # this process, all threads
    for r in range(args.rounds + 1):
        k = r % len(LOAD_METHODS)
        order = LOAD_METHODS[k:] + LOAD_METHODS[:k]
        for m in order:
            # touch: destinations written, the source files read, just before the window
            with torch.no_grad():
                for t in tensors(model, opt):
                    t.fill_(0.0)
            buf.fill(0)
            (_evict if args.cold else _warm)(
                p["ckptfmt" if m == "raw" else m.removesuffix("_into")]
            )
            c0 = time.process_time()
            t0 = time.perf_counter()
            if m == "raw":
                got = raw_read(ck_files, buf)
                dt = time.perf_counter() - t0
                assert got == buf.nbytes
            else:
                load_into(m, model, opt, p)
                dt = time.perf_counter() - t0
            dc = time.process_time() - c0
            if m != "raw" and r == 0 and digest(model, opt) != saved["digest"]:
                raise SystemExit(f"{m}: the loaded state differs from the saved one")
            if r > 0:
                times[m].append(dt)
                cpu[m].append(dc)
    return {"times": times, **_summary(times, "ckptfmt"), "cpu": _cpu(cpu, "ckptfmt")}


def _cpu(cpu: dict[str, list[float]], ours: str) -> dict[str, Any]:
    """CPU seconds (every thread of the timed processes) per method: what the work costs
    whatever else the shared machine runs, which stretches wall clocks far more."""
    return {
        "times": cpu,
        "median_s": {m: statistics.median(v) for m, v in cpu.items() if v},
        "paired": {
            m: statistics.median(a / b for a, b in zip(v, cpu[ours]) if b > 0)
            for m, v in cpu.items()
            if v and m != ours
        },
    }


def _summary(times: dict[str, list[float]], ours: str) -> dict[str, Any]:
    med = {m: statistics.median(v) for m, v in times.items() if v}
    return {
        "median_s": med,
        "min_s": {m: min(v) for m, v in times.items() if v},
        "max_s": {m: max(v) for m, v in times.items() if v},
        "speedup": {m: med[m] / med[ours] for m in med if m != ours},
        # the same ratio round by round (both timed within seconds of each other), median
        "paired": {
            m: statistics.median(a / b for a, b in zip(v, times[ours]))
            for m, v in times.items()
            if v and m != ours
        },
    }


# --- whole restarts -----------------------------------------------------------------------------


def child(args: argparse.Namespace) -> None:
    """One restart: imports, the model, its optimizer, the load; prints the wall clock when the
    state is in the model, then the state's digest (checked by the parent, outside the time)."""
    import torch

    model, opt = build(args, step=False)
    load_into(args.child, model, opt, paths(Path(args.dir)))
    done = time.time()
    print(json.dumps({"done": done, "digest": digest(model, opt)}), flush=True)
    del torch


def part_restart(args: argparse.Namespace, root: Path, saved: dict[str, Any]) -> dict[str, Any]:
    p = paths(root)
    times: dict[str, list[float]] = {m: [] for m in RESTART_METHODS}
    # bytecode cached, as for an installed package (this VM sets PYTHONDONTWRITEBYTECODE,
    # which recompiles every ckptfmt module at each start: ~0.2 s); round 0 compiles it
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONWARNINGS="ignore", PYTHONPYCACHEPREFIX=str(root / "pycache"))
    for r in range(args.rounds + 1):
        k = r % len(RESTART_METHODS)
        order = RESTART_METHODS[k:] + RESTART_METHODS[:k]
        for m in order:
            _warm(p[m.removesuffix("_into")])
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", m, "--dir", str(root)]
            cmd += ["--params-mib", str(args.params_mib), "--width", str(args.width)]
            t0 = time.time()
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
            if done.returncode != 0:
                raise SystemExit(f"restart {m} failed:\n{done.stderr[-3000:]}")
            res = json.loads(done.stdout.strip().splitlines()[-1])
            if res["digest"] != saved["digest"]:
                raise SystemExit(f"restart {m}: the loaded state differs from the saved one")
            if r > 0:
                times[m].append(res["done"] - t0)
    imports = {}
    for what in ("torch", "ckptfmt_torch"):
        code = f"import time; t=time.perf_counter(); import {what}; print(time.perf_counter()-t)"
        if what == "ckptfmt_torch":
            code = "import torch; " + code
        runs = [
            float(
                subprocess.run(
                    [sys.executable, "-c", code], capture_output=True, text=True, env=env
                ).stdout.strip()
            )
            for _ in range(3)
        ]
        imports[what] = statistics.median(runs)
    return {"times": times, "import_s": imports, **_summary(times, "ckptfmt")}


# --- one node lost ------------------------------------------------------------------------------


def mpi_lost(args: argparse.Namespace) -> None:
    """Under mpiexec: each rank saves its rows once, then times restores (see the docstring)."""
    import numpy as np

    import ckptfmt
    from ckptfmt.storage.steps import step_dir_name
    from ckptfmt.transport.mpi import MpiComm

    comm = MpiComm()
    rank, size = comm.rank, comm.size
    nodes = args.mpi_nodes
    node = f"n{rank * nodes // size}"
    root = Path(args.dir) / f"lost-{nodes}"
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    comm.barrier()
    total = args.params_mib * 3 << 20  # the same bytes as model + Adam
    cols = 1 << 16
    rows = total // 4 // cols // size
    names = ("param", "exp_avg", "exp_avg_sq")
    rng = np.random.default_rng(rank)
    state = {
        n: ckptfmt.Shard(
            rng.standard_normal((rows // 3, cols), dtype=np.float32),
            (rank * (rows // 3), 0),
            (size * (rows // 3), cols),
        )
        for n in names
    }
    want = {n: state[n].data.copy() for n in names}
    mgr = ckptfmt.CheckpointManager(
        local_dir=str(root / "{node}"),
        comm=comm,
        node=node,
        redundancy="xor",
        write=ckptfmt.WriteOptions(fsync=False),
        at_exit=ckptfmt.ExitPolicy(flush=False),
    )
    mgr.save(1, state)
    mgr.wait()
    lost_dir = root / f"n{args.lose}" / step_dir_name(1)
    times: dict[str, list[float]] = {"intact": [], "lost": []}
    cpu: dict[str, list[float]] = {"intact": [], "lost": []}  # every rank's, summed
    rebuild: list[float] = []
    rewrite: list[float] = []  # the background write's time left once restore returned
    for r in range(args.rounds + 1):
        for kind in ("intact", "lost") if r % 2 == 0 else ("lost", "intact"):
            if kind == "lost" and rank == 0:
                shutil.rmtree(lost_dir)
            for n in names:
                state[n].data.fill(0)  # touch, just before the window
            prof = None
            if kind == "lost" and r == 1 and args.profile:
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
            comm.barrier()
            c0 = time.process_time()
            t0 = time.perf_counter()
            rep = mgr.restore(state)
            comm.barrier()
            dt = time.perf_counter() - t0
            dc = time.process_time() - c0
            if prof is not None:
                prof.disable()
                prof.dump_stats(f"{args.profile}-{nodes}n-r{rank}.prof")
            if rep.step != 1 or rep.level != 1 or bool(rep.rebuilt) != (kind == "lost"):
                raise SystemExit(f"rank {rank}: {kind}: {rep}")
            if any(not np.array_equal(state[n].data, want[n]) for n in names):
                raise SystemExit(f"rank {rank}: {kind}: the restored rows differ")
            # the rebuilt files are written on the saver thread after restore returned: the
            # time the rest of that takes is measured apart, never inside the next window
            t1 = time.perf_counter()
            mgr.wait()
            comm.barrier()
            left = time.perf_counter() - t1
            all_cpu = sum(float(x) for x in comm.allgather_json(dc))
            if kind == "lost" and rep.rewrite not in ("", "written"):
                raise SystemExit(f"rank {rank}: the rebuilt files: {rep.rewrite}")
            if r > 0:
                times[kind].append(dt)
                cpu[kind].append(all_cpu)
                if kind == "lost":
                    rebuild.append(rep.rebuild_seconds)
                    rewrite.append(left)
    mgr.close(flush=False)
    if rank == 0:
        out = {
            "times": times,
            "rebuild_seconds": rebuild,
            "rewrite_left_seconds": rewrite,
            "ranks": size,
            "nodes": nodes,
            "bytes_per_rank": sum(state[n].data.nbytes for n in names),
            **_summary(times, "intact"),
            "cpu": _cpu(cpu, "intact"),
        }
        print("RESULT " + json.dumps(out), flush=True)


def part_lost(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    py = Path(sys.executable)
    mpiexec = py.with_name("mpiexec")
    out: dict[str, Any] = {}
    for nodes in (int(n) for n in args.nodes.split(",")):
        cmd = ["timeout", "-k", "5", "900", str(mpiexec), "-n", str(args.ranks)]
        cmd += [str(py), "-m", "mpi4py", str(Path(__file__).resolve()), "--mpi-nodes", str(nodes)]
        cmd += ["--dir", str(root), "--params-mib", str(args.params_mib)]
        cmd += ["--rounds", str(args.rounds), "--lose", str(args.lose)]
        if args.profile:
            cmd += ["--profile", args.profile]
        done = subprocess.run(cmd, capture_output=True, text=True)
        line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if done.returncode != 0 or not line:
            raise SystemExit(
                f"lost ({nodes} nodes) failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
            )
        res = json.loads(line[0][len("RESULT ") :])
        res["slowdown"] = res["median_s"]["lost"] / res["median_s"]["intact"]
        out[f"{nodes}"] = res
    return out


# --- Lightning and the HF Trainer ---------------------------------------------------------------


def part_lightning(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """``trainer.fit(ckpt_path=...)``: start to the first training step, ckptfmt's CheckpointIO
    against Lightning's default, the checkpoint saved once by each after one step."""
    import pytorch_lightning as L
    import torch
    from integrations_lightning import _data, _io, _model, _trainer

    ns = argparse.Namespace(batch=8)
    base = root / "lightning"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    ckpts = {}
    for kind in ("ckptfmt", "torch"):
        trainer = _trainer(_io(kind), 1, [])
        trainer.fit(_model(args.params_mib), _data(ns, 4))
        ckpts[kind] = base / f"{kind}.ckpt"
        trainer.save_checkpoint(ckpts[kind])

    class First(L.Callback):
        def __init__(self) -> None:
            self.at: float | None = None

        def on_train_batch_start(self, trainer: Any, *a: Any) -> int:
            if self.at is None:
                self.at = time.perf_counter()
            trainer.should_stop = True
            return -1  # skip the step and stop: only the resume is timed

    times: dict[str, list[float]] = {"ckptfmt": [], "torch": []}
    for r in range(args.fit_rounds + 1):
        for kind in ("ckptfmt", "torch") if r % 2 == 0 else ("torch", "ckptfmt"):
            model = _model(args.params_mib)
            with torch.no_grad():
                for prm in model.parameters():
                    prm.fill_(0.0)
            _warm(ckpts[kind])
            first = First()
            trainer = L.Trainer(
                plugins=[_io(kind)],
                callbacks=[first],
                enable_checkpointing=False,
                default_root_dir=str(base),
                accelerator="cpu",
                devices=1,
                max_steps=2,
                logger=False,
                enable_progress_bar=False,
                enable_model_summary=False,
            )
            t0 = time.perf_counter()
            trainer.fit(model, _data(ns, 4), ckpt_path=str(ckpts[kind]))
            if first.at is None:
                raise SystemExit(f"lightning {kind}: no training step was reached")
            if r > 0:
                times[kind].append(first.at - t0)
    return {"times": times, **_summary(times, "ckptfmt")}


def part_hf(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """HF ``Trainer.train(resume_from_checkpoint=...)``: start to the first step, ckptfmt's
    ``Trainer`` against ``transformers.Trainer``, each from its own checkpoint of step 2."""
    import torch
    import transformers
    from ckptfmt_torch.hf import Trainer
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

    class First(TrainerCallback):
        def __init__(self) -> None:
            self.at: float | None = None

        def on_step_begin(self, targs: Any, state: Any, control: Any, **kw: Any) -> Any:
            if self.at is None:
                self.at = time.perf_counter()
            control.should_training_stop = True
            return control

    seq = 32
    config = GPT2Config(n_layer=4, n_embd=512, n_head=8, vocab_size=8192, n_positions=seq)
    x = torch.randint(0, config.vocab_size, (64, seq), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": r, "labels": r} for r in x]

    def make(kind: str, out: Path, steps: int, cb: list[Any]) -> Any:
        torch.manual_seed(0)
        targs = TrainingArguments(
            str(out),
            max_steps=steps,
            save_steps=2,
            save_strategy="steps",
            per_device_train_batch_size=2,
            use_cpu=True,
            report_to=[],
            disable_tqdm=True,
            logging_steps=1000,
        )
        cls = transformers.Trainer if kind == "hf" else Trainer
        return cls(model=GPT2LMHeadModel(config), args=targs, train_dataset=data, callbacks=cb)

    base = root / "hf"
    shutil.rmtree(base, ignore_errors=True)
    for kind in ("ckptfmt", "hf"):
        tr = make(kind, base / kind, 2, [])
        tr.train()
        mgr = getattr(tr, "checkpoint_manager", None)
        if mgr is not None:
            mgr.close()
    times: dict[str, list[float]] = {"ckptfmt": [], "hf": []}
    for r in range(args.fit_rounds + 1):
        for kind in ("ckptfmt", "hf") if r % 2 == 0 else ("hf", "ckptfmt"):
            first = First()
            tr = make(kind, base / kind, 4, [first])
            _warm(base / kind / "checkpoint-2")
            t0 = time.perf_counter()
            tr.train(resume_from_checkpoint=str(base / kind / "checkpoint-2"))
            if first.at is None:
                raise SystemExit(f"hf {kind}: no training step was reached")
            mgr = getattr(tr, "checkpoint_manager", None)
            if mgr is not None:
                mgr.close()
            if r > 0:
                times[kind].append(first.at - t0)
    params = sum(p.numel() for p in GPT2LMHeadModel(config).parameters())
    return {"times": times, "params": params, **_summary(times, "ckptfmt")}


# --- the table ----------------------------------------------------------------------------------


def _spread(res: dict[str, Any], m: str) -> str:
    return f"{res['median_s'][m]:.3f} ({res['min_s'][m]:.3f}-{res['max_s'][m]:.3f})"


def markdown(res: dict[str, Any]) -> str:
    lines = [f"Machine: {res['machine']}. State: {res['state_mib']:.0f} MiB (model + Adam)."]
    if "load" in res:
        ld = res["load"]
        b = res["state_bytes"]
        lines += [
            "",
            f"| restore, node intact ({'cold: from the disk' if res.get('cold') else 'warm'}) "
            "| median s (min-max) | GB/s "
            "| ckptfmt faster by (paired) |",
            "|---|---|---|---|",
        ]
        for m in LOAD_METHODS:
            speed = b / ld["median_s"][m] / 1e9
            x = "" if m == "ckptfmt" else f"{ld['speedup'][m]:.2f}x ({ld['paired'][m]:.2f}x)"
            lines.append(f"| {m} | {_spread(ld, m)} | {speed:.2f} | {x} |")
        for m in ("ckptfmt", "ckptfmt_into"):
            ratio = ld["median_s"]["raw"] / ld["median_s"][m]
            lines.append(f"\n{m}: {ratio:.2f} of the raw read speed (raw: the same files)")
        if "cpu" in ld:
            c = ld["cpu"]
            lines.append(
                "\nCPU s (median; paired ratio to ckptfmt): "
                + ", ".join(
                    f"{m} {c['median_s'][m]:.3f}"
                    + ("" if m == "ckptfmt" else f" ({c['paired'][m]:.2f})")
                    for m in LOAD_METHODS
                )
            )
    if "restart" in res:
        rs = res["restart"]
        lines += [
            "",
            "| whole restart (fresh python) | median s (min-max) | ckptfmt / it (paired) |",
            "|---|---|---|",
        ]
        for m in RESTART_METHODS:
            x = "" if m == "ckptfmt" else f"{1 / rs['speedup'][m]:.2f} ({1 / rs['paired'][m]:.2f})"
            lines.append(f"| {m} | {_spread(rs, m)} | {x} |")
        lines.append(
            f"\nimport torch {rs['import_s']['torch']:.2f} s; import ckptfmt_torch after it "
            f"{rs['import_s']['ckptfmt_torch']:.2f} s (medians of 3)"
        )
    if "lost" in res:
        lines += [
            "",
            "| one node lost, XOR | intact s | lost s (rebuild included) | lost / intact "
            "| rewrite left after s |",
            "|---|---|---|---|---|",
        ]
        for n, lo in res["lost"].items():
            left = lo.get("rewrite_left_seconds") or [0.0]
            lines.append(
                f"| {lo['ranks']} ranks on {n} nodes, {lo['bytes_per_rank'] / 2**20:.0f} MiB/rank "
                f"| {_spread(lo, 'intact')} | {_spread(lo, 'lost')} "
                f"| {lo['slowdown']:.2f}x ({lo['paired']['lost']:.2f}x) "
                f"| {statistics.median(left):.3f} |"
            )
        for n, lo in res["lost"].items():
            if "cpu" in lo:
                c = lo["cpu"]
                lines.append(
                    f"\n{n} nodes, CPU s of all ranks (median): intact "
                    f"{c['median_s']['intact']:.3f}, lost {c['median_s']['lost']:.3f} "
                    f"(paired lost / intact {c['paired']['lost']:.2f}x)"
                )
    for part, base in (("lightning", "torch"), ("hf", "hf")):
        if part in res:
            pr = res[part]
            lines += [
                "",
                f"| {part}: resume to first step | median s (min-max) | ckptfmt / it (paired) |",
                "|---|---|---|",
            ]
            for m in ("ckptfmt", base):
                x = (
                    ""
                    if m == "ckptfmt"
                    else f"{1 / pr['speedup'][m]:.2f} ({1 / pr['paired'][m]:.2f})"
                )
                lines.append(f"| {m} | {_spread(pr, m)} | {x} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.child:
        child(args)
        return 0
    if args.mpi_nodes:
        mpi_lost(args)
        return 0
    sys.path.insert(0, str(BENCH))
    root = Path(args.dir)
    parts = args.parts.split(",")
    res: dict[str, Any] = {
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs (shared), "
        f"Python {platform.python_version()}",
        "rounds": args.rounds,
        "touch": "destination tensors written and source files "
        + ("evicted from the page cache" if args.cold else "read")
        + " just before each window",
        "cold": args.cold,
    }
    if {"load", "restart"} & set(parts):
        saved = save_all(args, root)
        res.update(state_bytes=saved["state_bytes"], files_bytes=saved["files_bytes"])
        res["state_mib"] = saved["state_bytes"] / 2**20
        if "load" in parts:
            res["load"] = part_load(args, root, saved)
        if "restart" in parts:
            res["restart"] = part_restart(args, root, saved)
    res.setdefault("state_mib", args.params_mib * 3)
    if "lost" in parts:
        res["lost"] = part_lost(args, root)
    if "lightning" in parts:
        res["lightning"] = part_lightning(args, root)
    if "hf" in parts:
        res["hf"] = part_hf(args, root)
    shutil.rmtree(root, ignore_errors=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    md = markdown(res)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
