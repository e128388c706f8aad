"""The collective save straight to a bucket (``ckptfmt.parallel.save_to_bucket``), two code
trees against one local S3 server (moto), same run, medians: ``before`` (a tree given with
``--before``, e.g. ``git archive <commit>``: each rank writes a scratch directory, reads it back,
verifies and uploads it) and ``after`` (this tree: each rank puts its shards from memory through
the bucket store, no scratch directory).

2 ranks under ``mpiexec``, each holding ``--mib`` MiB of one float32 tensor split by rows,
default 16 MiB shards, ``WriteOptions(fsync=False)``. Per round, the two trees run one after the
other (the order alternating); each times ``--reps`` saves (overwrites) from a barrier to a
barrier, after one untimed save, and reports the median, each rank's CPU seconds per save
(median over ranks and runs) and its peak extra memory: its peak RSS (``ru_maxrss``) minus its
RSS once the state was built and the store set up. The local server (moto, one Python process)
is the bottleneck here: the time says little beyond "not slower"; the CPU and memory per rank
say what the route costs.

    python bench/bench_store_save.py --before /tmp/ckptfmt-before [--mib 256] [--reps 5]

``--incremental``: the same for an incremental save (``base=``): a base is saved once (this tree,
content hashes recorded) at ``incr-base``; each rank also holds a tensor of ``--mib``/8 MiB
that changes at every save while its ``--mib`` MiB do not; each timed save overwrites
``<name>-<tree>`` against the base (before: every rank saves into a scratch directory, then
copies its unchanged files from the base inside the store and uploads the rest; after: every
rank puts its changed shards from memory and has the store copy the unchanged ones).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
COLS = 32768  # float32 columns: 128 KiB a row

SERVER = """
import time
from moto.server import ThreadedMotoServer
s = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
s.start()
print("PORT", s.get_host_and_port()[1], flush=True)
while True:
    time.sleep(3600)
"""


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def ranks(args: argparse.Namespace) -> None:
    """One rank of one tree's run: ``--reps`` timed saves after a warm one."""
    import numpy as np
    from mpi4py import MPI

    from ckptfmt import Shard, WriteOptions
    from ckptfmt.parallel import save_to_bucket
    from ckptfmt.storage.objects import Bucket
    from ckptfmt.transport.mpi import MpiComm

    comm = MpiComm()
    rank, size = comm.rank, comm.size
    rows = args.mib * (1 << 20) // (COLS * 4)
    mine = np.random.default_rng(rank).standard_normal((rows, COLS), dtype=np.float32)
    state = {"w": Shard(mine, (rank * rows, 0), (size * rows, COLS))}
    url = f"s3://{args.bucket}/{args.name}"
    against: str | None = None
    moving = np.zeros((max(1, rows // 8), COLS), np.float32)
    if args.incremental:  # the state of the base (saved by mode "base") and a changing tensor
        m_rows = moving.shape[0]
        state["m"] = Shard(moving, (rank * m_rows, 0), (size * m_rows, COLS))
        against = f"s3://{args.bucket}/incr-base"
    Bucket.at(url)  # the client library loaded before the baseline
    # content_hash only when asked: a tree from before incremental saves has no such option
    hashing = {"content_hash": True} if args.incremental else {}
    write = WriteOptions(fsync=False, overwrite=True, **hashing)
    if args.mode == "base":
        save_to_bucket(comm, state, against or url, step=0, node=f"n{rank}", write=write)
        return
    base = rss_now()
    times = []
    cpu0 = 0.0
    for i in range(args.reps + 1):
        MPI.COMM_WORLD.Barrier()
        if i == 1:
            use = resource.getrusage(resource.RUSAGE_SELF)
            cpu0 = use.ru_utime + use.ru_stime
        moving[:] = i + 1  # the changing tensor's files differ from the base's at every save
        t0 = time.perf_counter()
        extra = {"base": against} if against else {}  # a tree from before has no base=
        save_to_bucket(comm, state, url, step=i, node=f"n{rank}", write=write, **extra)
        MPI.COMM_WORLD.Barrier()
        if i:
            times.append(time.perf_counter() - t0)
    use = resource.getrusage(resource.RUSAGE_SELF)
    peak = use.ru_maxrss * 1024
    cpu = (use.ru_utime + use.ru_stime - cpu0) / args.reps  # this rank's CPU seconds a save
    extra = MPI.COMM_WORLD.gather(peak - base, root=0)
    cpus = MPI.COMM_WORLD.gather(cpu, root=0)
    if rank == 0:
        Path(args.part).write_text(json.dumps({"times": times, "extra": extra, "cpu": cpus}))


def run(args: argparse.Namespace) -> None:
    server = subprocess.Popen(
        [sys.executable, "-u", "-c", SERVER], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        assert server.stdout is not None
        line = b""
        while not line.startswith(b"PORT "):
            line = server.stdout.readline()
            if not line:
                raise SystemExit("the S3 server did not start")
        endpoint = f"http://127.0.0.1:{int(line.split()[1])}"
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ALLOW_HTTP": "true",
        }
        import boto3

        boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
            region_name="us-east-1",
        ).create_bucket(Bucket="bench")
        trees = {"before": Path(args.before).resolve(), "after": REPO}
        got: dict[str, list[dict[str, Any]]] = {k: [] for k in trees}
        mpiexec = Path(sys.executable).parent / "mpiexec"
        part = Path(tempfile.mkdtemp()) / "part.json"
        flag = ["--incremental"] if args.incremental else []
        if args.incremental:  # the base, once, by this tree
            cmd = [str(mpiexec), "-n", "2", sys.executable, "-m", "mpi4py", __file__, "base"]
            cmd += ["--bucket", "bench", "--mib", str(args.mib), *flag]
            run_env = {**env, "PYTHONPATH": str(REPO)}
            subprocess.run(["timeout", "900", *cmd], env=run_env, check=True, cwd=REPO)
        for rnd in range(args.rounds):
            order = list(trees) if rnd % 2 == 0 else list(reversed(trees))
            for name in order:
                cmd = [str(mpiexec), "-n", "2", sys.executable, "-m", "mpi4py", __file__]
                cmd += ["ranks", "--bucket", "bench", "--name", name, "--mib", str(args.mib)]
                cmd += ["--reps", str(args.reps), "--part", str(part), *flag]
                run_env = {**env, "PYTHONPATH": str(trees[name])}
                subprocess.run(["timeout", "900", *cmd], env=run_env, check=True, cwd=trees[name])
                got[name].append(json.loads(part.read_text()))
    finally:
        server.terminate()
        server.wait(10)
    total = 2 * args.mib
    what = "incremental collective save" if args.incremental else "collective save"
    print(f"{what} to a bucket (moto), 2 ranks x {args.mib} MiB, medians:")
    for name, runs in got.items():
        med = statistics.median(t for r in runs for t in r["times"])
        extra = max(e for r in runs for e in r["extra"]) / (1 << 20)
        cpu = statistics.median(c for r in runs for c in r["cpu"])
        print(
            f"  {name:7s} {med:7.3f} s  {total / med:7.1f} MiB/s  rank CPU {cpu:6.2f} s/save  "
            f"peak extra RSS per rank (max over ranks and runs) {extra:7.1f} MiB"
        )
    b = statistics.median(t for r in got["before"] for t in r["times"])
    a = statistics.median(t for r in got["after"] for t in r["times"])
    print(f"  after/before time ratio {a / b:.3f}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", nargs="?", default="run", choices=["run", "ranks", "base"])
    p.add_argument("--incremental", action="store_true")
    p.add_argument("--before", default="")
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--bucket", default="bench")
    p.add_argument("--name", default="ckpt")
    p.add_argument("--part", default="")
    args = p.parse_args()
    (run if args.mode == "run" else ranks)(args)


if __name__ == "__main__":
    main()
