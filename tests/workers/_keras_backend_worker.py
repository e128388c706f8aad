"""The Keras adapter on one Keras backend, in a process of its own (Keras picks its backend once
per process): ``KERAS_BACKEND=<b> python _keras_backend_worker.py MODE OUT [CKPT...]``
(``tests/adapters/keras/test_keras_backends.py`` launches it; ``parallel`` under ``mpiexec``).

Modes, each writing ``OUT/<mode>.<backend>[.rank<r>].json``:

- ``single``: which backends importing ``ckptfmt_keras`` adds to those Keras imported (none
  should be added); ``fit`` killed (an exception from a callback) and resumed by
  ``BackupAndRestore`` in four ways (mid-epoch, at an epoch's end, a step save that ends an
  epoch, mid-epoch with gradient accumulation and weight averages), each against the
  uninterrupted run: weights and optimizer digest, history, restored counters, and the names
  of the saved state (the torch random state under torch); then a trained model saved with
  ``ckptfmt_keras.save`` to ``OUT/ckpt.<backend>`` with the digest of every saved array.
- ``load CKPT...``: each checkpoint loaded into a fresh model built alike; the digest of what the
  model and optimizer then hold, by name.
- ``parallel``: two workers (``MpiComm``) training one model with ``distributed_optimizer``
  through ``BackupAndRestore``, killed mid-epoch and resumed in the same processes, against an
  uninterrupted run; each worker's final digest and the digest of its first batch.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
BACKENDS = ("tensorflow", "jax", "torch")


def imported_backends() -> set[str]:
    return {b for b in BACKENDS if b in sys.modules}


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    import keras

    by_keras = imported_backends()
    import ckptfmt_keras  # noqa: F401

    added = sorted(imported_backends() - by_keras)
    backend = keras.backend.backend()
    if mode == "single":
        result: dict[str, Any] = {"keras_imported": sorted(by_keras), "added": added}
        result.update(single(keras, out))
        write(out / f"single.{backend}.json", result)
    elif mode == "load":
        write(out / f"load.{backend}.json", load(keras, sys.argv[3:]))
    elif mode == "parallel":
        from ckptfmt.transport.mpi import MpiComm

        comm = MpiComm()
        write(out / f"parallel.{backend}.rank{comm.rank}.json", parallel(keras, comm, out))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


def write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


# --- the model and data ---------------------------------------------------------------------------


def data() -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(4)
    x = rng.standard_normal((96, 8)).astype(np.float32)
    return x, (x[:, :6] * 0.3).astype(np.float32)


def build(keras: Any, seed: int = 1) -> Any:
    """Explicit layer names (the same variable paths on every backend), an unseeded Dropout
    (under torch it draws from torch's global generator) and Adam."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", name="h"),
            keras.layers.Dropout(0.3, name="drop"),
            keras.layers.Dense(6, name="out"),
        ],
        name="mlp",
    )
    return model


def compiled(keras: Any, model: Any, optimizer: Any = None, per_execution: int = 1) -> Any:
    model.compile(
        optimizer=optimizer or keras.optimizers.Adam(1e-2),
        loss="mse",
        metrics=["mae"],
        jit_compile=False,
        steps_per_execution=per_execution,
    )
    return model


def digests(model: Any) -> dict[str, str]:
    import ckptfmt_keras as ck

    out = {}
    for prefix, obj in (("model", model), ("optimizer", model.optimizer)):
        for name, a in ck.to_arrays(obj).items():
            if a.dtype.kind in "iu":  # Keras's counters: the dtype is the backend's, compare values
                out[f"{prefix}/{name}"] = f"int{list(a.shape)}:{a.astype('int64').tolist()}"
            else:
                out[f"{prefix}/{name}"] = (
                    f"{a.dtype}{list(a.shape)}:" + hashlib.sha256(a.tobytes()).hexdigest()
                )
    return out


def history_bits(history: Any) -> dict[str, list[str]]:
    return {k: [repr(float(v)) for v in vs] for k, vs in history.history.items()}


def crash_after(keras: Any, count: int) -> Any:
    class Crash(keras.callbacks.Callback):  # type: ignore[misc]
        seen = 0

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.seen += 1
            if self.seen == count:
                raise RuntimeError("crash")

    return Crash()


# --- single ---------------------------------------------------------------------------------------


SCENARIOS = {  # name: (data kind, save_freq, crash after this many train-function calls)
    "mid_epoch": ("py", 5, 17),  # saves at 5, 10, 15: resumes at epoch 1, step 3
    "epoch_end": ("py", "epoch", 20),  # resumes at the start of epoch 1
    "step_save_ends_epoch": ("arrays", 4, 7),  # saves at 4, 8, 12 (at the epoch end); 2 a call
    # mid_epoch with an optimizer whose ``iterations`` is a tensor computed from a variable
    # (gradient accumulation) and which keeps moving averages of the weights
    "accumulated": ("py", 5, 17),
}
OPTIMIZER_OPTIONS: dict[str, dict[str, Any]] = {
    "accumulated": {"gradient_accumulation_steps": 2, "use_ema": True},
}


def single(keras: Any, out: Path) -> dict[str, Any]:
    import ckptfmt_keras as ck

    import ckptfmt
    from ckptfmt import WriteOptions

    x, y = data()
    torch = keras.backend.backend() == "torch"  # its trainer runs one step a call
    results: dict[str, Any] = {}
    for name, (kind, save_freq, crash) in SCENARIOS.items():
        per_execution = 1 if torch or kind == "py" else 2
        if kind == "arrays" and per_execution == 1:
            crash *= 2  # the same batches: 14

        def run(
            backup: Path,
            crash: int | None,
            per_execution: int = per_execution,
            kind: str = kind,
            save_freq: Any = save_freq,
            scenario: str = name,
        ) -> Any:
            optimizer = keras.optimizers.Adam(1e-2, **OPTIMIZER_OPTIONS.get(scenario, {}))
            model = compiled(keras, build(keras), optimizer, per_execution=per_execution)
            dataset = ck.ResumableDataset(x, y, batch_size=8, seed=5)
            cb = ck.BackupAndRestore(
                backup,
                save_freq=save_freq,
                delete_checkpoint=False,
                dataset=dataset if kind == "py" else None,
                write=WriteOptions(fsync=False),
            )
            callbacks = [cb] + ([crash_after(keras, crash)] if crash else [])
            if kind == "py":
                source: Any = {"x": dataset.py_dataset()}
            else:
                source = {"x": x, "y": y, "batch_size": 8}
            h = model.fit(**source, shuffle=False, epochs=3, verbose=0, callbacks=callbacks)
            return model, h, cb

        ref, ref_h, _ = run(out / name / "ref", None)
        try:
            run(out / name / "ckpt", crash)
            raise SystemExit(f"{name}: no crash")
        except RuntimeError:
            pass
        resumed, h, cb = run(out / name / "ckpt", None)
        saved = ckptfmt.latest(out / name / "ckpt")  # kept (delete_checkpoint=False)
        saved_names = sorted(ckptfmt.open(saved.path).tensors()) if saved else []
        got, want = history_bits(h), history_bits(ref_h)
        results[name] = {
            "counters": cb.restored_counters,
            "weights_equal": digests(resumed) == digests(ref),
            "history_equal": {k: v[-len(got[k]) :] for k, v in want.items()} == got,
            "epochs_reported": len(got.get("loss", [])),
            "saved_names": saved_names,
        }
    model = compiled(keras, build(keras))
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    backend = keras.backend.backend()
    ck.save(model, out / f"ckpt.{backend}", counters={"epoch": 1})
    results["saved"] = digests(model)
    return results


# --- load -----------------------------------------------------------------------------------------


def load(keras: Any, paths: list[str]) -> dict[str, Any]:
    import ckptfmt_keras as ck

    out: dict[str, Any] = {}
    for path in paths:
        model = compiled(keras, build(keras, seed=99))  # other initial values
        counters = ck.load(model, path).values("counters")
        out[Path(path).name] = {"counters": counters, "loaded": digests(model)}
    return out


# --- parallel -------------------------------------------------------------------------------------


def parallel(keras: Any, comm: Any, out: Path) -> dict[str, Any]:
    import ckptfmt_keras as ck

    from ckptfmt import WriteOptions

    x, y = data()

    def run(backup: Path, crash: int | None) -> Any:
        opt = ck.distributed_optimizer(keras.optimizers.Adam(1e-2), comm)
        model = compiled(keras, build(keras), optimizer=opt)
        dataset = ck.ResumableDataset(x, y, batch_size=8, seed=5, rank=comm.rank, size=comm.size)
        cb = ck.BackupAndRestore(
            backup,
            save_freq=2,
            comm=comm,
            dataset=dataset,
            delete_checkpoint=False,
            write=WriteOptions(fsync=False),
        )
        callbacks = [cb] + ([crash_after(keras, crash)] if crash else [])
        h = model.fit(dataset.py_dataset(), shuffle=False, epochs=3, verbose=0, callbacks=callbacks)
        return model, h, cb

    ref, ref_h, ref_cb = run(out / "par_ref", None)
    try:
        run(out / "par_ckpt", 9)  # 6 steps an epoch: saves at 2, 4, 6, 8; epoch 1, step 2
        raise SystemExit("no crash")
    except RuntimeError:
        pass
    resumed, h, cb = run(out / "par_ckpt", None)
    got, want = history_bits(h), history_bits(ref_h)
    first = ck.ResumableDataset(x, y, batch_size=8, seed=5, rank=comm.rank, size=comm.size)
    return {
        "counters": cb.restored_counters,
        "final": digests(resumed),
        "reference": digests(ref),
        "history_equal": {k: v[-len(got[k]) :] for k, v in want.items()} == got,
        "first_batch": hashlib.sha256(first.batch(0, 0)[0].tobytes()).hexdigest(),
        # replicas that drifted apart would be set equal at a save, and listed here
        "replica_fixes": ref_cb.replica_fixes + cb.replica_fixes,
    }


if __name__ == "__main__":
    main()
