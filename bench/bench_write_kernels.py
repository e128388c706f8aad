#!/usr/bin/env python3
"""Why the save's inner loop is what it is: CRC32C kernels, and where chunks sit in a file.

Two measurements behind two choices of the writer (``ckptfmt/checksum.py``,
``ckptfmt/format/shard.py``), each against its alternative in the same run, medians:

* ``crc``: CRC32C throughput of the ``crc32c`` package and of ISA-L's ``crc32_iscsi`` (through
  ``ckptfmt.checksum``'s binding, when ``ckptfmt[fast]`` is installed), over a 512 MiB array in
  buffers of 64 KiB to 4 MiB (from memory, as a save or a load hashes), and over one 256 KiB
  buffer hashed again and again (from the cache);
* ``place``: 256 MiB written as 16 files of 16 MiB into files that exist (a recycled level-1
  slot), 2 threads, each 1 MiB chunk hashed then written with its 4-byte CRC, the next chunk
  placed right after it (``back to back``), at the next multiple of 64 bytes (``64``, ckptfmt's
  placement) or of 4096 (``4096``); beside them, ``pwrite`` of the same bytes without CRCs (the
  floor: what bench_level1.py calls "pwrite into preallocated files").

The arrays' pages are touched just before every timed window (this VM hands memory idle for ~2 s
back to the host; bench/README.md).

    python bench/bench_write_kernels.py          # ~1 min; bench/results/write_kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import struct
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import crc32c as package
import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

from ckptfmt import checksum  # noqa: E402

MIB = 1 << 20


def crc_part(rounds: int) -> list[dict[str, object]]:
    kernel = checksum._fast_kernel()
    big = np.random.default_rng(1).integers(0, 256, 512 * MIB, dtype=np.uint8)
    hot = big[: 256 << 10]
    rows = []
    kernels: dict[str, Callable[[memoryview], int]] = {"crc32c package": package.crc32c}
    if kernel is not None:
        kernels["ISA-L crc32_iscsi"] = lambda v: kernel(v, 0)
    for n in (64 << 10, 256 << 10, 1 << 20, 4 << 20):
        for name, fn in kernels.items():
            times = []
            for _ in range(rounds):
                big[::4096] += 0
                t = time.perf_counter()
                for i in range(0, big.size, n):
                    fn(memoryview(big[i : i + n]))
                times.append(time.perf_counter() - t)
            rows.append(
                {
                    "what": f"{n >> 10} KiB buffers, from memory",
                    "kernel": name,
                    "GB/s": big.size / statistics.median(times) / 1e9,
                }
            )
    for name, fn in kernels.items():
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(2000):
                fn(memoryview(hot))
            times.append(time.perf_counter() - t)
        rows.append(
            {
                "what": "256 KiB, from the cache",
                "kernel": name,
                "GB/s": hot.nbytes * 2000 / statistics.median(times) / 1e9,
            }
        )
    return rows


def place_part(rounds: int, where: Path) -> list[dict[str, object]]:
    crc = checksum.crc32c
    data = np.random.default_rng(0).integers(0, 256, 256 * MIB, dtype=np.uint8)
    files = [(i, memoryview(data)[i * 16 * MIB : (i + 1) * 16 * MIB]) for i in range(16)]
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    for i, _ in files:
        (where / str(i)).write_bytes(bytes(16 * MIB + 16 * 4096))
    zeros = bytes(4096)

    def placed(stride_pad: int) -> Callable[[tuple[int, memoryview]], None]:
        def write(job: tuple[int, memoryview]) -> None:
            i, piece = job
            fd = os.open(where / str(i), os.O_WRONLY)
            try:
                at = 0
                for k in range(0, len(piece), MIB):
                    chunk = piece[k : k + MIB]
                    iov = [chunk, struct.pack("<I", crc(chunk))]
                    if stride_pad:
                        iov.append(zeros[:stride_pad])
                    at += os.pwritev(fd, iov, at)
            finally:
                os.close(fd)

        return write

    def pwrite(job: tuple[int, memoryview]) -> None:
        i, piece = job
        fd = os.open(where / str(i), os.O_WRONLY)
        try:
            os.pwrite(fd, piece, 0)
        finally:
            os.close(fd)

    methods = {
        "pwrite, no CRC (the floor)": pwrite,
        "back to back (B+4)": placed(0),
        "64-byte multiples (ckptfmt)": placed(60),
        "4096-byte multiples": placed(4092),
    }
    times: dict[str, list[float]] = {m: [] for m in methods}
    with ThreadPoolExecutor(2) as pool:
        for r in range(rounds + 1):
            order = list(methods)[r % len(methods) :] + list(methods)[: r % len(methods)]
            for m in order:
                data[::4096] += 0
                t = time.perf_counter()
                list(pool.map(methods[m], files))
                if r:
                    times[m].append(time.perf_counter() - t)
    shutil.rmtree(where, ignore_errors=True)
    floor = statistics.median(times["pwrite, no CRC (the floor)"])
    return [
        {
            "placement": m,
            "median ms": statistics.median(v) * 1e3,
            "min ms": min(v) * 1e3,
            "max ms": max(v) * 1e3,
            "floor / it": floor / statistics.median(v),
        }
        for m, v in times.items()
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--dir", default="/dev/shm/ckptfmt-bench-kernels")
    args = ap.parse_args()
    out = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.release()}",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": os.getloadavg(),
        "crc": crc_part(args.rounds),
        "place": place_part(args.rounds, Path(args.dir)),
    }
    print(f"{out['machine']}, {out['when']}, load average {out['load_average'][0]:.1f}")
    print("\n| CRC32C | kernel | GB/s |\n|---|---|---|")
    for row in out["crc"]:
        print(f"| {row['what']} | {row['kernel']} | {row['GB/s']:.1f} |")
    print(
        "\n| 256 MiB, 1 MiB chunks, 2 threads, into existing files | median ms (min-max) |"
        " pwrite / it |\n|---|---|---|"
    )
    for row in out["place"]:
        print(
            f"| {row['placement']} | {row['median ms']:.1f} ({row['min ms']:.1f}-"
            f"{row['max ms']:.1f}) | {row['floor / it']:.2f} |"
        )
    (BENCH / "results").mkdir(exist_ok=True)
    (BENCH / "results" / "write_kernels.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
