#!/usr/bin/env python3
"""ckptfmt's Keras adapter against Keras's own ``save_weights`` (HDF5) and ``tf.train.Checkpoint``:
save and load time of one model with its Adam state, and the time a training loop is blocked
by checkpoints taken while ``fit`` runs. Same model, same process, interleaved rounds.
With ``--orbax``: the same model on Keras's JAX backend (a process of its own), ckptfmt's
``BackupAndRestore`` against ``keras.callbacks.OrbaxCheckpoint`` (asynchronous saves): the time
``fit`` is blocked per checkpoint, the whole loop, and the restore of the newest checkpoint.

    .venv/bin/python bench/bench_keras.py            # ~100 MB of weights (+ 200 MB Adam), 5 rounds
    .venv/bin/python bench/bench_keras.py --quick    # smoke run: small model, 2 rounds
    .venv/bin/python bench/bench_keras.py --orbax    # JAX: ckptfmt against Orbax

See bench/README.md (section ``bench_keras.py``) for what each row means.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import ckptfmt_keras as ck
import keras
import numpy as np

import ckptfmt
from ckptfmt import WriteOptions

REPO = Path(__file__).resolve().parents[1]
MIN_REPS = 5


# --- the model ------------------------------------------------------------------------------------


def build(width: int, layers: int, jit_compile: bool = False) -> keras.Model:
    keras.utils.set_random_seed(0)
    body = [keras.Input((width,))]
    body += [keras.layers.Dense(width, activation="relu", name=f"d{i}") for i in range(layers)]
    model = keras.Sequential(body, name="bench")
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse", jit_compile=jit_compile)
    return model


def nbytes(model: keras.Model) -> tuple[int, int]:
    weights = sum(int(np.prod(v.shape)) * 4 for v in model.variables)
    opt = sum(np.asarray(v.numpy()).nbytes for v in model.optimizer.variables)
    return weights, opt


def snapshot(model: keras.Model) -> list[bytes]:
    return [np.asarray(v.numpy()).tobytes() for v in model.variables + model.optimizer.variables]


def scramble(model: keras.Model) -> None:
    for v in model.variables + model.optimizer.variables:
        v.assign(np.zeros(v.shape, dtype=ck.convert.numpy_dtype(v)))


# --- save and load --------------------------------------------------------------------------------


def methods(model: keras.Model) -> dict[str, tuple[Callable[[Path], None], Callable[[Path], None]]]:
    """name -> (save to path, load from path); every method saves the weights and the optimizer."""
    import tensorflow as tf

    tf_ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    return {
        "ckptfmt": (lambda p: ck.save(model, p), lambda p: ck.load(model, p)),
        "ckptfmt_nofsync": (
            lambda p: ck.save(model, p, write=WriteOptions(fsync=False)),
            lambda p: ck.load(model, p),
        ),
        "h5": (
            lambda p: model.save_weights(str(p) + ".weights.h5"),
            lambda p: model.load_weights(str(p) + ".weights.h5"),
        ),
        "tf_checkpoint": (
            lambda p: tf_ckpt.write(str(p / "ckpt")),
            lambda p: tf_ckpt.read(str(p / "ckpt")).assert_consumed(),
        ),
    }


LABELS = {
    "ckptfmt": "ckptfmt_keras.save / load (fsync, CRC32C)",
    "ckptfmt_nofsync": "ckptfmt_keras.save(fsync=False) / load",
    "h5": "model.save_weights / load_weights (.weights.h5)",
    "tf_checkpoint": "tf.train.Checkpoint write / read",
    "read_vars": "(floor) read every variable: v.numpy()",
}


def clear(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    Path(str(path) + ".weights.h5").unlink(missing_ok=True)


# --- the training loop ----------------------------------------------------------------------------


class TfCheckpointEvery(keras.callbacks.Callback):
    """``tf.train.Checkpoint.write`` every ``every`` batches (optionally TF's async mode)."""

    def __init__(self, directory: Path, every: int, asynchronous: bool) -> None:
        super().__init__()
        import tensorflow as tf

        self.directory, self.every = directory, every
        self.options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=asynchronous)
        self.ckpt: Any = None
        self.count = 0

    def on_train_begin(self, logs: Any = None) -> None:
        import tensorflow as tf

        self.ckpt = tf.train.Checkpoint(model=self.model, optimizer=self.model.optimizer)
        self.count = 0

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if (batch + 1) % self.every == 0:
            assert self.ckpt is not None
            self.count += 1
            self.ckpt.write(str(self.directory / f"ckpt-{self.count}"), options=self.options)

    def on_train_end(self, logs: Any = None) -> None:
        assert self.ckpt is not None
        self.ckpt.sync()  # async writes finish inside fit, as the others' do


class Clock(keras.callbacks.Callback):
    """Wraps a callback and times its ``on_train_batch_end`` at the saving batches (what the
    training loop waits for), and the training loop from before the callback's
    ``on_train_begin`` to after its ``on_train_end`` (``fit``'s own set-up of the data and the
    train function is left out: it varied by ~2 s between identical calls here). Everything
    else is passed through."""

    def __init__(self, inner: keras.callbacks.Callback, every: int) -> None:
        super().__init__()
        self.inner, self.every = inner, every
        self.blocked: list[float] = []
        self.loop = 0.0
        self._last_save = False

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        self.inner.set_model(model)

    def set_params(self, params: Any) -> None:
        super().set_params(params)
        self.inner.set_params(params)

    def on_train_begin(self, logs: Any = None) -> None:
        self.loop = time.perf_counter()
        self.inner.on_train_begin(logs)

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.inner.on_epoch_begin(epoch, logs)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        start = time.perf_counter()
        self.inner.on_train_batch_end(batch, logs)
        if (batch + 1) % self.every == 0:
            self.blocked.append(time.perf_counter() - start)
            self._last_save = (batch + 1) == (self.params or {}).get("steps")

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        start = time.perf_counter()
        self.inner.on_epoch_end(epoch, logs)
        if self._last_save:  # a save at the epoch's last batch may be made here (ckptfmt's is)
            self.blocked[-1] += time.perf_counter() - start
            self._last_save = False

    def on_train_end(self, logs: Any = None) -> None:
        self.inner.on_train_end(logs)
        self.loop = time.perf_counter() - self.loop


def loop_callbacks(base: Path, every: int) -> dict[str, Callable[[], keras.callbacks.Callback]]:
    return {
        "none": lambda: keras.callbacks.Callback(),
        "ckptfmt_async": lambda: ck.BackupAndRestore(base / "ckptfmt", save_freq=every),
        "ckptfmt_no_saves": lambda: ck.BackupAndRestore(base / "ckptfmt0", save_freq=False),
        "keras_backup_h5": lambda: keras.callbacks.BackupAndRestore(
            str(base / "keras"), save_freq=every
        ),
        "tf_checkpoint": lambda: TfCheckpointEvery(base / "tf", every, asynchronous=False),
    }


# tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True) fails on the first write
# with Keras 3 variables (TF 2.21, Keras 3.15): Keras's Variable._copy_trackable_to_cpu creates a
# tf.Variable inside a tf.function ("tf.function only supports singleton tf.Variables created on
# the first call"), so TensorFlow's asynchronous checkpoint cannot be measured for a Keras model.
UNAVAILABLE = {
    "tf_checkpoint_async": "TF's async checkpoint option raises ValueError with Keras 3 variables"
}


LOOP_LABELS = {
    "none": "no checkpoints",
    "ckptfmt_async": "ckptfmt_keras.BackupAndRestore (async, fsync)",
    "ckptfmt_no_saves": "(fixed cost) ckptfmt_keras.BackupAndRestore(save_freq=False)",
    "keras_backup_h5": "keras.callbacks.BackupAndRestore (.weights.h5)",
    "tf_checkpoint": "tf.train.Checkpoint.write",
}


# --- running --------------------------------------------------------------------------------------


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def git_head() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=False
        ).stdout.strip()

    return {
        "head": git("rev-parse", "HEAD"),
        "dirty_files": len(git("status", "--porcelain").splitlines()),
    }


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--reps", type=int, default=MIN_REPS)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20, help="batches per fit() in the loop test")
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dir", default="/dev/shm/ckptfmt-bench-keras")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "keras.json"))
    ap.add_argument("--quick", action="store_true", help="width 512, 2 rounds (not for quoting)")
    ap.add_argument(
        "--orbax", action="store_true", help="JAX backend: against keras.callbacks.OrbaxCheckpoint"
    )
    args = ap.parse_args(argv)
    if args.orbax:
        return orbax_main(args, argv)
    if args.quick:
        args.width, args.reps, args.out = 512, 2, "/tmp/ckptfmt-bench-keras-quick.json"
    base = Path(args.dir)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)

    model = build(args.width, args.layers)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.steps * args.batch, args.width)).astype(np.float32)
    y = rng.standard_normal((args.steps * args.batch, args.width)).astype(np.float32)
    model.fit(x[: args.batch], y[: args.batch], batch_size=args.batch, verbose=0)  # builds Adam
    weights_bytes, opt_bytes = nbytes(model)
    print(
        f"model: {args.layers} x Dense({args.width}): weights {weights_bytes / 1e6:.1f} MB, "
        f"Adam state {opt_bytes / 1e6:.1f} MB; target {base}",
        flush=True,
    )

    io = methods(model)
    save_s: dict[str, list[float]] = {k: [] for k in io}
    load_s: dict[str, list[float]] = {k: [] for k in io}
    read_s: list[float] = []
    loops = loop_callbacks(base / "loop", args.save_every)
    fit_s: dict[str, list[float]] = {k: [] for k in loops}
    loop_s: dict[str, list[float]] = {k: [] for k in loops}
    blocked_s: dict[str, list[float]] = {k: [] for k in loops}
    rounds = []
    for r in range(args.warmup + args.reps):
        timed = r >= args.warmup
        order = list(io)[r % len(io) :] + list(io)[: r % len(io)]
        for name in order:
            save, load = io[name]
            path = base / name
            clear(path)
            path.mkdir(parents=True)
            want = snapshot(model) if not timed else None
            t0 = time.perf_counter()
            save(path)
            t1 = time.perf_counter()
            if not timed:  # check once that every method gives back every bit
                scramble(model)
            t2 = time.perf_counter()
            load(path)
            t3 = time.perf_counter()
            if not timed and snapshot(model) != want:
                raise SystemExit(f"{name}: the loaded state differs from the saved one")
            if timed:
                save_s[name].append(t1 - t0)
                load_s[name].append(t3 - t2)
            clear(path)
        t0 = time.perf_counter()
        for v in model.variables + model.optimizer.variables:
            v.numpy()
        if timed:
            read_s.append(time.perf_counter() - t0)

        order = list(loops)[r % len(loops) :] + list(loops)[: r % len(loops)]
        for name in order:
            shutil.rmtree(base / "loop", ignore_errors=True)
            (base / "loop").mkdir(parents=True)
            clock = Clock(loops[name](), args.save_every)
            t0 = time.perf_counter()
            model.fit(
                x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0, callbacks=[clock]
            )
            elapsed = time.perf_counter() - t0
            if timed:
                fit_s[name].append(elapsed)
                loop_s[name].append(clock.loop)
                blocked_s[name] += clock.blocked
        rounds.append({"round": r, "timed": timed, "loadavg": loadavg()})
        print(f"round {r + 1}/{args.warmup + args.reps} done, loadavg {loadavg()}", flush=True)
    shutil.rmtree(base, ignore_errors=True)

    total = weights_bytes + opt_bytes
    io_rows = {
        name: {
            "label": LABELS[name],
            "save_s": med(save_s[name]),
            "load_s": med(load_s[name]),
            "save_GBps": total / med(save_s[name]) / 1e9,
            "load_GBps": total / med(load_s[name]) / 1e9,
            "save_vs_h5": med(save_s["h5"]) / med(save_s[name]),
            "load_vs_h5": med(load_s["h5"]) / med(load_s[name]),
            "save_vs_tf": med(save_s["tf_checkpoint"]) / med(save_s[name]),
            "load_vs_tf": med(load_s["tf_checkpoint"]) / med(load_s[name]),
            "save_samples": save_s[name],
            "load_samples": load_s[name],
        }
        for name in io
    }
    saves = args.steps // args.save_every
    base_loop = med(loop_s["none"])
    loop_rows = {
        name: {
            "label": LOOP_LABELS[name],
            "loop_s": med(loop_s[name]),
            "fit_s": med(fit_s[name]),
            "overhead_per_save_s": (med(loop_s[name]) - base_loop) / saves,
            "blocked_per_save_s": med(blocked_s[name]) if blocked_s[name] else 0.0,
            "loop_samples": loop_s[name],
            "fit_samples": fit_s[name],
            "blocked_samples": blocked_s[name],
        }
        for name in loops
    }
    for name, row in loop_rows.items():
        if name not in ("none", "ckptfmt_no_saves"):
            row["blocked_vs_ckptfmt"] = row["blocked_per_save_s"] / max(
                loop_rows["ckptfmt_async"]["blocked_per_save_s"], 1e-9
            )
    results = {
        "config": {**vars(args), "weights_bytes": weights_bytes, "optimizer_bytes": opt_bytes},
        "versions": {
            "python": platform.python_version(),
            "tensorflow": version_of("tensorflow"),
            "keras": keras.__version__,
            "numpy": np.__version__,
            "ckptfmt": ckptfmt.__version__,
        },
        "git": git_head(),
        "read_variables_s": {"median": med(read_s), "samples": read_s},
        "save_load": io_rows,
        "training_loop": loop_rows,
        "unavailable": UNAVAILABLE,
        "rounds": rounds,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(markdown(results))
    return 0


def markdown(res: dict[str, Any]) -> str:
    c = res["config"]
    mb = (c["weights_bytes"] + c["optimizer_bytes"]) / 1e6
    lines = [
        f"Model: {c['layers']} x Dense({c['width']}), {c['weights_bytes'] / 1e6:.0f} MB weights "
        f"+ {c['optimizer_bytes'] / 1e6:.0f} MB Adam state = {mb:.0f} MB; {c['dir']}; "
        f"medians of {c['reps']} rounds",
        "",
        "| method (weights + optimizer) | save s | load s | save vs h5 | load vs h5 "
        "| save vs tf.train | load vs tf.train |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in res["save_load"].values():
        lines.append(
            f"| {row['label']} | {row['save_s']:.3f} | {row['load_s']:.3f} | "
            f"{row['save_vs_h5']:.2f}x | {row['load_vs_h5']:.2f}x | "
            f"{row['save_vs_tf']:.2f}x | {row['load_vs_tf']:.2f}x |"
        )
    lines.append(f"| {LABELS['read_vars']} | {res['read_variables_s']['median']:.3f} | | | | | |")
    lines += [
        "",
        f"fit(): {c['steps']} batches of {c['batch']}, a checkpoint every {c['save_every']}",
        "",
        "| checkpointing | loop s | added per save s | blocked per save s | blocked vs ckptfmt |",
        "|---|---|---|---|---|",
    ]
    for row in res["training_loop"].values():
        vs = f"{row['blocked_vs_ckptfmt']:.2f}x" if "blocked_vs_ckptfmt" in row else ""
        lines.append(
            f"| {row['label']} | {row['loop_s']:.2f} | {row['overhead_per_save_s']:.3f} | "
            f"{row['blocked_per_save_s']:.3f} | {vs} |"
        )
    return "\n".join(lines)


# --- JAX: against keras.callbacks.OrbaxCheckpoint -------------------------------------------------


def version_of(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


ORBAX_LABELS = {
    "none": "no checkpoints",
    "ckptfmt_async": "ckptfmt_keras.BackupAndRestore (async, fsync, CRC32C)",
    "orbax_async": "keras.callbacks.OrbaxCheckpoint (async)",
}


def orbax_loops(base: Path, every: int) -> dict[str, Callable[[], keras.callbacks.Callback]]:
    return {
        "none": lambda: keras.callbacks.Callback(),
        "ckptfmt_async": lambda: ck.BackupAndRestore(
            base / "ckptfmt", save_freq=every, delete_checkpoint=False
        ),
        "orbax_async": lambda: keras.callbacks.OrbaxCheckpoint(
            str(base / "orbax"), save_freq=every, max_to_keep=1
        ),
    }


def orbax_restore(name: str, model: keras.Model, base: Path) -> None:
    """What a restarted job runs to get the newest checkpoint back into ``model``: ckptfmt's
    manager (newest step, every chunk's CRC32C checked) and ``from_state``; Keras's own reader
    of an Orbax directory (``load_weights``: the newest step, into the model and optimizer)."""
    if name == "ckptfmt_async":
        manager = ckptfmt.CheckpointManager(shared_dir=base / "ckptfmt")
        try:
            if not ck.restore(model, manager).restored:
                raise SystemExit("ckptfmt: nothing to restore")
        finally:
            manager.close(flush=False)
    else:
        model.load_weights(str(base / "orbax"))


def orbax_main(args: argparse.Namespace, argv: list[str] | None) -> int:
    """``--orbax``: run on the JAX backend (in a process of its own when this one is not)."""
    if keras.backend.backend() != "jax":
        env = {**os.environ, "KERAS_BACKEND": "jax"}
        cmd = [sys.executable, __file__, *(sys.argv[1:] if argv is None else argv)]
        return subprocess.run(cmd, env=env, check=False).returncode
    if args.quick:
        args.width, args.reps = 512, 2
    if args.out == str(REPO / "bench" / "results" / "keras.json"):
        args.out = str(REPO / "bench" / "results" / "keras_orbax.json")
    if args.quick:
        args.out = "/tmp/ckptfmt-bench-keras-orbax-quick.json"
    base = Path(args.dir)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    model = build(args.width, args.layers, jit_compile=True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.steps * args.batch, args.width)).astype(np.float32)
    y = rng.standard_normal((args.steps * args.batch, args.width)).astype(np.float32)
    model.fit(x[: args.batch], y[: args.batch], batch_size=args.batch, verbose=0)  # builds Adam
    weights_bytes, opt_bytes = nbytes(model)
    print(
        f"JAX: {args.layers} x Dense({args.width}): weights {weights_bytes / 1e6:.1f} MB, "
        f"Adam state {opt_bytes / 1e6:.1f} MB; target {base}",
        flush=True,
    )
    loops = orbax_loops(base / "loop", args.save_every)
    loop_s: dict[str, list[float]] = {k: [] for k in loops}
    fit_s: dict[str, list[float]] = {k: [] for k in loops}
    blocked_s: dict[str, list[float]] = {k: [] for k in loops}
    restore_s: dict[str, list[float]] = {k: [] for k in loops if k != "none"}
    rounds = []
    for r in range(args.warmup + args.reps):
        timed = r >= args.warmup
        order = list(loops)[r % len(loops) :] + list(loops)[: r % len(loops)]
        for name in order:
            shutil.rmtree(base / "loop", ignore_errors=True)
            (base / "loop").mkdir(parents=True)
            clock = Clock(loops[name](), args.save_every)
            t0 = time.perf_counter()
            model.fit(
                x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0, callbacks=[clock]
            )
            elapsed = time.perf_counter() - t0
            if name != "none":  # the last save was at the last batch: the state now
                want = snapshot(model) if not timed else None
                if not timed:
                    scramble(model)
                t1 = time.perf_counter()
                orbax_restore(name, model, base / "loop")
                t2 = time.perf_counter()
                if not timed and snapshot(model) != want:
                    raise SystemExit(f"{name}: the restored state differs from the saved one")
                if timed:
                    restore_s[name].append(t2 - t1)
            if timed:
                fit_s[name].append(elapsed)
                loop_s[name].append(clock.loop)
                blocked_s[name] += clock.blocked
        rounds.append({"round": r, "timed": timed, "loadavg": loadavg()})
        print(f"round {r + 1}/{args.warmup + args.reps} done, loadavg {loadavg()}", flush=True)
    shutil.rmtree(base, ignore_errors=True)

    saves = args.steps // args.save_every
    base_loop = med(loop_s["none"])
    rows = {
        name: {
            "label": ORBAX_LABELS[name],
            "loop_s": med(loop_s[name]),
            "fit_s": med(fit_s[name]),
            "overhead_per_save_s": (med(loop_s[name]) - base_loop) / saves,
            "blocked_per_save_s": med(blocked_s[name]) if blocked_s[name] else 0.0,
            "restore_s": med(restore_s[name]) if name in restore_s else None,
            "loop_samples": loop_s[name],
            "fit_samples": fit_s[name],
            "blocked_samples": blocked_s[name],
            "restore_samples": restore_s.get(name, []),
        }
        for name in loops
    }
    results = {
        "config": {**vars(args), "weights_bytes": weights_bytes, "optimizer_bytes": opt_bytes},
        "versions": {
            "python": platform.python_version(),
            "keras": keras.__version__,
            "backend": keras.backend.backend(),
            **{p: version_of(p) for p in ("jax", "jaxlib", "orbax-checkpoint", "numpy")},
            "ckptfmt": ckptfmt.__version__,
        },
        "git": git_head(),
        "training_loop": rows,
        "rounds": rounds,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(orbax_markdown(results))
    return 0


def orbax_markdown(res: dict[str, Any]) -> str:
    c = res["config"]
    lines = [
        f"JAX backend, {c['layers']} x Dense({c['width']}): "
        f"{(c['weights_bytes'] + c['optimizer_bytes']) / 1e6:.0f} MB with Adam; fit() on "
        f"{c['steps']} batches of {c['batch']}, a checkpoint every {c['save_every']}; "
        f"medians of {c['reps']} rounds",
        "",
        "| checkpointing | fit s | loop s | added per save s | blocked per save s | restore s |",
        "|---|---|---|---|---|---|",
    ]
    for row in res["training_loop"].values():
        restore = "" if row["restore_s"] is None else f"{row['restore_s']:.3f}"
        lines.append(
            f"| {row['label']} | {row['fit_s']:.2f} | {row['loop_s']:.2f} | "
            f"{row['overhead_per_save_s']:.3f} | {row['blocked_per_save_s']:.3f} | {restore} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
