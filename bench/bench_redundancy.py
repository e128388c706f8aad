#!/usr/bin/env python3
"""What level-1 redundancy costs: a collective save with xor, rs (m=2) and partner against the
same save without redundancy, the rebuild of one lost node against the survivors reading their
own data, and where the encoding's time goes.

One launch, one rank per simulated node (``node = f"n{rank}"``; with 8 ranks one redundancy set
of 8): every rank holds its own rows (``Shard``) of four tensors, float32 and bfloat16, random
bytes, ``--mib-per-rank`` MiB each rank. Every round runs, for each ``--fsync`` setting, every
method once, in an order that rotates by one each round:

* ``l1``: ``save_collective`` into this rank's node directory, no redundancy (the reference);
* ``xor`` / ``rs`` / ``partner``: the same with ``redundancy=``; right after each, the node of
  ``--lose`` loses its step directory and the ranks run ``rebuild_collective`` (timed), then the
  survivors read their own member data (``read_member``, with and without CRC checks, timed);
* ``pw_<scheme>``: every rank writes one file of the size of that scheme's parity file (what the
  parity's bytes cost to write on their own, same fsync setting);
* ``ring_<scheme>``: every rank makes the encoding's messages alone: the same ``comm.sendrecv``
  calls with buffers of the same sizes, in the same order (what moving the bytes costs here);
* ``vote``: ``--votes`` empty votes (``allgather_json``, as the save's votes): what one
  synchronization of all ranks costs here.

Run it under MPI (``bench/run_redundancy.sh`` does, and writes the README's table)::

    mpiexec -n 8 python -m mpi4py bench/bench_redundancy.py --out bench/results/redundancy.json
    python bench/bench_redundancy.py --table bench/results/redundancy.json

See bench/README.md (``bench_redundancy.py``) for what is timed and what the numbers said.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from bench_parallel import RoundClock, quiet_barrier  # noqa: E402
from bench_save_load import git_info, source_digest  # noqa: E402

DEFAULT_DIR = "/dev/shm/ckptfmt-bench-redundancy"
SCHEMES: dict[str, dict[str, Any]] = {
    "xor": {"scheme": "xor"},
    "rs": {"scheme": "rs", "m": 2},
    "partner": {"scheme": "partner"},
}
LABELS = {
    "l1": "level 1 only (no redundancy)",
    "xor": "xor",
    "rs": "rs (m=2)",
    "partner": "partner",
}
# what the encoding's and the rebuild's times are split into (wrapped functions, see instrument)
PARTS = {
    "encode": ("sendrecv", "gf", "crc", "write", "other"),
    "rebuild": (
        "manifest",
        "assess",
        "collectives",
        "plan",
        "prepare",
        "vote",
        "recv",
        "send",
        "gf",
        "write",
        "commit",
        "other",
    ),
}

# --- the state ------------------------------------------------------------------------------------


def make_state(rank: int, size: int, mib: int) -> tuple[dict[str, Any], int]:
    """This rank's rows of four tensors (two float32, two bfloat16; 1024 columns), each a
    quarter of ``mib`` MiB, random bytes (every page written). Returns the state and its bytes."""
    import ml_dtypes

    from ckptfmt import Shard

    rng = np.random.default_rng([rank, 11])
    state: dict[str, Any] = {}
    nbytes = 0
    for name, dt in (
        ("f32_a", np.float32),
        ("bf16_a", ml_dtypes.bfloat16),
        ("f32_b", np.float32),
        ("bf16_b", ml_dtypes.bfloat16),
    ):
        item = np.dtype(dt).itemsize
        rows = (mib << 20) // 4 // (1024 * item)
        raw = rng.integers(0, 256, size=rows * 1024 * item, dtype=np.uint8)
        data = raw.view(dt).reshape(rows, 1024)
        state[name] = Shard(data, (rank * rows, 0), (size * rows, 1024))
        nbytes += data.nbytes
    return state, nbytes


# --- instrumentation of the encoding --------------------------------------------------------------


@dataclass
class Profile:
    """Seconds (and bytes) spent in the pieces of ``encode_collective`` or
    ``rebuild_collective`` (the ``section`` running) on this rank."""

    section: str | None = None
    started: float = 0.0  # perf_counter at the start and the end of the section
    ended: float = 0.0
    depth: int = 0  # timed calls in progress: only the outermost one counts
    seconds: dict[str, float] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)
    total: float = 0.0

    def start(self, section: str) -> None:
        self.section = section
        self.seconds = dict.fromkeys(PARTS[section], 0.0)
        self.nbytes = {}
        self.total = 0.0

    def report(self) -> dict[str, Any]:
        return {"total_s": self.total, "parts_s": dict(self.seconds), "bytes": dict(self.nbytes)}


def instrument(comm: Any) -> Profile:
    """Wrap what ``encode_collective`` and ``rebuild_collective`` call (their modules' globals,
    the engine's GF multiply, this rank's ``comm`` methods) with clocks that run while one of the
    two is running. Each wrapper adds two ``perf_counter`` calls per call (dozens per save); the
    remainder of the total is ``other``."""
    from ckptfmt.engine import encode
    from ckptfmt.engine import rebuild as steps
    from ckptfmt.parallel.collective import rebuild
    from ckptfmt.parallel.collective.boundary import Boundary
    from ckptfmt.redundancy import engine

    prof = Profile()

    def timed(part: str, fn: Callable[..., Any], count: Callable[..., int] | None = None):
        def wrapper(*a: Any, **kw: Any) -> Any:
            if prof.section is None or prof.depth or part not in prof.seconds:
                return fn(*a, **kw)
            prof.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                prof.seconds[part] += time.perf_counter() - t0
                prof.depth -= 1
                if count is not None:
                    prof.nbytes[part] = prof.nbytes.get(part, 0) + count(*a, **kw)

        return wrapper

    def section(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **kw: Any) -> Any:
            prof.start(name)
            t0 = prof.started = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                prof.ended = time.perf_counter()
                prof.total = prof.ended - t0
                prof.seconds["other"] = prof.total - sum(
                    v for k, v in prof.seconds.items() if k != "other"
                )
                prof.section = None

        return wrapper

    size = lambda *a, **k: a[-1].size  # noqa: E731  (the block multiplied)
    # encoding (ckptfmt/engine/encode.py, called by the save in ckptfmt/parallel/collective/save.py)
    import ckptfmt.parallel.collective.save as protocol

    encode.mul_xor_into = timed("gf", encode.mul_xor_into, size)
    encode.crc32c = timed("crc", encode.crc32c)
    encode.write_gather = timed("write", encode.write_gather)
    comm.sendrecv = timed("sendrecv", comm.sendrecv, lambda s, d, r, *a, **k: r.size)
    plain_start = comm.start_exchange

    class Timed:  # the encoding's rounds: the wait for each is its messages' time
        def __init__(self, pending: Any, nbytes: int) -> None:
            self.pending, self.nbytes = pending, nbytes

        def wait(self) -> None:
            timed("sendrecv", self.pending.wait, lambda *a, **k: self.nbytes)()

    def start_exchange(pairs: Any, tag: int = 0) -> Any:
        return Timed(plain_start(pairs, tag), sum(r.size for _, _, r, _ in pairs))

    comm.start_exchange = start_exchange
    protocol.encode_collective = section("encode", protocol.encode_collective)  # type: ignore[attr-defined]
    # the rebuild (the driver ckptfmt/parallel/collective/rebuild.py, its steps
    # ckptfmt/engine/rebuild.py; ops run in ckptfmt/redundancy/engine.py)
    rebuild.read_manifest_bytes = timed("manifest", rebuild.read_manifest_bytes)
    rebuild.parse_manifest = timed("manifest", rebuild.parse_manifest)
    steps.assess_member = timed("assess", steps.assess_member)
    rebuild.plan_all = timed("plan", rebuild.plan_all)
    steps.write_metadata = timed("prepare", steps.write_metadata)
    Boundary.vote = timed("vote", Boundary.vote)  # type: ignore[method-assign]
    steps.write_member = timed("write", steps.write_member)
    steps.write_parity = timed("write", steps.write_parity)
    engine.mul_xor_into = timed("gf", engine.mul_xor_into, size)
    comm.send = timed("send", comm.send, lambda b, *a, **k: b.size)
    comm.start_send = timed("send", comm.start_send, lambda b, *a, **k: b.size)
    comm.recv = timed("recv", comm.recv, lambda b, *a, **k: b.size)
    comm.allgather_json = timed("collectives", comm.allgather_json)
    comm.bcast_json = timed("collectives", comm.bcast_json)

    class Commit:  # rebuild's view of ckptfmt.storage.commit, with its two steps timed
        def __getattr__(self, name: str) -> Any:
            return getattr(commit, name)

    from ckptfmt.storage import commit

    proxy = Commit()
    proxy.prepare = timed("prepare", commit.prepare)  # type: ignore[attr-defined]
    proxy.finalize = timed("commit", commit.finalize)  # type: ignore[attr-defined]
    rebuild.commit = proxy  # type: ignore[assignment]
    rebuild.rebuild_collective = section("rebuild", rebuild.rebuild_collective)
    return prof


# --- one launch -----------------------------------------------------------------------------------


@dataclass
class Env:
    mpi: Any
    comm: Any
    rank: int
    size: int
    node: str
    base: Path
    state: dict[str, Any]
    nbytes: int
    lose: int
    threads: int
    prof: Profile
    read_buf: np.ndarray
    parity_bytes: dict[str, int] = field(default_factory=dict)  # this rank's parity file size
    pw_buf: np.ndarray | None = None
    geometry: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # n, m, chunk


def node_dir(env: Env) -> Path:
    return env.base / env.node


def barrier_time(env: Env, body: Callable[[], Any]) -> tuple[float, Any]:
    """Wall seconds from a (sleeping) barrier before to one after, on this rank."""
    quiet_barrier(env.mpi)
    t0 = time.perf_counter()
    out = body()
    quiet_barrier(env.mpi)
    return time.perf_counter() - t0, out


def run_save(env: Env, key: str, rnd: int, fsync: bool) -> dict[str, Any]:
    """One collective save (``key``: ``l1`` or a scheme); for schemes, then the loss of one node
    and its rebuild, and the survivors' reads. Returns this rank's timings."""
    from ckptfmt.container.members import read_member
    from ckptfmt.container.metadata import ManifestMeta
    from ckptfmt.format.options import WriteOptions
    from ckptfmt.parallel.collective import rebuild
    from ckptfmt.parallel.collective.save import save_collective
    from ckptfmt.redundancy.config import Redundancy
    from ckptfmt.redundancy.record import record_of
    from ckptfmt.storage import commit
    from ckptfmt.storage.files import Inside

    path = node_dir(env) / f"{key}-{int(fsync)}-{rnd}"
    red = Redundancy.of(SCHEMES[key]) if key in SCHEMES else None
    marks: dict[str, float] = {}

    def save() -> Any:
        marks["start"] = time.perf_counter()
        m, _ = save_collective(
            env.comm,
            env.state,
            path,
            step=rnd,
            node=env.node,
            group=f"node:{env.node}",
            redundancy=red,
            fault=lambda point: marks.__setitem__(point, time.perf_counter()),
            write=WriteOptions(fsync=fsync, threads=env.threads),
            meta=ManifestMeta(levels={"1": {}}),
        )
        return m

    save_s, manifest = barrier_time(env, save)
    res: dict[str, Any] = {
        "save_s": save_s,
        "phases": {
            "data_s": marks["written"] - marks["start"],
            # the encoding, between this rank's files written and its parity file written
            "encode_s": marks.get("encoded", marks["written"]) - marks["written"],
            # the save's one vote (on the data and the parity) and the manifest built
            "vote_s": marks["manifest"] - marks.get("encoded", marks["written"]),
            "commit_s": marks["committed"] - marks["manifest"],
        },
    }
    if red is None:
        return res | {"path": str(path)}
    res["encode"] = env.prof.report()
    record = record_of(manifest)
    assert record is not None
    rset, j = record.set_of(env.rank)
    env.parity_bytes[key] = rset.parity[j].size
    env.geometry[key] = (rset.n, record.m, rset.chunk)
    res["member_bytes"] = rset.sizes[j]
    res["parity_bytes"] = rset.parity[j].size
    # one node loses its copy (untimed), then everyone rebuilds it
    if env.rank == env.lose:
        commit.remove(path)
    quiet_barrier(env.mpi)
    rebuild_s, (report, _) = barrier_time(
        env, lambda: rebuild.rebuild_collective(env.comm, path, f"node:{env.node}", fsync)
    )
    res["rebuild_s"] = rebuild_s
    res["rebuild"] = env.prof.report()
    res["rebuild_report_s"] = report.seconds
    res["rebuilt"] = [report.lost_data, report.lost_parity]
    if env.rank == env.lose:  # the rebuilt copy is the saved one: every CRC checked
        damage = read_member(Inside(path), manifest, env.rank, env.read_buf, verify=True)
        res["rebuilt_ok"] = not damage
    for verify in (False, True):

        def read(verify: bool = verify) -> None:
            if env.rank != env.lose:
                damage = read_member(Inside(path), manifest, env.rank, env.read_buf, verify=verify)
                if damage:
                    raise AssertionError(f"rank {env.rank}: {damage[0]}")

        res[f"read_{'verify' if verify else 'plain'}_s"], _ = barrier_time(env, read)
    return res | {"path": str(path)}


def run_parity_write(env: Env, scheme: str, rnd: int, fsync: bool) -> dict[str, Any]:
    """Every rank writes one file of its parity file's size for ``scheme`` (known from an
    earlier save), nothing else."""
    from ckptfmt.storage.files import write_gather

    n = env.parity_bytes[scheme]
    assert env.pw_buf is not None
    path = node_dir(env) / f"pw-{scheme}-{int(fsync)}-{rnd}"

    def body() -> None:
        path.mkdir()
        write_gather(path / "parity", [env.pw_buf[:n].data], fsync)

    s, _ = barrier_time(env, body)
    return {"save_s": s, "path": str(path)}


def run_ring(env: Env, scheme: str) -> dict[str, Any]:
    """The messages of ``encode_collective`` for ``scheme`` (same loop, same sizes, same
    partners: the set is every rank), without reading, multiplying or writing anything."""
    from ckptfmt.engine.encode import ENCODE_TAG

    n, m, chunk = env.geometry[scheme]
    j = env.rank
    assert env.pw_buf is not None
    recv = env.read_buf

    def body() -> None:
        if scheme == "partner":
            env.comm.sendrecv(
                env.pw_buf[:chunk], (j + 1) % n, recv[:chunk], (j - 1) % n, ENCODE_TAG
            )
            return
        c = n - m
        for d in range(1, n):
            for p in range(m):
                t = (p - m - d) % n
                if t < c:
                    pair = (env.pw_buf[t * chunk : (t + 1) * chunk], (j + d) % n, recv[:chunk])
                    env.comm.start_exchange([(*pair, (j - d) % n)], ENCODE_TAG).wait()

    s, _ = barrier_time(env, body)
    return {"save_s": s}


def run_votes(env: Env, votes: int) -> dict[str, Any]:
    """``votes`` collective votes with nothing to say, back to back."""

    def body() -> None:
        for _ in range(votes):
            env.comm.allgather_json({"error": None, "payload": []})

    s, _ = barrier_time(env, body)
    return {"save_s": s / votes}


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    for p in path.parent.glob(f".{path.name}.*"):
        shutil.rmtree(p, ignore_errors=True)


def run_launch(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    from ckptfmt.redundancy import gf256
    from ckptfmt.transport.mpi import MpiComm

    mpi = MPI.COMM_WORLD
    comm = MpiComm(mpi, wait=args.wait)
    rank, size = comm.rank, comm.size
    if size < 3:
        raise SystemExit("rs with m=2 needs at least 3 nodes: run with 8 ranks")
    base = Path(args.dir)
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
    quiet_barrier(mpi)
    state, nbytes = make_state(rank, size, args.mib_per_rank)
    env = Env(
        mpi=mpi,
        comm=comm,
        rank=rank,
        size=size,
        node=f"n{rank}",
        base=base,
        state=state,
        nbytes=nbytes,
        lose=args.lose,
        threads=args.threads,
        prof=instrument(comm),
        read_buf=np.zeros(nbytes + (1 << 20), np.uint8),
    )
    node_dir(env).mkdir()
    env.pw_buf = np.random.default_rng(rank).integers(0, 256, nbytes + (1 << 20), np.uint8)
    fsyncs = [{"off": False, "on": True}[x] for x in args.fsync.split(",")]
    methods = [
        "l1",
        *SCHEMES,
        *(f"pw_{s}" for s in SCHEMES),
        *(f"ring_{s}" for s in SCHEMES),
        "vote",
    ]
    samples: dict[str, dict[str, list[list[dict[str, Any]]]]] = {
        str(f): {k: [] for k in methods} for f in fsyncs
    }
    trace = []
    started = time.perf_counter()
    rnd, go_on = 0, True
    if rank == 0:
        print(
            f"# ranks={size} nodes=1 per rank, {nbytes / 2**20:.0f} MiB per rank, "
            f"GF backend {gf256.backend() if hasattr(gf256, 'backend') else 'numpy'}, "
            f"lose node n{args.lose}, fsync {args.fsync}",
            flush=True,
        )
    pending: list[Path] = []
    try:
        while go_on:
            timed = rnd >= args.warmup
            quiet_barrier(mpi)
            clock = RoundClock()
            rot = rnd % len(methods)
            order = methods[rot:] + methods[:rot]
            # parity-sized writes need the sizes from a save of that scheme: the first round
            # (a warm-up) runs the saves first
            if rnd == 0:
                order = methods
            for fsync in fsyncs:
                for key in order:
                    for p in pending:  # free the previous output just before the next run
                        remove(p)
                    gc.collect()
                    if key.startswith("pw_"):
                        res = run_parity_write(env, key[3:], rnd, fsync)
                    elif key.startswith("ring_"):
                        res = run_ring(env, key[5:])
                    elif key == "vote":
                        res = run_votes(env, args.votes)
                    else:
                        res = run_save(env, key, rnd, fsync)
                    pending = [Path(res.pop("path"))] if "path" in res else []
                    gathered = comm.allgather_json(res)
                    if key in SCHEMES and rank == args.lose and not res["rebuilt_ok"]:
                        raise AssertionError(f"{key}: the rebuilt member fails its CRCs")
                    if timed:
                        samples[str(fsync)][key].append(gathered)
            trace.append(clock.record(mpi, comm, rnd, timed, order, args.max_foreign))
            round_s = trace[-1]["round_s"]
            rnd += 1
            n_timed = rnd - args.warmup
            n_quiet = sum(t["quiet"] for t in trace if t["timed"])
            elapsed = time.perf_counter() - started
            go_on = comm.bcast_json(
                n_timed < args.reps
                or (n_quiet < args.reps and elapsed + round_s <= args.budget_min * 60),
                root=0,
            )
            if rank == 0:
                print(
                    f"# round {rnd} ({'timed' if timed else 'warm-up'}"
                    f"{', quiet' if trace[-1]['quiet'] else ''}) {round_s:.1f}s, done at "
                    f"{elapsed:.0f}s; others took {100 * trace[-1]['foreign_cpu_share']:.0f}% "
                    f"of the CPUs, load {trace[-1]['loadavg']}",
                    flush=True,
                )
    finally:
        for p in pending:
            remove(p)
        quiet_barrier(mpi)
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)
    if rank != 0:
        return 0
    doc = {
        "ranks": size,
        "nodes": [f"n{r}" for r in range(size)],
        "state_bytes_per_rank": nbytes,
        "samples": samples,  # fsync -> method -> [round][rank] {...}
        "quiet_rounds": [t["quiet"] for t in trace if t["timed"]],
        "rounds": trace,
        "config": {
            "mib_per_rank": args.mib_per_rank,
            "reps": args.reps,
            "warmup": args.warmup,
            "fsync": args.fsync,
            "lose": args.lose,
            "votes": args.votes,
            "threads": args.threads,
            "wait": args.wait,
            "dir": str(base),
            "max_foreign": args.max_foreign,
            "budget_min": args.budget_min,
            "gf_backend": gf256.backend() if hasattr(gf256, "backend") else "numpy",
            "env": {k: v for k, v in os.environ.items() if k.startswith("MPIR_CVAR")},
        },
        "versions": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "mpi": MPI.Get_library_version().splitlines()[0],
        },
        "git": git_info(),
        "source_sha256": source_digest(),
        "cpus": os.cpu_count(),
        "wall_s": round(time.perf_counter() - started, 1),
        "command": " ".join(
            ["mpiexec", "-n", str(size), Path(sys.executable).name, "-m", "mpi4py", *sys.argv]
        ),
    }
    doc["summary"] = summarize(doc)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(markdown(doc), flush=True)
    print(f"# wrote {out} ({doc['wall_s']}s)", flush=True)
    return 0


# --- summaries ------------------------------------------------------------------------------------


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def rounds_used(doc: dict[str, Any]) -> list[int]:
    quiet = [i for i, q in enumerate(doc["quiet_rounds"]) if q]
    return quiet if len(quiet) >= doc["config"]["reps"] else list(range(len(doc["quiet_rounds"])))


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """Medians over the rounds :func:`rounds_used` picks. Wall-clock times are barrier to
    barrier: the slowest rank's. Survivors' reads: the slowest survivor. Encoding parts: the
    mean over ranks (they overlap in time), and the slowest rank's total."""
    use = rounds_used(doc)
    lose = doc["config"]["lose"]
    out: dict[str, Any] = {"rounds_used": use}
    for fs, by_method in doc["samples"].items():
        rows: dict[str, Any] = {}
        l1 = [max(r["save_s"] for r in by_method["l1"][i]) for i in use]
        for key, rounds in by_method.items():
            rounds = [rounds[i] for i in use]
            save = [max(r["save_s"] for r in rnd) for rnd in rounds]
            row: dict[str, Any] = {
                "save_s": med(save),
                "save_min_s": min(save),
                "save_samples_s": [round(x, 4) for x in save],
                "ratio_to_l1": med(save) / med(l1),
                "ratio_to_l1_per_round_median": med([s / b for s, b in zip(save, l1)]),
            }
            if key in SCHEMES:
                sizes = [r["parity_bytes"] for r in rounds[0]]
                pw = [
                    max(r["save_s"] for r in rnd)
                    for rnd in (by_method[f"pw_{key}"][i] for i in use)
                ]
                ring = [
                    max(r["save_s"] for r in rnd)
                    for rnd in (by_method[f"ring_{key}"][i] for i in use)
                ]
                enc = [max(r["encode"]["total_s"] for r in rnd) for rnd in rounds]
                member = sum(r["member_bytes"] for r in rounds[0])

                def mean_parts(sec: str, rounds: list[list[dict[str, Any]]] = rounds) -> Any:
                    return {
                        p: med(
                            [statistics.mean(r[sec]["parts_s"][p] for r in rnd) for rnd in rounds]
                        )
                        for p in PARTS[sec]
                    }

                gf_rate = [
                    sum(r["encode"]["bytes"].get("gf", 0) for r in rnd)
                    / max(sum(r["encode"]["parts_s"]["gf"] for r in rnd), 1e-9)
                    for rnd in rounds
                ]
                survivors = [r for r in range(len(rounds[0])) if r != lose]
                row |= {
                    "parity_bytes_per_rank": max(sizes),
                    "member_bytes_per_rank": max(r["member_bytes"] for r in rounds[0]),
                    "extra_s": med(save) - med(l1),
                    "parity_write_s": med(pw),
                    "beyond_parity_write_s": med(save) - med(l1) - med(pw),
                    "encode_s": med(enc),
                    "encode_gb_per_s": member / med(enc) / 1e9,
                    "encode_parts_mean_s": mean_parts("encode"),
                    "ring_s": med(ring),
                    "gf_kernel_gb_per_s": med(gf_rate) / 1e9,
                    "sendrecv_bytes_per_rank": max(
                        r["encode"]["bytes"].get("sendrecv", 0) for r in rounds[0]
                    ),
                    "rebuild_s": med([max(r["rebuild_s"] for r in rnd) for rnd in rounds]),
                    "rebuild_parts_mean_s": mean_parts("rebuild"),
                    "rebuild_parts_lost_rank_s": {
                        p: med([rnd[lose]["rebuild"]["parts_s"][p] for rnd in rounds])
                        for p in PARTS["rebuild"]
                    },
                    "rebuild_received_bytes_lost_rank": rounds[0][lose]["rebuild"]["bytes"].get(
                        "recv", 0
                    ),
                    "read_plain_s": med(
                        [max(rnd[s]["read_plain_s"] for s in survivors) for rnd in rounds]
                    ),
                    "read_verify_s": med(
                        [max(rnd[s]["read_verify_s"] for s in survivors) for rnd in rounds]
                    ),
                    "rebuilt": rounds[0][0]["rebuilt"],
                }
                # what no implementation on this machine gets below: the level-1 save, plus
                # moving the set's bytes between the ranks (the same messages alone), plus
                # writing the parity's bytes (a parity-sized file alone), one after the other
                row["floor_s"] = med(l1) + med(ring) + med(pw)
                row["floor_ratio"] = row["floor_s"] / med(l1)
                row["rebuild_over_read_verify"] = row["rebuild_s"] / row["read_verify_s"]
                row["rebuild_over_read_plain"] = row["rebuild_s"] / row["read_plain_s"]
            if key in SCHEMES or key == "l1":
                row["phases_s"] = {
                    ph: med([max(r["phases"][ph] for r in rnd) for rnd in rounds])
                    for ph in rounds[0][0]["phases"]
                }
            rows[key] = row
        out[fs] = rows
    return out


def markdown(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    mib = doc["state_bytes_per_rank"] / 2**20
    lines = [
        f"{doc['ranks']} ranks, one per simulated node, {mib:.0f} MiB per rank "
        f"({doc['ranks'] * mib:.0f} MiB per checkpoint), tmpfs, {doc['cpus']} cores "
        f"(oversubscribed {doc['ranks'] // max(doc['cpus'], 1)}x), GF(2^8) backend "
        f"{doc['config']['gf_backend']}; rounds used: {len(s['rounds_used'])} of "
        f"{len(doc['quiet_rounds'])} ({sum(doc['quiet_rounds'])} quiet). One vote of all "
        f"ranks (an empty allgather_json) takes "
        + ", ".join(
            f"{1e3 * v['vote']['save_s']:.1f} ms (fsync {'on' if k == 'True' else 'off'} pass)"
            for k, v in s.items()
            if k != "rounds_used"
        )
        + ".",
        "",
        "| fsync | save | median s | min s | / level-1-only (medians) | median of per-round "
        "ratios | parity bytes per rank | extra s | parity-sized write s | beyond the parity "
        "write s | floor: level 1 + messages alone + parity write |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for fs, rows in ((k, v) for k, v in s.items() if k != "rounds_used"):
        for key in ("l1", *SCHEMES):
            r = rows[key]
            extra = (
                f"{r['parity_bytes_per_rank'] / 2**20:.1f} MiB | {r['extra_s']:.3f} | "
                f"{r['parity_write_s']:.3f} | {r['beyond_parity_write_s']:.3f} | "
                f"{r['floor_ratio']:.2f}x"
                if key in SCHEMES
                else "— | — | — | — | —"
            )
            lines.append(
                f"| {'on' if fs == 'True' else 'off'} | {LABELS[key]} | {r['save_s']:.3f} | "
                f"{r['save_min_s']:.3f} | {r['ratio_to_l1']:.2f}x | "
                f"{r['ratio_to_l1_per_round_median']:.2f}x | {extra} |"
            )
    lines += [
        "",
        "| fsync | scheme | rebuild of one node s | survivors read own data s (no CRC) | "
        "(CRC checked) | rebuild / read (CRC) | encode s (slowest rank) | encode GB/s (set "
        "data) | GF kernel GB/s | its messages alone s | sent per rank MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for fs, rows in ((k, v) for k, v in s.items() if k != "rounds_used"):
        for key in SCHEMES:
            r = rows[key]
            lines.append(
                f"| {'on' if fs == 'True' else 'off'} | {LABELS[key]} | {r['rebuild_s']:.3f} | "
                f"{r['read_plain_s']:.3f} | {r['read_verify_s']:.3f} | "
                f"{r['rebuild_over_read_verify']:.2f}x | {r['encode_s']:.3f} | "
                f"{r['encode_gb_per_s']:.2f} | {r['gf_kernel_gb_per_s']:.2f} | "
                f"{r['ring_s']:.3f} | {r['sendrecv_bytes_per_rank'] / 2**20:.1f} |"
            )
    lines += [
        "",
        "| fsync | save | own files written s | encoding s | vote (data and parity) s | "
        "commit s | encoding, mean over ranks: " + " / ".join(PARTS["encode"]) + " s |",
        "|---|---|---|---|---|---|---|",
    ]
    for fs, rows in ((k, v) for k, v in s.items() if k != "rounds_used"):
        for key in ("l1", *SCHEMES):
            r = rows[key]
            ph = r["phases_s"]
            parts = "—"
            if key in SCHEMES:
                parts = " / ".join(f"{r['encode_parts_mean_s'][p]:.3f}" for p in PARTS["encode"])
            lines.append(
                f"| {'on' if fs == 'True' else 'off'} | {LABELS[key]} | {ph['data_s']:.3f} | "
                f"{ph['encode_s']:.3f} | {ph['vote_s']:.3f} | {ph['commit_s']:.3f} | {parts} |"
            )
    lines += [
        "",
        "| fsync | scheme | rebuild, the lost node's rank: "
        + " / ".join(PARTS["rebuild"])
        + " s | received MiB |",
        "|---|---|---|---|",
    ]
    for fs, rows in ((k, v) for k, v in s.items() if k != "rounds_used"):
        for key in SCHEMES:
            r = rows[key]
            parts = " / ".join(f"{r['rebuild_parts_lost_rank_s'][p]:.3f}" for p in PARTS["rebuild"])
            lines.append(
                f"| {'on' if fs == 'True' else 'off'} | {LABELS[key]} | {parts} | "
                f"{r['rebuild_received_bytes_lost_rank'] / 2**20:.0f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mib-per-rank", type=int, default=32, help="state MiB per rank (default 32)")
    ap.add_argument("--reps", type=int, default=5, help="timed rounds (default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    ap.add_argument("--fsync", default="off,on", help="off, on or off,on (default)")
    ap.add_argument("--votes", type=int, default=20, help="empty votes timed per round")
    ap.add_argument("--lose", type=int, default=3, help="the rank (= node) lost (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="writer threads per rank (default 2)")
    ap.add_argument(
        "--wait",
        default="polite",
        choices=["polite", "block"],
        help="MpiComm(wait=...): sleep between tests (default) or MPI's spinning waits",
    )
    ap.add_argument("--dir", default=DEFAULT_DIR, help=f"tmpfs directory (default {DEFAULT_DIR})")
    ap.add_argument(
        "--max-foreign",
        type=float,
        default=0.15,
        help="a round is quiet when other processes took at most this CPU share",
    )
    ap.add_argument(
        "--budget-min",
        type=float,
        default=6,
        help="add rounds (beyond --reps) until --reps quiet ones, within this",
    )
    ap.add_argument("--out", default=str(BENCH / "results" / "redundancy.json"))
    ap.add_argument("--table", metavar="JSON", help="print the tables of a finished run")
    args = ap.parse_args(argv)
    if args.table:
        doc = json.loads(Path(args.table).read_text())
        doc["summary"] = summarize(doc)
        print(markdown(doc))
        return 0
    return run_launch(args)


if __name__ == "__main__":
    sys.exit(main())
