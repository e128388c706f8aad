"""Level 3 on object storage: the manager's flush to a bucket and its restore from it, against
plain obstore requests for the same bytes and against DCP's fsspec/s3fs writer, on a local
S3 server (moto), same run, medians.

A 1 GiB state (one float32 tensor split by rows between 2 ranks: 512 MiB each, default 16 MiB
shards) is saved to level 1 by 2 ranks under ``mpiexec``; then, per round, each timed from a
barrier to a barrier (the slowest rank; a first round warms up and is not counted; of each pair
below, each goes first every other round):

* ``ckptfmt_flush``: ``flush_to_bucket`` (each rank reads, verifies and puts its files, 8 in
  flight, and its share of the zarr.json documents; rank 0 the manifest; commit object; latest
  pointer);
* ``obstore_put``: the same files read and put with plain ``obstore.put``, 8 in flight per rank
  (no verification, no commit): the ceiling the flush is held against (target >= 0.8x);
* ``ckptfmt_restore``: what the manager's restore does on level 3 (rank 0 reads the commit,
  every rank GETs the shard objects of its rows through ``ObjectInside``, every object's size
  and every CRC checked), into the arrays of the state being restored (a training job's model
  and optimizer exist when it restores: ``CheckpointManager.restore(into=True)``, the torch
  adapter's ``restore(into=True)``);
* ``ckptfmt_restore_fresh``: the same into new arrays (``into=False``, the default), which
  pays for first touching 512 MiB of new memory per rank (see ``touch_new_memory``);
* ``obstore_get``: each rank GETs the same objects whole with plain ``obstore.get``, 8 in
  flight (target >= 0.8x);
* ``obstore_get_place``: the same GETs, each object's bytes then copied into existing memory and
  CRC'd in 2 MiB batches: the least any reader that places and checks the bytes does, which
  the restore is held against too;
* ``download_then_load``: the other way a restore could go: each rank downloads the objects it
  needs into a local directory (``Bucket.download``, 8 in flight), then loads from it.

* ``touch_new_memory`` (not a restore): the time to write one byte per page of a new 512 MiB
  array on each rank, what new memory costs here at that moment; on this VM it swings from
  ~0.05 s to over 1 s (memory the host reclaimed is faulted back in), which no reader of a
  bucket can help.

Then, under ``torchrun`` on the same server, ``dcp_save``: ``torch.distributed.checkpoint.save``
of the same 2 x 512 MiB through ``FsspecWriter("s3://...")`` (s3fs), ``thread_count=8``, and
``dcp_load`` back (target: the flush faster than ``dcp_save``).

Requests are counted by the server itself (moto's request log, one line per HTTP request,
retries included): PUT (multipart initiations, parts and completions count as PUTs, as S3 bills
them), GET, HEAD, LIST, DELETE, per checkpoint.

    python bench/bench_object_store.py [--reps 3] [--mib 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
IN_FLIGHT = 8
COLS = 32768  # float32 columns: 128 KiB a row


def quiet_barrier(mpi: Any) -> None:
    """A barrier that sleeps while it waits (MPICH's spins; this machine has 2 cores)."""
    req = mpi.Ibarrier()
    while not req.Test():
        time.sleep(0.0005)


# --- the request log ------------------------------------------------------------------------------

# werkzeug colours the lines of answers other than 200 (a ranged GET's 206, a 404)
_LINE = re.compile(r'"(?:\x1b\[[0-9;]*m)*(GET|PUT|POST|HEAD|DELETE) (\S+) HTTP')


def count_requests(log: Path, start: int, end: int) -> tuple[dict[str, int], int]:
    """The requests logged between bytes ``start`` and ``end`` of the server's log, by kind."""
    with open(log, "rb") as f:
        f.seek(start)
        data = f.read(end - start).decode(errors="replace")
    out: Counter[str] = Counter()
    for method, target in _LINE.findall(data):
        if method == "GET" and ("list-type" in target or "delimiter" in target):
            out["LIST"] += 1
        elif method == "POST" and "?delete" in target:
            out["DELETE"] += 1
        elif method == "POST":  # multipart initiation and completion
            out["PUT"] += 1
        else:
            out[method] += 1
    return dict(out), end


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, all its threads."""
    t = os.times()
    return t.user + t.system


def server_cpu_seconds() -> float:
    """The S3 server's user + system CPU seconds so far (``/proc``), 0 where it cannot be read."""
    try:
        fields = Path(f"/proc/{os.environ['BENCH_SERVER_PID']}/stat").read_text().rsplit(")", 1)[1]
        utime, stime = fields.split()[11:13]
    except (KeyError, OSError, ValueError):
        return 0.0
    return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")


def log_end(log: Path) -> int:
    """The end of the server's log once it stops growing (it logs a request after answering)."""
    size = -1
    while True:
        now = log.stat().st_size
        if now == size:
            return now
        size = now
        time.sleep(0.4)


# --- the mpiexec ranks ----------------------------------------------------------------------------


def rank_main(args: argparse.Namespace) -> None:
    import numpy as np
    import obstore
    from crc32c import crc32c
    from mpi4py import MPI
    from obstore.store import from_url

    from ckptfmt import Shard, WriteOptions
    from ckptfmt.container.metadata import ManifestMeta
    from ckptfmt.parallel.collective.load import load_collective
    from ckptfmt.parallel.collective.save import save_collective
    from ckptfmt.parallel.levels.bucket import BucketLevel, flush_to_bucket
    from ckptfmt.storage.objects import Bucket
    from ckptfmt.storage.steps import step_dir_name
    from ckptfmt.transport.mpi import MpiComm

    mpi = MPI.COMM_WORLD
    comm = MpiComm()
    rank, size = comm.rank, comm.size
    rows = args.mib * (1 << 20) // (COLS * 4)
    mine = rows // size
    data = np.random.default_rng(rank).standard_normal((mine, COLS), dtype=np.float32)
    state = {"w": Shard(data, (rank * mine, 0), (rows, COLS))}
    model = np.ones_like(data)  # the state a restore writes into: it exists, its pages touched
    landing: np.ndarray | None = None  # obstore_get_place's destination
    work = Path(args.work)
    url = f"s3://{args.bucket}"
    store = from_url(url)  # the AWS_* environment: the same server and credentials
    log = Path(args.server_log)
    results: dict[str, list[float]] = {}
    cpu: dict[str, list[list[float]]] = {}  # per round: [the ranks' CPU s, the server's CPU s]
    requests: dict[str, dict[str, int]] = {}

    def timed(name: str, fn: Any, keep: bool = True) -> Any:
        # the log settles before the barrier: waiting for it after would start rank 0 last
        start_log = log_end(log) if rank == 0 else 0
        quiet_barrier(mpi)
        t0, c0, s0 = time.perf_counter(), cpu_seconds(), server_cpu_seconds()
        out = fn()
        quiet_barrier(mpi)
        dt = time.perf_counter() - t0
        used = mpi.allreduce(cpu_seconds() - c0)  # every rank's threads, barriers' waits included
        served = server_cpu_seconds() - s0
        if keep:  # round 0 warms the connections, the allocator and the server up
            results.setdefault(name, []).append(dt)
            cpu.setdefault(name, []).append([used, served])
        if rank == 0:
            requests[name], _ = count_requests(log, start_log, log_end(log))
        return out

    def put_files(prefix: str, files: list[tuple[str, Path]]) -> None:
        def one(item: tuple[str, Path]) -> None:
            key, path = item
            obstore.put(store, f"{prefix}/{key}", path.read_bytes(), use_multipart=False)

        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            list(pool.map(one, files))

    def get_keys(keys: list[str]) -> int:
        def one(key: str) -> int:
            return len(obstore.get(store, key).bytes())

        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            return sum(pool.map(one, keys))

    def get_place(keys: list[str], sizes: list[int]) -> None:
        """Each object whole, its bytes copied into existing memory and CRC'd in 2 MiB
        batches: what any reader that places and checks the bytes does at least."""
        starts = np.cumsum([0, *sizes])

        def one(i: int) -> None:
            got = np.frombuffer(memoryview(obstore.get(store, keys[i]).bytes()), np.uint8)
            dest = landing[starts[i] : starts[i] + got.size]
            for a in range(0, got.size, 2 << 20):
                np.copyto(dest[a : a + (2 << 20)], got[a : a + (2 << 20)])
                crc32c(dest[a : a + (2 << 20)])

        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            list(pool.map(one, range(len(keys))))

    for rep in range(args.reps + 1):
        keep = rep > 0
        local = work / f"l1-{rank}" / step_dir_name(rep)
        manifest, _ = save_collective(
            comm,
            state,
            local,
            step=rep,
            node=f"n{rank}",
            group=f"node:n{rank}",
            write=WriteOptions(fsync=False),
            meta=ManifestMeta(levels={"1": {}}),
        )
        root = Bucket.at(f"{url}/ckptfmt")
        my_files = [
            (f.path, local / f.path)
            for t in manifest.tensors()
            for r in t.regions
            if r.rank == rank
            for f in r.files
        ]
        if rank == 0:
            my_files += [(p.relative_to(local).as_posix(), p) for p in local.rglob("zarr.json")]
            my_files.append(("ckptfmt.json", local / "ckptfmt.json"))
        pair = [
            ("ckptfmt_flush", lambda: flush_to_bucket(comm, manifest, local, root)),  # noqa: B023
            ("obstore_put", lambda: put_files(f"plain/{rep}", my_files)),  # noqa: B023
        ]
        for name, fn in pair[:: 1 if rep % 2 else -1]:  # each goes first every other round
            timed(name, fn, keep)

        level = BucketLevel(root)
        step_bucket = root.child(step_dir_name(rep))
        box = ((rank * mine, 0), (mine, COLS))

        def restore(fresh: bool = False) -> Any:
            where, src = level.open_step(comm, step_bucket, rep)  # noqa: B023
            into = None if fresh else {"w": model}
            got, _ = load_collective(comm, where, {"w": box}, rep, source=src, into=into)  # noqa: B023
            return got

        def restore_checked() -> None:
            model.fill(0)
            for fresh in (False, True):
                got = restore(fresh)
                if got["w"].tobytes() != data.tobytes():
                    raise SystemExit(f"rank {rank}: the restored rows differ")

        def touch_new_memory() -> None:
            fresh = np.empty(data.nbytes, np.uint8)
            fresh[::4096] = 1

        def download_then_load() -> None:
            """The alternative to reading through ObjectInside: each rank downloads the
            objects it needs into a level-1-like directory, then loads from there."""
            level.open_step(comm, step_bucket, rep)  # noqa: B023  (the commit check, as restore)
            objs = step_bucket.child(manifest.save_id)  # noqa: B023
            dl = work / f"dl-{rank}" / step_dir_name(rep)  # noqa: B023
            mine = [k for k, _ in my_files if "/c/" in k]  # noqa: B023
            docs = [p.relative_to(local).as_posix() for p in local.rglob("zarr.json")]  # noqa: B023
            keys = [*mine, *docs, "ckptfmt.json"]

            def one(key: str) -> None:
                (dl / key).parent.mkdir(parents=True, exist_ok=True)
                objs.download(key, dl / key)

            with ThreadPoolExecutor(IN_FLIGHT) as pool:
                list(pool.map(one, keys))
            load_collective(comm, dl, {"w": box}, rep, node=f"n{rank}")  # noqa: B023

        plain_keys = [f"plain/{rep}/{k}" for k, _ in my_files if "/c/" in k]
        plain_sizes = [p.stat().st_size for k, p in my_files if "/c/" in k]
        if landing is None:  # touched once: existing memory, as the restore's arrays
            landing = np.ones(sum(plain_sizes), np.uint8)
        cases = [
            ("ckptfmt_restore", restore),
            ("obstore_get", lambda: get_keys(plain_keys)),  # noqa: B023
            ("obstore_get_place", lambda: get_place(plain_keys, plain_sizes)),  # noqa: B023
            ("ckptfmt_restore_fresh", lambda: restore(fresh=True)),
            ("download_then_load", download_then_load),
            ("touch_new_memory", touch_new_memory),
        ]
        for name, fn in cases[rep % 6 :] + cases[: rep % 6]:  # each goes first in turn
            timed(name, fn, keep)
        shutil.rmtree(work / f"dl-{rank}", ignore_errors=True)
        restore_checked()  # untimed: the bytes are the saved ones

        quiet_barrier(mpi)
        if rank == 0:  # keep the server's memory bounded: nothing of this round stays
            for prefix in (f"ckptfmt/{step_dir_name(rep)}", f"plain/{rep}"):
                listed = [m["path"] for page in obstore.list(store, prefix) for m in page]
                for i in range(0, len(listed), 1000):
                    obstore.delete(store, listed[i : i + 1000])
        shutil.rmtree(local)
        quiet_barrier(mpi)

    total = sum(f.size for _, f in manifest.files())
    if rank == 0:
        Path(args.part).write_text(
            json.dumps({"seconds": results, "cpu": cpu, "requests": requests, "bytes": total})
        )


# --- the torchrun ranks (DCP) ---------------------------------------------------------------------


def dcp_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    rows = args.mib * (1 << 20) // (COLS * 4)
    mine = rows // size
    g = torch.Generator().manual_seed(rank)
    t = torch.randn((mine, COLS), generator=g, dtype=torch.float32)
    log = Path(args.server_log)
    results: dict[str, list[float]] = {}
    requests: dict[str, dict[str, int]] = {}

    def timed(name: str, fn: Any, keep: bool) -> None:
        dist.barrier()
        start_log = log_end(log) if rank == 0 else 0
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        if keep:  # round 0 warms up, as for ckptfmt's
            results.setdefault(name, []).append(time.perf_counter() - t0)
        if rank == 0:
            requests[name], _ = count_requests(log, start_log, log_end(log))

    for rep in range(args.reps + 1):
        path = f"s3://{args.bucket}/dcp/{rep}"
        sd = {f"w{rank}": t}
        timed(
            "dcp_save",
            lambda: dcp.save(sd, storage_writer=FsspecWriter(path, thread_count=IN_FLIGHT)),  # noqa: B023
            rep > 0,
        )
        back = {f"w{rank}": torch.empty_like(t)}
        timed("dcp_load", lambda: dcp.load(back, storage_reader=FsspecReader(path)), rep > 0)  # noqa: B023
        if not torch.equal(back[f"w{rank}"], t):
            raise SystemExit(f"rank {rank}: DCP loaded other values")
        dist.barrier()
        if rank == 0:
            import s3fs

            s3fs.S3FileSystem().rm(path, recursive=True)
        dist.barrier()
    if rank == 0:
        Path(args.part).write_text(json.dumps({"seconds": results, "requests": requests}))
    dist.barrier()
    dist.destroy_process_group()


# --- the driver ---------------------------------------------------------------------------------

SERVER = """
import sys, time
from moto.server import ThreadedMotoServer
s = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=True)
s.start()
print("PORT", s.get_host_and_port()[1], flush=True)
while True:
    time.sleep(3600)
"""


def run(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-objects-", dir=args.work))
    log = work / "server.log"
    with open(log, "wb") as err:
        server = subprocess.Popen(
            [sys.executable, "-u", "-c", SERVER], stdout=subprocess.PIPE, stderr=err
        )
    try:
        assert server.stdout is not None
        line = b""
        while not line.startswith(b"PORT "):
            line = server.stdout.readline()
            if not line:
                raise SystemExit("the S3 server did not start")
        port = int(line.split()[1])
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ALLOW_HTTP": "true",
            "PYTHONPATH": str(REPO),
            "BENCH_SERVER_PID": str(server.pid),
        }
        import boto3

        boto3.client(
            "s3",
            endpoint_url=env["AWS_ENDPOINT_URL"],
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
            region_name="us-east-1",
        ).create_bucket(Bucket="bench")
        common = ["--bucket", "bench", "--mib", str(args.mib), "--reps", str(args.reps)]
        common += ["--server-log", str(log), "--work", str(work)]
        part = work / "part.json"
        mpiexec = Path(sys.executable).parent / "mpiexec"
        cmd = [str(mpiexec), "-n", "2", sys.executable, "-m", "mpi4py", __file__, "ranks"]
        subprocess.run(["timeout", "900", *cmd, *common, "--part", str(part)], env=env, check=True)
        mine = json.loads(part.read_text())
        part.unlink()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", "2", __file__, "dcp"]
        subprocess.run(["timeout", "900", *cmd, *common, "--part", str(part)], env=env, check=True)
        dcp = json.loads(part.read_text())
    finally:
        server.terminate()
        server.wait(10)
    report(args, mine, dcp)
    shutil.rmtree(work, ignore_errors=True)


def report(args: argparse.Namespace, mine: dict[str, Any], dcp: dict[str, Any]) -> None:
    seconds = {**mine["seconds"], **dcp["seconds"]}
    requests = {**mine["requests"], **dcp["requests"]}
    nbytes = mine["bytes"]
    med = {k: statistics.median(v) for k, v in seconds.items()}
    cpu_med = {  # the mpiexec cases only (the ranks' and the server's CPU seconds)
        k: [statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)]
        for k, v in mine.get("cpu", {}).items()
    }
    doc = {
        "what": "level 3 on a local S3 server (moto 5, one process): flush and restore of a "
        f"{nbytes / 2**30:.2f} GiB checkpoint by 2 ranks vs plain obstore and DCP+s3fs",
        "machine": f"{os.cpu_count()} CPUs, shared",
        "reps": args.reps,
        "bytes": nbytes,
        "seconds": seconds,
        "median_s": med,
        "median_mib_s": {k: nbytes / 2**20 / v for k, v in med.items()},
        "median_cpu_s_ranks_server": cpu_med,
        "ratios": {
            "flush_vs_obstore_put": med["obstore_put"] / med["ckptfmt_flush"],
            "flush_vs_dcp_save": med["dcp_save"] / med["ckptfmt_flush"],
            "restore_vs_obstore_get": med["obstore_get"] / med["ckptfmt_restore"],
            "restore_vs_obstore_get_place": med["obstore_get_place"] / med["ckptfmt_restore"],
            "get_place_vs_obstore_get": med["obstore_get"] / med["obstore_get_place"],
            "restore_fresh_vs_obstore_get": med["obstore_get"] / med["ckptfmt_restore_fresh"],
            "restore_vs_dcp_load": med["dcp_load"] / med["ckptfmt_restore"],
            "restore_vs_download_then_load": med["download_then_load"] / med["ckptfmt_restore"],
        },
        "requests_last_round": requests,
    }
    out = HERE / "results" / "object_store.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    lines = [
        "# Level 3 on object storage (bench/bench_object_store.py)",
        "",
        f"{doc['what']}; {doc['machine']}; {args.reps} rounds, medians. Ratio: the baseline's "
        "time over ckptfmt's (> 1: ckptfmt faster).",
        "",
        "| operation | median s | MiB/s | CPU s: ranks / server "
        "| requests (PUT/GET/HEAD/LIST/DELETE) |",
        "|---|---|---|---|---|",
    ]
    for k in [
        "ckptfmt_flush",
        "obstore_put",
        "dcp_save",
        "ckptfmt_restore",
        "obstore_get",
        "obstore_get_place",
        "ckptfmt_restore_fresh",
        "download_then_load",
        "dcp_load",
        "touch_new_memory",
    ]:
        r = requests.get(k, {})
        counts = "/".join(str(r.get(x, 0)) for x in ("PUT", "GET", "HEAD", "LIST", "DELETE"))
        used = cpu_med.get(k)
        busy = f"{used[0]:.2f} / {used[1]:.2f}" if used else "-"
        lines.append(f"| {k} | {med[k]:.2f} | {nbytes / 2**20 / med[k]:.0f} | {busy} | {counts} |")
    lines += ["", "| ratio | value |", "|---|---|"]
    lines += [f"| {k} | {v:.2f}x |" for k, v in doc["ratios"].items()]
    (HERE / "results" / "object_store.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", nargs="?", default="run", choices=["run", "ranks", "dcp"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--bucket", default="bench")
    p.add_argument("--server-log", default="")
    p.add_argument("--work", default=None)
    p.add_argument("--part", default="")
    args = p.parse_args()
    if args.mode == "ranks":
        rank_main(args)
    elif args.mode == "dcp":
        dcp_main(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
