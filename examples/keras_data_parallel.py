"""Data-parallel Keras training on MPI workers with multi-level checkpoints, resumable after a
crash at the exact epoch and step.

    .venv/bin/mpiexec -n 2 .venv/bin/python -m mpi4py examples/keras_data_parallel.py DIR [--crash]

Every worker holds the whole model and trains on its own share of the data; the gradients are
averaged over the workers before each update (``distributed_optimizer``), so the replicas stay
identical. ``BackupAndRestore`` saves every 4 batches to node-local storage (``DIR/local/{node}``,
level 1) and flushes to ``DIR/shared`` (level 3) in the background; each worker writes its share.
Run once with ``--crash`` (a worker dies in the second epoch), then again without: ``fit``
resumes from the last checkpoint, in the middle of the epoch, and ends with the weights an
uninterrupted run (the command without ``--crash`` in an empty DIR) ends with: the printed
CRC32C of all weights is the same. The two simulated nodes are ``n0`` and ``n1`` (half the ranks
each).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import ckptfmt_keras as ck
import crc32c
import keras
import numpy as np

import ckptfmt
from ckptfmt.transport.mpi import MpiComm


def main(workdir: Path, crash: bool) -> None:
    comm = MpiComm()
    keras.utils.set_random_seed(0)  # the same initial weights and dropout stream in every run
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 20)).astype(np.float32)
    y = (x[:, :3].sum(axis=1, keepdims=True) > 0).astype(np.float32)

    model = keras.Sequential(
        [
            keras.Input((20,)),
            keras.layers.Dense(64, activation="relu", name="hidden"),
            keras.layers.Dropout(0.1, name="dropout"),
            keras.layers.Dense(1, activation="sigmoid", name="head"),
        ],
        name="classifier",
    )
    optimizer = ck.distributed_optimizer(keras.optimizers.Adam(1e-3), comm)
    model.compile(optimizer, "binary_crossentropy", metrics=["accuracy"], jit_compile=False)

    data = ck.ResumableDataset(x, y, batch_size=16, seed=1, rank=comm.rank, size=comm.size)
    backup = ck.BackupAndRestore(
        workdir / "shared",
        save_freq=4,
        delete_checkpoint=False,
        local_dir=str(workdir / "local" / "{node}"),
        comm=comm,
        node=f"n{comm.rank * 2 // comm.size}",
        dataset=data,
    )
    callbacks: list[keras.callbacks.Callback] = [backup]
    if crash:
        callbacks.append(CrashAt(comm, backup, global_step=len(data) + 6))
    model.fit(data.tf_dataset(), epochs=3, verbose=0, callbacks=callbacks, shuffle=False)

    if comm.rank == 0:
        if backup.restored_counters:
            print("resumed from", backup.restored_counters, "level", backup.last_restore.level)
        newest = ckptfmt.latest(workdir / "shared")
        print("newest checkpoint on level 3:", newest)
        weights = b"".join(np.asarray(v.numpy()).tobytes() for v in model.variables)
        print(f"CRC32C of all weights: {crc32c.crc32c(weights):08x}")


class CrashAt(keras.callbacks.Callback):
    """Kill one worker (SIGKILL) once the checkpoint before ``global_step`` is committed."""

    def __init__(self, comm: MpiComm, backup: ck.BackupAndRestore, global_step: int) -> None:
        super().__init__()
        self.comm, self.backup, self.global_step = comm, backup, global_step

    def on_train_batch_end(self, batch: int, logs: object = None) -> None:
        if self.backup.global_step == self.global_step:
            assert self.backup.manager is not None
            self.backup.manager.wait()
            self.comm.barrier()
            if self.comm.rank == self.comm.size - 1:
                print(f"rank {self.comm.rank}: killed at global step {self.global_step}")
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(Path(sys.argv[1]), "--crash" in sys.argv[2:])
