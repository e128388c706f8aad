"""A rank of a job whose manager's level 3 is a bucket: ``_bucket_worker.py mpi|torch PLAN.json``.

Run under ``mpiexec ... python -m mpi4py`` (``mpi``) or ``torchrun`` (``torch``) by
``tests/objects/test_manager_bucket_jobs.py``, with the AWS environment of the tests' S3 server
(or of the fault proxy in front of it). ``PLAN.json``::

    {"out": DIR, "root": DIR, "url": "s3://bucket/run", "options": {...storage_options},
     "tasks": [{"name": ..., "action": "save" | "wipe" | "restore" | "torch-save" |
                "torch-restore" | "url-save" | "url-load" | "torch-url-save" |
                "torch-url-load", ...}, ...]}

Level 1 is ``<root>/l1/{node}`` (rank ``r`` of ``n`` on node ``n{r * 2 // n}``). ``save`` saves
``steps`` (each waited for; ``hold``: after the step named, rank 0 writes ``<out>/<mark>`` and
every rank waits for ``<out>/<mark>.go``, which the parent writes once it has changed the
server, so a fault lands between two flushes); ``wipe`` removes every node's level 1 (each
node's first rank its own); ``restore`` restores into a zeroed template and checks every byte
against the state of the step restored. ``torch-save``/``torch-restore`` do the same with a
``torch.nn`` model and its optimizer through ``ckptfmt_torch.to_state`` / ``restore``.
``url-save`` saves ``step`` collectively straight to ``<url>/direct`` (no manager:
``ckptfmt.parallel.save_to_bucket``); ``url-load`` loads it whole on each rank and checks every
byte; ``torch-url-save`` / ``torch-url-load`` do the same through ``ckptfmt_torch.save`` /
``load`` with a model and its optimizer.
Each rank writes ``<out>/<task>.rank<r>.json``: what it saw and the problems it found.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from kit.worker import end_torch_job, make_comm, node_of

ROWS, COLS = 97, 1000  # the sharded tensor: uneven over 2 and 4 ranks


def full(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([step, 11])
    return {
        "w": rng.standard_normal((ROWS, COLS)).astype(np.float32),
        "emb": rng.standard_normal((300, 256)).astype(np.float32),
    }


def rows(rank: int, size: int) -> tuple[int, int]:
    base, extra = divmod(ROWS, size)
    start = rank * base + min(rank, extra)
    return start, base + (rank < extra)


def state(step: int, rank: int, size: int, zero: bool = False) -> dict[str, Any]:
    from ckptfmt import PerRank, Shard

    g = full(step)
    start, n = rows(rank, size)
    w = g["w"][start : start + n].copy()
    emb = g["emb"]
    rng = np.full(8, rank * 1000 + step, np.int64)
    if zero:
        w, emb, rng = np.zeros_like(w), np.zeros_like(emb), np.zeros_like(rng)
    return {
        "model": {"w": Shard(w, (start, 0), (ROWS, COLS)), "emb": emb},
        "rng": PerRank(rng),
        "step": -1 if zero else step,
    }


def manager(plan: dict[str, Any], task: dict[str, Any], comm: Any) -> Any:
    from ckptfmt import CheckpointManager, ExitPolicy, WriteOptions

    root = Path(plan["root"])
    return CheckpointManager(
        local_dir=root / "l1" / "{node}",
        shared_dir=plan["url"],
        storage_options=plan.get("options") or None,
        comm=comm,
        node=node_of(comm.rank, comm.size),
        flush_every=task.get("flush_every", 1),
        keep_local=task.get("keep_local", 2),
        keep_shared=task.get("keep_shared", 3),
        write=WriteOptions(
            fsync=False,
            chunk_bytes=task.get("chunk_bytes", 64 << 10),
            shard_bytes=task.get("shard_bytes", 256 << 10),
        ),
        at_exit=ExitPolicy(flush=False, sigterm=False),
        deadline_s=120,
    )


def wait_for(path: Path, deadline_s: float = 90) -> None:
    end = time.monotonic() + deadline_s
    while not path.exists():
        if time.monotonic() > end:
            raise SystemExit(f"{path} never appeared")
        time.sleep(0.05)


def do_save(plan: dict[str, Any], task: dict[str, Any], comm: Any) -> dict[str, Any]:
    out = Path(plan["out"])
    mgr = manager(plan, task, comm)
    res: dict[str, Any] = {"saves": {}}
    hold = task.get("hold", {})
    for step in task["steps"]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mgr.save(step, state(step, comm.rank, comm.size))
            mgr.wait()  # the save, its flush and retention are done; a failure is warned of
        report = mgr.last_save
        res["saves"][str(step)] = {
            "flushed": bool(report and report.flushed),
            "warnings": [str(w.message) for w in caught],
        }
        if str(step) in hold:
            comm.barrier()
            if comm.rank == 0:
                (out / hold[str(step)]).write_text(str(step))
            wait_for(out / f"{hold[str(step)]}.go")
            comm.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr.close(flush=task.get("close_flush", False))
    failed = [(s, str(e)) for s, e in mgr.failed_saves]
    res["failed"] = failed
    res["warnings"] = [str(w.message) for w in caught]
    res["requests"] = dict(mgr._retention.shared.root.requests)
    return res


def do_wipe(plan: dict[str, Any], comm: Any) -> dict[str, Any]:
    comm.barrier()
    node = node_of(comm.rank, comm.size)
    leader = min(r for r in range(comm.size) if node_of(r, comm.size) == node)
    if comm.rank == leader:
        shutil.rmtree(Path(plan["root"]) / "l1" / node, ignore_errors=True)
    comm.barrier()
    return {}


def do_restore(plan: dict[str, Any], task: dict[str, Any], comm: Any) -> dict[str, Any]:
    mgr = manager(plan, task, comm)
    st = state(0, comm.rank, comm.size, zero=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = mgr.restore(st)
    res: dict[str, Any] = {
        "step": report.step,
        "level": report.level,
        "path": report.path,
        "tried": report.tried,
        "warnings": [str(w.message) for w in caught],
        "problems": [],
    }
    if report.step is not None:
        want = state(report.step, comm.rank, comm.size)
        checks = [
            ("model/w", st["model"]["w"].data, want["model"]["w"].data),
            ("model/emb", st["model"]["emb"], want["model"]["emb"]),
            ("rng", st["rng"].value, want["rng"].value),
        ]
        for name, got, exp in checks:
            if got.tobytes() != exp.tobytes():
                res["problems"].append(f"{name} differs from step {report.step}")
        if st["step"] != report.step:
            res["problems"].append(f"step value {st['step']} != {report.step}")
    mgr.close(flush=False)
    return res


# --- the torch adapter ----------------------------------------------------------------------------


def torch_model(seed: int) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def train(model: Any, opt: Any, steps: int) -> None:
    import torch

    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x = torch.randn(16, 64, generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def tensors_digest(model: Any, opt: Any) -> str:
    h = hashlib.sha256()
    for _, t in sorted(model.state_dict().items()):
        h.update(t.detach().numpy().tobytes())
    for s in opt.state.values():
        for _, t in sorted(s.items()):
            h.update(t.detach().numpy().tobytes() if hasattr(t, "numpy") else repr(t).encode())
    return h.hexdigest()


def do_torch(plan: dict[str, Any], task: dict[str, Any], comm: Any) -> dict[str, Any]:
    import ckptfmt_torch

    mgr = manager(plan, task, comm)
    model, opt = torch_model(seed=0 if task["action"] == "torch-save" else 1)
    res: dict[str, Any] = {}
    if task["action"] == "torch-save":
        train(model, opt, 3)
        mgr.save(3, ckptfmt_torch.to_state({"model": model, "optim": opt, "step": 3}))
        mgr.close(flush=False)
        res["digest"] = tensors_digest(model, opt)
        return res
    report = ckptfmt_torch.restore({"model": model, "optim": opt, "step": 0}, mgr)
    res.update(step=report.step, level=report.level, digest=tensors_digest(model, opt))
    mgr.close(flush=False)
    return res


def do_url(plan: dict[str, Any], task: dict[str, Any], comm: Any) -> dict[str, Any]:
    import ckptfmt
    from ckptfmt import WriteOptions
    from ckptfmt.parallel import save_to_bucket

    url, step = f"{plan['url']}/direct", task["step"]
    options = plan.get("options") or None
    if task["action"] == "url-save":
        write = WriteOptions(fsync=False, chunk_bytes=64 << 10, shard_bytes=256 << 10)
        m = save_to_bucket(
            comm,
            state(step, comm.rank, comm.size),
            url,
            step=step,
            node=node_of(comm.rank, comm.size),
            write=write,
            storage_options=options,
        )
        return {"save_id": m.save_id}
    got = ckptfmt.load(url, storage_options=options)
    want = full(step)
    problems = [n for n in ("w", "emb") if got["model"][n].tobytes() != want[n].tobytes()]
    ranks = [np.full(8, r * 1000 + step, np.int64).tobytes() for r in range(comm.size)]
    if [r.tobytes() for r in got["rng"]] != ranks:
        problems.append("rng")
    return {"step": got["step"], "problems": problems}


def do_torch_url(plan: dict[str, Any], task: dict[str, Any], comm: Any) -> dict[str, Any]:
    import ckptfmt_torch

    url = f"{plan['url']}/torch-direct"
    model, opt = torch_model(seed=0 if task["action"] == "torch-url-save" else 1)
    if task["action"] == "torch-url-save":
        train(model, opt, 3)
        ckptfmt_torch.save({"model": model, "optim": opt, "step": 3}, url, step=3)
        return {"digest": tensors_digest(model, opt)}
    train(model, opt, 1)  # an optimizer with state to be replaced
    sd = {"model": model, "optim": opt, "step": 0}
    manifest = ckptfmt_torch.load(sd, url)
    return {"step": manifest.step, "value": sd["step"], "digest": tensors_digest(model, opt)}


def main(argv: list[str]) -> int:
    kind, plan_file = argv
    plan = json.loads(Path(plan_file).read_text())
    out = Path(plan["out"])
    comm = make_comm(kind)
    for task in plan["tasks"]:
        action = task["action"]
        if action == "save":
            res = do_save(plan, task, comm)
        elif action == "wipe":
            res = do_wipe(plan, comm)
        elif action == "restore":
            res = do_restore(plan, task, comm)
        elif action in ("url-save", "url-load"):
            res = do_url(plan, task, comm)
        elif action in ("torch-url-save", "torch-url-load"):
            res = do_torch_url(plan, task, comm)
        else:
            res = do_torch(plan, task, comm)
        (out / f"{task['name']}.rank{comm.rank}.json").write_text(json.dumps(res, indent=1))
        comm.barrier()
    if kind == "torch":
        end_torch_job()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
