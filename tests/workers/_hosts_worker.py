"""A rank of a job on simulated hosts (``tests/hostsim.py``, ``tests/parallel/test_hosts.py``):
``_hosts_worker.py mpi|torch save|restore OUT REDUNDANCY_JSON``.

Each rank runs on its own host: its node is its host name (no ``CKPTFMT_NODE``), its level 1 is
``/local/ckpt`` (the host's own folder; no other host's exists in its mount namespace), and the
job has no level 3. ``OUT`` is the cluster's shared folder; every rank writes
``OUT/<phase>.rank<r>.json`` there.

- ``save``: checkpoints steps 1 and 2 (state from :func:`state_at`) with the given redundancy,
  waits for both, reports what it sees on this host, then lingers until the test kills a host
  (mpiexec then ends the job; under torch the test ends the rest).
- ``restore``: on the survivors plus a spare, restores into zeroed buffers and reports the step,
  the level, what was rebuilt, and whether every tensor, value and per-rank entry is bit-exact.

With ``HOSTSIM_LOGS`` set, the rank's stdout and stderr go to ``HOSTSIM_LOGS/<phase>.rank<r>.log``
(the rank from the launcher's environment, before anything is imported), with a timestamped
line at each stage, so that a rank that is late can be told apart from one that is stuck.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any


def capture_output() -> None:
    """Redirect fd 1 and 2 to this rank's own log file when ``HOSTSIM_LOGS`` names a folder."""
    folder = os.environ.get("HOSTSIM_LOGS")
    if not folder or len(sys.argv) < 3:
        return
    rank = os.environ.get("PMI_RANK") or os.environ.get("RANK") or f"pid{os.getpid()}"
    fd = os.open(
        Path(folder, f"{sys.argv[2]}.rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND
    )
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def mark(what: str) -> None:
    """One timestamped line (wall clock, so that ranks' logs line up) in this rank's log."""
    print(f"{time.time():.3f} {socket.gethostname()} pid {os.getpid()}: {what}", flush=True)


capture_output()
mark(f"started: {' '.join(sys.argv[1:3])}")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from kit.arrays import random_array as bits  # noqa: E402
from kit.worker import end_torch_job, make_comm  # noqa: E402

from ckptfmt import CheckpointManager, ExitPolicy, PerRank, Shard, WriteOptions  # noqa: E402  # noqa: E402

LOCAL = "/local/ckpt"
LINGER_S = 90.0
CHUNK_BYTES = 64 << 10
SHARD_BYTES = 256 << 10


def state_at(step: int, rank: int, size: int) -> dict[str, Any]:
    """Rank ``rank``'s training state at ``step``: replicated (data-parallel) weights in three
    dtypes, one tensor split by rows across the ranks, a per-rank entry and JSON values."""
    rng = np.random.default_rng(1000 + step)
    rows = 8 * size
    split = bits(rng, np.float32, (rows, 1024))
    part = rows // size
    return {
        "model": {
            "w": bits(rng, np.float32, (512, 1100)),  # ~2.2 MB: several shard files
            "b": bits(rng, ml_dtypes.bfloat16, (3001,)),
            "e": bits(rng, np.int64, (77, 13)),
        },
        "split": Shard(split[rank * part : (rank + 1) * part], (rank * part, 0), split.shape),
        "rng": PerRank(bits(np.random.default_rng(step * 100 + rank), np.uint8, (997,))),
        "step": step,
        "lr": 0.1 / step,
    }


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = zeros_like(v)
        elif isinstance(v, Shard):
            out[k] = Shard(np.zeros_like(v.data), v.offset, v.global_shape)
        elif isinstance(v, PerRank):
            out[k] = PerRank(np.zeros_like(v.value))
        elif isinstance(v, np.ndarray):
            out[k] = np.zeros_like(v)
        else:
            out[k] = None
    return out


def mismatches(got: Any, want: Any, path: str = "") -> list[str]:
    """Names of the leaves of ``got`` that are not bit-exact copies of ``want``'s."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or list(got) != list(want):
            return [f"{path}: keys {list(got) if isinstance(got, dict) else got!r}"]
        return [m for k in want for m in mismatches(got[k], want[k], f"{path}/{k}")]
    if isinstance(want, Shard):
        got = got.data if isinstance(got, Shard) else got
        want = want.data
    if isinstance(want, PerRank):
        got = got.value if isinstance(got, PerRank) else got
        want = want.value
    if isinstance(want, np.ndarray):
        ok = (
            isinstance(got, np.ndarray)
            and got.dtype == want.dtype
            and got.shape == want.shape
            and got.tobytes() == want.tobytes()
        )
        return [] if ok else [path]
    return [] if type(got) is type(want) and repr(got) == repr(want) else [path]


def main() -> None:
    kind, phase, out, red_json = sys.argv[1:5]
    redundancy = json.loads(red_json)
    mark("imported")
    if kind == "torch":
        import torch.distributed  # noqa: F401  (timed on its own: the slow part of starting)

        mark("torch imported")
    comm = make_comm(kind)
    rank, size = comm.rank, comm.size
    mark(f"communicator up: rank {rank} of {size}")
    host = socket.gethostname()
    mgr = CheckpointManager(
        local_dir=LOCAL,
        comm=comm,
        redundancy=redundancy,
        write=WriteOptions(fsync=False, chunk_bytes=CHUNK_BYTES, shard_bytes=SHARD_BYTES),
        at_exit=ExitPolicy(sigterm=False),
    )
    report: dict[str, Any] = {"rank": rank, "size": size, "host": host, "node": mgr.node}
    if phase == "save":
        for saved in (1, 2):
            mgr.save(saved, state_at(saved, rank, size))
            mark(f"save {saved} started")
        mgr.wait()
        mark("saves done")
        report["failed"] = [repr(e) for _, e in mgr.failed_saves]
        report["local"] = sorted(os.listdir(LOCAL))
        report["local_files"] = sum(len(f) for _, _, f in os.walk(LOCAL))
        report["tcp_peers"] = tcp_peers()
        write(out, phase, rank, report)
        mark("reported")
        comm.barrier()
        mark("lingering")
        time.sleep(LINGER_S)  # the test kills a host meanwhile; reaching the end is a failure
        write(out, "lingered", rank, report)
        sys.exit(3)
    want = state_at(2, rank, size)
    got = zeros_like(want)
    mark("restoring")
    step = mgr.restore(got).step
    mark(f"restored step {step}")
    mgr.wait()  # the rebuilt files are written on the saver thread after restore returned
    lr = mgr.last_restore
    report.update(
        step=step,
        level=lr.level if lr else None,
        rebuilt=lr.rebuilt if lr else [],
        tried=lr.tried if lr else [],
        unrecoverable=lr.unrecoverable if lr else [],
        rewrite=lr.rewrite if lr else "",
        mismatches=mismatches(got, want) if step == 2 else ["(no step 2)"],
        local=sorted(os.listdir(LOCAL)),
        tcp_peers=tcp_peers(),
    )
    write(out, phase, rank, report)
    mark("reported")
    mgr.close(flush=False)
    mark("closed")
    if kind == "torch":
        end_torch_job()


def tcp_peers() -> list[str]:
    """Addresses of other hosts with an established TCP connection from this host's network
    namespace (``/proc/net/tcp``): MPI's and gloo's data paths between hosts."""
    peers: set[str] = set()
    with open("/proc/self/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[3] != "01":  # ESTABLISHED
                continue
            ip_hex = fields[2].split(":")[0]
            ip = socket.inet_ntoa(bytes.fromhex(ip_hex)[::-1])
            peers.add(ip)
    return sorted(peers)


def write(out: str, phase: str, rank: int, report: dict[str, Any]) -> None:
    path = Path(out) / f"{phase}.rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, default=str))
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
