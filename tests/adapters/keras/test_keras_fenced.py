"""``BackupAndRestore(fenced=True)`` in a real Keras ``fit`` (TensorFlow): a checkpoint after
every batch whose copy is left to the manager's thread (the save holds the variables' values,
which TensorFlow keeps by copying on write; the next batch's start is the fence), each
checkpoint the state of its own step bit for bit, with and without XLA; a variable changed
outside the optimizer after the save, before the fence, does not reach the checkpoint (the
documented guarantee) and costs only its copy."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit.arrays import flat_tree as flat
from kit.keras import raise_after_batch, xy

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import ckptfmt_keras as ck  # noqa: E402

import ckptfmt  # noqa: E402
from ckptfmt import WriteOptions  # noqa: E402

pytestmark = pytest.mark.tf
STEPS = 6


def build() -> Any:
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", name="h"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Dense(6, name="out"),
        ],
        name="mlp",
    )


class Snapshot(keras.callbacks.Callback):  # type: ignore[misc]
    """Every variable's bytes at each batch's end (before the backup's save: listed first)."""

    def __init__(self) -> None:
        super().__init__()
        self.at: dict[int, dict[str, np.ndarray]] = {}
        self.step = 0

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.step += 1
        got = {f"model/{k}": v for k, v in ck.to_arrays(self.model).items()}
        got.update({f"optimizer/{k}": v for k, v in ck.to_arrays(self.model.optimizer).items()})
        self.at[self.step] = {k: np.array(v, copy=True) for k, v in got.items()}


class Meddle(keras.callbacks.Callback):  # type: ignore[misc]
    """After the backup's save at step ``at`` (listed after it), before the next batch (the
    fence): a kernel and a moving mean changed outside the optimizer."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.step = at, 0

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.step += 1
        if self.step == self.at:
            kernel = self.model.get_layer("h").kernel
            kernel.assign(kernel * 2.0)
            mean = self.model.get_layer("bn").moving_mean
            mean.assign(mean + 1.0)


def fit(root: Path, jit: bool, *extra: Any) -> tuple[Any, Snapshot, Any]:
    model = build()
    model.compile(optimizer="adam", loss="mse", jit_compile=jit)
    snap = Snapshot()
    cb = ck.BackupAndRestore(
        root / "shared",
        save_freq=1,
        delete_checkpoint=False,
        fenced=True,
        local_dir=root / "local" / "{node}",
        node="n0",
        keep_local=STEPS + 1,
        async_save=True,
        write=WriteOptions(fsync=False),
    )
    x, y = xy(8 * STEPS)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[snap, cb, *extra])
    return model, snap, cb


def saved(root: Path, step: int) -> dict[str, np.ndarray]:
    got = flat(ckptfmt.load(root / "local" / "n0" / ckptfmt.step_dir_name(step)))
    return {k: v for k, v in got.items() if k.startswith(("model/", "optimizer/"))}


def assert_step(root: Path, step: int, want: dict[str, np.ndarray]) -> None:
    got = saved(root, step)
    assert got.keys() == want.keys(), step
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes(), (step, k)


@pytest.mark.parametrize("jit", [False, True])
def test_every_batch_each_checkpoint_is_its_steps_state(tmp_path: Path, jit: bool) -> None:
    _, snap, cb = fit(tmp_path, jit)
    assert sorted(snap.at) == list(range(1, STEPS + 1))
    for step, want in snap.at.items():
        assert_step(tmp_path, step, want)
    assert len(cb.blocked_s) == STEPS and cb._in_flight is None


def test_a_change_after_the_save_does_not_reach_the_checkpoint(tmp_path: Path) -> None:
    _, snap, cb = fit(tmp_path, False, Meddle(at=3))
    assert len(cb.blocked_s) == STEPS  # the fenced saves
    for step, want in snap.at.items():
        assert_step(tmp_path, step, want)  # step 3: the values before the change
    got = saved(tmp_path, 4)  # the change reached the next step's state, as in training
    assert not np.array_equal(got["model/mlp/h/kernel"], snap.at[3]["model/mlp/h/kernel"])
    assert saved(tmp_path, 3)["model/mlp/bn/moving_mean"].tobytes() == (
        snap.at[3]["model/mlp/bn/moving_mean"].tobytes()
    )


def test_a_callback_reused_after_a_failed_fit_starts_clean(tmp_path: Path) -> None:
    """A fit raised right after a fenced save (its fence never came); the same callback object
    in the next fit: the save left in flight is over when that fit starts (its manager is
    closed there), so no fence of the new fit waits on it or adds to the failed fit's last
    ``blocked_s`` entry; the new fit resumes at that save and each of its saves is its step's
    state, bit for bit."""
    model = build()
    model.compile(optimizer="adam", loss="mse", jit_compile=False)
    cb = ck.BackupAndRestore(
        tmp_path / "shared",
        save_freq=1,
        delete_checkpoint=False,
        fenced=True,
        local_dir=tmp_path / "local" / "{node}",
        node="n0",
        keep_local=STEPS + 1,
        async_save=True,
        write=WriteOptions(fsync=False),
    )
    x, y = xy(8 * STEPS)

    def run(*extra: Any) -> None:
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[*extra])

    with pytest.raises(RuntimeError, match="crash"):
        run(cb, raise_after_batch(3))
    assert cb._in_flight is not None  # the save of step 3, whose fence never came
    failed = list(cb.blocked_s)
    assert len(failed) == 3
    snap = Snapshot()
    run(snap, cb)
    assert cb.restored_counters is not None and cb.restored_counters["global_step"] == 3
    assert cb.blocked_s[:3] == failed  # the failed fit's entries, untouched
    assert len(cb.blocked_s) == STEPS and cb._in_flight is None  # one per save of this fit
    for step in range(4, STEPS + 1):
        assert_step(tmp_path, step, snap.at[step])
