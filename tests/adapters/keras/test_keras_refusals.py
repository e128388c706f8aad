"""What a new Keras user hits (issues 16 and 18): a load that fails changes no variable (model,
optimizer and metrics checked together); a dtype mismatch is refused unless ``cast=`` allows
it, and every conversion is reported; a second model built the same way in the same process
(Keras numbers it ``sequential_1``, its layers ``dense_2``...) loads the first one's checkpoint;
an optimizer not built yet is built, a missing one is reported as skipped; and
``BackupAndRestore`` resumes a checkpoint saved after an epoch's last batch into the next
epoch, so the resumed ``fit`` reports what the uninterrupted one did (one process here for
``save_freq`` equal to, dividing and not dividing the steps per epoch; 2 workers under
``mpiexec`` for the equal case, as the issue reproduced it)."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit import REPO
from kit.keras import compiled, raise_after_batch
from kit.keras import xy as kit_xy
from kit.launch import describe, run_mpi

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
keras = pytest.importorskip("keras")

import ckptfmt_keras as ck  # noqa: E402

import ckptfmt  # noqa: E402
from ckptfmt import WriteOptions  # noqa: E402
from ckptfmt.errors import CastWarning  # noqa: E402

pytestmark = pytest.mark.tf


def unnamed(bf16: bool = False) -> Any:
    """A model whose names Keras makes up (``sequential_<n>/dense_<m>``), with a dropout seed."""
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dropout(0.2, seed=3),
            keras.layers.Dense(6, dtype="bfloat16" if bf16 else None),
        ]
    )


def named() -> Any:
    """The same model with every name given (so that only what a test is about differs)."""
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", name="h"),
            keras.layers.Dropout(0.2, seed=3, name="drop"),
            keras.layers.Dense(6, name="out"),
        ],
        name="mlp",
    )


def xy(n: int = 96, seed: int = 4) -> tuple[np.ndarray, np.ndarray]:
    return kit_xy(n, seed)


def trained(model: Any) -> Any:
    x, y = xy(32)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model


def values(obj: Any) -> list[tuple[str, tuple[int, ...], bytes]]:
    """Every variable's dtype, shape and bytes, in the object's order (not by name: the names
    of two models differ)."""
    return [(str(a.dtype), a.shape, a.tobytes()) for a in ck.to_arrays(obj).values()]


# --- names that Keras numbers -----------------------------------------------------------------


def test_second_model_built_the_same_way_loads_the_first(tmp_path: Path) -> None:
    first = trained(compiled(unnamed(bf16=True)))
    ck.save(first, tmp_path / "c", counters={"epoch": 1})
    second = compiled(unnamed(bf16=True))
    assert set(ck.to_arrays(second)).isdisjoint(ck.to_arrays(first))  # sequential_1/dense_2/...
    assert values(second) != values(first)
    assert ck.load(second, tmp_path / "c").values("counters") == {"epoch": 1}
    assert values(second) == values(first)
    assert values(second.optimizer) == values(first.optimizer)  # slots follow their variables
    # the same again through load_variables / assign of the model alone
    third = unnamed(bf16=True)
    ck.assign(third, ckptfmt.load(tmp_path / "c")["model"])
    assert values(third) == values(first)


def test_model_without_optimizer_says_it_skipped_it(tmp_path: Path) -> None:
    first = trained(compiled(unnamed()))
    ck.save(first, tmp_path / "c")
    bare = unnamed()  # not compiled: no optimizer to receive the state
    with pytest.warns(UserWarning, match="optimizer state was skipped"):
        ck.load(bare, tmp_path / "c")
    assert values(bare) == values(first)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck.load(unnamed(), tmp_path / "c", optimizer=None)  # asked for: no warning


def test_optimizer_not_built_yet_is_built_and_loaded(tmp_path: Path) -> None:
    first = trained(compiled(unnamed()))
    ck.save(first, tmp_path / "c")
    second = compiled(unnamed())
    assert not second.optimizer.built
    ck.load(second, tmp_path / "c")
    assert second.optimizer.built
    assert values(second.optimizer) == values(first.optimizer)


# --- all or nothing -----------------------------------------------------------------------------


def test_failed_optimizer_load_leaves_the_model_untouched(tmp_path: Path) -> None:
    first = trained(compiled(named()))
    ck.save(first, tmp_path / "c")
    # an SGD with momentum has other slots than the Adam that saved: the optimizer part fails
    second = trained(compiled(named(), keras.optimizers.SGD(0.1, momentum=0.9)))
    model_before, opt_before = values(second), values(second.optimizer)
    with pytest.raises(ck.StateMismatchError):
        ck.load(second, tmp_path / "c")
    assert values(second) == model_before, "the model was written before the optimizer failed"
    assert values(second.optimizer) == opt_before


def test_failed_model_load_leaves_everything_untouched(tmp_path: Path) -> None:
    first = trained(compiled(unnamed()))
    ck.save(first, tmp_path / "c")
    keras.utils.set_random_seed(2)
    layers = [keras.layers.Dense(16), keras.layers.Dropout(0.2), keras.layers.Dense(5)]  # not 6
    other = compiled(keras.Sequential([keras.Input((8,)), *layers]))
    before = values(other)
    with pytest.raises(
        ck.StateMismatchError,
        match=r"float32\[16, 5\] in the variables, float32\[16, 6\] in the arrays",
    ):
        ck.load(other, tmp_path / "c")
    assert values(other) == before


# --- the dtype policy ---------------------------------------------------------------------------


def test_dtype_mismatch_refused_unless_cast(tmp_path: Path) -> None:
    first = trained(compiled(unnamed(bf16=False)))  # float32 everywhere
    ck.save(first, tmp_path / "c", optimizer=None)
    second = unnamed(bf16=True)  # the output layer is bfloat16
    before = values(second)
    with pytest.raises(ck.StateMismatchError, match='cast="safe"') as exc:
        ck.load(second, tmp_path / "c", optimizer=None)
    assert len(exc.value.mismatched) == 2  # the bfloat16 layer's kernel and bias
    assert values(second) == before
    with pytest.raises(ck.StateMismatchError):  # float32 -> bfloat16 rounds: not safe
        ck.load(second, tmp_path / "c", optimizer=None, cast="safe")
    assert values(second) == before
    with pytest.warns(CastWarning) as rec:
        ck.load(second, tmp_path / "c", optimizer=None, cast="any")
    casts = [c for r in rec if isinstance(r.message, CastWarning) for c in r.message.casts]
    assert sorted((c.saved, c.target) for c in casts) == [("float32", "bfloat16")] * 2
    want = [
        a.astype(b.dtype)
        for a, b in zip(ck.to_arrays(first).values(), ck.to_arrays(second).values())
    ]
    assert [a.tobytes() for a in ck.to_arrays(second).values()] == [a.tobytes() for a in want]


def test_safe_cast_bfloat16_into_float32_is_exact(tmp_path: Path) -> None:
    first = trained(compiled(unnamed(bf16=True)))
    ck.save(first, tmp_path / "c", optimizer=None)
    second = unnamed(bf16=False)
    with pytest.warns(CastWarning):
        ck.load(second, tmp_path / "c", optimizer=None, cast="safe")
    for a, b in zip(ck.to_arrays(first).values(), ck.to_arrays(second).values()):
        assert b.astype(a.dtype).tobytes() == a.tobytes()


# --- BackupAndRestore at an epoch's end ---------------------------------------------------------


class BatchLogs(keras.callbacks.Callback):
    """Every batch's logs and every epoch's, as exact reprs."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: dict[tuple[int, int], dict[str, str]] = {}
        self.epoch = -1

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.batches[(self.epoch, batch)] = {k: repr(float(v)) for k, v in (logs or {}).items()}


STEPS, EPOCHS = 12, 3  # 96 samples, 8 a batch; more epochs where the crash is later


@pytest.mark.parametrize(
    "save_freq, crash_after, restored_global",
    [
        (12, 30, 24),  # equal: saved after epoch 1's last batch, crash in epoch 2
        (6, 27, 24),  # dividing: the same save point
        (5, 22, 20),  # not dividing: mid-epoch 1 (step 8)
        (5, 38, 35),  # not dividing: one batch before epoch 2's end (35 = 2 * 12 + 11)
        (5, 63, 60),  # not dividing, at an epoch's end all the same (60 = 5 * 12)
    ],
)
def test_resume_after_an_epochs_last_batch_reports_like_the_uninterrupted_run(
    tmp_path: Path, save_freq: int, crash_after: int, restored_global: int
) -> None:
    x, y = xy()
    epochs = max(EPOCHS, crash_after // STEPS + 1)

    def run(root: Path, crash: int | None = None) -> tuple[Any, Any, Any, BatchLogs]:
        model = compiled(named())  # names given: only the epoch's end is under test here
        data = ck.ResumableDataset(x, y, batch_size=8, seed=5)
        cb = ck.BackupAndRestore(
            root, save_freq=save_freq, dataset=data, write=WriteOptions(fsync=False)
        )
        logs = BatchLogs()
        cbs = [cb, logs] + ([raise_after_batch(crash)] if crash else [])
        h = model.fit(data.tf_dataset(), epochs=epochs, verbose=0, callbacks=cbs)
        return model, h, cb, logs

    ref_model, ref_h, _, ref_logs = run(tmp_path / "ref")
    with pytest.raises(RuntimeError, match="crash"):
        run(tmp_path / "ckpt", crash=crash_after)
    model, h, cb, logs = run(tmp_path / "ckpt")

    assert cb.restored_counters is not None
    assert cb.restored_counters["global_step"] == restored_global
    epoch, step = divmod(restored_global, STEPS)
    assert (cb.restored_counters["epoch"], cb.restored_counters["step"]) == (epoch, step)
    # the history is the uninterrupted run's for the epochs this fit ran, none of them empty
    assert h.epoch == list(range(epoch, epochs))
    for key, vals in h.history.items():
        assert len(vals) == len(h.epoch), f"{key}: {len(vals)} values for {len(h.epoch)} epochs"
        want = ref_h.history[key][epoch:]
        assert [repr(float(v)) for v in vals] == [repr(float(v)) for v in want], key
    # every batch this fit trained logs what the uninterrupted run logged at that batch; the
    # last batch passed over logs what it logged when it was trained
    for (e, b), got in logs.batches.items():
        if got:
            assert got == ref_logs.batches[(e, b)], (e, b)
    if step:
        assert logs.batches[(epoch, step - 1)] == ref_logs.batches[(epoch, step - 1)]
    for v, w in zip(values(model), values(ref_model)):
        assert v == w


WORKER = str(REPO / "tests" / "workers" / "_keras_worker.py")


@pytest.mark.mpi
def test_two_workers_resume_after_an_epochs_last_batch(tmp_path: Path) -> None:
    """2 workers under mpiexec, 10 batches an epoch, a save every 10,
    a worker killed in epoch 2 after the save at the end of epoch 1."""
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}
    train = {"action": "train", "epochs": 4, "save_freq": 10}
    run = {**train, "root": str(tmp_path / "run")}
    tasks = [
        {**train, "name": "ref", "root": str(tmp_path / "ref")},
        {**run, "name": "killed", "kill": [1, 24]},
    ]
    plan = tmp_path / "first.plan.json"
    plan.write_text(json.dumps({"out": str(tmp_path / "out"), "tasks": tasks}))
    first = run_mpi(2, WORKER, str(plan), timeout=300, env=env)
    assert (tmp_path / "out" / "ref" / "rank1.json").exists(), describe(first)
    assert first.returncode != 0, "the worker was not killed"
    plan = tmp_path / "resumed.plan.json"
    plan.write_text(
        json.dumps({"out": str(tmp_path / "out"), "tasks": [{**run, "name": "resumed"}]})
    )
    resumed = run_mpi(2, WORKER, str(plan), timeout=300, env=env)
    assert resumed.returncode == 0, describe(resumed)
    for r in range(2):
        ref = json.loads((tmp_path / "out" / "ref" / f"rank{r}.json").read_text())
        res = json.loads((tmp_path / "out" / "resumed" / f"rank{r}.json").read_text())
        assert res["restored"]["global_step"] == 20
        assert (res["restored"]["epoch"], res["restored"]["step"]) == (2, 0)
        assert res["epochs"] == [2, 3], res["epochs"]
        for key, vals in res["history"].items():
            assert len(vals) == 2, f"rank {r}: {key} has {len(vals)} values for 2 epochs"
            assert vals == ref["history"][key][2:], f"rank {r}: {key}"


# --- a leftover backup ------------------------------------------------------------------------


class _Crash(keras.callbacks.Callback):  # type: ignore[misc]
    """Ends ``fit`` by an exception after batch ``n`` of the first epoch (a crashed run)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if batch + 1 == self.n:
            raise RuntimeError("crashed")


def other() -> Any:
    """Not ``named()``: an output of another width, and a layer ``named()`` lacks."""
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", name="h"),
            keras.layers.Dense(16, activation="relu", name="extra"),
            keras.layers.Dense(5, name="out"),
        ],
        name="mlp",
    )


def test_a_leftover_backup_of_another_model_is_named_with_what_differs(tmp_path: Path) -> None:
    """A crashed ``fit`` leaves its backup; a ``fit`` of another model on the same directories
    is refused naming the backup's path and step, each difference, and the directories to
    remove; removed as it says, the ``fit`` starts afresh and, having ended, deletes its own
    backup (Keras's semantics, which the docs state)."""
    shared, local = tmp_path / "backup", tmp_path / "local" / "{node}"
    x, y = xy(64)

    def callback() -> Any:
        return ck.BackupAndRestore(
            shared, save_freq=2, local_dir=local, node="n0", async_save=False
        )

    with pytest.raises(RuntimeError, match="crashed"):
        compiled(named()).fit(
            x,
            y,
            batch_size=8,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[callback(), _Crash(5)],
        )
    assert ckptfmt.latest(shared) is not None and ckptfmt.latest(shared).step == 4
    model = compiled(other())
    before = values(model)
    y5 = y[:, :5]
    with pytest.raises(ckptfmt.errors.StateMismatchError) as info:
        model.fit(x, y5, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[callback()])
    exc, message = info.value, str(info.value)
    step_dir = tmp_path / "local" / "n0" / "step-0000000004"  # level 1 is tried first
    assert (exc.path, exc.step) == (str(step_dir), 4)
    assert message.startswith(f"{step_dir} (step 4): the model does not match the backup")
    assert "mlp/out/kernel: float32[16, 5] in the model, float32[16, 6] in the backup" in message
    assert "not in the backup: mlp/extra/kernel, mlp/extra/bias" in message
    assert "saved at epoch 0, batch 4" in message
    remove = f"remove {shared} and {tmp_path / 'local' / 'n0'} to start afresh"
    assert remove in message
    assert any("extra" in n for n in exc.missing) and "mlp/out/bias" in exc.mismatched
    assert values(model) == before  # nothing written into it
    for d in (shared, tmp_path / "local" / "n0"):  # as the message says
        shutil.rmtree(d)
    backup = callback()
    model.fit(x, y5, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[backup])
    assert backup.last_restore is not None and not backup.last_restore.restored
    assert not shared.exists() and not (tmp_path / "local" / "n0").exists()  # fit ended: deleted
