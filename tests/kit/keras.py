"""The small Keras model setup the Keras adapter's tests share: a compiled model and its data."""

from __future__ import annotations

from typing import Any

import numpy as np


def compiled(model: Any, optimizer: Any = None, **kwargs: Any) -> Any:
    """``model`` compiled the way every Keras test trains it: Adam(1e-2) unless ``optimizer``,
    mean squared error, an MAE metric, no XLA (bit-exact comparisons across runs). Keras is
    imported here, after the test module chose its environment."""
    import keras

    model.compile(
        optimizer=optimizer or keras.optimizers.Adam(1e-2),
        loss="mse",
        metrics=["mae"],
        jit_compile=False,
        **kwargs,
    )
    return model


def xy(n: int = 64, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` random inputs of width 8 and their linear targets of width 6."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 8)).astype(np.float32)
    return x, (x[:, :6] * 0.3).astype(np.float32)


def raise_after_batch(after: int) -> Any:
    """A Keras callback raising ``RuntimeError("crash")`` at the end of batch ``after`` of the
    fit (listed after a ``BackupAndRestore``: that batch's save is made first)."""
    import keras

    class Crash(keras.callbacks.Callback):  # type: ignore[misc]  # Keras is untyped
        def __init__(self) -> None:
            super().__init__()
            self.seen = 0

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.seen += 1
            if self.seen == after:
                raise RuntimeError("crash")

    return Crash()
