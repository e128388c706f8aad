"""``ckptfmt export`` and ``ckptfmt import`` with a bucket as OUT: time and peak RSS of the
command, for this tree and, with ``--before DIR``, another tree (an earlier commit's ``ckptfmt``,
``tools`` and ``adapters``, e.g. from ``git archive``), alternating in each round, same run.

Against the tests' S3 server (moto on 127.0.0.1, started in this process, so its memory is not
the command's): a checkpoint of ``--mib`` MiB of float32 tensors (``--tensors`` of them) in a
local directory, and its safetensors export beside it. Each round, for each tree:

* ``export``: ``ckptfmt export -q CKPT s3://b/hf-N`` (one file, the 5 GB default shard size);
* ``import``: ``ckptfmt import -q HF s3://b/ckpt-N``.

Each command runs in a process of its own; its peak RSS is its ``VmHWM`` (``/proc/self/status``,
read at exit: ``ru_maxrss`` would carry this process's own peak, copied by the fork, across the
exec). The objects are deleted after each command. Medians of ``--rounds``.

    python bench/bench_interop_bucket.py [--mib 256] [--rounds 5] [--before /tmp/ei-before]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


PEAK = (
    "import atexit, os, sys\n"
    "def peak():\n"
    "    hwm = open('/proc/self/status').read().split('VmHWM:')[1].split()[0]\n"
    "    open(os.environ['BENCH_PEAK_FILE'], 'w').write(hwm)\n"
    "atexit.register(peak)\n"
    "from ckptfmt_cli.main import main\n"
    "sys.argv[0] = 'ckptfmt'\n"
    "main()\n"
)


def run(
    tree: Path | None, env: dict[str, str], args: list[str], peak_file: Path
) -> tuple[float, int]:
    """Seconds and peak RSS (bytes) of ``ckptfmt ARGS`` run from ``tree`` (None: this one)."""
    env = {**env, "BENCH_PEAK_FILE": str(peak_file)}
    if tree is not None:
        paths = [str(tree), str(tree / "tools"), str(tree / "adapters")]
        env["PYTHONPATH"] = os.pathsep.join(paths)
    cmd = [sys.executable, "-c", PEAK, *args]
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd="/", capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
    return seconds, int(peak_file.read_text()) * 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", type=Path, default=None)
    parser.add_argument("--out")
    args = parser.parse_args()

    import logging

    from kit.s3 import start_server

    import ckptfmt
    from ckptfmt import WriteOptions

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    server_gen = start_server()
    server = next(server_gen)
    os.environ.update(server.env)
    env = {**os.environ, **server.env}
    name = server.make_bucket()
    client = server.client()
    trees: dict[str, Path | None] = {"after": None}
    if args.before is not None:
        trees = {"before": args.before, "after": None}

    work = Path(tempfile.mkdtemp(prefix="ckptfmt-bench-ei-"))
    rng = np.random.default_rng(0)
    each = (args.mib << 20) // args.tensors // 4
    state = {
        "model": {
            f"t{k}.weight": rng.standard_normal(each, np.float32) for k in range(args.tensors)
        }
    }
    ckpt, hf = work / "ckpt", work / "hf"
    ckptfmt.save(state, ckpt, write=WriteOptions(fsync=False))
    del state
    subprocess.run(
        [sys.executable, "-m", "ckptfmt_cli", "export", "-q", str(ckpt), str(hf)], check=True
    )

    def clear() -> None:
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=name).get("Contents", [])]
        for k in keys:
            client.delete_object(Bucket=name, Key=k)

    results: dict[str, dict[str, list[Any]]] = {
        t: {"export_s": [], "export_rss": [], "import_s": [], "import_rss": []} for t in trees
    }
    n = 0
    peak = work / "peak"
    for _ in range(args.rounds):
        for tree, where in trees.items():
            n += 1
            s, rss = run(where, env, ["export", "-q", str(ckpt), f"s3://{name}/hf-{n}"], peak)
            results[tree]["export_s"].append(s)
            results[tree]["export_rss"].append(rss)
            clear()
            s, rss = run(where, env, ["import", "-q", str(hf), f"s3://{name}/ck-{n}"], peak)
            results[tree]["import_s"].append(s)
            results[tree]["import_rss"].append(rss)
            clear()
    summary = {tree: {k: statistics.median(v) for k, v in r.items()} for tree, r in results.items()}
    doc = {"mib": args.mib, "rounds": args.rounds, "median": summary, "runs": results}
    for tree, m in summary.items():
        print(
            f"{tree:7s} export {m['export_s']:.2f} s, peak RSS {m['export_rss'] / 2**20:.0f} MiB; "
            f"import {m['import_s']:.2f} s, peak RSS {m['import_rss'] / 2**20:.0f} MiB"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2))
    subprocess.run(["rm", "-rf", str(work)], check=False)


if __name__ == "__main__":
    main()
