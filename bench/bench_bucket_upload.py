"""One large file into a bucket: ``Bucket.upload`` against obstore's own ``put`` of the same file.

Against the tests' S3 server (moto on 127.0.0.1, started here), one 256 MiB file of random bytes,
alternating in each round (medians of ``--rounds``):

* ``bucket_upload``: ``Bucket.upload`` (the file read in parts of ``part_size``, each part's
  CRC32C computed from the read that feeds the upload: an iterator handed to obstore's put);
* ``obstore_put_path``: ``obstore.put`` of the file's ``Path`` (obstore reads it in Rust), same
  part size and parts in flight, no CRC32C;
* ``obstore_put_path_then_crc``: the same, then a second pass over the file for its CRC32C (what
  ``upload`` would cost with the CRC computed apart);
* ``single_put_from_memory``: one PUT of the 256 MiB already in memory (no multipart): what the
  server takes at most in one request, its ceiling here;
* ``crc_pass``: the CRC32C pass alone (the file in the page cache).

    python bench/bench_bucket_upload.py [--mib 256] [--rounds 3] [--out bench/results/x.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--file", default="/tmp/ckptfmt-bench-upload.bin")
    parser.add_argument("--out")
    args = parser.parse_args()

    import crc32c
    import obstore
    from kit.s3 import start_server
    from obstore.store import from_url

    from ckptfmt.storage.objects import Bucket, part_size
    from ckptfmt.storage.objects.bucket import UPLOAD_CONCURRENCY

    server_gen = start_server()
    server = next(server_gen)
    os.environ.update(server.env)
    name = server.make_bucket()
    path = Path(args.file)
    size = args.mib << 20
    if not path.exists() or path.stat().st_size != size:
        path.write_bytes(os.urandom(size))
    bucket = Bucket.at(f"s3://{name}/bench")
    store = from_url(f"s3://{name}")
    chunk = part_size(size)

    def crc_pass() -> int:
        value = 0
        with open(path, "rb") as f:
            while piece := f.read(chunk):
                value = crc32c.crc32c(piece, value)
        return value

    def put_path(key: str) -> None:
        obstore.put(
            store,
            key,
            path,
            use_multipart=True,
            chunk_size=chunk,
            max_concurrency=UPLOAD_CONCURRENCY,
        )

    data = path.read_bytes()
    cases = {
        "bucket_upload": lambda: bucket.upload("ours", path),
        "obstore_put_path": lambda: put_path("plain"),
        "obstore_put_path_then_crc": lambda: (put_path("plain2"), crc_pass()),
        "single_put_from_memory": lambda: obstore.put(store, "single", data, use_multipart=False),
        "crc_pass": crc_pass,
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.rounds):
        for case, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[case].append(time.perf_counter() - start)
    medians = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "mib": args.mib,
        "part_size": chunk,
        "concurrency": UPLOAD_CONCURRENCY,
        "load_average": os.getloadavg(),
        "seconds": times,
        "median_s": medians,
        "mib_per_s": {k: args.mib / v for k, v in medians.items()},
        "bucket_upload_vs_obstore_put": medians["obstore_put_path"] / medians["bucket_upload"],
    }
    for k, v in medians.items():
        print(f"{k:28s} {v:7.3f} s  {args.mib / v:7.0f} MiB/s  {[round(t, 3) for t in times[k]]}")
    print(f"obstore put / Bucket.upload time ratio: {result['bucket_upload_vs_obstore_put']:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    server_gen.close()


if __name__ == "__main__":
    main()
