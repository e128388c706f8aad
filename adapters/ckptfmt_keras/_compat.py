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
``tests/adapters/keras/test_compat.py`` resolves every entry against the installed frameworks.

The supported ranges (:data:`SUPPORTED`) are the extras' bounds in ``pyproject.toml`` (a test
keeps them equal): up to the newest version checked, exclusive of the next minor release.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from ckptfmt.errors import FrameworkCompatError

SUPPORTED: dict[str, str] = {"keras": ">=3,<3.16", "tensorflow-cpu": ">=2.16,<2.22"}
"""framework (its distribution's name) -> the range this adapter supports (the extras' bounds)."""

_MODULE_OF = {"tensorflow-cpu": "tensorflow"}  # else the distribution's own name


@dataclasses.dataclass(frozen=True)
class Private:
    """One private name of a framework: ``where`` is ``"module"`` or ``"module:Class"``,
    ``name`` the attribute there; ``params``: the parameters the adapter passes it by name
    (checked present in its signature); ``uses``: what the adapter does with it;
    ``on_objects``: an attribute each object gets in ``__init__`` (the class has none), checked
    on the object at each use."""

    framework: str
    where: str
    name: str
    params: tuple[str, ...] = ()
    uses: str = ""
    on_objects: bool = False

    @property
    def qualname(self) -> str:
        """The name as the framework spells it: ``keras.Model._symbolic_build``."""
        return f"{self.where.replace(':', '.')}.{self.name}"


def installed_version(framework: str) -> str:
    """The installed version of ``framework`` (its ``__version__``), or ``"(not installed)"``."""
    try:
        module = importlib.import_module(_MODULE_OF.get(framework, framework))
    except ImportError:
        return "(not installed)"
    return str(getattr(module, "__version__", "(unknown version)"))


def resolve(entry: Private) -> Any:
    """The object ``entry`` names, imported and checked now (not cached: :func:`private` caches).
    Raises :class:`FrameworkCompatError` when it is missing or its signature lacks a parameter
    the adapter passes."""
    module_name, _, owner = entry.where.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in owner.split(".") if owner else []:
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise _error(entry, f"cannot be imported ({type(exc).__name__}: {exc})") from None
    if entry.on_objects:
        return obj  # the class: its objects are checked as they come (see _attribute)
    if not hasattr(obj, entry.name):
        raise _error(entry, "is missing")
    found = getattr(obj, entry.name)
    if entry.params:
        try:
            sig = inspect.signature(found)
        except (TypeError, ValueError):
            raise _error(entry, "is no longer a callable with a signature") from None
        takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        lost = [p for p in entry.params if p not in sig.parameters and not takes_any]
        if lost:
            raise _error(entry, f"has no parameter {', '.join(lost)} any more (it is {sig})")
    return found


@functools.cache
def private(key: str) -> Any:
    """The object of :data:`PRIVATE`'s entry ``key``, resolved and checked on first use."""
    return resolve(PRIVATE[key])


def _error(entry: Private, reason: str) -> FrameworkCompatError:
    return FrameworkCompatError(
        entry.framework,
        installed_version(entry.framework),
        entry.qualname,
        SUPPORTED[entry.framework],
        reason,
    )


def _attribute(key: str, obj: Any) -> Any:
    """The attribute of entry ``key`` on ``obj`` (per-object ones: Keras sets them in
    ``__init__``): :class:`FrameworkCompatError` when ``obj`` has none."""
    private(key)
    entry = PRIVATE[key]
    if not hasattr(obj, entry.name):
        raise _error(entry, f"is missing on a {type(obj).__name__}")
    return getattr(obj, entry.name)


PRIVATE: dict[str, Private] = {
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
