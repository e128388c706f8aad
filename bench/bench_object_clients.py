"""The object-store client ckptfmt builds on, chosen by measurement: obstore against boto3 and
s3fs, the same objects, the same requests in flight, the same server, same run, medians.

Against the tests' S3 server (moto on 127.0.0.1, started here), one process, per round and per
client (each goes first in turn; a first round warms up and is not counted):

* ``put``: ``--objects`` objects of ``--mib`` MiB of random bytes from memory, 8 in flight (a
  thread each; what a flush does with its shard files);
* ``get``: the same objects back whole, 8 in flight (what a restore does);
* ``small``: ``--small`` objects of 300 bytes put then read back, 8 in flight (a checkpoint's
  ``zarr.json`` documents): the cost per request.

The clients: ``obstore.put`` (one request, as ckptfmt puts a file up to 32 MiB) / ``obstore.get``
(Rust object_store); boto3's ``put_object`` /
``get_object`` (one client, ``max_pool_connections`` 8); s3fs's ``pipe_file`` / ``cat_file``
(fsspec, over aiobotocore). Also printed: each library's import time in a fresh interpreter
(what every rank of a job pays).

    python bench/bench_object_clients.py [--objects 32] [--mib 16] [--small 400] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
IN_FLIGHT = 8


def _import_seconds(module: str) -> float:
    """Median of 3 fresh interpreters' time to import ``module``."""
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    runs = [
        float(
            subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True
            ).stdout
        )
        for _ in range(3)
    ]
    return statistics.median(runs)


def _clients(bucket: str, endpoint: str) -> dict[str, dict[str, Callable[..., Any]]]:
    import boto3
    import obstore
    import s3fs
    from botocore.config import Config
    from obstore.store import from_url

    store = from_url(f"s3://{bucket}")
    b3 = boto3.client("s3", endpoint_url=endpoint, config=Config(max_pool_connections=IN_FLIGHT))
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, use_listings_cache=False)
    return {
        "obstore": {
            "put": lambda key, data: obstore.put(store, key, data, use_multipart=False),
            "get": lambda key: len(obstore.get(store, key).bytes()),
        },
        "boto3": {
            "put": lambda key, data: b3.put_object(Bucket=bucket, Key=key, Body=data),
            "get": lambda key: len(b3.get_object(Bucket=bucket, Key=key)["Body"].read()),
        },
        "s3fs": {
            "put": lambda key, data: fs.pipe_file(f"{bucket}/{key}", data),
            "get": lambda key: len(fs.cat_file(f"{bucket}/{key}")),
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--objects", type=int, default=32)
    p.add_argument("--mib", type=int, default=16)
    p.add_argument("--small", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "object_clients"))
    args = p.parse_args()

    from kit.s3 import start_server

    server_gen = start_server()
    server = next(server_gen)
    os.environ.update(server.env)
    bucket = server.make_bucket()
    clients = _clients(bucket, server.env["AWS_ENDPOINT_URL"])
    big = [os.urandom(args.mib << 20) for _ in range(args.objects)]
    small = [os.urandom(300) for _ in range(args.small)]
    seconds: dict[str, list[float]] = {}

    def run(name: str, fn: Callable[[int], Any], n: int, keep: bool) -> None:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            list(pool.map(fn, range(n)))
        if keep:
            seconds.setdefault(name, []).append(time.perf_counter() - t0)

    names = list(clients)
    for rnd in range(args.rounds + 1):
        keep = rnd > 0
        for lib in names[rnd % 3 :] + names[: rnd % 3]:
            c = clients[lib]
            pre = f"r{rnd}/{lib}"
            run(f"{lib}_put", lambda i: c["put"](f"{pre}/big/{i}", big[i]), args.objects, keep)  # noqa: B023
            run(f"{lib}_get", lambda i: c["get"](f"{pre}/big/{i}"), args.objects, keep)  # noqa: B023

            def small_round(i: int) -> None:
                c["put"](f"{pre}/small/{i}", small[i])  # noqa: B023
                c["get"](f"{pre}/small/{i}")  # noqa: B023

            run(f"{lib}_small", small_round, args.small, keep)
        listed = server.client().list_objects_v2(Bucket=bucket, Prefix=f"r{rnd}/")
        while listed.get("Contents"):  # keep the server's memory bounded
            server.client().delete_objects(
                Bucket=bucket, Delete={"Objects": [{"Key": o["Key"]} for o in listed["Contents"]]}
            )
            listed = server.client().list_objects_v2(Bucket=bucket, Prefix=f"r{rnd}/")

    imports = {lib: _import_seconds(lib) for lib in names}
    report(args, seconds, imports)
    server_gen.close()


def report(args: Any, seconds: dict[str, list[float]], imports: dict[str, float]) -> None:
    med = {k: statistics.median(v) for k, v in seconds.items()}
    mib = args.objects * args.mib
    title = (
        f"{args.objects} x {args.mib} MiB objects and {args.small} x 300 B ones, {IN_FLIGHT} in "
        f"flight, one process, a local S3 server (moto); {args.rounds} rounds, medians"
    )
    lines = [
        "# Object-store clients (bench/bench_object_clients.py)",
        "",
        title + ".",
        "",
        "| client | put MiB/s | get MiB/s | small put+get, requests/s | import s |",
        "|---|---|---|---|---|",
    ]
    for lib in ("obstore", "boto3", "s3fs"):
        lines.append(
            f"| {lib} | {mib / med[f'{lib}_put']:.0f} | {mib / med[f'{lib}_get']:.0f} "
            f"| {2 * args.small / med[f'{lib}_small']:.0f} | {imports[lib]:.3f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(
        json.dumps({"title": title, "seconds": seconds, "import_s": imports}, indent=1)
    )


if __name__ == "__main__":
    main()
