"""Every private API of Keras and TensorFlow that this adapter uses, in one place: the one
module to read and update when a framework is upgraded (docs/keras.md, "Private framework
APIs").

Each private name is an entry of :data:`PRIVATE` (a :class:`Private`: the framework, where the
name lives, the parameters the adapter passes it). It is imported and checked the first time it
is used, never when the adapter is imported, then cached: a name that is missing, or a callable
that lost a parameter the adapter passes, raises :class:`ckptfmt.errors.FrameworkCompatError`
naming the framework, its installed version, the name and the supported range, instead of a
feature silently switched off. Attributes Keras sets on each object (``_initial_epoch``,
``_compile_metrics``, ``_seed_generators``) are checked on the object at each use as well.
``tests/adapters/keras/test_keras_compat.py`` resolves every entry against the installed frameworks.

The supported ranges (:data:`SUPPORTED`) are the extras' bounds in ``pyproject.toml`` (a test
keeps them equal): up to the newest version checked, exclusive of the next minor release.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from ckptfmt.frameworks import Private, PrivateNames

SUPPORTED: dict[str, str] = {"keras": ">=3,<3.16", "tensorflow-cpu": ">=2.16,<2.22"}
"""framework (its distribution's name) -> the range this adapter supports (the extras' bounds)."""

PRIVATE = PrivateNames(SUPPORTED, {"tensorflow-cpu": "tensorflow"})
"""Every private name this adapter uses, by key (``ckptfmt.frameworks``)."""


# what the rest of the adapter calls: the object of an entry, checked on first use (``private``),
# the check itself (``resolve``), and the error that names a framework's version and range
private = PRIVATE.checked
resolve = PRIVATE.resolve
installed_version = PRIVATE.installed_version
_error = PRIVATE.error
_attribute = PRIVATE.attribute


PRIVATE.update(
    {
        # --- the callback's resume (keras.Model, every backend's trainer) ---
        "Model._symbolic_build": Private(
            "keras",
            "keras:Model",
            "_symbolic_build",
            ("data_batch",),
            "builds the compiled metrics from a batch's shapes before fit has (TensorFlow), so "
            "that the saved accumulators can be assigned at a resume mid-epoch",
        ),
        "Model._compile_metrics": Private(
            "keras",
            "keras:Model",
            "_compile_metrics",
            (),
            "None, or the compiled metrics (its `built` says whether their variables exist)",
            on_objects=True,
        ),
        "Model._initial_epoch": Private(
            "keras",
            "keras:Model",
            "_initial_epoch",
            (),
            "the epoch fit starts from when set (what keras.callbacks.BackupAndRestore sets)",
            on_objects=True,
        ),
        "EpochIterator": Private(
            "keras",
            "keras.src.trainers.epoch_iterator",
            "EpochIterator",
            (),
            "fit's iterator over the data (a local of every backend's fit), found from "
            "on_train_begin: its steps_per_epoch and data_adapter.num_batches say whether fit "
            "carries the data's iterator from one epoch to the next",
        ),
        # --- variable names (convert.py) ---
        "Layer._flatten_layers": Private(
            "keras",
            "keras.layers:Layer",
            "_flatten_layers",
            ("include_self", "recursive"),
            "a layer's direct sub-layers, to name their seed generators' states after them",
        ),
        "Layer._seed_generators": Private(
            "keras",
            "keras.layers:Layer",
            "_seed_generators",
            (),
            "a layer's seed generators (dropout, noise), whose states are variables",
            on_objects=True,
        ),
        "tf.Module._flatten": Private(
            "tensorflow-cpu",
            "tensorflow:Module",
            "_flatten",
            ("predicate", "with_path"),
            "a tf.Module's variables with their attribute paths (the names they are saved under)",
        ),
    }
)
"""Every private name this adapter uses, by key."""


# --- the callback's resume --------------------------------------------------------------------


def build_metrics_from(model: Any, batch: Any) -> None:
    """Build ``model``'s compiled metrics from ``batch``'s shapes, as ``fit`` does on its first
    step (nothing runs), where they are not built yet."""
    if metrics_unbuilt(model):
        _attribute("Model._symbolic_build", model)(data_batch=batch)


def metrics_unbuilt(model: Any) -> bool:
    """Whether ``model`` has compiled metrics whose variables do not exist yet."""
    compiled = _attribute("Model._compile_metrics", model)
    return compiled is not None and not compiled.built


def set_initial_epoch(model: Any, epoch: int | None) -> None:
    """Make ``fit`` start at ``epoch`` (``None``: at its ``initial_epoch`` argument again)."""
    _attribute("Model._initial_epoch", model)
    model._initial_epoch = epoch


def carried_batches(depth: int = 8) -> tuple[int, int | None] | None:
    """Called from a callback's ``on_train_begin``: ``(steps_per_epoch, the data's batches or
    None where unknown)`` when the running ``fit`` carries its data iterator from one epoch to
    the next (its ``steps_per_epoch`` is fewer than the data's batches, or the data's number
    of batches is unknown: each epoch goes on where the last one stopped), else None. Found as
    the ``EpochIterator`` among the locals of the callers up to ``depth`` frames up (``fit``
    makes it before it calls ``on_train_begin``)."""
    cls = private("EpochIterator")
    frame: FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            break
        for value in frame.f_locals.values():
            if isinstance(value, cls):
                steps, batches = value.steps_per_epoch, value.data_adapter.num_batches
                if steps and (batches is None or batches > steps):
                    return int(steps), None if batches is None else int(batches)
                return None
        frame = frame.f_back
    return None


# --- variable names ---------------------------------------------------------------------------


def seed_generators(layer: Any) -> list[Any]:
    """The seed generators a layer owns itself (not its sub-layers')."""
    return list(_attribute("Layer._seed_generators", layer))


def sublayers(layer: Any) -> list[Any]:
    """The direct sub-layers of ``layer``."""
    flatten = _attribute("Layer._flatten_layers", layer)
    return list(flatten(include_self=False, recursive=False))


def module_variables(module: Any, is_variable: Callable[[Any], bool]) -> list[tuple[str, Any]]:
    """A ``tf.Module``'s variables with their attribute paths joined by ``/``."""
    flatten = _attribute("tf.Module._flatten", module)
    return [
        ("/".join(str(p) for p in path), v)
        for path, v in flatten(predicate=is_variable, with_path=True)
    ]
