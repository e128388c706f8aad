#!/usr/bin/env python3
"""Save/load throughput of ckptfmt against a raw-file baseline, torch.save and safetensors.

One run measures every method on every storage target and dtype, interleaved round-robin per
repetition (the order of the methods rotates from one repetition to the next), so that slow
phases of the machine (other processes, memory the hypervisor took back, disk writeback) fall on
all methods alike. See bench/README.md for what each row means.

    python bench/bench_save_load.py                 # full run: ~1 GiB float32 + bf16, 7 reps
    python bench/bench_save_load.py --quick         # smoke run: 64 MiB, 3 reps
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import ckptfmt  # noqa: E402
from ckptfmt import WriteOptions  # noqa: E402
from ckptfmt.checkpoint import writer_threads  # noqa: E402

GIB = 1 << 30
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": BF16}
DEFAULT_TARGETS = {"shm": "/dev/shm/ckptfmt-bench", "disk": "/tmp/ckptfmt-bench"}
MIN_REPS_UNDER_BUDGET = 5

# --malloc warm: keep freed heap memory inside the process so every load writes into warm pages.
# One arena (threads share it), no mmap'd chunks (a freed large array would go back to the
# kernel, and from there to the hypervisor after ~2 s), and never trim the heap.
WARM_MALLOC_ENV = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
}


# --- the state ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Model:
    d: int
    layers: int
    vocab: int
    ctx: int

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """GPT-2-style parameter shapes (weights stored [out, in] as torch.nn.Linear does)."""
        d = self.d
        out: dict[str, tuple[int, ...]] = {
            "wte.weight": (self.vocab, d),
            "wpe.weight": (self.ctx, d),
        }
        for i in range(self.layers):
            p = f"h.{i}."
            out.update(
                {
                    p + "ln_1.weight": (d,),
                    p + "ln_1.bias": (d,),
                    p + "attn.c_attn.weight": (3 * d, d),
                    p + "attn.c_attn.bias": (3 * d,),
                    p + "attn.c_proj.weight": (d, d),
                    p + "attn.c_proj.bias": (d,),
                    p + "ln_2.weight": (d,),
                    p + "ln_2.bias": (d,),
                    p + "mlp.c_fc.weight": (4 * d, d),
                    p + "mlp.c_fc.bias": (4 * d,),
                    p + "mlp.c_proj.weight": (d, 4 * d),
                    p + "mlp.c_proj.bias": (d,),
                }
            )
        out.update({"ln_f.weight": (d,), "ln_f.bias": (d,)})
        return out

    def params(self) -> int:
        return sum(math.prod(s) for s in self.shapes().values())


def model_for(
    target_bytes: int, itemsize: int, vocab: int = 50304, ctx: int = 2048, layers_hint: int = 16
) -> Model:
    """A GPT-like model of about ``target_bytes``: width from ``P = 12 L d^2 + (vocab+ctx) d`` with
    L = layers_hint (rounded to a multiple of 64), then the layer count that lands closest."""
    p = target_bytes / itemsize
    a, b = 12 * layers_hint, vocab + ctx
    d = (-b + math.sqrt(b * b + 4 * a * p)) / (2 * a)
    d = max(64, round(d / 64) * 64)
    per_layer = 12 * d * d + 13 * d
    fixed = (vocab + ctx + 2) * d
    layers = max(1, round((p - fixed) / per_layer))
    return Model(d, layers, vocab, ctx)


def make_state(model: Model, dtype: np.dtype, seed: int) -> dict[str, np.ndarray]:
    """Flat ``name -> array`` of N(0, 0.02) random values (written here: every page touched)."""
    rng = np.random.default_rng(seed)
    state = {}
    for name, shape in model.shapes().items():
        a = rng.standard_normal(shape, dtype=np.float32)
        a *= 0.02
        state[name] = a if dtype == np.float32 else a.astype(dtype)
    return state


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"h.0.attn.weight": a}`` -> ``{"h": {"0": {"attn": {"weight": a}}}}``."""
    root: dict[str, Any] = {}
    for name, a in flat.items():
        node = root
        *parents, last = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = a
    return root


def flatten_nested(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten_nested(v, prefix + k + "."))
        else:
            out[prefix + k] = v
    return out


def pretouch(flat: dict[str, np.ndarray]) -> None:
    """Read one byte of every page of the state (it stays resident; this only makes sure)."""
    for a in flat.values():
        if a.size:
            int(a.reshape(-1).view(np.uint8)[::4096].sum())


# --- the methods ----------------------------------------------------------------------------------


class Case:
    """The state of one dtype in the forms the methods take, prepared outside the timed region."""

    def __init__(self, flat: dict[str, np.ndarray]):
        import torch

        self.flat = flat
        self.nested = nest(flat)
        self.nbytes = sum(a.nbytes for a in flat.values())
        self.meta = {k: (a.dtype, a.shape) for k, a in flat.items()}

        def as_torch(a: np.ndarray) -> torch.Tensor:
            if a.dtype == BF16:  # torch cannot take ml_dtypes arrays: share the bits as int16
                return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
            return torch.from_numpy(a)

        self.torch = {k: as_torch(a) for k, a in flat.items()}


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _raw_write(a: np.ndarray, path: Path, fsync: bool) -> None:
    if fsync:
        with open(path, "wb") as f:
            a.tofile(f)
            f.flush()
            os.fsync(f.fileno())
    else:
        a.tofile(path)


def raw_save(threads: int, fsync: bool) -> Callable[[Case, Path], None]:
    def save(case: Case, path: Path) -> None:
        path.mkdir()
        items = list(case.flat.items())
        if threads == 1:
            for k, a in items:
                _raw_write(a, path / k, fsync)
        else:
            with ThreadPoolExecutor(max_workers=threads) as pool:
                list(pool.map(lambda kv: _raw_write(kv[1], path / kv[0], fsync), items))
        if fsync:  # the directory entries too, as ckptfmt's commit does
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    return save


def raw_load(threads: int) -> Callable[[Case, Path], Any]:
    def read(case: Case, path: Path, k: str) -> np.ndarray:
        dtype, shape = case.meta[k]
        return np.fromfile(path / k, dtype=dtype).reshape(shape)

    def load(case: Case, path: Path) -> dict[str, np.ndarray]:
        if threads == 1:
            return {k: read(case, path, k) for k in case.meta}
        with ThreadPoolExecutor(max_workers=threads) as pool:
            return dict(zip(case.meta, pool.map(lambda k: read(case, path, k), case.meta)))

    return load


def ckpt_save(fsync: bool) -> Callable[[Case, Path], None]:
    def save(case: Case, path: Path) -> None:
        ckptfmt.save(case.nested, path, write=WriteOptions(fsync=fsync))

    return save


def ckpt_load(case: Case, path: Path) -> Any:
    return ckptfmt.load(path)


def torch_save(case: Case, path: Path) -> None:
    import torch

    torch.save(case.torch, path)


def torch_load(case: Case, path: Path) -> Any:
    import torch

    return torch.load(path, weights_only=True, mmap=False)


def st_save(case: Case, path: Path) -> None:
    from safetensors.numpy import save_file

    save_file(case.flat, str(path))


def st_load(case: Case, path: Path) -> Any:
    from safetensors.numpy import load_file

    return load_file(str(path))


@dataclass(frozen=True)
class Method:
    key: str
    label: str
    save: Callable[[Case, Path], None]
    load: Callable[[Case, Path], Any] | None  # None: its files are the same as another row's


def methods() -> list[Method]:
    t = writer_threads()
    return [
        Method("raw", "raw (tofile/fromfile)", raw_save(1, False), raw_load(1)),
        Method("raw_fsync", "raw + fsync", raw_save(1, True), None),
        Method("raw_2t", f"raw ({t} threads)", raw_save(t, False), raw_load(t)),
        Method("raw_fsync_2t", f"raw + fsync ({t} threads)", raw_save(t, True), None),
        Method("ckptfmt", "ckptfmt", ckpt_save(True), ckpt_load),
        Method("ckptfmt_nofsync", "ckptfmt (fsync=False)", ckpt_save(False), None),
        Method("torch", "torch.save / torch.load", torch_save, torch_load),
        Method("safetensors", "safetensors.numpy", st_save, st_load),
    ]


def to_flat_numpy(obj: Any) -> dict[str, np.ndarray]:
    """A loaded result as flat ``name -> numpy array`` (for the correctness check only)."""
    import torch

    flat = flatten_nested(obj) if any(isinstance(v, dict) for v in obj.values()) else obj
    out = {}
    for k, v in flat.items():
        if isinstance(v, torch.Tensor):
            v = v.view(torch.int16).numpy().view(BF16) if v.dtype == torch.bfloat16 else v.numpy()
        out[k] = v
    return out


def bits_equal(a: np.ndarray, b: np.ndarray, block: int = 1 << 24) -> bool:
    x = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    y = np.ascontiguousarray(b).reshape(-1).view(np.uint8)
    return all(np.array_equal(x[i : i + block], y[i : i + block]) for i in range(0, x.size, block))


def check_equal(case: Case, obj: Any, what: str) -> None:
    got = to_flat_numpy(obj)
    if set(got) != set(case.flat):
        raise AssertionError(f"{what}: names differ")
    for k, a in case.flat.items():
        b = got[k]
        if b.dtype != a.dtype or b.shape != a.shape or not bits_equal(a, b):
            raise AssertionError(
                f"{what}: {k} differs ({b.dtype} {b.shape} vs {a.dtype} {a.shape})"
            )


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    for p in path.parent.glob(f".{path.name}.*"):  # ckptfmt staging leftovers, if any
        shutil.rmtree(p, ignore_errors=True)


# --- running --------------------------------------------------------------------------------------


class Carry:
    """What the previous step left behind: its output files and its loaded result.

    Both are freed only just before the next timed step needs the same amount of memory (tmpfs or
    page-cache pages for a save, anonymous memory for a load). Memory left free for ~2 s is handed
    back to the hypervisor and is slow to touch again (bench/README.md); freeing right before
    reuse keeps every method on warm pages, instead of charging whichever ran after a pause.
    """

    def __init__(self) -> None:
        self.output: Path | None = None
        self.result: Any = None

    def drop_output(self) -> None:
        if self.output is not None:
            remove(self.output)
            self.output = None

    def clear(self) -> None:
        self.drop_output()
        self.result = None
        gc.collect()


def run_one(
    m: Method,
    case: Case,
    base: Path,
    tag: str,
    disk: bool,
    check: bool,
    rec: dict[str, list[float]],
    carry: Carry,
) -> None:
    path = base / f"{m.key}-{tag}"
    remove(path)
    carry.drop_output()
    if disk:  # settle the file system (deleted files' discards, journal) before timing
        os.sync()
    gc.collect()
    t0 = time.perf_counter()
    m.save(case, path)
    rec["save"].append(time.perf_counter() - t0)
    carry.output = path
    if m.load is not None:
        carry.result = None
        gc.collect()
        t0 = time.perf_counter()
        obj = m.load(case, path)
        rec["load"].append(time.perf_counter() - t0)
        if check:
            check_equal(case, obj, m.label)
        carry.result = obj


def summarize(
    rec: dict[str, list[float]], nbytes: int, raw: dict[str, list[float]], raw_fsync: list[float]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for op in ("save", "load"):
        xs = rec[op]
        if not xs:
            out[op] = None
            continue
        med = statistics.median(xs)
        raw_med = statistics.median(raw[op])
        out[op] = {
            "samples_s": [round(x, 5) for x in xs],
            "median_s": med,
            "min_s": min(xs),
            "max_s": max(xs),
            "gb_per_s": nbytes / med / 1e9,
            "ratio_vs_raw": raw_med / med,
        }
        if op == "save":
            out[op]["ratio_vs_raw_fsync"] = statistics.median(raw_fsync) / med
    return out


def markdown(results: dict[str, Any], labels: dict[str, str]) -> str:
    lines = [
        "| target | dtype | GiB | method | save s | save GB/s | save vs raw | save vs raw+fsync "
        "| load s | load GB/s | load vs raw |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for target, by_dtype in results.items():
        for dtype, r in by_dtype.items():
            gib = r["nbytes"] / GIB
            for key, s in r["methods"].items():
                sv, ld = s["save"], s["load"]
                load_cells = (
                    f"{ld['median_s']:.3f} | {ld['gb_per_s']:.2f} | {ld['ratio_vs_raw']:.2f}x"
                    if ld
                    else "— | — | —"
                )
                lines.append(
                    f"| {target} | {dtype} | {gib:.2f} | {labels[key]} | {sv['median_s']:.3f} | "
                    f"{sv['gb_per_s']:.2f} | {sv['ratio_vs_raw']:.2f}x | "
                    f"{sv['ratio_vs_raw_fsync']:.2f}x | {load_cells} |"
                )
    return "\n".join(lines)


def git_info() -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    return {
        "head": git("rev-parse", "HEAD"),
        "dirty_files": git("status", "--porcelain").splitlines(),
    }


def source_digest() -> str:
    """sha256 over ckptfmt's Python sources as measured (the tree may hold uncommitted edits)."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted((REPO / "ckptfmt").rglob("*.py")):
        h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--size-gib",
        type=float,
        default=None,
        help="float32 state size in GiB (default 1.0; 0.0625 with --quick)",
    )
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 7; 3 quick)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    ap.add_argument(
        "--targets",
        default="shm,disk",
        help="comma list of shm, disk, or name=/path (default shm,disk)",
    )
    ap.add_argument("--shm-dir", default=DEFAULT_TARGETS["shm"])
    ap.add_argument("--disk-dir", default=DEFAULT_TARGETS["disk"])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument(
        "--bf16-scale",
        choices=("model", "bytes"),
        default="model",
        help="bfloat16: 'model' = same shapes as float32 (half the bytes, default); "
        "'bytes' = more layers so the bytes match float32",
    )
    ap.add_argument(
        "--methods",
        default=None,
        help="comma list of method keys (default all; raw is always included)",
    )
    ap.add_argument(
        "--malloc",
        choices=("warm", "default"),
        default="warm",
        help="warm (default): re-exec with glibc malloc settings that keep freed "
        "memory in the process, so loads do not pay for pages the hypervisor "
        "took back; "
        "default: leave malloc alone (loads then also measure fresh-page faults)",
    )
    ap.add_argument(
        "--budget-min",
        type=float,
        default=9.0,
        help="stop adding timed rounds (but not below 5, or --reps if fewer) when the "
        "next one would end after this many minutes; 0 = no limit (default 9)",
    )
    ap.add_argument("--quick", action="store_true", help="small smoke run")
    ap.add_argument("--no-check", action="store_true", help="skip the bit-exact check of loads")
    ap.add_argument(
        "--out",
        default=None,
        help="JSON path (default bench/results/save_load.json; "
        "save_load_quick.json with --quick); a .md table is written beside it",
    )
    args = ap.parse_args(argv)
    if args.malloc == "warm" and any(os.environ.get(k) != v for k, v in WARM_MALLOC_ENV.items()):
        if argv is not None:
            ap.error("--malloc warm needs a fresh process: run the script, not main(argv)")
        env = {**os.environ, **WARM_MALLOC_ENV}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)

    size_gib = args.size_gib if args.size_gib is not None else (0.0625 if args.quick else 1.0)
    reps = args.reps if args.reps is not None else (3 if args.quick else 7)
    if reps < 1:
        ap.error("--reps must be >= 1")
    targets: dict[str, Path] = {}
    for t in filter(None, args.targets.split(",")):
        name, _, p = t.partition("=")
        default = {"shm": args.shm_dir, "disk": args.disk_dir}.get(name)
        if not p and default is None:
            ap.error(f"unknown target {t!r} (use shm, disk or name=/path)")
        targets[name] = Path(p or default)
    dtypes = [d for d in args.dtypes.split(",") if d]
    for d in dtypes:
        if d not in DTYPES:
            ap.error(f"unknown dtype {d!r}")
    all_methods = methods()
    if args.methods:
        keep = set(args.methods.split(",")) | {"raw", "raw_fsync"}
        unknown = keep - {m.key for m in all_methods}
        if unknown:
            ap.error(f"unknown methods {sorted(unknown)}")
        all_methods = [m for m in all_methods if m.key in keep]
    labels = {m.key: m.label for m in all_methods}

    t_start = time.perf_counter()
    sources_sha = source_digest()
    # states, built (and so touched) before anything is timed
    fp32_model = model_for(int(size_gib * GIB), 4)
    cases: dict[str, Case] = {}
    models: dict[str, Model] = {}
    for i, d in enumerate(dtypes):
        dt = DTYPES[d]
        model = fp32_model
        if dt == BF16 and args.bf16_scale == "bytes":
            per_layer = 12 * model.d**2 + 13 * model.d
            extra = round(model.params() / per_layer)  # double the bytes at 2 bytes/element
            model = Model(model.d, model.layers + extra, model.vocab, model.ctx)
        models[d] = model
        t0 = time.perf_counter()
        cases[d] = Case(make_state(model, dt, seed=i))
        print(
            f"# {d}: d={model.d} layers={model.layers} vocab={model.vocab} ctx={model.ctx} "
            f"tensors={len(cases[d].flat)} bytes={cases[d].nbytes} "
            f"({cases[d].nbytes / GIB:.3f} GiB), built in {time.perf_counter() - t0:.1f}s",
            flush=True,
        )

    for base in targets.values():
        if base.exists():
            shutil.rmtree(base)
        base.mkdir(parents=True)

    # rec[target][dtype][method] = {"save": [...], "load": [...]}
    rec = {
        t: {d: {m.key: {"save": [], "load": []} for m in all_methods} for d in dtypes}
        for t in targets
    }
    load_trace = []
    carry = Carry()
    round_times: list[float] = []
    started = time.perf_counter()
    try:
        for r in range(args.warmup + reps):
            timed = r >= args.warmup
            rot = r % len(all_methods)
            order = all_methods[rot:] + all_methods[:rot]
            load_trace.append({"round": r, "timed": timed, "loadavg": loadavg()})
            for tname, base in targets.items():
                disk = tname != "shm" and not str(base).startswith("/dev/shm")
                for d in dtypes:
                    pretouch(cases[d].flat)
                    for m in order:
                        sink = rec[tname][d][m.key] if timed else {"save": [], "load": []}
                        run_one(
                            m,
                            cases[d],
                            base,
                            f"{d}-{r}",
                            disk,
                            check=(r == 0 and not args.no_check),
                            rec=sink,
                            carry=carry,
                        )
            elapsed = time.perf_counter() - started
            round_times.append(elapsed - sum(round_times))
            print(
                f"# round {r + 1}/{args.warmup + reps} ({'timed' if timed else 'warm-up'}) "
                f"done at {elapsed:.0f}s, loadavg {loadavg()}",
                flush=True,
            )
            done = r + 1 - args.warmup
            budget_s = args.budget_min * 60 - (started - t_start)
            if (
                args.budget_min > 0
                and done >= min(reps, MIN_REPS_UNDER_BUDGET)
                and done < reps
                and elapsed + max(round_times) > budget_s
            ):
                print(
                    f"# stopping after {done} timed rounds: another would pass "
                    f"--budget-min {args.budget_min}",
                    flush=True,
                )
                break
    finally:
        carry.clear()
        for base in targets.values():
            shutil.rmtree(base, ignore_errors=True)

    results: dict[str, Any] = {}
    for tname in targets:
        results[tname] = {}
        for d in dtypes:
            rr = rec[tname][d]
            nbytes = cases[d].nbytes
            results[tname][d] = {
                "nbytes": nbytes,
                "methods": {
                    k: summarize(v, nbytes, rr["raw"], rr["raw_fsync"]["save"])
                    for k, v in rr.items()
                },
            }
    table = markdown(results, labels)
    print()
    print(table)

    doc = {
        "benchmark": "save_load",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wall_s": round(time.perf_counter() - t_start, 1),
        "config": {
            "size_gib": size_gib,
            "reps_requested": reps,
            "reps_done": len(next(iter(next(iter(rec.values())).values()))["raw"]["save"]),
            "warmup": args.warmup,
            "malloc": args.malloc,
            "malloc_env": {k: os.environ.get(k) for k in WARM_MALLOC_ENV},
            "budget_min": args.budget_min,
            "targets": {k: str(v) for k, v in targets.items()},
            "dtypes": dtypes,
            "bf16_scale": args.bf16_scale,
            "methods": labels,
            "ckptfmt_writer_threads": writer_threads(),
        },
        "models": {
            d: {
                **vars(m),
                "params": m.params(),
                "tensors": len(m.shapes()),
                "nbytes": cases[d].nbytes,
            }
            for d, m in models.items()
        },
        "environment": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "numpy": np.__version__,
            "torch": __import__("torch").__version__,
            "safetensors": __import__("safetensors").__version__,
            "ckptfmt": ckptfmt.__version__,
            "git": git_info(),
            "ckptfmt_sources_sha256": sources_sha,
            "loadavg_per_round": load_trace,
        },
        "definitions": {
            "gb_per_s": "tensor bytes / median seconds / 1e9",
            "ratio_vs_raw": "median time of 'raw' (single stream, no fsync) / median time of the "
            "method; > 1 is faster than raw",
            "ratio_vs_raw_fsync": "same against 'raw + fsync' (single stream)",
        },
        "results": results,
        "markdown": table,
    }
    out = Path(
        args.out
        or REPO / "bench" / "results" / ("save_load_quick.json" if args.quick else "save_load.json")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(table + "\n")
    print(f"\n# wrote {out} and {out.with_suffix('.md')} ({doc['wall_s']}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
