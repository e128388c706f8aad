"""A worker of a data-parallel Keras job: ``_keras_worker.py PLAN.json`` under
``mpiexec ... python -m mpi4py`` (``tests/adapters/keras/test_keras_parallel.py`` launches it).

``PLAN.json``: ``{"out": DIR, "tasks": [...]}``, run in order in this one job (TensorFlow's
import costs more than a task). Tasks:

- ``{"name", "action": "average"}``: ``average_arrays`` on rank-dependent arrays (float32,
  bfloat16, float16, float64), both reductions; each rank checks the result against the rank-order
  sum it computes itself from every rank's inputs, and that all ranks got the same bytes.
- ``{"name", "action": "train", "root", "epochs", "save_freq", "reduction", "redundancy",
  "kill": [rank, step] | null, "dump_saves": bool, "dp_check": bool}``: the model of
  :func:`build_model` trained with ``distributed_optimizer`` on this rank's share of
  :func:`dataset` through ``BackupAndRestore``
  (level 1 at ``<root>/l1/{node}``, level 3 at ``<root>/l3``; rank ``r`` of ``n`` on node
  ``n{r * 2 // n}``). With ``kill``, every rank waits for the save in flight at that global step
  and then that rank kills itself with SIGKILL (mid-epoch). Writes, under ``<out>/<name>/``: the
  state each rank restored (``restored.rank<r>``), the state at every save
  (``save-<step>.rank<r>``, with ``dump_saves``) and at the end (``final.rank<r>``), each a
  ckptfmt checkpoint of ``{"model": ..., "optimizer": ...}``; and ``rank<r>.json``: restored
  counters and the restore report, the loss history, the replica fixes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import ml_dtypes
import numpy as np
from kit.worker import node_of

SAMPLES = 160
FEATURES = 16
PER_WORKER_BATCH = 8


def dataset() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    y = (x[:, :4] * 0.5 + 0.1 * rng.standard_normal((SAMPLES, 4))).astype(np.float32)
    return x, y


def build_model(keras: Any, plain: bool = False) -> Any:
    """A small MLP with a bfloat16 layer, batch normalization (non-trainable state each worker
    updates from its own batches) and dropout (a seed-generator state); ``plain`` leaves out the
    last two, whose per-worker behaviour a single process cannot reproduce."""
    keras.utils.set_random_seed(11)
    layers = [keras.Input((FEATURES,)), keras.layers.Dense(32, activation="relu", name="h1")]
    if not plain:
        layers += [
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Dropout(0.1, seed=5, name="drop"),
        ]
    layers += [
        keras.layers.Dense(32, activation="relu", name="h2", dtype="bfloat16"),
        keras.layers.Dense(4, name="out"),
    ]
    return keras.Sequential(layers, name="mlp")


def compile_model(keras: Any, model: Any, optimizer: Any) -> None:
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"], jit_compile=False)


def main() -> None:
    import keras
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    from kit.worker import make_comm

    import ckptfmt

    plan = json.loads(Path(sys.argv[1]).read_text())
    comm = make_comm("mpi")
    for task in plan["tasks"]:
        out = Path(plan["out"]) / task["name"]
        out.mkdir(parents=True, exist_ok=True)
        if task["action"] == "average":
            average_task(comm, out)
        else:
            train_task(keras, ckptfmt, comm, task, out)
        comm.barrier()


def average_task(comm: Any, out: Path) -> None:
    from ckptfmt_keras import average_arrays

    def inputs(rank: int) -> list[np.ndarray]:
        rng = np.random.default_rng([3, rank])
        return [
            rng.standard_normal((5, 7)).astype(np.float32),
            rng.standard_normal(33).astype(ml_dtypes.bfloat16),
            rng.standard_normal((2, 3)).astype(np.float16),
            rng.standard_normal(4).astype(np.float64),
            np.float32(rng.standard_normal()),
        ]

    problems = []
    every = [inputs(r) for r in range(comm.size)]
    for i, arrays in enumerate(zip(*every)):  # the expected mean, summed here in rank order
        acc = np.float64 if arrays[0].dtype == np.float64 else np.float32
        total = np.asarray(arrays[0], dtype=acc).copy()
        for a in arrays[1:]:
            total += np.asarray(a, dtype=acc)
        total /= acc(comm.size)
        every[0][i] = total.astype(arrays[0].dtype)  # reuse slot: expected values
    expected = every[0]
    results = {}
    for reduction in ("ordered", "allreduce"):
        got = average_arrays(inputs(comm.rank), comm, reduction)
        for name, g, want in zip("abcde", got, expected):
            if g.dtype != want.dtype or g.shape != want.shape:
                problems.append(f"{reduction} {name}: {g.dtype}{g.shape} != {want.dtype}")
            elif reduction == "ordered" and g.tobytes() != want.tobytes():
                problems.append(f"{reduction} {name}: not the rank-order mean")
            elif not np.allclose(g.astype(np.float64), want.astype(np.float64), rtol=1e-2):
                problems.append(f"{reduction} {name}: not the mean")
        results[reduction] = [g.tobytes().hex() for g in got]
    everyone = comm.allgather_json(results)
    if any(r != everyone[0] for r in everyone):
        problems.append("ranks got different bytes")
    (out / f"rank{comm.rank}.json").write_text(json.dumps({"problems": problems}))


def train_task(keras: Any, ckptfmt: Any, comm: Any, task: dict[str, Any], out: Path) -> None:
    import ckptfmt_keras as ck

    rank, size = comm.rank, comm.size
    root = Path(task["root"])
    x, y = dataset()

    def dump(path: Path, model: Any) -> None:
        state = {
            "model": ck.nest(ck.to_arrays(model)),
            "optimizer": ck.nest(ck.to_arrays(model.optimizer)),
        }
        ckptfmt.save(state, path, write=ckptfmt.WriteOptions(fsync=False, overwrite=True))

    model = build_model(keras)
    opt = ck.distributed_optimizer(
        keras.optimizers.Adam(1e-2), comm, reduction=task.get("reduction", "ordered")
    )
    compile_model(keras, model, opt)
    data = ck.ResumableDataset(x, y, batch_size=PER_WORKER_BATCH, seed=1, rank=rank, size=size)
    backup = ck.BackupAndRestore(
        root / "l3",
        save_freq=task["save_freq"],
        delete_checkpoint=False,
        local_dir=str(root / "l1" / "{node}"),
        comm=comm,
        node=node_of(rank, size),
        dataset=data,
        redundancy=task.get("redundancy"),
        write=ckptfmt.WriteOptions(fsync=False),
    )

    class Observe(keras.callbacks.Callback):
        """After ``backup`` in the list: sees what it restored and what it saved."""

        def on_train_begin(self, logs: Any = None) -> None:
            if backup.restored_counters is not None:
                dump(out / f"restored.rank{rank}", self.model)

        last = -1

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            step = backup.global_step  # the global step (batches trained), as the callback counts
            if step == self.last:  # a batch passed over while resuming
                return
            self.last = step
            if task.get("dump_saves") and step % task["save_freq"] == 0:
                dump(out / f"save-{step}.rank{rank}", self.model)
            kill = task.get("kill")
            if kill and step == kill[1]:
                assert backup.manager is not None
                backup.manager.wait()  # the save in flight is committed on every level
                comm.barrier()
                if rank == kill[0]:
                    (out / f"killed.rank{rank}").write_text(str(step))
                    os.kill(os.getpid(), signal.SIGKILL)

    history = model.fit(
        data.tf_dataset(), epochs=task["epochs"], verbose=0, callbacks=[backup, Observe()]
    )
    dump(out / f"final.rank{rank}", model)
    report = backup.last_restore
    result = {
        "rank": rank,
        "size": size,
        "restored": backup.restored_counters,
        "report": None
        if report is None
        else {
            "step": report.step,
            "level": report.level,
            "tried": report.tried,
            "rebuilt": list(report.rebuilt),
        },
        "history": {k: [repr(float(v)) for v in vs] for k, vs in history.history.items()},
        "epochs": list(history.epoch),
        "replica_fixes": backup.replica_fixes,
    }
    if task.get("dp_check"):
        result["dp_check"] = dp_check(keras, ck, comm, x, y, out)
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def dp_check(keras: Any, ck: Any, comm: Any, x: np.ndarray, y: np.ndarray, out: Path) -> int:
    """One epoch of the plain model (no batch norm, no dropout) data-parallel, without
    checkpoints; its final weights are compared by the test with a single process training on
    the global batches."""
    import ckptfmt

    model = build_model(keras, plain=True)
    opt = ck.distributed_optimizer(keras.optimizers.SGD(0.05), comm)
    compile_model(keras, model, opt)
    data = ck.ResumableDataset(
        x, y, batch_size=PER_WORKER_BATCH, seed=2, rank=comm.rank, size=comm.size
    )
    data.set_epoch(0)
    model.fit(data.tf_dataset(), epochs=1, verbose=0)
    ckptfmt.save(
        {"model": ck.nest(ck.to_arrays(model))},
        out / f"dp.rank{comm.rank}",
        write=ckptfmt.WriteOptions(fsync=False, overwrite=True),
    )
    return len(data)


if __name__ == "__main__":
    main()
