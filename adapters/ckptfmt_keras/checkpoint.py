"""A Keras model's training state as one ckptfmt state, and its single-process save and load.

The layout (each ``/`` a level of the checkpoint, every tensor a plain zarr array)::

    model/<variable path>        every variable of the model (trainable, non-trainable, seed states)
    optimizer/<variable name>    every variable of the optimizer (iterations and slots)
    metrics/<variable path>      the metrics' accumulators (only when asked: the callback does)
    counters/epoch, counters/step, ...   JSON integers (epoch, step within it, global step,
                                 optimizer iterations)

Nothing of the model's structure or code is stored: the program builds the model, this fills it.
"""

from __future__ import annotations

import os
import typing
import warnings
from collections.abc import Mapping
from typing import Any

import keras

import ckptfmt
from ckptfmt.manifest import Manifest
from ckptfmt.tree import report_casts
from ckptfmt_keras.convert import (
    AssignPlan,
    NameMap,
    Transform,
    assign,
    auto_name_map,
    flat_names,
    named_variables,
    nest,
    plan_assign,
    slot_name_map,
    to_arrays,
)

AUTO = "auto"


def _optimizer(model: keras.Model, optimizer: Any) -> Any:
    return getattr(model, "optimizer", None) if optimizer == AUTO else optimizer


def training_state(
    model: keras.Model,
    *,
    optimizer: Any = AUTO,
    counters: Mapping[str, int] | None = None,
    metrics: bool = False,
) -> dict[str, Any]:
    """The state ckptfmt saves for ``model``: its variables, its optimizer's (``"auto"``: the
    compiled one, if any; ``None``: none), optionally its metrics' accumulators, and
    ``counters`` (JSON values). Arrays are copies, taken now."""
    state: dict[str, Any] = {"model": nest(to_arrays(model))}
    opt = _optimizer(model, optimizer)
    if opt is not None:
        state["optimizer"] = nest(to_arrays(opt))
    if metrics:
        state["metrics"] = nest(to_arrays(model.metrics_variables))
    if counters:
        state["counters"] = {k: int(v) for k, v in counters.items()}
    return state


def restore_training_state(
    model: keras.Model,
    state: Mapping[str, Any],
    *,
    optimizer: Any = AUTO,
    metrics: bool = False,
    strict: bool = True,
    cast: str | None = None,
) -> dict[str, int]:
    """Copy a state of :func:`training_state` into ``model`` (and its optimizer, built first if
    it is not yet, and its metrics when asked); return the counters. Bit-exact; all or nothing:
    the model's, the optimizer's and the metrics' names, shapes and dtypes are all checked
    before any variable is changed (with ``strict``, every variable must be in the state).
    ``cast``: the dtype policy of ``ckptfmt.tree.casting`` (refused by default).

    Names that differ only in Keras' numbering (a second model built the same way in this
    process) are paired by order (``convert.auto_name_map``), the optimizer's slots with their
    model variables. Optimizer state in ``state`` that has no optimizer to go to (the model is
    not compiled, or ``optimizer=None`` was not asked) is skipped with a warning."""
    plans: list[AssignPlan] = []
    model_arrays = state.get("model", {})
    model_names = named_variables(model)
    model_map = auto_name_map(model_names, flat_names(model_arrays)) or {n: n for n in model_names}
    plans.append(plan_assign(model, model_arrays, strict=strict, cast=cast))
    opt = _optimizer(model, optimizer)
    if "optimizer" in state and flat_names(state["optimizer"]):
        if opt is None and optimizer == AUTO:
            warnings.warn(
                "ckptfmt_keras: the checkpoint holds optimizer state but the model has no "
                "optimizer (compile it first): the optimizer state was skipped",
                UserWarning,
                stacklevel=2,
            )
        elif opt is not None:
            if not opt.built:  # slots exist only once built; build them to receive the values
                opt.build(model.trainable_variables)
            opt_names = named_variables(opt)
            saved = flat_names(state["optimizer"])
            slots = slot_name_map(opt_names, model_map)
            name_map = None if set(slots.values()) != set(saved) else slots
            plans.append(
                plan_assign(opt, state["optimizer"], strict=strict, name_map=name_map, cast=cast)
            )
    if metrics and "metrics" in state:
        plans.append(
            plan_assign(model.metrics_variables, state["metrics"], strict=False, cast=cast)
        )
    for plan in plans:  # every check passed: now write
        plan.apply()
    report_casts([c for plan in plans for c in plan.casts])
    return {k: int(v) for k, v in dict(state.get("counters", {})).items()}


def save(
    path: str | os.PathLike[str],
    model: keras.Model,
    *,
    optimizer: Any = AUTO,
    counters: Mapping[str, int] | None = None,
    step: int | None = None,
    overwrite: bool = False,
    fsync: bool = True,
) -> Manifest:
    """Save ``model`` (and its optimizer) as a ckptfmt checkpoint at ``path`` (one process;
    several ranks use ``BackupAndRestore`` or ``ckptfmt.CheckpointManager``)."""
    state = training_state(model, optimizer=optimizer, counters=counters)
    return ckptfmt.save(state, path, step=step, overwrite=overwrite, fsync=fsync)


def load(
    path: str | os.PathLike[str],
    model: keras.Model,
    *,
    optimizer: Any = AUTO,
    strict: bool = True,
    cast: str | None = None,
) -> dict[str, int]:
    """Load a checkpoint written by :func:`save` into ``model`` (and its optimizer); every byte
    is verified. Returns the saved counters (empty when there were none). All or nothing, and
    ``cast`` as :func:`restore_training_state`."""
    return restore_training_state(
        model, ckptfmt.load(path), optimizer=optimizer, strict=strict, cast=cast
    )


def save_variables(
    path: str | os.PathLike[str],
    obj: Any,
    *,
    step: int | None = None,
    overwrite: bool = False,
    fsync: bool = True,
) -> Manifest:
    """Save the variables of any object ``to_arrays`` takes (a ``tf.Module``, a Keras layer or
    optimizer, a mapping or list of variables), by name, as a ckptfmt checkpoint."""
    return ckptfmt.save(nest(to_arrays(obj)), path, step=step, overwrite=overwrite, fsync=fsync)


def load_variables(
    path: str | os.PathLike[str],
    obj: Any,
    *,
    strict: bool = True,
    name_map: NameMap | None = None,
    transform: Transform | None = None,
    cast: str | None = None,
) -> list[str]:
    """Assign the tensors of the checkpoint at ``path`` to the variables of ``obj`` by name
    (see ``assign``; only the tensors used are read, each verified); return the names set."""
    view = typing.cast(
        Mapping[str, Any], ckptfmt.open(path)
    )  # read lazily, by name, like a mapping
    return assign(
        obj,
        view,
        strict=strict,
        name_map=name_map,
        transform=transform,
        cast=cast,
    )
