"""A model of many tensors in a bucket with a remote store's round trip: the manager's flush and
restore against plain obstore requests for the same objects, same run, medians.

``bench_object_store.py`` measures bytes (one 1 GiB tensor); this one measures requests. A model
of ``--layers`` layers (a 256 x 256 float32 ``w`` split by rows between 2 ranks, and a replicated
``b``: 2 tensors a layer, so 2 x layers shard objects and, with the groups, about 3 x layers
``zarr.json`` documents) is saved to level 1 by 2 thread ranks, then flushed to a bucket of the
tests' S3 server (moto, 127.0.0.1) through the tests' proxy (``tests/kit/s3_proxy.py``), which
holds every request ``--round-trip-ms`` before passing it on: a local server answers in about a
millisecond, a remote store in tens of them, and what a checkpoint of many small objects costs
is how many round trips it waits for one after another. Per round, each timed from a barrier to
a barrier (a first round is not counted; each case goes first in turn):

* ``ckptfmt_flush``: ``flush_to_bucket`` (every rank its data files, each verified, and its
  share of the documents, 8 in flight; rank 0 the manifest; commit object; latest pointer);
* ``obstore_put``: every rank puts the same objects with plain ``obstore.put``, 8 in flight;
* ``ckptfmt_restore``: what the manager's restore does on level 3 (rank 0 reads the commit,
  every rank loads its rows, the ranks sharing the documents' checks), into the existing arrays;
* ``obstore_get``: every rank GETs the objects the restore reads (its shard objects, its share
  of the documents, the manifest; rank 0 the commit), 8 in flight;
* ``ckptfmt_load``: one process, ``ckptfmt.load(url)`` of the step;
* ``obstore_get_all``: one process GETs every object of the step, 8 in flight;
* ``ckptfmt_verify``: one process, ``ckptfmt.verify(url)`` of the step (the commit's HEADs,
  every document and every chunk's CRC32C).

HTTP requests are counted at the proxy (a LIST is a GET there; the multipart completions and
batch deletes are POSTs). Ratio: the plain requests' time over ckptfmt's (1: as fast
as the plain requests; < 1: slower). Thread ranks share one interpreter: with the round trip
the requests, not the CPU, set the pace.

    python bench/bench_object_many.py [--layers 150] [--round-trip-ms 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
IN_FLIGHT = 8
ROWS, COLS = 256, 256


def _model(layers: int, rank: int, shard: bool = True) -> dict[str, Any]:
    import numpy as np

    from ckptfmt import Shard

    rng = np.random.default_rng(7)
    out: dict[str, Any] = {}
    half = ROWS // 2
    for i in range(layers):
        w = rng.standard_normal((ROWS, COLS), dtype=np.float32)
        b = rng.standard_normal(COLS, dtype=np.float32)
        mine = Shard(w[rank * half : (rank + 1) * half], (rank * half, 0), w.shape)
        out[f"layer{i:03d}"] = {"w": mine if shard else w, "b": b}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=150)
    p.add_argument("--round-trip-ms", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--work", default=None)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "object_many"))
    args = p.parse_args()

    import tempfile

    import numpy as np
    import obstore
    from kit.s3 import start_server
    from kit.s3_proxy import S3Proxy
    from obstore.store import from_url

    import ckptfmt
    from ckptfmt import WriteOptions
    from ckptfmt.container.metadata import ManifestMeta
    from ckptfmt.format.zarr_meta import documents
    from ckptfmt.parallel.collective.load import load_collective
    from ckptfmt.parallel.collective.save import save_collective
    from ckptfmt.parallel.levels.bucket import BucketLevel, flush_to_bucket
    from ckptfmt.storage.objects import Bucket
    from ckptfmt.storage.steps import step_dir_name
    from ckptfmt.transport.threads import run_threads

    server_gen = start_server()
    server = next(server_gen)
    proxy = S3Proxy(server.endpoint)
    os.environ.update(proxy.env(server.env))
    bucket_name = server.make_bucket()
    url = f"s3://{bucket_name}"
    store = from_url(url)
    work = Path(tempfile.mkdtemp(prefix="bench-many-", dir=args.work))
    seconds: dict[str, list[float]] = {}
    requests: dict[str, dict[str, int]] = {}

    def timed(name: str, fn: Callable[[], Any], keep: bool) -> Any:
        before = dict(proxy.requests)
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        if keep:
            seconds.setdefault(name, []).append(dt)
            requests[name] = {k: v - before.get(k, 0) for k, v in proxy.requests.items()}
        return out

    def in_flight(fn: Callable[[str], Any], keys: list[str]) -> None:
        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            list(pool.map(fn, keys))

    def put_all(pairs: list[tuple[str, bytes]]) -> None:
        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            list(pool.map(lambda kv: obstore.put(store, kv[0], kv[1]), pairs))

    def get_one(key: str) -> int:
        return len(obstore.get(store, key).bytes())

    for rnd in range(args.rounds + 1):
        keep = rnd > 0
        step = rnd + 1
        proxy.delay(0)

        def save(comm: Any) -> tuple[Any, Path]:
            local = work / f"l1-{comm.rank}" / step_dir_name(step)  # noqa: B023
            manifest, _ = save_collective(
                comm,
                _model(args.layers, comm.rank),
                local,
                step=step,  # noqa: B023
                node=f"n{comm.rank}",
                group=f"node:n{comm.rank}",
                write=WriteOptions(fsync=False),
                meta=ManifestMeta(levels={"1": {}}),
            )
            return manifest, local

        saved = run_threads(2, save)
        manifest = saved[0][0]
        docs = sorted(documents(manifest))
        root = Bucket.at(f"{url}/ckptfmt")
        step_url = f"{url}/ckptfmt/{step_dir_name(step)}"
        prefix = f"ckptfmt/{step_dir_name(step)}/{manifest.save_id}"

        def objects_of(rank: int) -> list[str]:
            own = [
                f.path
                for t in manifest.tensors()  # noqa: B023
                for r in t.regions
                if r.rank == rank
                for f in r.files
            ]
            return own + docs[rank::2] + (["ckptfmt.json"] if rank == 0 else [])  # noqa: B023

        def flush(comm: Any) -> None:
            m, local = saved[comm.rank]  # noqa: B023
            flush_to_bucket(comm, m, local, root)  # noqa: B023

        def plain_put(comm: Any) -> None:
            local = saved[comm.rank][1]  # noqa: B023
            pairs = [
                (f"plain/{step}/{rel}", (local / rel).read_bytes())  # noqa: B023
                for rel in objects_of(comm.rank)
            ]
            put_all(pairs)

        model = {r: _model(args.layers, r) for r in (0, 1)}

        def restore(comm: Any) -> None:
            level = BucketLevel(root)  # noqa: B023
            where, src = level.open_step(comm, root.child(step_dir_name(step)), step)  # noqa: B023
            mine = model[comm.rank]  # noqa: B023
            into = {f"{k}/w": v["w"].data for k, v in mine.items()}
            boxes = {f"{k}/w": (v["w"].offset, v["w"].data.shape) for k, v in mine.items()}
            load_collective(comm, where, boxes, step, source=src, into=into)  # noqa: B023

        def plain_get(comm: Any) -> None:
            reads = [  # its own rows of every w, every b whole
                f.path
                for t in manifest.tensors()  # noqa: B023
                for r in t.regions
                if r.rank == comm.rank or t.name[-1] == "b"
                for f in r.files
            ]
            keys = [f"{prefix}/{rel}" for rel in reads]  # noqa: B023
            keys += [f"{prefix}/{d}" for d in docs[comm.rank :: 2]]  # noqa: B023
            keys.append(f"{prefix}/ckptfmt.json")  # noqa: B023
            if comm.rank == 0:
                keys.append(f"ckptfmt/{step_dir_name(step)}/ckptfmt-commit.json")  # noqa: B023
            in_flight(get_one, keys)

        def get_all() -> None:
            listed = [m["path"] for page in obstore.list(store, prefix) for m in page]  # noqa: B023
            in_flight(get_one, listed)

        proxy.delay(args.round_trip_ms / 1000)
        pair = [
            ("ckptfmt_flush", lambda: run_threads(2, flush)),
            ("obstore_put", lambda: run_threads(2, plain_put)),
        ]
        for name, fn in pair[:: 1 if rnd % 2 else -1]:
            timed(name, fn, keep)
        cases = [
            ("ckptfmt_restore", lambda: run_threads(2, restore)),
            ("obstore_get", lambda: run_threads(2, plain_get)),
            ("ckptfmt_load", lambda: ckptfmt.load(step_url)),  # noqa: B023
            ("obstore_get_all", get_all),
            ("ckptfmt_verify", lambda: ckptfmt.verify(step_url)),  # noqa: B023
        ]
        for name, fn in cases[rnd % 5 :] + cases[: rnd % 5]:
            timed(name, fn, keep)
        proxy.delay(0)
        got = ckptfmt.load(step_url)  # untimed: the bytes are the saved ones
        for k, v in _model(args.layers, 0, shard=False).items():
            if not (np.array_equal(got[k]["w"], v["w"]) and np.array_equal(got[k]["b"], v["b"])):
                raise SystemExit(f"{k} differs after the round trip through the bucket")

    report(args, seconds, requests, manifest)
    proxy.close()
    server_gen.close()


def report(args: Any, seconds: dict[str, list[float]], requests: dict[str, Any], m: Any) -> None:
    med = {k: statistics.median(v) for k, v in seconds.items()}
    ratios = {
        "flush_vs_obstore_put": med["obstore_put"] / med["ckptfmt_flush"],
        "restore_vs_obstore_get": med["obstore_get"] / med["ckptfmt_restore"],
        "load_vs_obstore_get_all": med["obstore_get_all"] / med["ckptfmt_load"],
        "verify_vs_obstore_get_all": med["obstore_get_all"] / med["ckptfmt_verify"],
    }
    total = sum(f.size for _, f in m.files())
    title = (
        f"{args.layers} layers ({len(m.tensors())} tensors, {total / 2**20:.1f} MiB), 2 thread "
        f"ranks, a local S3 server (moto) behind a proxy that holds each request "
        f"{args.round_trip_ms:g} ms; {args.rounds} rounds, medians"
    )
    lines = [
        "# Many tensors in a bucket (bench/bench_object_many.py)",
        "",
        title + ". Ratio: the plain requests' time over ckptfmt's.",
        "",
        "| operation | median s | rounds | HTTP requests (PUT/GET/HEAD/DELETE/POST) |",
        "|---|---|---|---|",
    ]
    for k, v in med.items():
        r = requests.get(k, {})
        counts = "/".join(str(r.get(x, 0)) for x in ("PUT", "GET", "HEAD", "DELETE", "POST"))
        lines.append(f"| {k} | {v:.3f} | {' '.join(f'{t:.3f}' for t in seconds[k])} | {counts} |")
    lines += ["", "| ratio | value |", "|---|---|"]
    lines += [f"| {k} | {v:.2f}x |" for k, v in ratios.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(
        json.dumps({"title": title, "seconds": seconds, "requests": requests, "ratios": ratios})
    )


if __name__ == "__main__":
    main()
