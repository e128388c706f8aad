"""Keras 3 / TensorFlow adapter for ckptfmt: Keras and TensorFlow state <-> named numpy arrays.

    import ckptfmt_keras as ck

    ck.save(model, "ckpt/step-100", counters={"epoch": 3})   # model + optimizer, bit-exact
    counters = ck.load(model, "ckpt/step-100").values("counters")  # into a model built alike
    ck.to_arrays(model)                                      # {"mlp/dense/kernel": ndarray, ...}
    ck.assign(model, arrays, name_map=..., transform=...)    # by name, nothing cast

    model.compile(optimizer=ck.distributed_optimizer(keras.optimizers.Adam(), comm), ...)
    model.fit(..., callbacks=[ck.BackupAndRestore("/shared/ckpt", save_freq=100, comm=comm)])

    # a custom loop with the core's manager:
    mgr = ckptfmt.CheckpointManager(local_dir="/local/{node}", shared_dir="/shared", comm=comm)
    report = ck.restore(model, mgr)                          # report.step None: fresh start
    mgr.save(step, ck.to_state(model, counters={"step": step}))

The checkpoints are ordinary ckptfmt checkpoints: ``ckptfmt.open`` or plain zarr read them in a
process that never imports TensorFlow. Conversion only; saving, levels and restoring are the core's
(``ckptfmt.CheckpointManager``).
"""

from __future__ import annotations

from ckptfmt.errors import ReplicaWarning, StateMismatchError
from ckptfmt_keras.callback import BackupAndRestore
from ckptfmt_keras.checkpoint import (
    from_state,
    load,
    load_variables,
    restore,
    save,
    save_variables,
    to_state,
)
from ckptfmt_keras.convert import (
    assign,
    flat_names,
    named_variables,
    nest,
    to_arrays,
)
from ckptfmt_keras.data import ResumableDataset
from ckptfmt_keras.parallel import (
    average_arrays,
    average_gradients,
    broadcast_variables,
    distributed_optimizer,
)

__all__ = [
    "BackupAndRestore",
    "ReplicaWarning",
    "ResumableDataset",
    "StateMismatchError",
    "assign",
    "average_arrays",
    "average_gradients",
    "broadcast_variables",
    "distributed_optimizer",
    "flat_names",
    "from_state",
    "load",
    "load_variables",
    "named_variables",
    "nest",
    "restore",
    "save",
    "save_variables",
    "to_arrays",
    "to_state",
]
