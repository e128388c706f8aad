#!/usr/bin/env python3
"""Incremental saves (``ckptfmt.save(..., base=...)``) against full saves of the same state.

One run, every variant interleaved round by round (the order rotates), medians of ``--reps``
rounds; every array of the state is touched (each page read) just before each timed window,
since this VM hands idle memory back to the host and a save would otherwise time page faults.

- ``full``: the default save (no content hash computed).
- ``full+hash``: the same save recording content hashes (what the first save of a chain and
  every incremental save pay for change detection); the difference to ``full`` is the cost of
  the hash, in wall time and in the process's CPU time (every thread; on a shared machine the
  steadier of the two, since it leaves out the waits for other jobs). The hash alone (CRC-64
  by ISA-L over the state, one thread, 1 MiB pieces) is timed too.
- ``incr 5%`` / ``incr 25%``: a frozen base of equal tensors of which 5% / 25% of the bytes
  changed since the base (a committed full save with hashes): the incremental save.
- bytes written: the bytes of the files a step's directory holds that are not links of the
  base's (data files written, the zarr documents and the manifest).
- sparse rows: one large table of which a few rows changed: the data files written, against
  the table's files.
- targets: ``/dev/shm`` (tmpfs, no fsync: a full save is a memory copy, the hardest case for an
  incremental save, which still reads every byte once to hash it) and ``/tmp`` (the local disk,
  with the default fsync: what a node-local level 1 is).
- restore: ``ckptfmt.load`` of the tenth step of a chain of incremental saves (each 5% changed
  from the one before) against a load of a full save of the same state.
- ``bucket``: a flush of a level-1 checkpoint to a bucket level 3 (moto's S3 server in its own
  process), full and incremental (5% / 25% changed since the step on the bucket): unchanged
  objects are copied inside the store; the time and the bytes uploaded.

    python bench/bench_incremental.py             # 400 MiB state, /dev/shm, /tmp, bucket, 7 rounds
    python bench/bench_incremental.py --quick     # 40 MiB, 3 rounds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import ckptfmt  # noqa: E402
from ckptfmt import WriteOptions  # noqa: E402
from ckptfmt.format import incremental  # noqa: E402
from ckptfmt.redundancy import isal  # noqa: E402

MIB = 1 << 20


def touch(state: dict[str, np.ndarray]) -> None:
    """Read one byte of every page of every array (fault back what the host took)."""
    for a in state.values():
        int(a.reshape(-1).view(np.uint8)[::4096].sum())


def new_bytes(step: Path) -> int:
    """The bytes of the files under ``step`` that were written for it (one link: not shared)."""
    return sum(p.stat().st_size for p in step.rglob("*") if p.is_file() and p.stat().st_nlink == 1)


def files_written(step: Path, prefix: str) -> tuple[int, int]:
    """(files written, files) of the data files under ``step/prefix``."""
    files = [p for p in (step / prefix / "c").rglob("*") if p.is_file()]
    return sum(1 for p in files if p.stat().st_nlink == 1), len(files)


def make_state(n: int, tensor_mib: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    rows = tensor_mib * MIB // (4 * 1024)
    return {f"layer{i:03d}": rng.standard_normal((rows, 1024), dtype=np.float32) for i in range(n)}


def changed(state: dict[str, np.ndarray], fraction: float, salt: int) -> dict[str, np.ndarray]:
    """``state`` with its first ``fraction`` of tensors changed (new arrays; the rest shared)."""
    names = sorted(state)
    k = round(len(names) * fraction)
    out = dict(state)
    for name in names[:k]:
        out[name] = state[name] + np.float32(salt)
    return out


CPU: dict[str, list[float]] = {}
"""CPU seconds of this process (every thread) per timed run, by variant: on a shared machine
the wall time of a save holds the waits for other jobs' CPU; its CPU time does not."""


def timed(fn: Callable[[], Any], state: dict[str, np.ndarray], name: str = "") -> float:
    touch(state)
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    if name:
        CPU.setdefault(name, []).append(time.process_time() - c0)
    return wall


def hash_alone(state: dict[str, np.ndarray]) -> float:
    """Seconds to hash the state's bytes with the content hash, 1 MiB pieces, one thread."""
    name = incremental.algorithm()
    touch(state)
    t0 = time.perf_counter()
    for a in state.values():
        flat = a.reshape(-1).view(np.uint8)
        h = incremental.Hasher(name)
        for at in range(0, flat.size, MIB):
            h.add(flat[at : at + MIB])
        h.hexdigest()
    return time.perf_counter() - t0


TARGETS = {
    # tmpfs: "storage" at memory speed, nothing to fsync (the hardest case for incremental saves:
    # a full save is a memcpy, an incremental one still reads every byte once to hash it)
    "shm": ("/dev/shm/ckptfmt-bench-incr", False),
    # the local disk with ckptfmt's default fsync (what a node-local level 1 is)
    "disk": ("/tmp/ckptfmt-bench-incr", True),
}


def run_target(root: Path, fsync: bool, n: int, tensor_mib: int, reps: int) -> dict[str, Any]:
    """Every measurement on one target directory; the numbers as a JSON-able dict."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    plain = WriteOptions(fsync=fsync)
    hashed = WriteOptions(fsync=fsync, content_hash=True)

    state = make_state(n, tensor_mib)
    nbytes = sum(a.nbytes for a in state.values())
    base = root / "base"
    ckptfmt.save(state, base, write=hashed)
    s5, s25 = changed(state, 0.05, 1), changed(state, 0.25, 2)
    times: dict[str, list[float]] = {k: [] for k in ("full", "full+hash", "incr5", "incr25")}
    written: dict[str, list[int]] = {k: [] for k in times}
    runs: dict[str, tuple[dict[str, np.ndarray], Callable[[Path], Any]]] = {
        "full": (s5, lambda p: ckptfmt.save(s5, p, write=plain)),
        "full+hash": (s5, lambda p: ckptfmt.save(s5, p, write=hashed)),
        "incr5": (s5, lambda p: ckptfmt.save(s5, p, write=hashed, base=base)),
        "incr25": (s25, lambda p: ckptfmt.save(s25, p, write=hashed, base=base)),
    }
    hash_s: list[float] = []
    order = list(runs)
    for rep in range(reps):
        for name in order[rep % len(order) :] + order[: rep % len(order)]:
            st, fn = runs[name]
            path = root / f"{name}-{rep}"
            times[name].append(timed(lambda: fn(path), st, f"{root}:{name}"))  # noqa: B023
            written[name].append(new_bytes(path))
            shutil.rmtree(path)
        hash_s.append(hash_alone(s5))

    # sparse rows inside one large table (128 MiB, 16 MiB shards)
    rng = np.random.default_rng(5)
    table = {"table": rng.standard_normal((128 * 256, 1024), dtype=np.float32)}
    ckptfmt.save(table, root / "t0", write=hashed)
    rows = [100, 101, 20000]  # in shards 0 and 4 of 8 (4096 rows each)
    sparse = {"table": table["table"].copy()}
    sparse["table"][rows] += 1
    ckptfmt.save(sparse, root / "t1", write=hashed, base=root / "t0")
    sparse_written, sparse_files = files_written(root / "t1", "table")
    sparse_bytes = new_bytes(root / "t1")
    shutil.rmtree(root / "t0")
    shutil.rmtree(root / "t1")
    del table, sparse

    # a chain of ten incremental steps, each 5% changed from the one before; restore the tenth
    chain_state, prev = state, base
    for k in range(1, 11):
        names = sorted(chain_state)
        at = (2 * k) % len(names)
        chain_state = dict(chain_state)
        for name in names[at : at + max(1, len(names) // 20)]:
            chain_state[name] = chain_state[name] + np.float32(k)
        step = root / f"chain-{k}"
        ckptfmt.save(chain_state, step, write=hashed, base=prev)
        prev = step
    full10 = root / "full10"
    ckptfmt.save(chain_state, full10, write=plain)
    load_t: dict[str, list[float]] = {"full": [], "chain10": []}
    for rep in range(reps):
        for name, path in [("full", full10), ("chain10", prev)][:: 1 if rep % 2 == 0 else -1]:
            t0 = time.perf_counter()
            got = ckptfmt.load(path)
            load_t[name].append(time.perf_counter() - t0)
            del got
    check = ckptfmt.load(prev)
    assert all(np.array_equal(check[k], chain_state[k]) for k in chain_state)
    del check
    shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    wmed = {k: statistics.median(v) for k, v in written.items()}
    lmed = {k: statistics.median(v) for k, v in load_t.items()}
    cpu = {k: CPU[f"{root}:{k}"] for k in times}
    cmed = {k: statistics.median(v) for k, v in cpu.items()}
    gb = nbytes / 1e9
    return {
        "save_cpu_s": cpu,
        "save_cpu_median_s": cmed,
        "hash_cost_cpu_s_per_gb": (cmed["full+hash"] - cmed["full"]) / gb,
        "target": str(root),
        "fsync": fsync,
        "state_bytes": nbytes,
        "save_s": times,
        "save_median_s": med,
        "written_median_bytes": wmed,
        "hash_alone_median_s": statistics.median(hash_s),
        "hash_cost_s_per_gb": (med["full+hash"] - med["full"]) / gb,
        "hash_alone_s_per_gb": statistics.median(hash_s) / gb,
        "incr5_time_ratio": med["incr5"] / med["full"],
        "incr25_time_ratio": med["incr25"] / med["full"],
        "incr5_fewer_bytes": wmed["full"] / wmed["incr5"],
        "incr25_fewer_bytes": wmed["full"] / wmed["incr25"],
        "incr5_limit_bytes": 1.1 * 0.05 * nbytes + MIB,
        "sparse": {
            "rows_changed": rows,
            "table_files_written": sparse_written,
            "table_files": sparse_files,
            "bytes_written": sparse_bytes,
        },
        "load_s": load_t,
        "load_median_s": lmed,
        "chain10_load_ratio": lmed["chain10"] / lmed["full"],
    }


_MOTO = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
host, port = server.get_host_and_port()
print(f"http://{host}:{port}", flush=True)
sys.stdin.read()
server.stop()
"""


def run_bucket(n: int, tensor_mib: int, reps: int) -> dict[str, Any]:
    """A flush of a committed level-1 checkpoint to a bucket level 3 (``flush_to_bucket``, one
    rank), full and incremental against the step before (5% / 25% changed): the time, the data
    bytes uploaded and copied inside the store, and the bytes uploaded in all (data, zarr
    documents, manifest; the commit object and the pointer aside). The store is moto's S3
    server in a process of its own on 127.0.0.1 (a local server: its copies are memory copies,
    its uploads a loopback HTTP transfer, so the time ratio is a floor of what a remote store
    gives, where an upload costs the link's bandwidth and a copy does not)."""
    import subprocess

    server = subprocess.Popen(
        [sys.executable, "-c", _MOTO], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        endpoint = server.stdout.readline().strip()
        os.environ.update(
            {
                "AWS_ACCESS_KEY_ID": "bench",
                "AWS_SECRET_ACCESS_KEY": "bench",
                "AWS_REGION": "us-east-1",
                "AWS_ENDPOINT_URL": endpoint,
                "AWS_ALLOW_HTTP": "true",
            }
        )
        return _flushes(n, tensor_mib, reps)
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(timeout=30)


def _flushes(n: int, tensor_mib: int, reps: int) -> dict[str, Any]:
    import boto3

    from ckptfmt.parallel.levels.bucket import flush_to_bucket
    from ckptfmt.storage.objects import Bucket
    from ckptfmt.storage.objects.commit import delete_checkpoint, read_commit
    from ckptfmt.storage.steps import step_dir_name
    from ckptfmt.transport.comm import SingleComm

    boto3.client("s3").create_bucket(Bucket="bench")
    local = Path("/dev/shm/ckptfmt-bench-incr-bucket")
    shutil.rmtree(local, ignore_errors=True)
    hashed = WriteOptions(fsync=False, content_hash=True)
    state = make_state(n, tensor_mib)
    nbytes = sum(a.nbytes for a in state.values())
    variants = {"full": (0.05, False), "incr5": (0.05, True), "incr25": (0.25, True)}
    made = {}
    base = ckptfmt.save(state, local / "step-1", step=1, write=hashed)
    for name, (frac, _) in variants.items():  # level 1: step 2 of each variant, saved once
        made[name] = ckptfmt.save(
            changed(state, frac, 3), local / name / "step-2", step=2, write=hashed
        )
    del state
    comm = SingleComm()
    roots = {name: Bucket.at(f"s3://bench/{name}") for name in variants}
    for root in roots.values():  # every root starts with the base flushed (untimed)
        flush_to_bucket(comm, base, local / "step-1", root)
    times: dict[str, list[float]] = {k: [] for k in variants}
    uploaded: dict[str, list[int]] = {k: [] for k in variants}
    copied: dict[str, list[int]] = {k: [] for k in variants}
    order = list(variants)
    for rep in range(reps):
        for name in order[rep % len(order) :] + order[: rep % len(order)]:
            report: dict[str, Any] = {}
            t0 = time.perf_counter()
            flush_to_bucket(
                comm,
                made[name],
                local / name / "step-2",
                roots[name],
                incremental=variants[name][1],
                report=report,
            )
            times[name].append(time.perf_counter() - t0)
            where = roots[name].child(step_dir_name(2))
            commit = read_commit(where)
            assert commit is not None
            total = sum(o.size for o in commit.objects)
            copied[name].append(int(report.get("linked_bytes", 0)))
            uploaded[name].append(total - copied[name][-1])
            delete_checkpoint(where, everything=True)  # the next round flushes step 2 again
    shutil.rmtree(local, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    umed = {k: statistics.median(v) for k, v in uploaded.items()}
    return {
        "target": "s3 (moto, 127.0.0.1, own process)",
        "state_bytes": nbytes,
        "flush_s": times,
        "flush_median_s": med,
        "uploaded_median_bytes": umed,
        "copied_median_bytes": {k: statistics.median(v) for k, v in copied.items()},
        "incr5_time_ratio": med["incr5"] / med["full"],
        "incr25_time_ratio": med["incr25"] / med["full"],
        "incr5_fewer_bytes": umed["full"] / umed["incr5"],
        "incr25_fewer_bytes": umed["full"] / umed["incr25"],
    }


def show_bucket(r: dict[str, Any]) -> None:
    med, umed = r["flush_median_s"], r["uploaded_median_bytes"]
    cmed = r["copied_median_bytes"]
    print(f"== bucket: {r['target']}, state {r['state_bytes'] / MIB:.0f} MiB")
    print(f"{'flush':>10} {'median s':>9} {'uploaded MiB':>13} {'copied MiB':>11}")
    for k in med:
        print(f"{k:>10} {med[k]:9.3f} {umed[k] / MIB:13.2f} {cmed[k] / MIB:11.2f}")
    print(
        f"incr 5%: {r['incr5_fewer_bytes']:.1f}x fewer bytes uploaded, "
        f"{r['incr5_time_ratio']:.3f}x the time; incr 25%: {r['incr25_fewer_bytes']:.1f}x, "
        f"{r['incr25_time_ratio']:.3f}x"
    )


def show(name: str, r: dict[str, Any]) -> None:
    med, wmed, lmed = r["save_median_s"], r["written_median_bytes"], r["load_median_s"]
    sp = r["sparse"]
    print(f"== {name}: {r['target']} (fsync {r['fsync']}), state {r['state_bytes'] / MIB:.0f} MiB")
    print(f"{'save':>10} {'median s':>9} {'written MiB':>12}")
    for k in med:
        print(f"{k:>10} {med[k]:9.3f} {wmed[k] / MIB:12.2f}")
    print(
        f"hash: {r['hash_cost_s_per_gb']:.4f} s/GB on top of a full save, "
        f"{r['hash_cost_cpu_s_per_gb']:.4f} CPU s/GB "
        f"(alone, one thread: {r['hash_alone_s_per_gb']:.4f} s/GB)"
    )
    print(
        f"incr 5%: {r['incr5_fewer_bytes']:.1f}x fewer bytes "
        f"(limit {r['incr5_limit_bytes'] / MIB:.1f} MiB), {r['incr5_time_ratio']:.3f}x the time; "
        f"incr 25%: {r['incr25_fewer_bytes']:.1f}x fewer bytes, {r['incr25_time_ratio']:.3f}x"
    )
    print(
        f"sparse rows {sp['rows_changed']}: {sp['table_files_written']} of {sp['table_files']} "
        f"table files written ({sp['bytes_written'] / MIB:.1f} MiB)"
    )
    print(
        f"load: full {lmed['full']:.3f} s, 10th incremental step {lmed['chain10']:.3f} s "
        f"({r['chain10_load_ratio']:.3f}x)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--targets",
        default="shm,disk,bucket",
        help="comma-separated: " + ",".join([*TARGETS, "bucket"]),
    )
    ap.add_argument("--tensors", type=int, default=40)
    ap.add_argument("--tensor-mib", type=int, default=10)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "incremental.json"))
    args = ap.parse_args()
    if args.quick:
        args.tensors, args.tensor_mib, args.reps = 20, 2, 3
    result: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "tensors": args.tensors,
        "reps": args.reps,
        "hash": incremental.algorithm(),
        "isal": isal.version(),
        "targets": {},
    }
    for name in args.targets.split(","):
        if name == "bucket":
            result["targets"][name] = run_bucket(args.tensors, args.tensor_mib, args.reps)
            show_bucket(result["targets"][name])
            continue
        where, fsync = TARGETS[name]
        result["targets"][name] = run_target(
            Path(where), fsync, args.tensors, args.tensor_mib, args.reps
        )
        show(name, result["targets"][name])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
