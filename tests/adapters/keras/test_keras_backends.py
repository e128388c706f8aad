"""The Keras adapter under each Keras backend (TensorFlow, JAX, PyTorch), each in a process of
its own (Keras picks its backend once per process; ``tests/workers/_keras_backend_worker.py``).

- importing ``ckptfmt_keras`` imports no backend Keras itself did not (under JAX: no TensorFlow);
- ``BackupAndRestore``: ``fit`` killed mid-epoch, at an epoch's end, and after a step save that
  ends an epoch, then resumed, ends bit-identical to the uninterrupted run (weights, optimizer,
  history), a model with an unseeded ``Dropout`` (under PyTorch it draws from torch's global
  generator, saved as ``rng/torch``);
- one format: a checkpoint saved under each backend loads under each other, every float tensor
  bit for bit, the same names; Keras's integer counters by value;
- two data-parallel workers (``MpiComm``, ``distributed_optimizer``) on JAX and PyTorch, killed
  mid-epoch and resumed, end as the uninterrupted job (TensorFlow's: ``test_keras_parallel.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kit import REPO
from kit.launch import assert_ok, describe, run_mpi, with_kit_path

BACKENDS = ("tensorflow", "jax", "torch")
WORKER = REPO / "tests" / "workers" / "_keras_backend_worker.py"
TIMEOUT = 400
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.slow


def needs(backend: str) -> None:
    pytest.importorskip("keras")
    pytest.importorskip({"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}[backend])


def run_worker(backend: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = with_kit_path({**os.environ, **ENV, "KERAS_BACKEND": backend})
    try:
        return subprocess.run(
            [sys.executable, str(WORKER), *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{backend} {args[0]}: timed out after {TIMEOUT} s", pytrace=False)


@pytest.fixture(scope="module")
def singles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each backend's ``single`` run (its resumes and a saved checkpoint), then each backend
    loading every backend's checkpoint."""
    out = tmp_path_factory.mktemp("backends")
    results: dict[str, Any] = {}
    ran = []
    for backend in BACKENDS:
        try:
            needs(backend)
        except pytest.skip.Exception:
            continue
        assert_ok(run_worker(backend, "single", str(out / backend)))
        results[backend] = json.loads((out / backend / f"single.{backend}.json").read_text())
        ran.append(backend)
    ckpts = [str(out / b / f"ckpt.{b}") for b in ran]
    loads = {}
    for backend in ran:
        assert_ok(run_worker(backend, "load", str(out / backend), *ckpts))
        loads[backend] = json.loads((out / backend / f"load.{backend}.json").read_text())
    return {"single": results, "load": loads}


@pytest.mark.parametrize("backend", BACKENDS)
def test_imports_no_other_backend(singles: dict[str, Any], backend: str) -> None:
    if backend not in singles["single"]:
        pytest.skip(f"{backend} is not installed")
    assert singles["single"][backend]["added"] == []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "scenario, restored",
    [
        ("mid_epoch", {"epoch": 1, "step": 3, "global_step": 15}),
        ("epoch_end", {"epoch": 1, "step": 0, "global_step": 12}),
        ("step_save_ends_epoch", {"epoch": 1, "step": 0, "global_step": 12}),
        # gradient accumulation: 15 batches are 7 updates (its iterations a tensor, not a
        # variable: saving it failed under JAX)
        (
            "accumulated",
            {"epoch": 1, "step": 3, "global_step": 15, "optimizer_iterations": 7},
        ),
    ],
)
def test_killed_fit_resumes_bit_identical(
    singles: dict[str, Any], backend: str, scenario: str, restored: dict[str, int]
) -> None:
    if backend not in singles["single"]:
        pytest.skip(f"{backend} is not installed")
    got = singles["single"][backend][scenario]
    assert {k: got["counters"][k] for k in restored} == restored
    assert got["weights_equal"], "weights or optimizer state differ from the uninterrupted run"
    assert got["history_equal"], "the resumed epochs report other metrics"
    assert got["epochs_reported"] == 2
    assert "model/mlp/drop/seed_generator_state" in got["saved_names"]
    assert ("rng/torch" in got["saved_names"]) == (backend == "torch")


def test_one_format_across_backends(singles: dict[str, Any]) -> None:
    saved = {b: r["saved"] for b, r in singles["single"].items()}
    if len(saved) < 2:
        pytest.skip("needs two Keras backends")
    names = {b: sorted(s) for b, s in saved.items()}
    assert len({tuple(n) for n in names.values()}) == 1, names  # the same variable paths
    for loader, loaded in singles["load"].items():
        for source, ckpt in saved.items():
            got = loaded[f"ckpt.{source}"]
            assert got["counters"] == {"epoch": 1}
            differ = sorted(k for k in ckpt if got["loaded"].get(k) != ckpt[k])
            assert not differ, f"saved under {source}, loaded under {loader}: {differ}"


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_data_parallel_workers_resume_bit_identical(tmp_path: Path, backend: str) -> None:
    needs(backend)
    result = run_mpi(
        2,
        str(WORKER),
        "parallel",
        str(tmp_path),
        timeout=TIMEOUT,
        env={**ENV, "KERAS_BACKEND": backend},
    )
    if result.returncode != 0:
        pytest.fail(describe(result), pytrace=False)
    ranks = [
        json.loads((tmp_path / f"parallel.{backend}.rank{r}.json").read_text()) for r in (0, 1)
    ]
    for r in ranks:
        assert {k: r["counters"][k] for k in ("epoch", "step", "global_step")} == {
            "epoch": 1,
            "step": 2,
            "global_step": 8,
        }
        assert r["final"] == r["reference"]
        assert r["history_equal"]
        assert r["replica_fixes"] == []  # averaged gradients kept the replicas identical
    assert ranks[0]["first_batch"] != ranks[1]["first_batch"]  # each worker its own batches
    assert ranks[0]["final"] == ranks[1]["final"]


BROADCAST = """
import json
import ml_dtypes
import numpy as np
import keras
from ckptfmt.transport.threads import run_threads
from ckptfmt_keras import backend
from ckptfmt_keras.parallel import broadcast_variables

BITS = [0x7FC1, 0xFF81, 0x7F81, 0x8000, 0x0001, 0x3F80]  # NaN payloads, -0.0, a subnormal, 1

def body(comm):
    v = keras.Variable(np.zeros(6, np.float32), dtype="bfloat16", name="w")
    if comm.rank == 0:
        backend.assign(v, np.array(BITS, np.uint16).view(ml_dtypes.bfloat16))
    broadcast_variables([v], comm)
    return backend.to_numpy(v).view(np.uint16).tolist()

print(json.dumps({"ranks": run_threads(2, body), "want": BITS}))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_replicas_take_rank_0s_bits(backend: str) -> None:
    """Every replica starts from rank 0's weights bit for bit on each backend, bfloat16 NaN
    payloads too (under PyTorch a variable's own ``numpy`` and ``assign`` go through float32,
    which made rank 1's NaNs other NaNs than rank 0's)."""
    needs(backend)
    env = with_kit_path({**os.environ, **ENV, "KERAS_BACKEND": backend})
    proc = subprocess.run(
        [sys.executable, "-c", BROADCAST],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["ranks"] == [got["want"], got["want"]]


LOSS_SCALED = """
import json, sys, tempfile, threading
from pathlib import Path
import numpy as np
import keras
import ckptfmt_keras as ck
from ckptfmt import WriteOptions
from ckptfmt.transport.threads import run_threads

lock = threading.Lock()  # Keras's seed and names: one model built at a time
root = Path(sys.argv[1])

def body(comm):
    keras.mixed_precision.set_global_policy("mixed_float16")  # Keras's state is per thread
    opt = ck.distributed_optimizer(keras.optimizers.SGD(1e-3), comm)
    with lock:
        keras.utils.set_random_seed(1)
        i = keras.Input((4,))
        model = keras.Model(i, keras.layers.Dense(2, name="d")(i), name="m")
        model.compile(optimizer=opt, loss="mse", jit_compile=False)  # wrapped: loss scaling
    x = np.random.default_rng(comm.rank).standard_normal((160, 4)).astype(np.float32)
    if comm.rank == 0:
        x[:8] *= np.float32(1e4)  # only rank 0's first gradients overflow float16
    y = np.zeros((160, 2), np.float32)
    cb = ck.BackupAndRestore(root, save_freq=5, comm=comm, write=WriteOptions(fsync=False))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[cb])
    names = ck.to_arrays(model) | ck.to_arrays(model.optimizer)
    return {
        "state": {k: a.tobytes().hex() for k, a in names.items()},
        "updates": int(keras.ops.convert_to_numpy(model.optimizer.inner_optimizer.iterations)),
        "fixes": len(cb.replica_fixes),
    }

print(json.dumps(run_threads(2, body)))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_float16_workers_skip_an_overflowed_step_together(
    tmp_path: Path, backend: str
) -> None:
    """``mixed_float16``: ``compile`` wraps the averaging optimizer in a ``LossScaleOptimizer``,
    which checked each rank's own gradients for overflow before the exchange; a rank whose
    gradients overflowed skipped the step and the exchange while the other waited in it (a
    broken barrier here, a hang under MPI). ``BackupAndRestore`` moves the averaging out to the
    ``LossScaleOptimizer``: both ranks skip the overflowed step, update alike after, and hold
    the same state bit for bit with no replica fixed."""
    needs(backend)
    env = with_kit_path({**os.environ, **ENV, "KERAS_BACKEND": backend})
    proc = subprocess.run(
        [sys.executable, "-c", LOSS_SCALED, str(tmp_path / "b")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ranks[0]["state"] == ranks[1]["state"]
    assert 0 < ranks[0]["updates"] == ranks[1]["updates"] < 20  # some steps skipped, not all
    assert ranks[0]["fixes"] == ranks[1]["fixes"] == 0
