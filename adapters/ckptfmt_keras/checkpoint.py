"""A Keras model's training state as one ckptfmt state: its single-process save and load, and
its restore through a ``ckptfmt.CheckpointManager``.

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
from ckptfmt.checkpoint import load_with_manifest
from ckptfmt.errors import UsageError
from ckptfmt.format import WriteOptions
from ckptfmt.maintenance import NodeDirs
from ckptfmt.manifest import Manifest
from ckptfmt.parallel import CheckpointManager, RestoreReport
from ckptfmt.plan import ReadOptions
from ckptfmt.storage import ProgressCallback
from ckptfmt.tree import Cast, check_policy, report_casts
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


def to_state(
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


def from_state(
    model: keras.Model,
    state: Mapping[str, Any],
    *,
    optimizer: Any = AUTO,
    metrics: bool = False,
    strict: bool = True,
    cast: Cast = "no",
) -> dict[str, int]:
    """Copy a state of :func:`to_state` into ``model`` (and its optimizer, built first if
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
    model: keras.Model,
    path: str | os.PathLike[str],
    *,
    optimizer: Any = AUTO,
    counters: Mapping[str, int] | None = None,
    step: int | None = None,
    write: WriteOptions | None = None,
    progress: ProgressCallback | None = None,
) -> Manifest:
    """Save ``model`` (and its optimizer) as a ckptfmt checkpoint at ``path`` (one process;
    several ranks use ``BackupAndRestore`` or ``ckptfmt.CheckpointManager``); return its
    manifest. ``write``, ``progress``: as for ``ckptfmt.save``."""
    state = to_state(model, optimizer=optimizer, counters=counters)
    return ckptfmt.save(state, path, step=step, write=write, progress=progress)


def load(
    model: keras.Model,
    path: NodeDirs,
    *,
    optimizer: Any = AUTO,
    strict: bool = True,
    cast: Cast = "no",
    progress: ProgressCallback | None = None,
) -> Manifest:
    """Load a checkpoint written by :func:`save` into ``model`` (and its optimizer); every byte
    is verified. Returns its manifest: the saved counters are
    ``load(model, path).values("counters")``. All or nothing, and ``cast`` as
    :func:`from_state`. ``path`` and ``progress``: as for ``ckptfmt.load`` (a ``{node}``
    template of level-1 copies too)."""
    check_policy(cast)  # a usage error before anything is read
    state, manifest = load_with_manifest(path, progress=progress)
    from_state(model, state, optimizer=optimizer, strict=strict, cast=cast)
    return manifest


def restore(
    model: keras.Model,
    manager: CheckpointManager,
    *,
    optimizer: Any = AUTO,
    metrics: bool = False,
    strict: bool = True,
    cast: Cast = "no",
    read: ReadOptions | None = None,
) -> RestoreReport:
    """Collective (as ``manager.restore``): load the newest step every rank can load (level 1
    first, then level 3, then older steps) into ``model`` (and its optimizer, and its metrics'
    accumulators when asked), as :func:`from_state` does: bit-exact, all or nothing (everything
    is checked before any variable changes). Returns the manager's
    :class:`~ckptfmt.RestoreReport`: ``report.step`` is None when there is nothing to restore
    (the model untouched); ``report.state`` is the loaded tree, the saved counters in
    ``report.state["counters"]``. ``read``: as for ``CheckpointManager.restore`` (another number
    of ranks than the save's)."""
    check_policy(cast)  # a usage error before anything collective
    report = manager.restore(read=read)
    if report.restored:
        if report.state is None:  # pragma: no cover - restore sets it with a step
            raise UsageError("the manager restored a step but kept no state")
        from_state(
            model, report.state, optimizer=optimizer, metrics=metrics, strict=strict, cast=cast
        )
    return report


def save_variables(
    obj: Any,
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    write: WriteOptions | None = None,
    progress: ProgressCallback | None = None,
) -> Manifest:
    """Save the variables of any object ``to_arrays`` takes (a ``tf.Module``, a Keras layer or
    optimizer, a mapping or list of variables), by name, as a ckptfmt checkpoint; return its
    manifest. ``write``, ``progress``: as for ``ckptfmt.save``."""
    return ckptfmt.save(nest(to_arrays(obj)), path, step=step, write=write, progress=progress)


def load_variables(
    obj: Any,
    path: NodeDirs,
    *,
    strict: bool = True,
    name_map: NameMap | None = None,
    transform: Transform | None = None,
    cast: Cast = "no",
) -> list[str]:
    """Assign the tensors of the checkpoint at ``path`` to the variables of ``obj`` by name
    (see ``assign``; only the tensors used are read, each verified); return the names set.
    It reads lazily (``ckptfmt.open``, a ``{node}`` template too), so it returns the names
    rather than a manifest, and takes no ``progress``: what it reads is decided tensor by
    tensor as they are assigned."""
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
