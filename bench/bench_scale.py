"""Weak scaling of checkpoint overhead across simulated hosts (``tests/hostsim.py``).

``bench/bench_scale.py [--ranks 1,2,4,8] [--rounds 3] [--mib 64] [--steps 12] [--every 4]``
(root; about 4-5 minutes with the defaults). One rank per host, each host its own network
namespace (TCP between hosts over a bridge), host name (the node) and node-local tmpfs at
``/local/ckpt``; level 3 and rank 0's root checkpoint go to a shared folder on this machine's
disk (``--shared-parent``). Every rank holds the whole state (data parallel, ``--mib`` MiB of
float32) and runs a GPU-like loop: each step sleeps ``--step-ms`` (the device's compute, spent
off the host), updates 1 MiB of the state and allreduces a 256 KiB gradient bucket; every
``--every``-th step it checkpoints with one method:

- ``none``: no checkpoint (the baseline of the overhead)
- ``root``: rank 0 writes the whole state with ``torch.save`` (+ fsync; ``np.savez`` where
  torch is not installed) to the shared folder while the others wait at a barrier
- ``l1``: ``CheckpointManager(local_dir="/local/ckpt")``; ``l1+xor``; ``l1+rs2`` (rs, m=2);
  ``l1+l3/2``: level 1, flushed to the shared folder every 2nd checkpoint

Per rank and checkpoint: the time blocked in the checkpoint call, the background time (save()
returning -> the background save done), the bytes written to level 1 / level 3 and the bytes
sent on ``eth0`` (less the same loop's without checkpoints). The overhead is the slowest rank's
loop time against ``none``'s in the same job. Floors measured in each job beside them: the
concurrent copy of the whole state on every rank (what staging costs), each rank writing
state/N bytes to its tmpfs at once, rank 0 writing the whole state to the shared folder, and a
ring exchange of state/N bytes. Ranks that wait (root's barrier, the floors', the loop's
allreduce) sleep between tests instead of spinning in MPICH's blocking calls, as on a cluster
where each rank has cores of its own; ckptfmt's ``MpiComm`` waits the same way. Launches rotate
the rank counts and the methods' order round by round; medians over rounds (and over the
checkpoints in a round). Results: ``bench/results/scale.json`` and ``scale.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
METHODS = ["none", "root", "l1", "l1+xor", "l1+rs2", "l1+l3/2"]
RED: dict[str, Any] = {"l1+xor": "xor", "l1+rs2": {"scheme": "rs", "m": 2}}
LOCAL = "/local/ckpt"


def root_save(model: dict[str, np.ndarray], f: Any) -> None:
    """Root checkpointing's write: ``torch.save`` of the state as tensors (sharing the arrays'
    memory), as a PyTorch job does it; ``np.savez`` where torch is not installed."""
    try:
        import torch
    except ImportError:
        np.savez(f, **model)
        return
    torch.save({k: torch.from_numpy(v) for k, v in model.items()}, f)


def applicable(method: str, n: int) -> bool:
    return not ((method == "l1+xor" and n < 2) or (method == "l1+rs2" and n < 3))


# --- the job (one rank per host, under mpiexec) --------------------------------------------------


def tx_bytes() -> int:
    with open("/proc/self/net/dev") as f:
        for line in f:
            if line.strip().startswith("eth0:"):
                return int(line.split(":")[1].split()[8])
    return 0


def du(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class Job:
    def __init__(self, args: argparse.Namespace) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.w = MPI.COMM_WORLD
        self.rank, self.size = self.w.rank, self.w.size
        self.args = args
        self.shared = Path(args.shared)
        n_t = 8
        per = (args.mib << 20) // n_t // 4
        rng = np.random.default_rng(self.rank)
        self.state = {"model": {f"w{i}": rng.random(per, dtype=np.float32) for i in range(n_t)}}
        self.nbytes = sum(a.nbytes for a in self.state["model"].values())
        self.grad = np.ones(1 << 16, np.float32)
        self.gsum = np.empty_like(self.grad)

    def barrier(self) -> None:
        """A barrier whose waiting ranks sleep (Ibarrier + Test + 0.2 ms sleeps): MPICH's
        blocking barrier spins, and here 8 ranks share 2 cores, so ranks that only wait for
        rank 0 would take its CPU (on a cluster they spin on cores of their own)."""
        req = self.w.Ibarrier()
        while not req.Test():
            time.sleep(0.0002)

    def tmax(self, t: float) -> float:
        return float(self.w.allreduce(t, op=self.MPI.MAX))

    def timed(self, fn: Any) -> float:
        self.barrier()
        t = time.perf_counter()
        fn()
        self.barrier()
        return self.tmax(time.perf_counter() - t)

    def floors(self) -> dict[str, float]:
        arrays = list(self.state["model"].values())
        bufs = [np.empty_like(a) for a in arrays]
        for b, a in zip(bufs, arrays):
            np.copyto(b, a)  # pre-touch
        out = {"copy_s": self.timed(lambda: [np.copyto(b, a) for b, a in zip(bufs, arrays)])}
        share = np.ascontiguousarray(arrays[0]).view(np.uint8)[: self.nbytes // self.size]
        floor = Path(LOCAL) / "floor.bin"

        def write_local() -> None:
            with open(floor, "wb") as f:
                for _ in range(max(1, self.nbytes // self.size // share.nbytes)):
                    f.write(share)

        out["local_write_s"] = self.timed(write_local)
        floor.unlink()

        def write_shared() -> None:
            if self.rank == 0:
                p = self.shared / "floor.bin"
                with open(p, "wb") as f:
                    for a in arrays:
                        f.write(a)
                    f.flush()
                    os.fsync(f.fileno())
                p.unlink()

        out["shared_write_s"] = self.timed(write_shared)
        if self.size > 1:
            recv = np.empty_like(share)

            def ring() -> None:
                self.w.Sendrecv(
                    share,
                    (self.rank + 1) % self.size,
                    recvbuf=recv,
                    source=(self.rank - 1) % self.size,
                )

            out["ring_s"] = self.timed(ring)
        return out

    def run_method(self, method: str) -> dict[str, Any]:
        a = self.args
        mgr = None
        blocked: list[float] = []
        background: list[float] = []
        watchers: list[threading.Thread] = []
        if method == "root" and self.rank == 0:  # torch imported before the loop, not timed
            with contextlib.suppress(ImportError):
                import torch  # noqa: F401
        if method.startswith("l1"):
            from ckptfmt import CheckpointManager, ExitPolicy
            from ckptfmt.transport.mpi import MpiComm

            flush = method == "l1+l3/2"
            mgr = CheckpointManager(
                local_dir=f"{LOCAL}/{method.replace('/', '_')}",
                shared_dir=str(self.shared / "l3") if flush else None,
                comm=MpiComm(),
                redundancy=RED.get(method),
                flush_every=2 if flush else None,
                keep_local=2,
                keep_shared=1,
                at_exit=ExitPolicy(sigterm=False, flush=False),
            )
            mgr.save(0, self.state)  # warm-up: allocates and touches the staging buffers
            mgr.wait()

        def checkpoint(step: int) -> None:
            t = time.perf_counter()
            if mgr is not None:
                mgr.save(step, self.state)
                t_ret = time.perf_counter()
                idle = getattr(mgr, "_idle", None)
                if idle is not None:  # the background save's end, seen from a watcher thread

                    def watch() -> None:
                        idle.wait()
                        background.append(time.perf_counter() - t_ret)

                    th = threading.Thread(target=watch, daemon=True)
                    th.start()
                    watchers.append(th)
            elif method == "root":
                if self.rank == 0:
                    p = self.shared / "root" / f"step-{step}.pt"
                    p.parent.mkdir(exist_ok=True)
                    with open(p, "wb") as f:
                        root_save(self.state["model"], f)
                        f.flush()
                        os.fsync(f.fileno())
                self.barrier()
            blocked.append(time.perf_counter() - t)

        self.w.Barrier()
        tx0 = tx_bytes()
        t0 = time.perf_counter()
        n_ckpt = 0
        for i in range(1, a.steps + 1):
            time.sleep(a.step_ms / 1000)  # the device's compute
            self.state["model"]["w0"][: 1 << 18] += 1.0  # the optimizer's host work (1 MiB)
            req = self.w.Iallreduce(self.grad, self.gsum)  # waits politely, as above
            while not req.Test():
                time.sleep(0.0002)
            if method != "none" and i % a.every == 0 and i < a.steps:
                checkpoint(i)
                n_ckpt += 1
        if mgr is not None:
            mgr.wait()
        loop = time.perf_counter() - t0
        tx = tx_bytes() - tx0
        for th in watchers:
            th.join(timeout=30)
        rec: dict[str, Any] = {"loop_s": loop, "tx": tx, "n_ckpt": n_ckpt}
        rec["blocked_s"] = blocked
        rec["background_s"] = background
        if mgr is not None:
            root = Path(LOCAL) / method.replace("/", "_")
            steps = sorted(p for p in root.glob("step-*") if p.is_dir())
            rec["l1_bytes"] = du(steps[-1]) if steps else 0
            if method == "l1+l3/2":
                l3 = sorted((self.shared / "l3").glob("step-*"))
                rec["l3_bytes"] = du(l3[-1]) / self.size if l3 else 0
            mgr.close(flush=False)
            shutil.rmtree(root, ignore_errors=True)
            if method == "l1+l3/2" and self.rank == 0:
                self.w.Barrier()
                shutil.rmtree(self.shared / "l3", ignore_errors=True)
            elif method == "l1+l3/2":
                self.w.Barrier()
        elif method == "root":
            rec["l3_bytes"] = self.nbytes if self.rank == 0 else 0
            self.w.Barrier()
            if self.rank == 0:
                shutil.rmtree(self.shared / "root", ignore_errors=True)
        self.w.Barrier()
        return rec

    def main(self) -> None:
        a = self.args
        order = [m for m in METHODS if applicable(m, self.size)]
        k = a.round % len(order)
        order = order[k:] + order[:k]
        res: dict[str, Any] = {"rank": self.rank, "size": self.size, "bytes": self.nbytes}
        res["floors"] = self.floors()
        res["methods"] = {m: self.run_method(m) for m in order}
        res["order"] = order
        out = self.shared / "results" / f"r{a.round}-n{self.size}-rank{self.rank}.json"
        out.write_text(json.dumps(res))


# --- the parent: hosts, launches, medians --------------------------------------------------------


def med(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def summarize(runs: dict[int, list[list[dict[str, Any]]]]) -> dict[str, Any]:
    """runs[n] = one list of per-rank results per round."""
    out: dict[str, Any] = {}
    for n, rounds in sorted(runs.items()):
        rows: dict[str, Any] = {}
        floors = {k: med([r[0]["floors"][k] for r in rounds]) for k in rounds[0][0]["floors"]}
        base = med([max(x["methods"]["none"]["loop_s"] for x in r) for r in rounds])
        base_tx = [[x["methods"]["none"]["tx"] for x in r] for r in rounds]
        for m in METHODS:
            if m not in rounds[0][0]["methods"]:
                continue
            loops, blocked, bg, l1b, l3b, sent = [], [], [], [], [], []
            for ri, r in enumerate(rounds):
                ms = [x["methods"][m] for x in r]
                loops.append(max(x["loop_s"] for x in ms))
                # per checkpoint: the slowest rank's blocked time (everyone waits for it)
                for c in range(ms[0]["n_ckpt"]):
                    blocked.append(max(x["blocked_s"][c] for x in ms))
                    if all(len(x["background_s"]) > c for x in ms):
                        bg.append(max(x["background_s"][c] for x in ms))
                l1b.append(max(x.get("l1_bytes", 0) for x in ms))
                l3b.append(max(x.get("l3_bytes", 0) for x in ms))
                if ms[0]["n_ckpt"]:
                    per = [(x["tx"] - base_tx[ri][i]) / x["n_ckpt"] for i, x in enumerate(ms)]
                    sent.append(max(per))
            loop = med(loops)
            rows[m] = {
                "loop_s": loop,
                "overhead_pct": 100 * (loop - base) / base if m != "none" else 0.0,
                "blocked_s": med(blocked) if blocked else 0.0,
                "background_s": med(bg) if bg else 0.0,
                "l1_bytes_per_rank": med(l1b),
                "l3_bytes_per_rank": med(l3b),
                "sent_bytes_per_rank": med(sent) if sent else 0.0,
                "loop_s_rounds": loops,
            }
        out[str(n)] = {"floors": floors, "methods": rows}
    return out


def table(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    mib = 1 << 20
    lines = [
        f"state {meta['mib']} MiB per rank, {meta['steps']} steps of {meta['step_ms']} ms, "
        f"checkpoint every {meta['every']}th step, {meta['rounds']} rounds, medians",
        "",
        "| ranks | method | overhead % | blocked s | background s | L1 MiB/rank | L3 MiB/rank "
        "| sent MiB/rank |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, row in summary.items():
        for m, r in row["methods"].items():
            lines.append(
                f"| {n} | {m} | {r['overhead_pct']:.1f} | {r['blocked_s']:.3f} | "
                f"{r['background_s']:.3f} | {r['l1_bytes_per_rank'] / mib:.1f} | "
                f"{r['l3_bytes_per_rank'] / mib:.1f} | {r['sent_bytes_per_rank'] / mib:.1f} |"
            )
    lines += [
        "",
        "| ranks | copy state s | write state/N to tmpfs s | rank 0 writes state to "
        "shared s | ring state/N s |",
        "|---|---|---|---|---|",
    ]
    for n, row in summary.items():
        f = row["floors"]
        lines.append(
            f"| {n} | {f['copy_s']:.3f} | {f['local_write_s']:.3f} | {f['shared_write_s']:.3f} "
            f"| {f.get('ring_s', float('nan')):.3f} |"
        )
    return "\n".join(lines) + "\n"


def parent(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(REPO / "tests"))
    import hostsim

    reason = hostsim.unavailable()
    if reason:
        print(f"bench_scale: {reason}", file=sys.stderr)
        return 2
    ranks = [int(x) for x in args.ranks.split(",")]
    names = [f"node{i}" for i in range(max(ranks))]
    root = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=args.shared_parent))
    runs: dict[int, list[list[dict[str, Any]]]] = {n: [] for n in ranks}
    t_start = time.time()
    load_start = os.getloadavg()[0]
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"), "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("CKPTFMT_NODE", None)
    try:
        with hostsim.cluster(names, root, LOCAL, local_tmpfs="4g") as c:
            (c.shared / "results").mkdir()
            for rnd in range(args.rounds):
                order = ranks[rnd % len(ranks) :] + ranks[: rnd % len(ranks)]
                for n in order:
                    cmd = [
                        sys.executable,
                        "-m",
                        "mpi4py",
                        __file__,
                        "--job",
                        "--shared",
                        str(c.shared),
                        "--round",
                        str(rnd),
                        *args.passthrough,
                    ]
                    t = time.time()
                    p = subprocess.run(
                        ["timeout", "-k", "5", "300", *c.mpiexec_cmd(names[:n], 1, cmd)],
                        env=env,
                        stdin=subprocess.DEVNULL,
                        capture_output=True,
                        text=True,
                    )
                    if p.returncode != 0:
                        print(p.stdout[-3000:], p.stderr[-3000:], file=sys.stderr)
                        return 1
                    got = [
                        json.loads((c.shared / "results" / f"r{rnd}-n{n}-rank{r}.json").read_text())
                        for r in range(n)
                    ]
                    runs[n].append(got)
                    print(f"round {rnd} ranks {n}: {time.time() - t:.1f} s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    meta = {
        "mib": args.mib,
        "steps": args.steps,
        "every": args.every,
        "step_ms": args.step_ms,
        "rounds": args.rounds,
        "ranks": ranks,
        "seconds": round(time.time() - t_start, 1),
        "cores": os.cpu_count(),
        "load_average_1min": [round(load_start, 1), round(os.getloadavg()[0], 1)],
        "shared": "disk (ext4 on the machine's virtual disk), fsync",
        "local": "tmpfs per host",
    }
    summary = summarize(runs)
    out = REPO / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "scale.json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=1))
    md = table(summary, meta)
    (out / "scale.md").write_text(md)
    print(md)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--step-ms", type=float, default=150.0)
    ap.add_argument(
        "--shared-parent",
        default=str(REPO / "bench" / "results"),
        help="where the shared folder is made (a disk)",
    )
    ap.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shared", help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        Job(args).main()
        return 0
    args.passthrough = [
        "--mib",
        str(args.mib),
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
        "--step-ms",
        str(args.step_ms),
    ]
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
