"""A small projection model of checkpoint overhead for data-parallel training at scale.

``bench/scale_model.py [--fit bench/results/scale.json] [--plot bench/results/scale_overhead.png]``
fits the model's machine figures on this machine's 1-8 rank measurements (``bench_scale.py``),
states the fit's error, checks the model against SCR's published Lassen figures and prints a
projection to 10,000 nodes. :func:`project` is the model itself, for other inputs.

Inputs (:class:`Inputs`): the state bytes per rank ``S``; whether the state is replicated across
ranks (data parallel: ckptfmt writes each replicated tensor once, ``S/P`` per rank; else every
rank writes its own ``S``); ranks per node ``r``; node-local write and read bandwidth per node;
network bandwidth per node (each direction); the shared file system's aggregate bandwidth and
its per-client cap; encode throughput per scheme (per node); the staging copy bandwidth per
node; checkpoint interval, step time and failure rate per node; redundancy set size ``k``; the
flush cadence; a barrier's cost per doubling of ranks.

Per checkpoint, with ``P = N r`` ranks and ``u`` bytes written per rank:

- ``root``: rank 0 writes the whole state to the shared file system, everyone waits:
  blocked = S / min(client cap, aggregate) + barrier(P); nothing in the background.
- ``l1``: blocked = staging, r u / copy bandwidth + the staging call's fixed cost (each rank
  copies only what it writes: its share u of the replicated tensors, once the ranks have agreed
  in one small collective that they hold the same ones); background = r u / local write.
- ``l1+xor``, ``l1+rs``: background adds the encode (r u / encode throughput), the parity
  written locally (r u m / (k - m)) and the bytes sent to the set's peers (r u, the ring's share,
  over the node's network).
- ``l1+l3/K``: every K-th checkpoint also copies r u per node to the shared file system, whose
  throughput is min(aggregate, N x client cap): the term that grows with N once the file system
  is saturated; amortised over K checkpoints.

The training overhead over one interval T (steps x step time) is
(blocked + max(0, background - T) + a background x share) / T, where ``a`` is the slowdown the
background work inflicts on the overlapped steps (0 for a GPU-like loop whose host is idle,
fitted here). Recovery from one node loss: ``root``/level 3 reads the state back from the shared
file system on every rank; level 1 + parity rebuilds the lost node's u r bytes from k members
(k u r over the spare's network, encode throughput) and loads (a replicated state reaches every
rank over the network). Expected efficiency with failures (system MTBF M = 1 / (N lambda)):
1 - overhead - (T/2 + R)/M, to first order, at the given interval and at Young/Daly's
T_opt = sqrt(2 delta M), delta the checkpoint's cost in lost time; a lost node that level 1
cannot cover (``l1`` without redundancy) falls back to level 3, K intervals back.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

GB = 1e9
SCHEMES = ["root", "l1", "l1+xor", "l1+rs2", "l1+l3/2"]


@dataclass(frozen=True)
class Inputs:
    """Machine and job figures (bytes, seconds, bytes/s; per node unless said otherwise)."""

    state_bytes: float = 1 * GB  # per rank
    replicated: bool = True  # data parallel: each tensor written once across the ranks
    ranks_per_node: int = 1
    local_write_bw: float = 2.0 * GB
    local_read_bw: float = 5.0 * GB
    net_bw: float = 12.5 * GB  # per node, each direction
    shared_bw: float = 150 * GB  # the shared file system's aggregate
    shared_client_bw: float = 2.0 * GB  # what one client (node) can reach on it
    copy_bw: float = 10 * GB  # staging copy per node
    stage_call_s: float = 0.005  # save()'s fixed cost: the roll call and the share agreement
    stage_call_per_doubling_s: float = 0.001
    encode_bw: dict[str, float] = field(
        default_factory=lambda: {"l1+xor": 20 * GB, "l1+rs2": 1.0 * GB}
    )
    set_size: int = 8
    flush_every: int = 2  # l1+l3/K: K
    interval_steps: int = 100
    step_s: float = 1.0
    node_failures_per_s: float = 1 / (5 * 365 * 86400)  # a node fails every 5 years
    barrier_s_per_doubling: float = 1e-4
    interference: float = 0.0  # the slowdown background work puts on overlapped steps
    save_latency_s: float = 0.05  # the manager's fixed cost per save (its collectives)
    save_latency_per_doubling_s: float = 0.01
    flush_efficiency: float = 1.0  # the flush's throughput / the file system's raw throughput


def per_rank_bytes(x: Inputs, n: int) -> float:
    p = n * x.ranks_per_node
    return x.state_bytes / p if x.replicated else x.state_bytes


def checkpoint_cost(x: Inputs, scheme: str, n: int) -> dict[str, float]:
    """Blocked and background seconds of one checkpoint on ``n`` nodes."""
    r, s = x.ranks_per_node, x.state_bytes
    p = n * r
    u = per_rank_bytes(x, n)
    barrier = x.barrier_s_per_doubling * math.log2(max(p, 1)) if p > 1 else 0.0
    if scheme == "root":
        return {"blocked": s / min(x.shared_client_bw, x.shared_bw) + barrier, "background": 0.0}
    call = x.stage_call_s + x.stage_call_per_doubling_s * math.log2(max(p, 1))
    blocked = r * u / x.copy_bw + call + barrier
    bg = x.save_latency_s + x.save_latency_per_doubling_s * math.log2(max(p, 1))
    bg += r * u / x.local_write_bw
    k = min(x.set_size, n)
    if scheme in ("l1+xor", "l1+rs2") and n > 1:
        m = 1 if scheme == "l1+xor" else 2
        k = max(k, m + 1)
        bg += r * u / x.encode_bw[scheme]
        bg += r * u * m / max(k - m, 1) / x.local_write_bw
        bg += r * u / x.net_bw
    if scheme == "l1+l3/2":
        agg = min(x.shared_bw, n * x.shared_client_bw) * x.flush_efficiency
        flush = n * r * u / agg
        bg += flush / x.flush_every
    return {"blocked": blocked, "background": bg}


def recovery_s(x: Inputs, scheme: str, n: int) -> float:
    """Time to restart after one node is lost (read back / rebuild, then load)."""
    r, s, p = x.ranks_per_node, x.state_bytes, n * x.ranks_per_node
    u = per_rank_bytes(x, n)
    agg = min(x.shared_bw, n * x.shared_client_bw)
    from_shared = p * s / agg  # every rank reads the whole state back
    if scheme in ("root", "l1", "l1+l3/2") or n == 1:
        return from_shared
    k = min(x.set_size, n)
    rebuild = k * u * r / x.net_bw + u * r / x.encode_bw[scheme] + u * r / x.local_write_bw
    load = r * u / x.local_read_bw + (r * s / x.net_bw if x.replicated and p > 1 else 0.0)
    return rebuild + load


def project(x: Inputs, scheme: str, n: int) -> dict[str, float]:
    """Blocked, background, overhead %, recovery, and expected efficiency on ``n`` nodes."""
    c = checkpoint_cost(x, scheme, n)
    t = x.interval_steps * x.step_s
    lost = c["blocked"] + max(0.0, c["background"] - t) + x.interference * min(c["background"], t)
    overhead = lost / t
    mtbf = 1 / (n * x.node_failures_per_s)
    rec = recovery_s(x, scheme, n)
    back = x.flush_every if scheme == "l1" else 1  # l1 alone: a node loss falls back to level 3
    if scheme == "l1":
        rec = recovery_s(x, "root", n)

    def efficiency(interval: float) -> float:
        o = lost / interval
        return max(0.0, 1 - o - (back * interval / 2 + rec) / mtbf)

    t_opt = math.sqrt(2 * max(lost, 1e-9) * mtbf)
    return {
        "blocked_s": c["blocked"],
        "background_s": c["background"],
        "overhead_pct": 100 * overhead,
        "recovery_s": rec,
        "efficiency": efficiency(t),
        "daly_interval_s": t_opt,
        "efficiency_at_daly": efficiency(t_opt),
        "total_overhead_pct": 100 * (1 - efficiency(t)),
    }


# --- fitting on bench_scale.py's measurements ----------------------------------------------------


def _nnls(a: Any, y: Any) -> Any:
    """Least squares with non-negative coefficients (drop the most negative, refit)."""
    import numpy as np

    keep = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while keep:
        c, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
        if (c >= 0).all():
            coef[keep] = c
            break
        keep.pop(int(np.argmin(c)))
    return coef


def fit(measured: dict[str, Any]) -> tuple[Inputs, dict[str, Any]]:
    """Fit the model's free figures on ``bench_scale.py``'s medians and report its error.

    On this machine every host shares 2 cores and one memory bus, so the bandwidth terms are
    the floors measured in the same job at the same number of hosts (copying the state,
    writing state/N to tmpfs, a ring exchange, rank 0 writing to the shared disk), scaled by
    the bytes each method moved. Fitted by least squares: the manager's fixed cost per save
    (a + b log2 N: its collectives, each a few polite-wait rounds), the encode throughput of
    xor and rs (machine totals), the flush's throughput, the staging call's fixed cost, root's
    growth per doubling, and the interference of background work with the loop.
    """
    import numpy as np

    meta, summ = measured["meta"], measured["summary"]
    s = meta["mib"] * (1 << 20)
    interval = meta["every"] * meta["step_ms"] / 1000
    n_ck = (meta["steps"] - 1) // meta["every"]
    loop_s = meta["steps"] * meta["step_ms"] / 1000
    k = 2  # l1+l3/2

    rows_bg, feats, ys, known = [], [], [], []
    blocked_rows, root_rows = [], []
    for n_s, row in summ.items():
        n = int(n_s)
        fl = row["floors"]
        u = s / n
        for m, got in row["methods"].items():
            if m == "none":
                continue
            if m == "root":
                root_rows.append((n, fl["shared_write_s"], got["blocked_s"]))
                continue
            # the floor copies the whole state on every rank; the manager copies its share
            blocked_rows.append((n, fl["copy_s"] * u / s, got["blocked_s"]))
            kn = fl["local_write_s"] * got["l1_bytes_per_rank"] / u
            if n > 1 and "ring_s" in fl:
                kn += fl["ring_s"] * got["sent_bytes_per_rank"] / u
            f = [1.0, math.log2(n), n * u * (m == "l1+xor"), n * u * (m == "l1+rs2")]
            f.append(n * u / k * (m == "l1+l3/2"))
            rows_bg.append((n, m))
            feats.append(f)
            known.append(kn)
            ys.append(got["background_s"])
    a_mat, y = np.array(feats), np.array(ys) - np.array(known)
    coef = _nnls(a_mat, y)
    bg_pred = dict(zip(rows_bg, (a_mat @ coef + np.array(known)).tolist()))
    # the staging call's cost beyond the copy: a + b log2 N (the roll call and the agreement)
    sc = _nnls(
        np.array([[1.0, math.log2(n)] for n, _, _ in blocked_rows]),
        np.array([b - c for _, c, b in blocked_rows]),
    )
    c0, c1 = float(sc[0]), float(sc[1])
    # root: a multiple of rank 0's raw write (the floor with one rank, the least disturbed),
    # slowed by the waiting ranks, which spin in MPI's barrier: rank 0 keeps cores/N of a core
    # once the N ranks outnumber this machine's cores (on a real node each rank has its own)
    root_floor = summ[min(summ, key=int)]["floors"]["shared_write_s"]
    cores = int(meta.get("cores") or 2)

    def share(n: int) -> float:
        return max(1.0, n / cores)

    ra = np.array([[root_floor * share(n), 1.0] for n, _, _ in root_rows])
    rcoef = _nnls(ra, np.array([b for *_, b in root_rows]))

    def predict(n: int, m: str, interf: float) -> dict[str, float]:
        fl = summ[str(n)]["floors"]
        if m == "root":
            bl = rcoef[0] * root_floor * share(n) + rcoef[1]
            bg = 0.0
        else:
            bl = c0 + c1 * math.log2(n) + fl["copy_s"] / n  # its share of the replicas: state/N
            bg = bg_pred[(n, m)]
        lost = bl + max(0.0, bg - interval) + interf * min(bg, interval)
        return {"blocked": bl, "background": bg, "overhead_pct": 100 * n_ck * lost / loop_s}

    def overhead_err(interf: float) -> float:
        return sum(
            (predict(int(n), m, interf)["overhead_pct"] - got["overhead_pct"]) ** 2
            for n, row in summ.items()
            for m, got in row["methods"].items()
            if m != "none"
        )

    interf = min((i / 20 for i in range(21)), key=overhead_err)
    rows = []
    for n_s, row in summ.items():
        for m, got in row["methods"].items():
            if m == "none":
                continue
            pr = predict(int(n_s), m, interf)
            rows.append(
                {
                    "ranks": int(n_s),
                    "method": m,
                    "blocked": (pr["blocked"], got["blocked_s"]),
                    "background": (pr["background"], got["background_s"]),
                    "overhead_pct": (pr["overhead_pct"], got["overhead_pct"]),
                }
            )

    def rel(key: str) -> float:
        errs = [abs(p - g) / g for r in rows for p, g in [r[key]] if g > 0.005]
        return statistics.median(errs) if errs else float("nan")

    fitted = {
        "save_latency_s": float(coef[0]),
        "save_latency_per_doubling_s": float(coef[1]),
        "encode_bw_xor": 1 / coef[2] if coef[2] > 0 else float("inf"),
        "encode_bw_rs2": 1 / coef[3] if coef[3] > 0 else float("inf"),
        "flush_bw": 1 / coef[4] if coef[4] > 0 else float("inf"),
        "stage_call_s": c0,
        "stage_call_per_doubling_s": c1,
        "root_floor_factor": float(rcoef[0]),
        "root_fixed_s": float(rcoef[1]),
        "interference": interf,
    }
    one = summ[min(summ, key=int)]["floors"]
    shared_raw = s / one["shared_write_s"]
    inputs = replace(
        PROJECTED_JOB,
        save_latency_s=fitted["save_latency_s"],
        save_latency_per_doubling_s=fitted["save_latency_per_doubling_s"],
        stage_call_s=fitted["stage_call_s"],
        stage_call_per_doubling_s=fitted["stage_call_per_doubling_s"],
        flush_efficiency=min(1.0, fitted["flush_bw"] / shared_raw),
        interference=interf,
    )
    report = {
        "fitted": fitted,
        "shared_raw_bw": shared_raw,
        "rows": rows,
        "median_rel_error": {k: rel(k) for k in ("blocked", "background")},
        "median_abs_error_overhead_pts": statistics.median(
            abs(r["overhead_pct"][0] - r["overhead_pct"][1]) for r in rows
        ),
        "max_abs_error_overhead_pts": max(
            abs(r["overhead_pct"][0] - r["overhead_pct"][1]) for r in rows
        ),
    }
    return inputs, report


# --- the Lassen check ----------------------------------------------------------------------------

LASSEN = Inputs(
    state_bytes=1 * GB,  # SCR's benchmark: 1 GB per process, each process its own data
    replicated=False,
    ranks_per_node=40,
    local_write_bw=60 * GB,  # RAM disk (/dev/shm): memory bandwidth less copies
    local_read_bw=60 * GB,
    net_bw=12.5 * GB,  # EDR InfiniBand, 100 Gb/s per direction (per port)
    shared_bw=150 * GB,  # GPFS (Lassen's): SCR measures 120-150 GB/s
    shared_client_bw=3 * GB,
    copy_bw=60 * GB,
    encode_bw={"l1+xor": 60 * GB, "l1+rs2": 10 * GB},
    set_size=8,
    save_latency_s=0.01,  # SCR is C over InfiniBand: its fixed cost per checkpoint is small
    save_latency_per_doubling_s=0.001,
)


def lassen_check() -> list[dict[str, Any]]:
    """Aggregate checkpoint bandwidth (all ranks' bytes / background time) on 512 nodes against
    SCR's published figures; partner sends a full copy over the network and writes it too."""
    n = 512
    x = LASSEN
    total = n * x.ranks_per_node * x.state_bytes
    r_u = x.ranks_per_node * x.state_bytes
    single = total / checkpoint_cost(x, "l1", n)["background"]
    partner_t = r_u / x.local_write_bw * 2 + r_u / x.net_bw
    xor = total / checkpoint_cost(x, "l1+xor", n)["background"]
    pfs = [min(x.shared_bw, m * x.shared_client_bw) for m in (16, 64, 256, 512)]
    return [
        {"what": "SINGLE, RAM disk", "model_TBps": single / 1e12, "published_TBps": 30.0},
        {"what": "PARTNER", "model_TBps": total / partner_t / 1e12, "published_TBps": 5.5},
        {"what": "XOR (set of 8)", "model_TBps": xor / 1e12, "published_TBps": 4.0},
        {
            "what": "PFS at 16/64/256/512 nodes",
            "model_TBps": [p / 1e12 for p in pfs],
            "published_TBps": "levels off at 0.12-0.15",
        },
    ]


# --- projection and plot -------------------------------------------------------------------------

NODES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 10000]


def projection(x: Inputs) -> dict[str, list[dict[str, float]]]:
    return {m: [{"nodes": n, **project(x, m, n)} for n in NODES] for m in SCHEMES}


def plot(proj: dict[str, list[dict[str, float]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4.2))
    for m, rows in proj.items():
        ns = [r["nodes"] for r in rows]
        ax[0].plot(ns, [r["overhead_pct"] for r in rows], marker="o", ms=3, label=m)
        ax[1].plot(ns, [r["total_overhead_pct"] for r in rows], marker="o", ms=3, label=m)
    for a in ax:
        a.set_xscale("log")
        a.set_xlabel("nodes")
        a.grid(True, which="both", alpha=0.3)
    ax[0].set_yscale("log")
    ax[0].set_ylabel("checkpoint overhead, % of training time")
    ax[1].set_yscale("log")
    ax[1].set_ylabel("... with lost work and recovery (1 - efficiency), %")
    ax[0].legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


#: the projection's job: 1 GB of data-parallel state per GPU rank, 4 ranks per node, a
#: checkpoint every 100 steps of 0.5 s, a node failing every 5 years; a machine like Lassen's
PROJECTED_JOB = replace(
    LASSEN,
    state_bytes=1 * GB,
    replicated=True,
    ranks_per_node=4,
    interval_steps=100,
    step_s=0.5,
    shared_client_bw=3 * GB,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = Path(__file__).resolve().parent / "results"
    ap.add_argument("--fit", default=str(here / "scale.json"))
    ap.add_argument("--plot", default=str(here / "scale_overhead.png"))
    ap.add_argument("--out", default=str(here / "scale_model.json"))
    ap.add_argument("--unique", action="store_true", help="project a non-replicated state")
    args = ap.parse_args()
    if args.unique:  # beside the default outputs, not over them
        args.plot = args.plot.replace(".png", "_unique.png")
        args.out = args.out.replace(".json", "_unique.json")
    out: dict[str, Any] = {}
    job = PROJECTED_JOB
    if Path(args.fit).exists():
        job, rep = fit(json.loads(Path(args.fit).read_text()))
        out["fit"] = rep
        print("fit on", args.fit)
        print("  fitted:", ", ".join(f"{k} {v:.4g}" for k, v in rep["fitted"].items()))
        print(
            f"  median relative error: blocked {rep['median_rel_error']['blocked']:.0%}, "
            f"background {rep['median_rel_error']['background']:.0%}; overhead: median "
            f"{rep['median_abs_error_overhead_pts']:.1f} points off, at most "
            f"{rep['max_abs_error_overhead_pts']:.1f}"
        )
        for r in rep["rows"]:
            print(
                f"  {r['ranks']} {r['method']:8} "
                f"blocked {r['blocked'][0]:.3f}/{r['blocked'][1]:.3f} "
                f"bg {r['background'][0]:.3f}/{r['background'][1]:.3f} "
                f"ovh {r['overhead_pct'][0]:.1f}/{r['overhead_pct'][1]:.1f}"
            )
    out["lassen"] = lassen_check()
    print("Lassen, 512 nodes, 1 GB per process (model vs SCR's published):")
    for r in out["lassen"]:
        print(f"  {r['what']}: model {r['model_TBps']}, published {r['published_TBps']} TB/s")
    job = replace(job, replicated=not args.unique)
    proj = projection(job)
    out["projection"] = {"inputs": {k: v for k, v in job.__dict__.items()}, "rows": proj}
    print("projection: overhead % / overhead with failures % (1 - efficiency) by nodes")
    for m, rows in proj.items():
        cells = [
            f"{r['nodes']}:{r['overhead_pct']:.2f}/{r['total_overhead_pct']:.1f}" for r in rows
        ]
        print(f"  {m:8}", " ".join(cells))
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    plot(
        proj,
        Path(args.plot),
        "projected checkpoint overhead, 1 GB data-parallel state per "
        "rank, 4 ranks/node, Lassen-like machine, checkpoint every 50 s",
    )
    print("plot:", args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
