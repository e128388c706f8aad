#!/usr/bin/env python
"""GF(2^8) erasure-code throughput, one core: ckptfmt's numpy and ISA-L paths against pyeclib,
zfec, galois and numpy XOR (bench/README.md, "bench_gf.py").

Reed-Solomon k = 8 data blocks + m = 2 parity (ckptfmt's Cauchy code), XOR k = 7 + 1; blocks of
1 MiB and 16 MiB. Encode, and rebuild of 1 and 2 lost data blocks from k survivors. GB/s = the
stripe's data bytes (k x block) / median seconds / 1e9, for every operation. Every implementation
is checked once against ckptfmt's numpy result (or, for zfec's own code, by its round trip)
before anything is timed. zfec and galois are not project dependencies: they are pip-installed
(pinned, --no-deps) into --extras (default a temporary folder) unless importable already.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("NUMBA_NUM_THREADS", "1")  # galois' kernels: keep everything on one core

import numpy as np

from ckptfmt.redundancy import gf256, isal
from ckptfmt.redundancy.schemes import ReedSolomon, _xor_into

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20
EXTRAS = ["zfec==1.6.0.0", "galois==0.4.11", "numba==0.68.1", "llvmlite==0.50.0"]
VARIANTS = {  # ISA-L's ec_encode_data kernels, called directly: (tables initialiser, cpu flags)
    "base": ("ec_init_tables_base", []),
    "avx2": ("ec_init_tables_base", ["avx2"]),
    "avx512": ("ec_init_tables_base", ["avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl"]),
    "avx2_gfni": ("ec_init_tables_gfni", ["avx2", "gfni", "vaes", "vpclmulqdq"]),
    "avx512_gfni": (
        "ec_init_tables_gfni",
        [
            "avx512f",
            "avx512dq",
            "avx512cd",
            "avx512bw",
            "avx512vl",
            "avx512_vbmi2",
            "gfni",
            "vaes",
            "vpclmulqdq",
            "avx512_vnni",
            "avx512_bitalg",
            "avx512_vpopcntdq",
        ],
    ),
}


@dataclass
class Case:
    impl: str  # row label
    scheme: str  # "rs 8+2", "xor 7+1", "isal kernels"
    op: str  # "encode", "rebuild 1", "rebuild 2"
    block: int  # bytes per block
    data_bytes: int  # bytes counted for GB/s (k x block)
    fn: Callable[[], Any]
    inner: int = 1
    samples: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def load_extras(extras: Path, install: bool) -> dict[str, Any]:
    """Import zfec and galois, pip-installing them into ``extras`` first if needed."""
    mods: dict[str, Any] = {}
    if str(extras) not in sys.path:
        sys.path.append(str(extras))  # after site-packages: the venv's numpy wins

    def try_import() -> None:
        for name in ("zfec", "galois"):
            if name in mods:
                continue
            try:
                mods[name] = __import__(name)
            except Exception as e:  # an extra that does not import is skipped, with the reason
                mods.setdefault("_errors", {})[name] = f"{type(e).__name__}: {e}"

    try_import()
    missing = [n for n in ("zfec", "galois") if n not in mods]
    if missing and install:
        print(f"installing {EXTRAS} into {extras} ...", flush=True)
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--target",
                str(extras),
                *EXTRAS,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if r.returncode:
            mods.setdefault("_errors", {})["pip"] = r.stderr.strip()[-500:]
        mods.get("_errors", {}).pop("zfec", None)
        mods.get("_errors", {}).pop("galois", None)
        sys.path_importer_cache.pop(str(extras), None)  # the folder did not exist before
        importlib.invalidate_caches()
        try_import()
    return mods


def dispatched_kernels(path: str) -> dict[str, str]:
    """Which kernel ISA-L's run-time dispatcher picked for each entry point (after a call).

    Reads the dispatcher's pointer (``<fn>_dispatched``, a local symbol) at its address in the
    loaded library; needs ``nm``.
    """
    nm = shutil.which("nm")
    if nm is None:
        return {"error": "nm not found"}
    out = subprocess.run([nm, path], capture_output=True, text=True, check=True).stdout
    syms: dict[str, int] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3:
            syms[parts[2]] = int(parts[0], 16)
    lib = ctypes.CDLL(path)  # the same handle isal loaded
    fn_addr = ctypes.cast(lib.ec_encode_data, ctypes.c_void_p).value or 0
    base = fn_addr - syms["ec_encode_data"]
    by_addr: dict[int, list[str]] = {}
    for name, addr in syms.items():
        by_addr.setdefault(addr, []).append(name)
    picked = {}
    for fn in ("ec_encode_data", "ec_encode_data_update", "ec_init_tables", "gf_vect_mul_init"):
        ptr = ctypes.c_void_p.from_address(base + syms[f"{fn}_dispatched"]).value or 0
        ptr = through_plt(ptr)
        names = by_addr.get(ptr - base, [f"? (offset {ptr - base:#x})"])
        picked[fn] = next((n for n in names if n.startswith(fn)), names[0])
    return picked


def through_plt(ptr: int) -> int:
    """The function a PLT stub at ``ptr`` jumps to (the dispatcher stores PLT addresses)."""
    code = bytes((ctypes.c_ubyte * 11).from_address(ptr))
    if code[:2] == b"\xff\x25":  # jmp [rip + disp32]
        got = ptr + 6 + int.from_bytes(code[2:6], "little", signed=True)
    elif code[:4] == b"\xf3\x0f\x1e\xfa" and code[4:7] == b"\xf2\xff\x25":  # endbr64; bnd jmp
        got = ptr + 11 + int.from_bytes(code[7:11], "little", signed=True)
    else:
        return ptr
    return ctypes.c_void_p.from_address(got).value or ptr


def rs_cases(block: int, rng: np.random.Generator, mods: dict[str, Any]) -> list[Case]:
    k, m = 8, 2
    data = [rng.integers(0, 256, block, dtype=np.uint8) for _ in range(k)]
    g = gf256.cauchy_matrix(k, m)
    enc = g[k:]
    want = [np.zeros(block, np.uint8) for _ in range(m)]
    gf256._mul_add_blocks_numpy(enc, data, want)
    allb = data + want
    lost_sets = {"rebuild 1": (0,), "rebuild 2": (0, 1)}
    use_of = {op: [i for i in range(k + m) if i not in lost][:k] for op, lost in lost_sets.items()}
    dec_of = {op: gf256.mat_inv(g[use_of[op]])[list(lost_sets[op])] for op in lost_sets}
    outs = [np.zeros(block, np.uint8) for _ in range(m)]  # reused by every ckptfmt case
    nbytes = k * block
    cases: list[Case] = []

    def add(impl: str, op: str, fn: Callable[[], Any], check: Callable[[Any], bool]) -> None:
        res = fn()
        if not check(res):
            raise SystemExit(f"{impl} {op} at {block} B per block: wrong bytes")
        cases.append(Case(impl, "rs 8+2", op, block, nbytes, fn))

    def same(got: list[np.ndarray], ref: list[np.ndarray]) -> bool:
        return all(np.array_equal(np.asarray(a), b) for a, b in zip(got, ref, strict=True))

    backends = [("numpy", "ckptfmt numpy pair tables")]
    if isal.available():
        backends.append(("isal", "ckptfmt ISA-L"))
    for backend, label in backends:
        mul: Callable[..., None] = (
            gf256._mul_add_blocks_numpy if backend == "numpy" else gf256.mul_add_blocks
        )
        add(label, "encode", lambda mul=mul: mul(enc, data, outs) or outs, lambda r: same(r, want))
        for op, lost in lost_sets.items():
            ins = [allb[i] for i in use_of[op]]
            o = outs[: len(lost)]
            ref = [data[i] for i in lost]
            add(
                label,
                op,
                lambda mul=mul, d=dec_of[op], ins=ins, o=o: mul(d, ins, o) or o,
                lambda r, ref=ref: same(r, ref),
            )

    rs = ReedSolomon(m)
    api = f"ckptfmt ReedSolomon.encode/rebuild ({gf256.backend()}, this process)"
    add(
        api,
        "encode",
        lambda: rs.encode(data),
        lambda r: same(r, want),
    )
    for op, lost in lost_sets.items():
        surv = {i: allb[i] for i in use_of[op]}
        add(
            api,
            op,
            lambda surv=surv, lost=lost: rs.rebuild(k, surv, lost),
            lambda r, lost=lost: same([r[i] for i in lost], [data[i] for i in lost]),
        )

    if "zfec" in mods:
        zfec = mods["zfec"]
        zenc, zdec = zfec.Encoder(k, k + m), zfec.Decoder(k, k + m)
        zpar = zenc.encode(data, [k, k + 1])  # zfec's own code: check its round trip
        zall = [*data, *(np.frombuffer(p, np.uint8) for p in zpar)]
        cases.append(
            Case("zfec", "rs 8+2", "encode", block, nbytes, lambda: zenc.encode(data, [k, k + 1]))
        )
        for op in lost_sets:
            sh = use_of[op]
            blocks = [zall[i] for i in sh]
            got = zdec.decode(blocks, sh)
            if not same([np.frombuffer(b, np.uint8) for b in got], data):
                raise SystemExit(f"zfec {op}: wrong bytes")
            cases.append(
                Case(
                    "zfec",
                    "rs 8+2",
                    op,
                    block,
                    nbytes,
                    lambda blocks=blocks, sh=sh: zdec.decode(blocks, sh),
                )
            )

    if "galois" in mods:
        gf = mods["galois"].GF(2**8)
        if int(gf.irreducible_poly) != 0x11D:
            raise SystemExit(f"galois GF(2^8) polynomial {gf.irreducible_poly} is not 0x11D")
        gdata, genc = gf(np.stack(data)), gf(enc)
        gall = gf(np.stack(allb))
        add(
            "galois (GF(2^8) matmul)", "encode", lambda: genc @ gdata, lambda r: same(list(r), want)
        )
        for op, lost in lost_sets.items():
            gdec, gin = gf(dec_of[op]), gall[use_of[op]]
            add(
                "galois (GF(2^8) matmul)",
                op,
                lambda gdec=gdec, gin=gin: gdec @ gin,
                lambda r, lost=lost: same(list(r), [data[i] for i in lost]),
            )
    return cases


FRESH = """
import json, sys, time
import numpy as np
from ckptfmt.redundancy import ReedSolomon
block, reps = int(sys.argv[1]), int(sys.argv[2])
k, m = 8, 2
rng = np.random.default_rng(1)
data = [rng.integers(0, 256, block, dtype=np.uint8) for _ in range(k)]
rs = ReedSolomon(m)
allb = data + rs.encode(data)
ops = {
    "encode": lambda: rs.encode(data),
    "rebuild 1": lambda: rs.rebuild(k, {i: allb[i] for i in range(1, 9)}, [0]),
    "rebuild 2": lambda: rs.rebuild(k, {i: allb[i] for i in range(2, 10)}, [0, 1]),
}
calls = max(1, (64 << 20) // block)
out = {op: [] for op in ops}
for _ in range(reps + 1):
    for op, fn in ops.items():
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out[op].append((time.perf_counter() - t0) / calls)
print(json.dumps({op: v[1:] for op, v in out.items()}))
"""


def fresh_process_rows(block: int, reps: int) -> list[dict[str, Any]]:
    """ReedSolomon.encode/rebuild timed in a new interpreter: how fast the scheme API is when the
    process's allocator has not yet been taught (by earlier large frees) to keep 1-16 MiB
    blocks on its heap, so every output is fresh memory."""
    r = subprocess.run(
        [sys.executable, "-c", FRESH, str(block), str(reps)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    if r.returncode:
        print(f"fresh-process rows skipped: {r.stderr.strip()[-300:]}", flush=True)
        return []
    rows = []
    for op, samples in json.loads(r.stdout).items():
        med = statistics.median(samples)
        rows.append(
            {
                "impl": f"ckptfmt ReedSolomon.encode/rebuild ({gf256.backend()}, new process)",
                "scheme": "rs 8+2",
                "op": op,
                "block_bytes": block,
                "data_bytes": 8 * block,
                "calls_per_sample": max(1, (64 << 20) // block),
                "rounds_used": len(samples),
                "quiet_only": False,
                "median_s": med,
                "gbps_median": 8 * block / med / 1e9,
                "gbps_cpu_median": None,
                "gbps_best": 8 * block / min(samples) / 1e9,
                "gbps_worst": 8 * block / max(samples) / 1e9,
                "samples_s": samples,
            }
        )
    return rows


def pyeclib_cases(stripe: int, rng: np.random.Generator, ec_iface: Any) -> list[Case]:
    """pyeclib's own isa_l_rs_cauchy 8+2 on one stripe of ``stripe`` bytes (blocks stripe / 8)."""
    k, m = 8, 2
    driver = ec_iface.ECDriver(k=k, m=m, ec_type="isa_l_rs_cauchy")
    raw = rng.integers(0, 256, stripe, dtype=np.uint8)
    payload = raw.tobytes()
    frags = driver.encode(payload)
    # its parity is ckptfmt's: the same Cauchy code (header of 80 bytes, then the fragment)
    blocks = [np.frombuffer(f, np.uint8)[80:] for f in frags]
    ref = [np.zeros(blocks[0].size, np.uint8) for _ in range(m)]
    gf256._mul_add_blocks_numpy(gf256.cauchy_matrix(k, m)[k:], blocks[:k], ref)
    if not all(np.array_equal(blocks[k + p], ref[p]) for p in range(m)):
        raise SystemExit("pyeclib isa_l_rs_cauchy parity differs from ckptfmt's rs")
    label = f"pyeclib ECDriver isa_l_rs_cauchy ({stripe // MIB} MiB stripes)"
    cases = [Case(label, "rs 8+2", "encode", stripe // k, stripe, lambda: driver.encode(payload))]
    for op, lost in (("rebuild 1", (0,)), ("rebuild 2", (0, 1))):
        have = [f for i, f in enumerate(frags) if i not in lost][:k]
        if driver.decode(have) != payload:
            raise SystemExit(f"pyeclib {op}: wrong bytes")
        cases.append(
            Case(label, "rs 8+2", op, stripe // k, stripe, lambda have=have: driver.decode(have))
        )
    return cases


def xor_cases(block: int, rng: np.random.Generator) -> list[Case]:
    k = 7
    data = [rng.integers(0, 256, block, dtype=np.uint8) for _ in range(k)]
    parity = np.zeros(block, np.uint8)
    _xor_into(parity, data)
    out = np.zeros(block, np.uint8)
    ones = np.ones((1, k), np.uint8)
    survivors = [*data[1:], parity]
    impls: list[tuple[str, Callable[[], Any], Callable[[], Any]]] = [
        (
            "numpy XOR (cache-blocked)",
            lambda: _xor_into(out, data),
            lambda: _xor_into(out, survivors),
        )
    ]
    if isal.available():
        impls.append(
            (
                "ckptfmt ISA-L (coefficients 1)",
                lambda: gf256.mul_add_blocks(ones, data, [out]),
                lambda: gf256.mul_add_blocks(ones, survivors, [out]),
            )
        )
    cases = []
    for label, fn_enc, fn_dec in impls:
        fn_enc()
        ok = np.array_equal(out, parity)
        fn_dec()
        if not (ok and np.array_equal(out, data[0])):
            raise SystemExit(f"{label}: wrong bytes")
        cases.append(Case(label, "xor 7+1", "encode", block, k * block, fn_enc))
        cases.append(Case(label, "xor 7+1", "rebuild 1", block, k * block, fn_dec))
    return cases


def variant_cases(block: int, rng: np.random.Generator, flags: set[str]) -> list[Case]:
    """ISA-L's ec_encode_data kernels called one by one (8+2 encode), those this CPU runs."""
    lib = ctypes.CDLL(isal.library_path() or "")
    k, m = 8, 2
    data = [rng.integers(0, 256, block, dtype=np.uint8) for _ in range(k)]
    coeffs = np.ascontiguousarray(gf256.cauchy_matrix(k, m)[k:])
    want = [np.zeros(block, np.uint8) for _ in range(m)]
    gf256._mul_add_blocks_numpy(coeffs, data, want)
    outs = [np.zeros(block, np.uint8) for _ in range(m)]
    src = (ctypes.c_void_p * k)(*(d.ctypes.data for d in data))
    dst = (ctypes.c_void_p * m)(*(o.ctypes.data for o in outs))
    cases = []
    for name, (init, need) in VARIANTS.items():
        if not set(need) <= flags or not hasattr(lib, f"ec_encode_data_{name}"):
            continue
        tables = np.zeros(k * m * 32, np.uint8)
        getattr(lib, init)(
            k, m, ctypes.c_void_p(coeffs.ctypes.data), ctypes.c_void_p(tables.ctypes.data)
        )
        fn = getattr(lib, f"ec_encode_data_{name}")
        fn.restype = None
        tbl = ctypes.c_void_p(tables.ctypes.data)
        alive = (data, outs, tables)  # raw pointers below: the arrays must outlive the case

        def call(fn: Any = fn, tbl: ctypes.c_void_p = tbl, alive: Any = alive) -> None:
            fn(block, k, m, tbl, src, dst)

        for o in outs:
            o[:] = 0
        call()
        if not all(np.array_equal(o, w) for o, w in zip(outs, want)):
            raise SystemExit(f"ec_encode_data_{name}: wrong bytes")
        cases.append(
            Case(f"ec_encode_data_{name}", "isal kernels", "encode", block, k * block, call)
        )
    return cases


def cpu_times() -> tuple[float, float]:
    """(this process's CPU seconds, all CPUs' busy seconds from /proc/stat)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    own = ru.ru_utime + ru.ru_stime
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        busy = (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        busy = float("nan")
    return own, busy


def run_cases(cases: list[Case], args: argparse.Namespace, deadline: float) -> list[dict[str, Any]]:
    """Interleaved rounds: every case once per round, the order rotating by one each round.

    After ``warmup`` + ``reps`` rounds, rounds are added (at most ``reps`` more, and only
    before ``deadline``) until ``reps`` of them were quiet: other processes took at most
    ``max_others`` of the CPUs. :func:`summarize` then uses the quiet rounds only.
    """
    rounds: list[dict[str, Any]] = []
    for c in cases:  # calibrate: enough calls per sample for >= target_ms
        t0 = time.perf_counter()
        c.fn()
        dt = time.perf_counter() - t0
        c.inner = max(1, min(200, int(args.target_ms / 1e3 / max(dt, 1e-6))))
    ncpu = os.cpu_count() or 1
    r = 0
    while True:
        timed = r >= args.warmup
        quiet = sum(1 for x in rounds if x["timed"] and x["quiet"])
        if r >= args.warmup + args.reps and (
            quiet >= args.reps or r >= args.warmup + 2 * args.reps or time.perf_counter() > deadline
        ):
            break
        order = cases[r % len(cases) :] + cases[: r % len(cases)]
        own0, busy0 = cpu_times()
        w0 = time.perf_counter()
        for c in order:
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            for _ in range(c.inner):
                c.fn()
            dt = (time.perf_counter() - t0) / c.inner
            dcpu = (time.process_time() - cpu0) / c.inner
            if timed:
                c.samples.append(dt)
                c.cpu.append(dcpu)
        own1, busy1 = cpu_times()
        wall = time.perf_counter() - w0
        others = max(0.0, (busy1 - busy0) - (own1 - own0)) / (wall * ncpu)
        rounds.append(
            {
                "round": r,
                "timed": timed,
                "quiet": others <= args.max_others,
                "wall_s": wall,
                "others_cpu_fraction": others,
                "loadavg": os.getloadavg()[0],
            }
        )
        r += 1
    return rounds


def summarize(c: Case, rounds: list[dict[str, Any]], reps: int) -> dict[str, Any]:
    timed = [x for x in rounds if x["timed"]]
    quiet_idx = [i for i, x in enumerate(timed) if x["quiet"]]
    use = quiet_idx if len(quiet_idx) >= reps else list(range(len(timed)))
    wall = [c.samples[i] for i in use]
    cpu = [c.cpu[i] for i in use]
    med, med_cpu = statistics.median(wall), statistics.median(cpu)
    return {
        "impl": c.impl,
        "scheme": c.scheme,
        "op": c.op,
        "block_bytes": c.block,
        "data_bytes": c.data_bytes,
        "calls_per_sample": c.inner,
        "rounds_used": len(use),
        "quiet_only": len(quiet_idx) >= reps,
        "median_s": med,
        "gbps_median": c.data_bytes / med / 1e9,
        "gbps_cpu_median": c.data_bytes / med_cpu / 1e9 if med_cpu > 0 else None,
        "gbps_best": c.data_bytes / min(wall) / 1e9,
        "gbps_worst": c.data_bytes / max(wall) / 1e9,
        "cpu_per_wall": med_cpu / med,
        "samples_s": c.samples,
        "samples_cpu_s": c.cpu,
    }


def size_label(n: int) -> str:
    return f"{n // MIB} MiB" if n % MIB == 0 else f"{n // 1024} KiB"


def cell(r: dict[str, Any]) -> str:
    """Wall-clock GB/s, the CPU-time figure beside it where they differ by over 15%."""
    wall, cpu = r["gbps_median"], r["gbps_cpu_median"]
    if cpu is None or abs(cpu - wall) <= 0.15 * wall:
        return f"{wall:.2f}"
    return f"{wall:.2f} (cpu {cpu:.2f})"


def markdown(results: list[dict[str, Any]]) -> str:
    ops = ["encode", "rebuild 1", "rebuild 2"]
    lines = []
    for scheme in ("rs 8+2", "xor 7+1", "isal kernels"):
        rows: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
        for r in results:
            if r["scheme"] == scheme:
                rows.setdefault((r["impl"], r["block_bytes"]), {})[r["op"]] = r
        if not rows:
            continue
        cols = [o for o in ops if any(o in v for v in rows.values())]
        lines += [
            f"**{scheme}**"
            + (" (ec_encode_data_<kernel> called directly)" if "kernels" in scheme else ""),
            "",
            "| implementation | block | stripe | " + " | ".join(f"{o} GB/s" for o in cols) + " |",
            "|---|---|---|" + "---|" * len(cols),
        ]
        k = 7 if scheme.startswith("xor") else 8
        for (impl, block), v in rows.items():
            cells = [cell(v[o]) if o in v else "—" for o in cols]
            lines.append(
                f"| {impl} | {size_label(block)} | {size_label(k * block)} | "
                + " | ".join(cells)
                + " |"
            )
        lines.append("")
    return "\n".join(lines)


def git_head() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def version_of(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--blocks-mib", default="1,16", help="bytes per block, MiB (default 1,16)")
    ap.add_argument(
        "--pyeclib-stripes-mib",
        default="1,32",
        help="extra pyeclib stripe sizes, MiB (default 1,32; stripes of 8 blocks of "
        "--blocks-mib are always run)",
    )
    ap.add_argument("--reps", type=int, default=5, help="timed rounds (default 5, at least 5)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument(
        "--max-others",
        type=float,
        default=0.15,
        help="a round is quiet when other processes took at most this share of the CPUs; "
        "medians use quiet rounds only when there are --reps of them (default 0.15)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=150.0,
        help="no rounds are added in search of quiet ones after this many seconds (default 150)",
    )
    ap.add_argument(
        "--galois-max-mib",
        type=float,
        default=1.0,
        help="galois only for blocks up to this size (default 1: it runs at ~0.1 GB/s)",
    )
    ap.add_argument(
        "--target-ms",
        type=float,
        default=20.0,
        help="repeat a call within one sample until it lasts this long (default 20)",
    )
    ap.add_argument(
        "--extras",
        type=Path,
        default=Path(tempfile.gettempdir()) / "ckptfmt-bench-gf-extras",
        help="where zfec and galois are pip-installed if not importable",
    )
    ap.add_argument("--no-install", action="store_true", help="skip zfec/galois unless importable")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gf.json")
    args = ap.parse_args(argv)
    if args.reps < 5:
        ap.error("--reps must be at least 5")
    t_start = time.perf_counter()
    flags = cpu_flags()
    if not isal.available():
        print(f"ISA-L not available ({isal.load_error()}): its rows are skipped", flush=True)
    gf256.set_backend("isal" if isal.available() else "numpy")
    mods = load_extras(args.extras, not args.no_install)
    try:
        from pyeclib import ec_iface
    except ImportError:
        ec_iface = None
    rng = np.random.default_rng(20261202)
    blocks = [int(float(x) * MIB) for x in args.blocks_mib.split(",") if x]
    stripes = [int(float(x) * MIB) for x in args.pyeclib_stripes_mib.split(",") if x]
    results: list[dict[str, Any]] = []
    rounds: dict[str, Any] = {}
    groups: list[tuple[str, Callable[[], list[Case]]]] = []
    galois_max = args.galois_max_mib * MIB
    for b in blocks:

        def group(b: int = b) -> list[Case]:
            use = {k: v for k, v in mods.items() if k != "galois" or b <= galois_max}
            cases = rs_cases(b, rng, use) + xor_cases(b, rng)
            if ec_iface is not None:
                cases += pyeclib_cases(8 * b, rng, ec_iface)
            if isal.available():
                cases += variant_cases(b, rng, flags)
            return cases

        groups.append((f"blocks of {size_label(b)}", group))
    if ec_iface is not None:
        for s in stripes:
            groups.append(
                (f"pyeclib {size_label(s)} stripes", lambda s=s: pyeclib_cases(s, rng, ec_iface))
            )
    for name, make in groups:  # one group at a time: the 16 MiB working set is ~0.5 GB
        cases = make()
        print(f"{name}: {len(cases)} cases, {args.warmup} + {args.reps} rounds ...", flush=True)
        rounds[name] = rnds = run_cases(cases, args, t_start + args.budget_s)
        results += [summarize(c, rnds, args.reps) for c in cases]
        quiet = sum(1 for x in rnds if x["timed"] and x["quiet"])
        print(
            f"  {len(rnds) - args.warmup} timed rounds, {quiet} quiet; others took "
            f"{statistics.median(x['others_cpu_fraction'] for x in rnds):.0%} of the CPUs (median)",
            flush=True,
        )
        del cases
    for b in blocks:
        print(f"ReedSolomon in a new process, blocks of {size_label(b)} ...", flush=True)
        results += fresh_process_rows(b, args.reps)
    kernels: dict[str, str] = {}
    if isal.available():  # each dispatcher picks its kernel on its first call
        gf256.mul_xor_into(np.zeros(64, np.uint8), 3, np.ones(64, np.uint8))
        isal.mul_table(3)
        kernels = dispatched_kernels(isal.library_path() or "")
    table = markdown(results)
    elapsed = time.perf_counter() - t_start
    print()
    print(table)
    print(f"ISA-L {isal.version()} dispatch: {kernels}")
    print(f"total {elapsed:.0f} s")
    meta = {
        "when_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "git_head": git_head(),
        "argv": sys.argv[1:] if argv is None else argv,
        "elapsed_s": elapsed,
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_flags_relevant": sorted(
            f for f in flags if f.startswith("avx") or f in ("gfni", "vaes", "vpclmulqdq", "ssse3")
        ),
        "python": platform.python_version(),
        "versions": {
            "numpy": np.__version__,
            "pyeclib": version_of("pyeclib"),
            "isa-l": isal.version(),
            "zfec": getattr(mods.get("zfec"), "__version__", None),
            "galois": getattr(mods.get("galois"), "__version__", None),
        },
        "extras_errors": mods.get("_errors", {}),
        "isal_library": isal.library_path(),
        "isal_dispatch": kernels,
        "gbps_definition": "k x block bytes (the stripe's data) / median seconds / 1e9",
        "reps": args.reps,
        "warmup": args.warmup,
        "max_others": args.max_others,
        "target_ms": args.target_ms,
        "rounds": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
