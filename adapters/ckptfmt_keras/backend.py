"""What differs between Keras 3's backends (TensorFlow, JAX, PyTorch), in one place.

The rest of the adapter speaks Keras only. Nothing here imports a backend other than the one
Keras runs on: TensorFlow objects (``tf.Variable``, ``tf.Module``) can only exist once
``tensorflow`` is imported, so they are recognised through ``sys.modules`` and never by
importing it; the torch global random state is read only under the torch backend.

- values: a variable's value as a numpy array, a copy bit for bit (bfloat16 and float8 through
  ``ml_dtypes``, NaN payloads kept), whichever backend holds it;
- random state outside Keras: Keras's own random state is in its ``SeedGenerator`` variables,
  which are model variables on every backend; but under PyTorch an unseeded ``Dropout`` (and
  any torch layer) draws from torch's global generator, which a resumed run must get back.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import keras
import ml_dtypes
import numpy as np

from ckptfmt.dtypes import by_name
from ckptfmt.errors import UnsupportedDtypeError


def name() -> str:
    """The backend Keras runs on: ``"tensorflow"``, ``"jax"`` or ``"torch"``."""
    return str(keras.backend.backend())


def loaded_tensorflow() -> ModuleType | None:
    """TensorFlow if this process imported it (else no TensorFlow object can exist)."""
    return sys.modules.get("tensorflow")


def is_variable(x: Any) -> bool:
    """A Keras variable, or a ``tf.Variable`` where TensorFlow is loaded."""
    if isinstance(x, keras.Variable):
        return True
    tf = loaded_tensorflow()
    return tf is not None and isinstance(x, tf.Variable)


def is_tf_module(x: Any) -> bool:
    """A ``tf.Module`` that is not a Keras layer (which has its own naming)."""
    tf = loaded_tensorflow()
    return tf is not None and isinstance(x, tf.Module)


def numpy_dtype(v: Any) -> np.dtype[Any]:
    """The numpy dtype of a Keras or TensorFlow variable (``ml_dtypes.bfloat16`` for bfloat16)."""
    dtype_name = v.dtype if isinstance(v.dtype, str) else str(v.dtype.name)
    try:
        return by_name(dtype_name).numpy
    except UnsupportedDtypeError:  # not a format dtype: numpy's or ml_dtypes' own name
        return np.dtype(getattr(ml_dtypes, dtype_name, dtype_name))


def to_numpy(v: Any) -> np.ndarray:
    """A copy of the value of a Keras or TensorFlow variable as a numpy array, bit for bit
    (taken now: training may go on changing, or under JAX donating, the variable's buffer)."""
    if not isinstance(v, keras.Variable):  # a tf.Variable
        return np.asarray(v.numpy())
    if name() == "torch":
        return _torch_to_numpy(v.value, numpy_dtype(v))
    if name() == "jax":
        return np.array(v.value, copy=True)
    return np.asarray(v.numpy())


def snapshot(v: Any) -> tuple[np.ndarray, Any] | None:
    """The value of a variable as it is now, without a copy, where the backend keeps it so
    whatever the variable becomes: ``(array, holder)``, the array valid while ``holder`` is
    held; None where it cannot (JAX donates the variables' buffers to the train step, PyTorch
    updates them in place: copy with :func:`to_numpy` instead).

    TensorFlow's resource variables copy on write: a value read from a variable shares its
    buffer, and an update of a variable whose buffer is still shared (its refcount above one)
    writes a new buffer instead of changing the shared one. So the read value is the state of
    now until it is let go; holding it makes the first update of each variable after this a
    copy (inside the train step), which is why the holder is let go once the value is copied.
    On a GPU the array is a copy to the host already."""
    tf = loaded_tensorflow()
    if tf is None:
        return None
    if isinstance(v, keras.Variable):
        if name() != "tensorflow":
            return None
        v = v.value
    if not isinstance(v, tf.Variable):
        return None
    held = v.read_value()
    return np.asarray(held), held


def _torch_to_numpy(t: Any, dtype: np.dtype[Any]) -> np.ndarray:
    t = t.detach().cpu()
    if dtype.kind == "V":  # ml_dtypes (bfloat16, float8): torch's numpy() has no such type
        import torch

        as_int = {1: torch.uint8, 2: torch.int16}[dtype.itemsize]
        return np.array(t.view(as_int).numpy(), copy=True).view(dtype)
    return np.array(t.numpy(), copy=True)


def assign(v: Any, value: np.ndarray) -> None:
    """Set a variable to ``value`` (its dtype and shape already the variable's), bit for bit."""
    if isinstance(v, keras.Variable) and value.dtype.kind == "V" and name() == "torch":
        import torch  # ml_dtypes arrays do not convert to torch tensors: move the bits

        as_int = {1: np.uint8, 2: np.int16}[value.dtype.itemsize]
        bits = torch.from_numpy(np.ascontiguousarray(value).view(as_int).copy())
        v.assign(bits.view(v.value.dtype))
        return
    v.assign(value)


# --- random state outside Keras's variables ----------------------------------------------------


def rng_state() -> np.ndarray | None:
    """The global random state the backend's unseeded layers draw from and that Keras's
    variables do not hold: torch's CPU generator under the torch backend; ``None`` otherwise
    (TensorFlow and JAX layers draw from their ``SeedGenerator`` variables)."""
    if name() != "torch":
        return None
    import torch

    return np.array(torch.get_rng_state().numpy(), copy=True)


def set_rng_state(state: np.ndarray) -> None:
    """Put back what :func:`rng_state` returned (under the torch backend)."""
    if name() != "torch":
        return
    import torch

    torch.set_rng_state(torch.from_numpy(np.array(state, dtype=np.uint8, copy=True)))
