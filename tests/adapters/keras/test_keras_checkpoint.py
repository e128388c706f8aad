"""The Keras 3 / TensorFlow adapter in one process: model, optimizer and counters bit-exact
(bfloat16 layers, mixed precision with loss scaling, NaN payloads), the same values as Keras's
own ``save_weights`` / ``.keras`` files, refusals that change nothing, ``tf.Module`` state, a
checkpoint read with no TensorFlow import, the PyTorch name-map example, ``ResumableDataset``,
the gradient exchange wired into the compiled train step, and ``BackupAndRestore`` resuming
``fit`` mid-epoch after a crash. Several workers under ``mpiexec``: ``test_keras_parallel.py``."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from kit.keras import compiled, raise_after_batch, xy

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import ckptfmt_keras as ck  # noqa: E402
from kit import REPO  # noqa: E402

import ckptfmt  # noqa: E402
from ckptfmt import WriteOptions  # noqa: E402
from ckptfmt.errors import ResumeWarning, UsageError  # noqa: E402
from ckptfmt.transport.comm import Comm  # noqa: E402
from ckptfmt.transport.threads import run_threads  # noqa: E402

pytestmark = pytest.mark.tf

F32_SPECIAL = np.array(
    [0x7FC00001, 0xFFC12345, 0x7F800001, 0x80000000, 0x00000001, 0xFF800000], dtype=np.uint32
).view(np.float32)
BF16_SPECIAL = np.array([0x7FC1, 0xFF81, 0x7F81, 0x8000, 0x0001, 0xFF80], dtype=np.uint16).view(
    ml_dtypes.bfloat16
)


# --- helpers -------------------------------------------------------------------------------------


def build(name: str = "mlp", *, dropout: bool = True, bf16: bool = True) -> Any:
    """A small MLP with explicitly named layers (so that its variable paths do not depend on how
    many models this process built before), a bfloat16 layer and a dropout seed state."""
    keras.utils.set_random_seed(1)
    layers = [keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="h")]
    if dropout:
        layers.append(keras.layers.Dropout(0.2, seed=3, name="drop"))
    layers.append(keras.layers.Dense(6, name="out", dtype="bfloat16" if bf16 else None))
    return keras.Sequential(layers, name=name)


def train(model: Any, steps: int = 4) -> Any:
    x, y = xy(8 * steps)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model


def arrays_of(*objs: Any) -> dict[str, bytes]:
    """Every variable's dtype, shape and bytes by name (what bit-exactness compares)."""
    out = {}
    for prefix, obj in zip("mo", objs):
        for name, a in ck.to_arrays(obj).items():
            out[f"{prefix}:{name}"] = (str(a.dtype), a.shape, a.tobytes())
    return out


def fill_special(obj: Any) -> None:
    """Put NaN payloads, -0.0, subnormals and infinities into every float variable."""
    for v in ck.named_variables(obj).values():
        dt = ck.convert.numpy_dtype(v)
        if dt not in (np.float32, ml_dtypes.bfloat16) or not v.shape:
            continue
        special = F32_SPECIAL if dt == np.float32 else BF16_SPECIAL
        a = np.asarray(v.numpy()).copy()
        flat = a.reshape(-1)
        flat[: len(special)] = special[: flat.size]
        v.assign(a)


# --- the state, bit for bit ----------------------------------------------------------------------


def test_save_load_bit_exact(tmp_path: Path) -> None:
    model = train(compiled(build()))
    fill_special(model)
    fill_special(model.optimizer)
    want = arrays_of(model, model.optimizer)
    ck.save(model, tmp_path / "c", counters={"epoch": 3, "step": 7}, step=11)

    fresh = compiled(build())
    assert arrays_of(fresh) != {k: v for k, v in want.items() if k.startswith("m:")}
    manifest = ck.load(fresh, tmp_path / "c")
    assert manifest.step == 11
    assert manifest.values("counters") == {"epoch": 3, "step": 7}
    assert arrays_of(fresh, fresh.optimizer) == want
    names = set(ckptfmt.open(tmp_path / "c").keys())
    assert {
        "model/mlp/h/kernel",
        "model/mlp/out/kernel",
        "model/mlp/drop/seed_generator_state",
        "optimizer/iteration",
        "optimizer/mlp_out_kernel_momentum",
        "counters/epoch",
    } <= names
    assert ckptfmt.open(tmp_path / "c")["model/mlp/out/kernel"].dtype == ml_dtypes.bfloat16


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_and_loss_scaling(tmp_path: Path, policy: str) -> None:
    keras.mixed_precision.set_global_policy(policy)
    try:
        opt = keras.optimizers.SGD(0.1, momentum=0.9)
        if policy == "mixed_float16":
            opt = keras.optimizers.LossScaleOptimizer(opt)
        model = train(compiled(build(bf16=False), opt))
        want = arrays_of(model, model.optimizer)
        ck.save(model, tmp_path / "c")
        fresh_opt = keras.optimizers.SGD(0.1, momentum=0.9)
        if policy == "mixed_float16":
            fresh_opt = keras.optimizers.LossScaleOptimizer(fresh_opt)
        fresh = compiled(build(bf16=False), fresh_opt)
        ck.load(fresh, tmp_path / "c")
        assert arrays_of(fresh, fresh.optimizer) == want
        keys = set(ckptfmt.open(tmp_path / "c").keys())
        if policy == "mixed_float16":
            assert {"optimizer/dynamic_scale", "optimizer/inner_optimizer/iteration"} <= keys
        # training goes on identically from the restored state
        train(model, 2)
        train(fresh, 2)
        assert arrays_of(fresh, fresh.optimizer) == arrays_of(model, model.optimizer)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_same_values_as_keras_own_files(tmp_path: Path) -> None:
    """``save_weights`` / ``load_weights`` (HDF5) and the ``.keras`` archive (with the optimizer)
    give every variable the values ckptfmt gives it."""
    model = train(compiled(build(dropout=False)))
    model.save_weights(tmp_path / "w.weights.h5")
    model.save(tmp_path / "m.keras")
    ck.save(model, tmp_path / "c")

    by_keras = compiled(build(dropout=False))
    by_keras.optimizer.build(by_keras.trainable_variables)  # else Keras skips its variables
    by_keras.load_weights(tmp_path / "w.weights.h5")
    by_ckptfmt = compiled(build(dropout=False))
    ck.load(by_ckptfmt, tmp_path / "c")
    want = arrays_of(model, model.optimizer)
    assert arrays_of(by_ckptfmt, by_ckptfmt.optimizer) == want
    assert arrays_of(by_keras, by_keras.optimizer) == want

    archived = keras.models.load_model(tmp_path / "m.keras")
    got = [np.asarray(v.numpy()).tobytes() for v in by_ckptfmt.optimizer.variables]
    keras_opt = [np.asarray(v.numpy()).tobytes() for v in archived.optimizer.variables]
    assert got == keras_opt


def test_mismatches_change_nothing(tmp_path: Path) -> None:
    """Every case offers zeros for the variables that do match, so a partial assignment would
    show; none happens, and the error names what is wrong."""
    model = train(compiled(build()))
    before = arrays_of(model)
    zeros = {k: np.zeros_like(v) for k, v in ck.to_arrays(model).items()}
    cases = {
        "missing": ({k: v for k, v in zeros.items() if k != "mlp/out/bias"}, "missing"),
        "unexpected": ({**zeros, "mlp/extra/kernel": np.zeros(3, np.float32)}, "unexpected"),
        "shape": ({**zeros, "mlp/h/kernel": zeros["mlp/h/kernel"].T.copy()}, "mismatched"),
        "dtype": ({**zeros, "mlp/out/kernel": np.zeros((16, 6), np.float32)}, "mismatched"),
    }
    for kind, (bad, field) in cases.items():
        with pytest.raises(ck.StateMismatchError) as info:
            ck.assign(model, bad)
        named = getattr(info.value, field)
        assert list(named) == [
            {"missing": "mlp/out/bias", "unexpected": "mlp/extra/kernel"}.get(
                kind, "mlp/h/kernel" if kind == "shape" else "mlp/out/kernel"
            )
        ], kind
        assert arrays_of(model) == before, f"{kind}: a variable changed"
    assert len(ck.assign(model, cases["missing"][0], strict=False)) == len(zeros) - 1
    assert arrays_of(model) != before


def test_tf_module_and_plain_variables(tmp_path: Path) -> None:
    class Block(tf.Module):
        def __init__(self, n: int) -> None:
            self.w = tf.Variable(tf.random.normal((n, n)), name="w")
            self.b = tf.Variable(tf.zeros((n,), dtype=tf.bfloat16), name="w")  # same name

    class Net(tf.Module):
        def __init__(self) -> None:
            self.blocks = [Block(3), Block(4)]
            self.scale = tf.Variable(2.5, name="scale")
            self.steps = tf.Variable(7, dtype=tf.int64)

    net = Net()
    net.blocks[1].b.assign(tf.constant(BF16_SPECIAL[:4]))
    ck.save_variables(net, tmp_path / "m")
    assert set(ck.to_arrays(net)) == {
        "blocks/0/b",
        "blocks/0/w",
        "blocks/1/b",
        "blocks/1/w",
        "scale",
        "steps",
    }
    other = Net()
    ck.load_variables(other, tmp_path / "m")
    assert arrays_of(other) == arrays_of(net)

    # a custom training loop with the core's manager (what the package docstring shows)
    with ckptfmt.CheckpointManager(
        shared_dir=tmp_path / "mgr", write=WriteOptions(fsync=False)
    ) as mgr:
        mgr.save(7, {"module": ck.nest(ck.to_arrays(net)), "step": 7})
    third = Net()
    with ckptfmt.CheckpointManager(shared_dir=tmp_path / "mgr") as mgr:
        report = mgr.restore()
        assert report.step == 7 and report.state is not None
        ck.assign(third, report.state["module"])
    assert arrays_of(third) == arrays_of(net)

    by_name = {"a": tf.Variable([1.0, 2.0]), "b": keras.Variable(np.int32(3))}
    assert set(ck.to_arrays(by_name)) == {"a", "b"}
    with pytest.raises(UsageError, match="two variables"):
        ck.to_arrays([tf.Variable(1.0, name="x"), tf.Variable(2.0, name="x")])


def test_opens_without_tensorflow(tmp_path: Path) -> None:
    """A Keras checkpoint is plain arrays: ckptfmt.open and zarr read it in a process that never
    imports TensorFlow or Keras, bfloat16 included."""
    model = train(compiled(build()))
    ck.save(model, tmp_path / "c")
    want = {
        f"{prefix}/{n}": hashlib.sha256(a.tobytes()).hexdigest()
        for prefix, obj in (("model", model), ("optimizer", model.optimizer))
        for n, a in ck.to_arrays(obj).items()
    }
    code = textwrap.dedent(
        f"""
        import hashlib, json, sys
        import numpy as np, zarr
        import ckptfmt
        from ckptfmt import WriteOptions
        ck = ckptfmt.open({str(tmp_path / "c")!r})
        group = zarr.open_group({str(tmp_path / "c")!r}, mode="r")
        out = {{}}
        for name, view in ck.tensors().items():
            a = view.read()
            z = np.asarray(group[name][...])
            assert z.dtype == a.dtype and z.tobytes() == a.tobytes(), name
            out[name] = [str(a.dtype), hashlib.sha256(a.tobytes()).hexdigest()]
        banned = [m for m in ("tensorflow", "keras", "torch") if m in sys.modules]
        print(json.dumps({{"tensors": out, "banned": banned}}))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["banned"] == []
    assert {n: h for n, (_, h) in got["tensors"].items()} == want
    assert got["tensors"]["model/mlp/out/kernel"][0] == "bfloat16"


@pytest.mark.torch
def test_pytorch_checkpoint_by_name_map() -> None:
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "keras_from_torch.py")],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "kernels are the transposed torch weights, bit for bit" in proc.stdout


# --- data and the gradient exchange ---------------------------------------------------------------


def test_resumable_dataset_order_is_a_function_of_the_epoch() -> None:
    x = np.arange(100, dtype=np.float32)[:, None]
    y = np.arange(100, dtype=np.int64)
    workers = [ck.ResumableDataset(x, y, batch_size=4, seed=9, rank=r, size=3) for r in range(3)]
    assert [len(w) for w in workers] == [8, 8, 8]  # 33 samples each, 8 whole batches
    for epoch in (0, 1):
        rows = [w.indices(epoch) for w in workers]
        flat = np.concatenate([r.reshape(-1) for r in rows])
        assert len(set(flat.tolist())) == flat.size  # no sample twice in an epoch
    assert not np.array_equal(workers[0].indices(0), workers[0].indices(1))
    again = ck.ResumableDataset(x, y, batch_size=4, seed=9, rank=1, size=3)
    assert np.array_equal(again.indices(5), workers[1].indices(5))

    ds = workers[2].tf_dataset()
    assert int(ds.cardinality()) == 8
    for epoch in (3, 0):
        workers[2].set_epoch(epoch)
        got = [(bx.numpy(), by.numpy()) for bx, by in ds]
        want = [workers[2].batch(epoch, s) for s in range(8)]
        assert len(got) == 8
        for (gx, gy), (wx, wy) in zip(got, want):
            assert np.array_equal(gx, wx) and np.array_equal(gy, wy)
            assert np.array_equal(gx[:, 0].astype(np.int64), gy)


def test_average_arrays_on_thread_ranks() -> None:
    def inputs(rank: int) -> list[np.ndarray]:
        rng = np.random.default_rng(rank)
        return [
            rng.standard_normal((3, 5)).astype(np.float32),
            rng.standard_normal(7).astype(ml_dtypes.bfloat16),
            rng.standard_normal(2),
        ]

    got = run_threads(3, lambda comm: ck.average_arrays(inputs(comm.rank), comm))
    for i in range(3):
        parts = [inputs(r)[i] for r in range(3)]
        acc = np.float64 if parts[0].dtype == np.float64 else np.float32
        want = ((parts[0].astype(acc) + parts[1].astype(acc)) + parts[2].astype(acc)) / acc(3)
        for r in range(3):
            assert got[r][i].dtype == parts[0].dtype
            assert got[r][i].tobytes() == want.astype(parts[0].dtype).tobytes()
    with pytest.raises(UsageError):
        run_threads(2, lambda comm: ck.average_arrays([np.zeros(2, np.int32)], comm))


class TwinComm(Comm):
    """Rank 0 of two whose twin always holds the same data: an allgather gives two copies. So
    averaging must give back exactly what went in ((x + x) / 2 == x), and every exchange the
    compiled train step makes is counted."""

    rank, size = 0, 2

    def __init__(self) -> None:
        self.exchanges = 0

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        self.exchanges += 1
        return [data, data]

    def dup(self) -> TwinComm:
        return self

    def barrier(self) -> None:
        pass

    def bcast_buffer(self, buf: np.ndarray, root: int) -> None:
        pass

    def send(self, buf: np.ndarray, dest: int, tag: int = 0) -> None:
        raise AssertionError("not used")

    recv = send

    def sendrecv(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("not used")

    def abort(self, code: int = 1) -> Any:
        raise AssertionError("not used")


@pytest.mark.parametrize("kind", ["adam", "loss_scale"])
def test_gradient_exchange_runs_in_the_compiled_train_step(tmp_path: Path, kind: str) -> None:
    def optimizer() -> Any:
        if kind == "adam":
            return keras.optimizers.Adam(1e-2)
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))

    keras.mixed_precision.set_global_policy("mixed_float16" if kind == "loss_scale" else "float32")
    try:
        plain = train(compiled(build(bf16=kind == "adam"), optimizer()), 5)
        comm = TwinComm()
        opt = ck.distributed_optimizer(optimizer(), comm)
        assert type(opt).__name__ == type(optimizer()).__name__
        twin = train(compiled(build(bf16=kind == "adam"), opt), 5)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert comm.exchanges == 5  # one per step (bfloat16 gradients are summed in float32 too)
    assert arrays_of(twin, twin.optimizer) == arrays_of(plain, plain.optimizer)
    with pytest.raises(UsageError, match="already"):
        ck.distributed_optimizer(opt, comm)
    if kind == "adam":  # a saved model names the optimizer's own class, not the wrapper
        twin.save(tmp_path / "m.keras")
        assert (
            type(keras.models.load_model(tmp_path / "m.keras").optimizer) is keras.optimizers.Adam
        )


def test_broadcast_and_agree_on_thread_ranks() -> None:
    def body(comm: Any) -> tuple[list[str], bytes]:
        arrays = {
            "same": np.arange(4, dtype=np.float32),
            "differs": np.full(3, comm.rank, dtype=ml_dtypes.bfloat16),
        }
        differ = ck.parallel.agree(arrays, comm)
        return differ, arrays["differs"].tobytes()

    for differ, data in run_threads(3, body):
        assert differ == ["differs"]
        assert data == np.zeros(3, ml_dtypes.bfloat16).tobytes()


# --- BackupAndRestore ----------------------------------------------------------------------------


def history_bits(history: Any) -> dict[str, list[str]]:
    return {k: [repr(float(v)) for v in vs] for k, vs in history.history.items()}


@pytest.mark.parametrize(
    "data_kind, save_freq, per_execution, crash_after",
    [
        ("resumable", 5, 1, 17),  # saves at 5, 10, 15: resumes at epoch 1, step 3
        ("arrays", 4, 2, 9),  # 2 batches an execution; saves at 4, 8, 12, 16; crash at 18
        ("resumable", "epoch", 1, 20),  # resumes at the start of epoch 1
    ],
)
def test_fit_resumes_mid_epoch_bit_exact(
    tmp_path: Path, data_kind: str, save_freq: Any, per_execution: int, crash_after: int
) -> None:
    x, y = xy(96, seed=4)
    epochs, batch = 3, 8  # 12 steps an epoch

    def run(backup_dir: Path, crash: int | None = None, delete: bool = False) -> Any:
        model = compiled(build(), steps_per_execution=per_execution)
        data = ck.ResumableDataset(x, y, batch_size=batch, seed=5)
        cb = ck.BackupAndRestore(
            backup_dir,
            save_freq=save_freq,
            delete_checkpoint=delete,
            dataset=data if data_kind == "resumable" else None,
            write=WriteOptions(fsync=False),
        )
        cbs = [cb] + ([raise_after_batch(crash)] if crash else [])
        if data_kind == "resumable":
            h = model.fit(data.tf_dataset(), epochs=epochs, verbose=0, callbacks=cbs)
        else:
            h = model.fit(
                x, y, batch_size=batch, shuffle=False, epochs=epochs, verbose=0, callbacks=cbs
            )
        return model, h, cb

    reference, ref_history, _ = run(tmp_path / "ref")
    with pytest.raises(RuntimeError, match="crash"):
        run(tmp_path / "ckpt", crash=crash_after)
    resumed, history, cb = run(tmp_path / "ckpt", delete=True)

    assert cb.restored_counters is not None
    steps_done = {5: 15, 4: 16, "epoch": 12}[save_freq]
    assert cb.restored_counters["global_step"] == steps_done
    assert (cb.restored_counters["epoch"], cb.restored_counters["step"]) == divmod(steps_done, 12)
    assert cb.restored_counters["optimizer_iterations"] == steps_done
    assert arrays_of(resumed, resumed.optimizer) == arrays_of(reference, reference.optimizer)
    # the resumed epochs report what the uninterrupted run reported (metrics restored too)
    got, want = history_bits(history), history_bits(ref_history)
    assert {k: v[-len(got[k]) :] for k, v in want.items()} == got
    assert len(got["loss"]) == epochs - cb.restored_counters["epoch"]
    assert not (tmp_path / "ckpt").exists()  # delete_checkpoint
    assert (
        resumed._initial_epoch is None
        and getattr(resumed.train_function, "_ckptfmt_original", None) is None
    )


def test_a_last_shorter_execution_counts_the_batches_it_trained(tmp_path: Path) -> None:
    """12 batches an epoch, 5 an execution: Keras ends the last execution (2 batches) at batch
    14 as if it held 5. Every save is named by the batches trained (the optimizer's iterations:
    saves at 5, 10, the epoch's end 12, then 17, 22, 24), and a fit killed after 22 resumes
    at epoch 1, step 10 and ends bit for bit as the uninterrupted fit."""
    x, y = xy(96, seed=4)

    def fit(root: Path, crash: int | None = None) -> tuple[Any, Any]:
        model = compiled(build(), steps_per_execution=5)
        cb = ck.BackupAndRestore(
            root,
            save_freq=4,
            delete_checkpoint=False,
            keep_shared=10,
            write=WriteOptions(fsync=False),
        )
        cbs = [cb] + ([raise_after_batch(crash)] if crash else [])
        model.fit(x, y, batch_size=8, shuffle=False, epochs=2, verbose=0, callbacks=cbs)
        return model, cb

    reference, cb = fit(tmp_path / "ref")
    assert cb.global_step == int(reference.optimizer.iterations.numpy()) == 24
    saved = sorted(p.name for p in (tmp_path / "ref").iterdir() if p.name.startswith("step-"))
    assert saved == [ckptfmt.step_dir_name(s) for s in (5, 10, 12, 17, 22, 24)]
    for name in saved:
        counters = ckptfmt.load(tmp_path / "ref" / name)["counters"]
        assert counters["global_step"] == counters["optimizer_iterations"], name
    with pytest.raises(RuntimeError, match="crash"):
        fit(tmp_path / "ckpt", crash=5)  # the 5th execution: batches 5-9 of epoch 1 (22)
    resumed, cb = fit(tmp_path / "ckpt")
    assert cb.restored_counters is not None
    assert cb.restored_counters["global_step"] == 22
    assert (cb.restored_counters["epoch"], cb.restored_counters["step"]) == (1, 10)
    assert cb.global_step == 24
    assert arrays_of(resumed, resumed.optimizer) == arrays_of(reference, reference.optimizer)


def test_a_resume_where_no_execution_begins_is_refused_and_changes_nothing(
    tmp_path: Path,
) -> None:
    """Saved after batch 10 (5 an execution), resumed with 4 an execution: the third execution
    passed over would take batches 8-11, 10 and 11 never trained, and the fit went on without
    them (its counters saying they were). Refused before any variable changes, naming the
    backup; with 2 an execution (dividing 10) the fit resumes and trains each batch once."""
    x, y = xy(96, seed=4)

    def fit(model: Any, crash: int | None = None) -> Any:
        cb = ck.BackupAndRestore(tmp_path / "b", save_freq=5, write=WriteOptions(fsync=False))
        cbs = [cb] + ([raise_after_batch(crash)] if crash else [])
        model.fit(x, y, batch_size=8, shuffle=False, epochs=1, verbose=0, callbacks=cbs)
        return cb

    with pytest.raises(RuntimeError, match="crash"):
        fit(compiled(build(), steps_per_execution=5), crash=2)  # saved at 5 and 10
    other = compiled(build(), steps_per_execution=4)
    other.optimizer.build(other.trainable_variables)
    before = arrays_of(other, other.optimizer)
    with pytest.raises(UsageError, match=r"step-0000000010.*batch 10 of epoch 0.*divides 10"):
        fit(other)
    assert arrays_of(other, other.optimizer) == before
    model = compiled(build(), steps_per_execution=2)
    cb = fit(model)
    assert cb.restored_counters is not None and cb.restored_counters["step"] == 10
    assert cb.global_step == int(model.optimizer.iterations.numpy()) == 12


@pytest.mark.parametrize("data_kind", ["arrays", "repeated"])
def test_a_fit_carrying_its_data_across_epochs_resumes_exactly_only_in_its_first(
    tmp_path: Path, data_kind: str
) -> None:
    """``steps_per_epoch=4`` of data of 12 batches (arrays) or of unknown length (a repeated
    ``tf.data`` dataset): Keras carries its data iterator from epoch to epoch, so epoch 1
    trains batches 4-7. A fit killed in epoch 0 resumes bit for bit (both fits start the data
    afresh); one killed in epoch 1 (saved at epoch 1, batch 2) would resume on batches 0-1
    instead of 6-7: it resumes all the same (the backup is the run's way forward), with a
    ResumeWarning naming steps_per_epoch, and trains the epochs left."""
    x, y = xy(96, seed=4)

    def fit(model: Any, root: Path, crash: int | None = None) -> Any:
        cb = ck.BackupAndRestore(
            root, save_freq=2, delete_checkpoint=False, write=WriteOptions(fsync=False)
        )
        cbs = [cb] + ([raise_after_batch(crash)] if crash else [])
        if data_kind == "arrays":
            data: Any = {"x": x, "y": y, "batch_size": 8}
        else:
            data = {"x": tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()}
        model.fit(**data, shuffle=False, steps_per_epoch=4, epochs=3, verbose=0, callbacks=cbs)
        return cb

    reference = compiled(build())
    fit(reference, tmp_path / "ref")
    with pytest.raises(RuntimeError, match="crash"):
        fit(compiled(build()), tmp_path / "first", crash=3)  # saved at epoch 0, batch 2
    resumed = compiled(build())
    cb = fit(resumed, tmp_path / "first")
    assert cb.restored_counters is not None
    assert (cb.restored_counters["epoch"], cb.restored_counters["step"]) == (0, 2)
    assert arrays_of(resumed, resumed.optimizer) == arrays_of(reference, reference.optimizer)

    with pytest.raises(RuntimeError, match="crash"):
        fit(compiled(build()), tmp_path / "second", crash=7)  # saved at epoch 1, batch 2
    other = compiled(build())
    has = "12" if data_kind == "arrays" else "an unknown number of"
    with pytest.warns(
        ResumeWarning,
        match=rf"step-0000000006.*epoch 1, batch 2.*steps_per_epoch=4 and data of {has} batch",
    ):
        cb = fit(other, tmp_path / "second")
    assert cb.restored_counters is not None
    assert (cb.restored_counters["epoch"], cb.restored_counters["step"]) == (1, 2)
    assert cb.global_step == 12  # the epochs left trained: 2 + 4 batches after the resume
    assert int(other.optimizer.iterations.numpy()) == 12


class Epochs(keras.callbacks.Callback):
    """The epochs a fit ran."""

    def __init__(self) -> None:
        super().__init__()
        self.epochs: list[int] = []

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.epochs.append(epoch)


def test_a_fit_ended_by_an_exception_leaves_nothing_to_the_next_fit(tmp_path: Path) -> None:
    """A fit that resumed (at epoch 1, step 3) and ended by an exception while it passed the
    3 batches over: neither where it started (Keras keeps that in the model) nor its train
    function passing batches over may reach the next fit of the same model, here on a fresh
    backup. That fit runs every epoch and trains every batch, bit for bit as a model with the
    same state fitted afresh."""
    x, y = xy(96, seed=4)

    def fit(model: Any, root: Path, crash: int | None = None, epochs: int = 3) -> Epochs:
        seen = Epochs()
        cb = ck.BackupAndRestore(root, save_freq=5, write=WriteOptions(fsync=False))
        cbs = [cb, seen] + ([raise_after_batch(crash)] if crash else [])
        model.fit(x, y, batch_size=8, shuffle=False, epochs=epochs, verbose=0, callbacks=cbs)
        return seen

    model = compiled(build())
    with pytest.raises(RuntimeError, match="crash"):
        fit(model, tmp_path / "a", crash=17)  # saved at 15: epoch 1, step 3
    with pytest.raises(RuntimeError, match="crash"):
        fit(model, tmp_path / "a", crash=2)  # resumed; crashes in the batches passed over
    twin = compiled(build())
    twin.optimizer.build(twin.trainable_variables)
    ck.from_state(twin, ck.to_state(model))  # the same state, never resumed
    assert arrays_of(twin, twin.optimizer) == arrays_of(model, model.optimizer)
    before = int(model.optimizer.iterations.numpy())

    assert fit(model, tmp_path / "b", epochs=2).epochs == [0, 1]
    assert int(model.optimizer.iterations.numpy()) == before + 24  # every batch trained
    assert fit(twin, tmp_path / "c", epochs=2).epochs == [0, 1]
    assert arrays_of(model, model.optimizer) == arrays_of(twin, twin.optimizer)
    assert model._initial_epoch is None
    assert getattr(model.train_function, "_ckptfmt_original", None) is None


def test_thread_ranks_each_close_their_own_manager_left_by_a_crash(tmp_path: Path) -> None:
    """Two ranks that are threads of one process (``run_threads``), one backup: a fit ended by
    an exception on both leaves each rank's manager open, and the next fit on each rank closes
    its own (a manager left open would flush, a collective, at the interpreter's exit, alone).
    The resumed fit restores the step both ranks saved."""
    x, y = xy(96, seed=4)
    lock = threading.Lock()  # Keras's global seed and layer names: one model built at a time
    left: dict[int, Any] = {}

    def fit(comm: Any, cb: Any, crash: int | None) -> Any:
        opt = ck.distributed_optimizer(keras.optimizers.SGD(1e-2), comm)
        with lock:
            model = compiled(build(bf16=False), opt)
        cbs = [cb] + ([raise_after_batch(crash)] if crash else [])
        data = (x[comm.rank :: 2], y[comm.rank :: 2])  # 6 batches an epoch
        model.fit(*data, batch_size=8, shuffle=False, epochs=2, verbose=0, callbacks=cbs)
        return cb

    def body(comm: Any) -> Any:
        def callback() -> Any:
            return ck.BackupAndRestore(
                tmp_path / "b", save_freq=5, comm=comm, write=WriteOptions(fsync=False)
            )

        crashed = callback()
        with pytest.raises(RuntimeError, match="crash"):
            fit(comm, crashed, crash=7)  # saved at 5
        left[comm.rank] = crashed.manager  # open: the fit never ended
        comm.barrier()
        return fit(comm, callback(), crash=None).restored_counters

    restored = run_threads(2, body)
    assert [r["global_step"] for r in restored] == [5, 5]
    for rank, manager in left.items():
        with pytest.raises(UsageError, match="closed"):
            manager.save(99, {})  # closed by this rank's next fit, not left open
        assert manager.comm.rank == rank


def test_callback_arguments() -> None:
    keras_args = set(inspect.signature(keras.callbacks.BackupAndRestore).parameters)
    ours = set(inspect.signature(ck.BackupAndRestore).parameters)
    assert keras_args <= ours
    assert {"settings", "comm", "dataset"} <= ours  # the manager's settings: one object
    for bad in (0, -1, True, "batch", 1.5):
        with pytest.raises(UsageError):
            ck.BackupAndRestore("d", save_freq=bad)
    with pytest.raises(UsageError):
        ck.BackupAndRestore("")
    with pytest.raises(UsageError):
        ck.BackupAndRestore("d", dataset=object())


def test_unbuilt_model_and_xla_are_refused(tmp_path: Path) -> None:
    x, y = xy(16)
    sub = keras.Sequential([keras.layers.Dense(2)])
    sub.compile("sgd", "mse")
    with pytest.raises(UsageError, match="build the model"):
        sub.fit(x, y[:, :2], verbose=0, callbacks=[ck.BackupAndRestore(tmp_path / "a")])
    model = compiled(build())
    model.compile(
        optimizer=ck.distributed_optimizer(keras.optimizers.SGD(), TwinComm()),
        loss="mse",
        jit_compile=True,
    )
    cb = ck.BackupAndRestore(tmp_path / "b", comm=TwinComm())
    with pytest.raises(UsageError, match="jit_compile"):
        model.fit(x, y, verbose=0, callbacks=[cb])


def test_redundancy_reaches_the_manager(tmp_path: Path) -> None:
    """``redundancy`` is the core's: on one node there is nothing to protect against, and the
    core says so (with several nodes, ``test_keras_parallel.py`` rebuilds a lost one)."""
    x, y = xy(16)
    cb = ck.BackupAndRestore(tmp_path / "l3", local_dir=tmp_path / "l1", redundancy="xor")
    with pytest.raises(UsageError, match="redundancy 'xor'"):
        compiled(build()).fit(x, y, verbose=0, callbacks=[cb])
