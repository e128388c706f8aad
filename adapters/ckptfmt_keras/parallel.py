"""Data-parallel Keras training over the ranks of a ckptfmt ``Comm`` (MPI: ``MpiComm``).

Each worker process holds a whole replica of the model and trains on its own share of the data;
before every update the gradients are averaged over the workers, so every replica applies the
same update and stays bit-identical (as Horovod does, with mpi4py instead of its own ops):

    comm = MpiComm()
    model.compile(optimizer=distributed_optimizer(keras.optimizers.Adam(1e-3), comm),
                  loss=..., jit_compile=False)

Averaging is deterministic and the same on every rank: ``"ordered"`` (the default) gathers every
rank's gradients and sums them in rank order, on any ``Comm``; ``"allreduce"`` uses MPI's
``Allreduce`` (less traffic, needs ``MpiComm``; MPICH gives identical bits on every rank for a
fixed world size, but the order of the sum is MPI's). Low-precision gradients (bfloat16, float16)
are summed in float32 and rounded once. The exchange leaves the train step for numpy, so the
model must not be XLA-compiled (``jit_compile=False``): under TensorFlow it runs as a
``tf.numpy_function`` inside the compiled train step; under JAX and PyTorch, whose train steps
then run eagerly, on the gradients' values directly. The same on every backend, on CPU.

Why this and not ``tf.distribute.MultiWorkerMirroredStrategy``: that strategy needs a
``TF_CONFIG`` with a gRPC server per worker (ports, a cluster spec) and its own collective
runtime, which a job started by ``mpiexec`` does not have; a worker that dies leaves the others
blocked in gRPC, where under ``python -m mpi4py`` the whole job ends; and the order of its sums
is its collective runtime's, not one this package can state. Averaging through the same ``Comm``
the checkpoints use keeps one launcher, one set of ranks, and a summation order that is defined,
so a resumed run repeats the uninterrupted one bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import crc32c
import keras
import numpy as np

from ckptfmt.errors import UsageError
from ckptfmt.transport import Comm
from ckptfmt_keras import backend
from ckptfmt_keras.convert import named_variables

REDUCTIONS = ("ordered", "allreduce")


# --- numpy level ----------------------------------------------------------------------------------


def _accumulator(dtype: np.dtype) -> np.dtype:
    if dtype == np.float64:
        return np.dtype(np.float64)
    if dtype.kind == "f" or dtype.name in ("bfloat16", "float16"):
        return np.dtype(np.float32)
    raise UsageError(f"cannot average gradients of dtype {dtype}")


def average_arrays(
    arrays: Sequence[np.ndarray], comm: Comm, reduction: str = "ordered"
) -> list[np.ndarray]:
    """Collective (every rank, the same shapes and dtypes in the same order): the mean of each
    array over the ranks, the same bits on every rank. With one rank the arrays come back as
    they are."""
    if reduction not in REDUCTIONS:
        raise UsageError(f"reduction is one of {REDUCTIONS}, not {reduction!r}")
    arrays = [np.asarray(a) for a in arrays]
    if comm.size == 1:
        return list(arrays)
    out: list[Any] = [None] * len(arrays)
    groups: dict[np.dtype, list[int]] = {}
    for i, a in enumerate(arrays):
        groups.setdefault(_accumulator(a.dtype), []).append(i)
    for acc, members in sorted(groups.items(), key=lambda kv: kv[0].name):
        flat = np.concatenate([arrays[i].astype(acc).ravel() for i in members])
        if reduction == "ordered":
            parts = comm.allgather_bytes(flat.tobytes())
            total = np.frombuffer(parts[0], dtype=acc).copy()
            for p in parts[1:]:  # rank order: the same additions, in the same order, everywhere
                total += np.frombuffer(p, dtype=acc)
        else:
            from mpi4py import MPI

            mpi = getattr(comm, "comm", None)
            if mpi is None:
                raise UsageError("reduction='allreduce' needs an MpiComm")
            total = flat
            mpi.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
        total /= acc.type(comm.size)
        start = 0
        for i in members:
            a = arrays[i]
            out[i] = total[start : start + a.size].reshape(a.shape).astype(a.dtype)
            start += a.size
    return out


# --- in the train step ----------------------------------------------------------------------------


def average_gradients(grads: Sequence[Any], comm: Comm, reduction: str = "ordered") -> list[Any]:
    """The gradients averaged over the ranks (``None`` entries kept; sparse ones made dense),
    as tensors of the running backend. One exchange per call: under TensorFlow through
    ``tf.numpy_function`` (so it runs inside a ``tf.function``), under JAX and PyTorch on the
    values (an eager train step: ``jit_compile=False``)."""
    present = [i for i, g in enumerate(grads) if g is not None]
    if comm.size == 1 or not present:
        return list(grads)
    if backend.name() != "tensorflow":
        if backend.name() == "jax":
            import jax

            if any(isinstance(grads[i], jax.core.Tracer) for i in present):
                raise UsageError(
                    "the gradient exchange cannot run in a jit-compiled JAX train step: "
                    "compile the model with jit_compile=False"
                )
        values = [keras.ops.convert_to_numpy(grads[i]) for i in present]
        out = list(grads)
        for i, a in zip(present, average_arrays(values, comm, reduction)):
            out[i] = keras.ops.convert_to_tensor(a, dtype=keras.backend.standardize_dtype(a.dtype))
        return out
    import tensorflow as tf

    dense = [tf.convert_to_tensor(grads[i]) for i in present]

    def exchange(*xs: np.ndarray) -> list[np.ndarray]:
        return average_arrays(xs, comm, reduction)

    averaged = tf.numpy_function(
        exchange,
        dense,
        Tout=[g.dtype for g in dense],
        stateful=True,
        name="ckptfmt_average_gradients",
    )
    if not isinstance(averaged, (list, tuple)):
        averaged = [averaged]
    out = list(grads)
    for i, g, a in zip(present, dense, averaged):
        a.set_shape(g.shape)
        out[i] = a
    return out


class _Averaging:
    """Mixed in before the optimizer's own class: ``apply`` (TensorFlow's and PyTorch's train
    step) and ``stateless_apply`` (JAX's) average first, once, so every rank applies the same
    update (and a ``LossScaleOptimizer`` sees the same gradients everywhere when it decides
    whether to skip a step)."""

    _ckptfmt_comm: Comm
    _ckptfmt_reduction: str
    _ckptfmt_base: type
    _ckptfmt_averaged = False  # inside stateless_apply, whose base calls apply

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        if not self._ckptfmt_averaged:
            grads = average_gradients(list(grads), self._ckptfmt_comm, self._ckptfmt_reduction)
        return super().apply(grads, trainable_variables)  # type: ignore[misc]

    def stateless_apply(
        self, optimizer_variables: Any, grads: Any, trainable_variables: Any
    ) -> Any:
        grads = average_gradients(list(grads), self._ckptfmt_comm, self._ckptfmt_reduction)
        object.__setattr__(self, "_ckptfmt_averaged", True)
        try:
            return super().stateless_apply(  # type: ignore[misc]
                optimizer_variables, grads, trainable_variables
            )
        finally:
            object.__setattr__(self, "_ckptfmt_averaged", False)


def _mix(optimizer: Any, comm: Comm, reduction: str) -> None:
    """Swap ``optimizer``'s class for a subclass averaging over ``comm`` (already duplicated)."""
    cls = type(optimizer)
    sub = type(cls.__name__, (_Averaging, cls), {"__module__": cls.__module__})
    object.__setattr__(optimizer, "__class__", sub)
    object.__setattr__(optimizer, "_ckptfmt_comm", comm)
    object.__setattr__(optimizer, "_ckptfmt_reduction", reduction)
    object.__setattr__(optimizer, "_ckptfmt_base", cls)


def distributed_optimizer(
    optimizer: keras.optimizers.Optimizer, comm: Comm, *, reduction: str = "ordered"
) -> keras.optimizers.Optimizer:
    """Collective (it duplicates ``comm`` for the gradient exchange): make ``optimizer`` average
    the gradients over the ranks of ``comm`` before every update. The same object is returned,
    its class swapped for a subclass of its own class (its config, name, variable paths and
    serialization stay those of the original class).

    A ``mixed_float16`` model's ``compile`` wraps the optimizer in a ``LossScaleOptimizer``,
    which decides to skip a step (gradients overflowed) before the optimizer inside averages:
    a rank that overflowed would skip the exchange the others wait in. ``BackupAndRestore``
    moves the averaging out to the ``LossScaleOptimizer`` when ``fit`` starts
    (:func:`average_outside_loss_scaling`); without it, pass
    ``distributed_optimizer(keras.optimizers.LossScaleOptimizer(opt), comm)``."""
    if reduction not in REDUCTIONS:
        raise UsageError(f"reduction is one of {REDUCTIONS}, not {reduction!r}")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise UsageError(f"not a Keras optimizer: {type(optimizer).__name__}")
    if isinstance(optimizer, _Averaging):
        raise UsageError("this optimizer already averages gradients")
    _mix(optimizer, comm.dup() if comm.size > 1 else comm, reduction)
    return optimizer


def average_outside_loss_scaling(optimizer: Any) -> Any:
    """Local. A ``LossScaleOptimizer`` that ``compile`` put around an optimizer of
    :func:`distributed_optimizer` (a ``mixed_float16`` model): its check for overflowed
    gradients ran on each rank's own, before the optimizer inside averaged them, so a rank whose
    gradients overflowed skipped the step and the exchange while the others waited in it. The
    averaging moves out to the ``LossScaleOptimizer`` (the same ranks, the same reduction): every
    rank then checks the same averaged gradients and skips, or steps, alike. Anything else is
    left as it is. Returns ``optimizer``."""
    inner = getattr(optimizer, "inner_optimizer", None)
    if not isinstance(inner, _Averaging) or isinstance(optimizer, _Averaging):
        return optimizer
    comm, reduction = inner._ckptfmt_comm, inner._ckptfmt_reduction
    object.__setattr__(inner, "__class__", inner._ckptfmt_base)
    _mix(optimizer, comm, reduction)
    return optimizer


def is_distributed(optimizer: Any) -> bool:
    return isinstance(optimizer, _Averaging)


# --- keeping the replicas identical -------------------------------------------------------------


def _bytes_of(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def broadcast_variables(variables: Any, comm: Comm, root: int = 0) -> None:
    """Collective: set every rank's variables (any object :func:`named_variables` takes, the
    same names everywhere) to ``root``'s values, in one broadcast, bit for bit (bfloat16 NaN
    payloads too, which a variable's own ``numpy`` and ``assign`` change under PyTorch)."""
    named = named_variables(variables)
    if comm.size == 1 or not named:
        return
    arrays = [backend.to_numpy(v) for v in named.values()]
    sizes = [a.nbytes for a in arrays]
    buf = np.empty(sum(sizes), dtype=np.uint8)
    if comm.rank == root:
        start = 0
        for a, n in zip(arrays, sizes):
            buf[start : start + n] = _bytes_of(a)
            start += n
    comm.bcast_buffer(buf, root)
    if comm.rank != root:
        start = 0
        for v, a, n in zip(named.values(), arrays, sizes):
            backend.assign(v, buf[start : start + n].view(a.dtype).reshape(a.shape))
            start += n


def agree(arrays: dict[str, np.ndarray], comm: Comm, root: int = 0) -> list[str]:
    """Collective: make replicated ``arrays`` (name -> array, the same names in the same order on
    every rank) identical on every rank, taking ``root``'s where they differ (compared by the
    CRC32C of their bytes); return the names that differed, whose entries are replaced."""
    if comm.size == 1:
        return []
    crcs = [f"{crc32c.crc32c(_bytes_of(a).data):08x}" for a in arrays.values()]
    seen = comm.allgather_json(crcs)
    differ = [name for i, name in enumerate(arrays) if any(s[i] != seen[root][i] for s in seen)]
    for name in differ:
        a = arrays[name]
        buf = _bytes_of(a).copy()
        comm.bcast_buffer(buf, root)
        arrays[name] = buf.view(a.dtype).reshape(a.shape)
    return differ
