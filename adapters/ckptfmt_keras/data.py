"""``ResumableDataset``: in-memory arrays as batches whose order is a function of the epoch only.

``fit()`` cannot start an epoch in its middle, and its own shuffling (``shuffle=True`` on arrays,
``tf.data`` reshuffling) draws from random state that a restarted process does not have. What
``BackupAndRestore`` needs from the data is only this: epoch ``e`` gives the same batches in the
same order every time it is iterated, in any process. The callback then positions it by epoch
(``set_epoch``, which it calls at every epoch's start) and skips the batches already trained.

    data = ResumableDataset(x, y, batch_size=32, seed=0, rank=comm.rank, size=comm.size)
    model.fit(data.py_dataset(), epochs=10,      # or data.tf_dataset() where TF is installed
              callbacks=[BackupAndRestore("/shared/ckpt", save_freq=100, dataset=data, comm=comm)])

Epoch ``e`` is a permutation of the samples drawn from ``(seed, e)``; with ``size`` workers each
gets its own contiguous block of it (the remainder, fewer than ``size`` samples, is left out),
cut into whole batches (a last partial batch is left out too), so every worker runs the same
number of steps and step ``s`` of all workers together is one global batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import keras
import numpy as np

from ckptfmt.errors import UsageError

if TYPE_CHECKING:
    import tensorflow as tf


class ResumableDataset:
    """Batches of ``(x, y)`` (either may be a tuple, list or dict of arrays with the same first
    extent; ``y`` may be ``None``) for this worker, in an order fixed by ``(seed, epoch)``."""

    def __init__(
        self,
        x: Any,
        y: Any = None,
        *,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        size: int = 1,
    ) -> None:
        if batch_size < 1 or size < 1 or not 0 <= rank < size:
            raise UsageError("need batch_size >= 1 and 0 <= rank < size")
        self.x, self.y = x, y
        lengths = {len(a) for a in keras.tree.flatten((x, y)) if a is not None}
        if len(lengths) != 1:
            raise UsageError(f"the arrays have different first extents: {sorted(lengths)}")
        self.samples = lengths.pop()
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.rank, self.size = rank, size
        self.per_worker = self.samples // size
        self.steps = self.per_worker // batch_size
        if self.steps == 0:
            raise UsageError(
                f"{self.samples} samples over {size} worker(s) make no batch of {batch_size}"
            )
        self.epoch = 0
        self._cached: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.steps

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration of :meth:`tf_dataset` yields (``BackupAndRestore``
        calls this at the start of every epoch)."""
        self.epoch = int(epoch)

    def indices(self, epoch: int) -> np.ndarray:
        """This worker's sample indices of ``epoch``, one row per step."""
        order = (
            np.random.default_rng([self.seed, epoch]).permutation(self.samples)
            if self.shuffle
            else np.arange(self.samples)
        )
        mine = order[self.rank * self.per_worker : (self.rank + 1) * self.per_worker]
        return mine[: self.steps * self.batch_size].reshape(self.steps, self.batch_size)

    def batch(self, epoch: int, step: int) -> Any:
        """The batch of ``step`` in ``epoch``: ``x`` alone, or ``(x, y)``."""
        idx = self._rows(epoch)[step]
        xs = keras.tree.map_structure(lambda a: np.asarray(a)[idx], self.x)
        if self.y is None:
            return xs
        return xs, keras.tree.map_structure(lambda a: np.asarray(a)[idx], self.y)

    def _rows(self, epoch: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, self.indices(epoch))
        return self._cached[1]

    def py_dataset(self) -> keras.utils.PyDataset:
        """A ``keras.utils.PyDataset`` of one epoch's batches (any backend, no TensorFlow
        needed), the epoch read from :meth:`set_epoch` as each batch is taken; its length is
        ``len(self)``. Read in ``fit``'s own thread (one worker, no queue ahead of it), so a
        batch is never taken before the epoch it belongs to is set."""
        return _EpochBatches(self)

    def tf_dataset(self) -> tf.data.Dataset:
        """A ``tf.data.Dataset`` of one epoch's batches, the epoch read from :meth:`set_epoch`
        when an iteration starts; its cardinality is known (``len(self)``), so ``fit()`` counts
        steps without running it dry. Needs TensorFlow (imported here, not before), on any
        backend."""
        import tensorflow as tf

        spec = tf.nest.map_structure(
            lambda a: tf.TensorSpec((self.batch_size, *a.shape[1:]), tf.as_dtype(a.dtype)),
            self.batch(0, 0),
        )

        def generate() -> Any:
            epoch = self.epoch  # read once, when the iteration starts
            for step in range(self.steps):
                yield self.batch(epoch, step)

        ds = tf.data.Dataset.from_generator(generate, output_signature=spec)
        return ds.apply(tf.data.experimental.assert_cardinality(self.steps))


class _EpochBatches(keras.utils.PyDataset):  # type: ignore[misc]  # Keras is untyped
    """:meth:`ResumableDataset.py_dataset`: batch ``i`` of the owner's current epoch."""

    def __init__(self, owner: ResumableDataset) -> None:
        super().__init__(workers=1, use_multiprocessing=False)
        self.owner = owner

    def __len__(self) -> int:
        return self.owner.steps

    def __getitem__(self, index: int) -> Any:
        return self.owner.batch(self.owner.epoch, index)
