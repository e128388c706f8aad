"""A worker of a data-parallel Keras job saved by 4 workers and restored by 2:
``_keras_reshard_worker.py PLAN.json`` under ``mpiexec ... python -m mpi4py``
(``tests/adapters/keras/test_keras_reshard.py`` launches it).

``PLAN.json``: ``{"out": DIR, "root": DIR, "task": "save" | "restore", "epochs": E}``. Both tasks
use the model, data and compile settings of ``_keras_worker.py``, an Adam optimizer made
data-parallel with ``distributed_optimizer`` and ``BackupAndRestore`` (level 3 at ``<root>/l3``,
level 1 at ``<root>/l1/{node}``; rank ``r`` of ``n`` on node ``n{r * 2 // n}``, so two simulated
nodes at either size). Rank ``r`` writes ``<out>/<task>.rank<r>.json``.

- ``save`` (4 workers): ``fit`` for E epochs, a checkpoint at every epoch's end
  (``save_freq="epoch"``). After each save an observer dumps the model and optimizer state the
  worker holds (``<out>/saved.rank<r>``, a ckptfmt checkpoint of ``{"model", "optimizer"}``, the
  last epoch's overwriting the earlier) and the SHA-256 of each of its metric accumulators.
- ``restore`` (2 workers, fresh processes): for level 3 alone (a callback without
  ``local_dir``) and then level 1 first (with ``local_dir``, the 2 workers on the same 2 nodes),
  each time after setting every model and optimizer variable to random values (their SHA-256
  recorded), ``fit(epochs=E)``, which restores at ``on_train_begin`` and, the checkpoint
  being at the end of epoch E, trains nothing. First without ``rank_map``/``per_rank``: must
  raise ``PerRankError`` (the metric accumulators are per worker), recorded with whether the
  model and optimizer were left untouched; then with ``rank_map={0: 0, 1: 1}`` and
  ``per_rank="drop"``, recording the warnings, the restored counters, the restore report, the
  SHA-256 of the per-rank rows this worker received, and dumping the model and optimizer state
  right after the restore (``<out>/restored-<level>.rank<r>``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
from _keras_worker import PER_WORKER_BATCH, build_model, compile_model, dataset
from kit.arrays import flat
from kit.worker import node_of

RANK_MAP = {0: 0, 1: 1}


def digest(a: Any) -> str:
    a = np.ascontiguousarray(np.asarray(a))
    return hashlib.sha256(f"{a.dtype}{a.shape}".encode() + a.tobytes()).hexdigest()


def main() -> None:
    import keras
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import ckptfmt_keras as ck
    from kit.worker import make_comm

    import ckptfmt

    plan = json.loads(Path(sys.argv[1]).read_text())
    comm = make_comm("mpi")
    out, root = Path(plan["out"]), Path(plan["root"])
    out.mkdir(parents=True, exist_ok=True)
    rank, size = comm.rank, comm.size
    x, y = dataset()

    def held(model: Any) -> dict[str, Any]:
        return {
            "model": ck.nest(ck.to_arrays(model)),
            "optimizer": ck.nest(ck.to_arrays(model.optimizer)),
        }

    def make() -> Any:
        model = build_model(keras)  # seeded: the same initial weights in every process
        compile_model(keras, model, ck.distributed_optimizer(keras.optimizers.Adam(1e-2), comm))
        return model

    data = ck.ResumableDataset(x, y, batch_size=PER_WORKER_BATCH, seed=1, rank=rank, size=size)
    node = node_of(rank, size)
    result: dict[str, Any] = {"rank": rank, "size": size, "node": node}

    if plan["task"] == "save":
        model = make()
        backup = ck.BackupAndRestore(
            root / "l3",
            save_freq="epoch",
            delete_checkpoint=False,
            local_dir=str(root / "l1" / "{node}"),
            comm=comm,
            node=node,
            dataset=data,
            write=ckptfmt.WriteOptions(fsync=False),
        )

        class Observe(keras.callbacks.Callback):
            """After ``backup``: the state it has just saved (replicas agreed by then)."""

            def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
                ckptfmt.save(
                    held(self.model),
                    out / f"saved.rank{rank}",
                    write=ckptfmt.WriteOptions(fsync=False, overwrite=True),
                )
                result["metrics"] = {
                    n: digest(v.numpy())
                    for n, v in ck.named_variables(self.model.metrics_variables).items()
                }
                result["counters_at_save"] = {
                    "epoch": epoch + 1,
                    "global_step": backup.global_step,
                    "optimizer_iterations": int(self.model.optimizer.iterations.numpy()),
                }

        model.fit(
            data.tf_dataset(), epochs=plan["epochs"], verbose=0, callbacks=[backup, Observe()]
        )
        result["steps_per_epoch"] = len(data)
        result["replica_fixes"] = backup.replica_fixes
    else:
        model = make()
        for level in ("l3", "l1"):
            result[level] = restore_task(keras, ckptfmt, ck, comm, model, data, plan, level)
    (out / f"{plan['task']}.rank{rank}.json").write_text(json.dumps(result))
    comm.barrier()


def scramble(ck: Any, obj: Any, seed: int) -> None:
    """Assign random values to every variable of ``obj``."""
    rng = np.random.default_rng(seed)
    for v in ck.named_variables(obj).values():
        a = np.asarray(v.numpy())
        if a.dtype.kind in "iu":
            v.assign(rng.integers(1000, 2000, a.shape).astype(a.dtype))
        else:
            v.assign(rng.standard_normal(a.shape).astype(a.dtype))


def restore_task(
    keras: Any, ckptfmt: Any, ck: Any, comm: Any, model: Any, data: Any, plan: Any, level: str
) -> dict[str, Any]:
    """Restore from ``level`` ("l3": a callback without level 1; "l1": with it, tried first),
    first without saying what becomes of the per-rank entries, then mapping and dropping them."""
    from ckptfmt.errors import PerRankError

    out, root, rank = Path(plan["out"]), Path(plan["root"]), comm.rank
    local = {"local_dir": str(root / "l1" / "{node}")} if level == "l1" else {}

    def backup_for(**resharding: Any) -> Any:
        return ck.BackupAndRestore(
            root / "l3",
            save_freq="epoch",
            delete_checkpoint=False,
            comm=comm,
            node=node_of(rank, comm.size),
            dataset=data,
            write=ckptfmt.WriteOptions(fsync=False),
            **local,
            **resharding,
        )

    def fit(callbacks: list[Any]) -> Any:
        return model.fit(data.tf_dataset(), epochs=plan["epochs"], verbose=0, callbacks=callbacks)

    def held() -> dict[str, Any]:
        return {
            "model": ck.nest(ck.to_arrays(model)),
            "optimizer": ck.nest(ck.to_arrays(model.optimizer)),
        }

    # other values in every variable there is (the optimizer's slots exist once it is built,
    # after the first restore), so that what the restore did shows
    scramble(ck, model, 1000 + (level == "l1"))
    if model.optimizer.built:
        scramble(ck, model.optimizer, 2000 + (level == "l1"))
    res: dict[str, Any] = {"refused": None}
    before = {k: digest(v) for k, v in flat(held()).items()}
    try:
        fit([backup_for()])
    except PerRankError as exc:
        res["refused"] = {
            "error": str(exc),
            "entries": list(exc.entries),
            "dropped": list(exc.dropped),
            "missing": list(exc.missing),
        }
    res["initial"] = before
    res["untouched"] = before == {k: digest(v) for k, v in flat(held()).items()}

    backup = backup_for(read=ckptfmt.ReadOptions(rank_map=RANK_MAP, per_rank="drop"))

    class Observe(keras.callbacks.Callback):
        """After ``backup``: the state right after the restore, before any step."""

        def on_train_begin(self, logs: Any = None) -> None:
            path = out / f"restored-{level}.rank{rank}"
            ckptfmt.save(held(), path, write=ckptfmt.WriteOptions(fsync=False, overwrite=True))
            assert backup.last_restore is not None
            state = backup.last_restore.state or {}
            res["per_rank_rows"] = {k: digest(v) for k, v in flat(state.get("metrics", {})).items()}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = fit([backup, Observe()])
    report = backup.last_restore
    assert report is not None
    res.update(
        {
            "warnings": [
                [type(w.message).__name__, str(w.message)]
                for w in caught
                if issubclass(w.category, UserWarning)
            ],
            "restored": backup.restored_counters,
            "report": {"step": report.step, "level": report.level, "tried": report.tried},
            "trained_epochs": len(history.history.get("loss", [])),
        }
    )
    return res


if __name__ == "__main__":
    main()
