"""Keras 3 variables (any backend) and TensorFlow variables <-> named numpy arrays, bit for bit.

What gets which names (components joined by ``/``; each becomes a level of the checkpoint):

- a Keras layer or model: its variables' ``path`` (``"mlp/dense/kernel"``), the paths Keras
  gives, stable as long as the model is built the same way (give layers explicit names where a
  program builds several models: Keras numbers unnamed ones, ``dense``, ``dense_1``, ... in the
  order they are created); the states of seed generators (dropout), which Keras numbers across
  the process, are named after the layers owning them (``"mlp/dropout/seed_generator_state"``);
- a Keras optimizer: its variables' own names, their paths without the name scopes of the
  optimizer, which Keras numbers (``"iteration"``, ``"mlp_dense_kernel_momentum"``; a
  ``LossScaleOptimizer`` has its own and its inner optimizer's under ``"inner_optimizer/"``);
- a ``tf.Module``: the attribute path to each variable (``"encoder/layers/0/w"``), which is how
  ``tf.train.Checkpoint`` finds them too (a variable's own ``name`` need not be unique);
- a mapping: its keys (values are variables);
- a sequence of variables: each one's ``path`` (Keras) or ``name`` without ``:0`` (TensorFlow).

Loading maps these names when Keras numbered things differently: a second model built the
same way in one process (``sequential_1/dense_2/kernel`` for ``sequential/dense/kernel``) gets
the arrays of the first. Components ``<base>`` / ``<base>_<n>`` under one parent are compared by
their order, not by their number (:func:`auto_name_map`), and only when that pairs every
variable with exactly one array; optimizer slots follow their model variables.

Values are copied exactly: ``bfloat16`` as ``ml_dtypes.bfloat16`` (what TensorFlow's own numpy
conversion gives), NaN payloads and ``-0.0`` kept. The names and dtypes are the same on every
Keras backend, so a checkpoint saved under one loads under another, but for Keras's own integer
counters, whose dtype is the backend's: a seed generator's state (a seed and a counter) is
``int64`` under TensorFlow, ``uint32`` under JAX and ``int32`` under PyTorch, an optimizer's
``iteration`` ``int64`` under TensorFlow and ``int32`` under JAX and PyTorch. ``assign``
converts these from the saved integer dtype when every value fits (the values, not the random
numbers drawn from them, are what carries over).
Otherwise ``assign`` never reshapes and casts only as ``cast=`` allows
(``ckptfmt.tree.casting``: refused by default; ``"safe"``, ``"any"``, each conversion
reported); a mismatch is an error, found before any variable is changed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np

from ckptfmt.container import Checkpoint
from ckptfmt.errors import StateMismatchError, UsageError
from ckptfmt.tree import Cast, Conversion, allowed, check_policy, convert, report_casts
from ckptfmt_keras import _compat, backend
from ckptfmt_keras.backend import numpy_dtype

NameMap = Mapping[str, str] | Callable[[str], str | None]
Transform = Callable[[str, np.ndarray], np.ndarray]


# --- names ----------------------------------------------------------------------------------------


def _variable_name(v: Any) -> str:
    if isinstance(v, keras.Variable):
        return str(v.path)
    name = str(v.name)
    return name[:-2] if name.endswith(":0") else name


def _is_variable(x: Any) -> bool:
    return backend.is_variable(x)


def _seed_state_names(layer: Any) -> dict[int, str]:
    """Names for the states of the layers' seed generators (dropout, noise): Keras numbers them
    across the whole process (``seed_generator_7/seed_generator_state``), so they are named
    after the layers that own them instead: ``<model>/<layer>/.../seed_generator_state``
    (``seed_generator_<i>_state`` for a layer with several)."""
    names: dict[int, str] = {}

    def walk(owner: Any, prefix: str) -> None:
        generators = _compat.seed_generators(owner)
        for i, gen in enumerate(generators):
            leaf = "seed_generator_state" if len(generators) == 1 else f"seed_generator_{i}_state"
            names.setdefault(id(gen.state), f"{prefix}/{leaf}")
        for child in _compat.sublayers(owner):
            walk(child, f"{prefix}/{child.name}")

    walk(layer, layer.name)
    return names


def _optimizer_variables(opt: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """An optimizer's variables by their own names (``iteration``, ``learning_rate``, a slot's
    ``<model variable path with _>_momentum``): their paths start with the name scopes in force
    when the optimizer was built (``adam_3/``, ``loss_scale_optimizer/sgd/``), which Keras
    numbers across the process and which differ between building on the first step and
    building ahead. A wrapped optimizer's (the ``LossScaleOptimizer``'s) are under
    ``inner_optimizer/``."""
    inner = getattr(opt, "inner_optimizer", None)
    inner_ids = {id(v) for v in inner.variables} if inner is not None else set()
    pairs = []
    for v in opt.variables:
        if id(v) not in inner_ids:
            name = str(v.name) if isinstance(v, keras.Variable) else _variable_name(v)
            pairs.append((prefix + name, v))
    if inner is not None:
        pairs += _optimizer_variables(inner, f"{prefix}inner_optimizer/")
    return pairs


def named_variables(obj: Any) -> dict[str, Any]:
    """The variables of ``obj`` by name (see the module docstring for the naming), in the
    object's own order. Raises ``UsageError`` when two variables would share a name."""
    if isinstance(obj, keras.layers.Layer):
        seeds = _seed_state_names(obj)
        pairs = [(seeds.get(id(v)) or _variable_name(v), v) for v in obj.variables]
    elif isinstance(obj, keras.optimizers.Optimizer):
        pairs = _optimizer_variables(obj)
    elif backend.is_tf_module(obj):
        pairs = _compat.module_variables(obj, _is_variable)
    elif isinstance(obj, Mapping):
        pairs = [(str(k), v) for k, v in obj.items()]
    elif _is_variable(obj):
        pairs = [(_variable_name(obj), obj)]
    elif isinstance(obj, Iterable):
        pairs = [(_variable_name(v), v) for v in obj]
    else:
        raise UsageError(f"cannot find variables in a {type(obj).__name__}")
    out: dict[str, Any] = {}
    for name, v in pairs:
        if not _is_variable(v):
            raise UsageError(f"{name!r} is a {type(v).__name__}, not a variable")
        if name in out and out[name] is not v:
            raise UsageError(
                f"two variables are named {name!r}; name the layers (or variables) apart"
            )
        out[name] = v
    return out


# --- variables -> arrays --------------------------------------------------------------------------


def to_arrays(obj: Any) -> dict[str, np.ndarray]:
    """A copy of every variable of ``obj`` as a numpy array, by name (flat, ``/``-joined)."""
    return {name: backend.to_numpy(v) for name, v in named_variables(obj).items()}


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a/b": x}`` -> ``{"a": {"b": x}}``: the nested mapping ckptfmt saves."""
    root: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, last = name.split("/")
        node = root
        for p in parents:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise UsageError(f"{name!r}: {p!r} is both a variable and a prefix of another")
            node = child
        if last in node:
            raise UsageError(f"{name!r}: a variable's name is a prefix of another's")
        node[last] = value
    return root


def flat_names(nested: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Inverse of :func:`nest`; a ``ckptfmt.Checkpoint`` gives its tensors (lazy views). An
    empty mapping (a group with nothing in it) contributes nothing."""
    if isinstance(nested, Checkpoint):
        return {
            n[len(prefix) :]: view for n, view in nested.tensors().items() if n.startswith(prefix)
        }
    out: dict[str, Any] = {}
    for key, value in nested.items():
        if isinstance(value, Mapping):
            out.update(flat_names(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


# --- arrays -> variables --------------------------------------------------------------------------


_NUMBERED = re.compile(r"^(.*?)_(\d+)$")


def _canonical(names: Iterable[str]) -> dict[str, str]:
    """Each ``/``-joined name with every component ``<base>`` or ``<base>_<n>`` replaced by
    ``<base>#<k>``, ``k`` its rank among the numbers of the same base under the same parent:
    what stays the same when Keras numbers a model's layers from another start."""
    split = {n: n.split("/") for n in names}
    numbers: dict[tuple[tuple[str, ...], str], set[int]] = {}
    parsed: dict[str, list[tuple[str, int]]] = {}
    for n, comps in split.items():
        parts = []
        for i, c in enumerate(comps):
            m = _NUMBERED.match(c)
            base, num = (m.group(1), int(m.group(2))) if m else (c, 0)
            numbers.setdefault((tuple(comps[:i]), base), set()).add(num)
            parts.append((base, num))
        parsed[n] = parts
    order = {key: sorted(nums) for key, nums in numbers.items()}
    return {
        n: "/".join(
            f"{base}#{order[(tuple(comps[:i]), base)].index(num)}"
            for i, (base, num) in enumerate(parsed[n])
        )
        for n, comps in split.items()
    }


def auto_name_map(variables: Iterable[str], arrays: Iterable[str]) -> dict[str, str] | None:
    """Variable name -> array name when the two sets differ only in Keras' automatic numbering
    (``sequential_1/dense_2/kernel`` -> ``sequential/dense/kernel``): every variable paired with
    exactly one array and every array used. ``None`` when the names agree already or cannot be
    paired so (then the names are compared as they are, and a mismatch is reported)."""
    var_names, arr_names = list(variables), list(arrays)
    if set(var_names) == set(arr_names):
        return None
    cv, ca = _canonical(var_names), _canonical(arr_names)
    by_key = {k: n for n, k in ca.items()}
    if (
        len(set(cv.values())) != len(cv)
        or len(by_key) != len(ca)
        or set(cv.values()) != set(by_key)
    ):
        return None
    return {n: by_key[k] for n, k in cv.items()}


def slot_name_map(optimizer_names: Iterable[str], model_map: Mapping[str, str]) -> dict[str, str]:
    """Optimizer variable name -> saved name, given the model's variable map (current path ->
    saved path): a slot is named after its model variable (``<path with _>_<slot>``, under
    ``inner_optimizer/`` for a wrapped optimizer), so it follows that variable's mapping."""
    prefixes = sorted(
        (
            (cur.replace("/", "_") + "_", saved.replace("/", "_") + "_")
            for cur, saved in model_map.items()
        ),
        key=lambda p: -len(p[0]),
    )
    out = {}
    for name in optimizer_names:
        head, _, last = name.rpartition("/")
        mapped = name
        for cur, saved in prefixes:
            if last.startswith(cur):
                mapped = f"{head}/" * bool(head) + saved + last[len(cur) :]
                break
        out[name] = mapped
    return out


_COUNTER = re.compile(r"(^|/)(seed_generator(_\d+)?_state|iteration)$")


def _counter_fits(name: str, value: np.ndarray, target: np.dtype[Any]) -> bool:
    """One of Keras's integer counters saved under another backend's integer dtype, every value
    representable in this backend's (see the module docstring)."""
    if value.dtype == target or value.dtype.kind not in "iu" or target.kind not in "iu":
        return False
    if not _COUNTER.search(name):
        return False
    return bool(np.array_equal(value.astype(target).astype(value.dtype), value))


@dataclass
class AssignPlan:
    """What :func:`plan_assign` found: the writes to make (variable, value), the names, and
    the dtype conversions (empty when every dtype agrees)."""

    writes: list[tuple[str, Any, np.ndarray]] = field(default_factory=list)
    casts: list[Conversion] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.writes]

    def apply(self) -> list[str]:
        for _, v, value in self.writes:
            backend.assign(v, value)
        return self.names


def assign(
    obj: Any,
    arrays: Mapping[str, Any],
    *,
    strict: bool = True,
    name_map: NameMap | None = None,
    transform: Transform | None = None,
    cast: Cast = "no",
) -> list[str]:
    """Copy ``arrays`` into the variables of ``obj`` by name; return the names assigned.

    ``arrays`` is flat (``"mlp/dense/kernel"``) or nested (what ``ckptfmt.load`` returns), or a
    ``ckptfmt.Checkpoint`` (read lazily, only the tensors used). ``name_map`` maps a variable's
    name to the name of its array in ``arrays`` (a mapping, or a function returning ``None`` for
    "no array"): how a checkpoint written by another framework, with other names, is read.
    Without one, names that differ only in Keras' automatic numbering are paired
    (:func:`auto_name_map`). ``transform(name, array)`` may change an array first (a transpose,
    say). With ``strict``, every variable must get an array and, without ``name_map``, every
    array a variable.

    Shapes must match exactly; dtypes too, unless ``cast`` allows converting (``"safe"``: no
    value changes, ``"any"``; every conversion reported as a ``ckptfmt.errors.CastWarning``),
    so what is loaded is bit-exact. Every check is made before any variable is changed.
    """
    plan = plan_assign(
        obj, arrays, strict=strict, name_map=name_map, transform=transform, cast=cast
    )
    names = plan.apply()
    report_casts(plan.casts)
    return names


def plan_assign(
    obj: Any,
    arrays: Mapping[str, Any],
    *,
    strict: bool = True,
    name_map: NameMap | None = None,
    transform: Transform | None = None,
    cast: Cast = "no",
) -> AssignPlan:
    """Everything :func:`assign` checks, without changing a variable: raises
    :class:`StateMismatchError` naming every problem, or returns the writes to make (so that a
    caller assigning several objects checks them all before it writes any)."""
    policy = check_policy(cast)
    variables = named_variables(obj)
    source = flat_names(arrays)
    auto = auto_name_map(variables, source) if name_map is None else None
    plan = AssignPlan()
    missing: list[str] = []
    mismatched: dict[str, tuple[str, str]] = {}
    used: set[str] = set()
    for name, v in variables.items():
        if auto is not None:
            src: str | None = auto[name]
        elif name_map is None:
            src = name
        elif callable(name_map):
            src = name_map(name)
        else:
            src = name_map.get(name)
        if src is None or src not in source:
            if strict:
                missing.append(name if src is None or src == name else f"{name} (<- {src})")
            continue
        used.add(src)
        value = np.asarray(source[src])
        if transform is not None:
            value = np.asarray(transform(name, value))
        want_shape, want_dtype = tuple(v.shape), numpy_dtype(v)
        if value.shape == want_shape and _counter_fits(name, value, want_dtype):
            plan.writes.append((name, v, value.astype(want_dtype)))
            continue
        if value.shape != want_shape or not allowed(value.dtype, want_dtype, policy):
            mismatched[name] = (
                f"{value.dtype}{list(value.shape)}",
                f"{want_dtype}{list(want_shape)}",
            )
            continue
        if value.dtype != want_dtype:
            plan.casts.append(Conversion(name, str(value.dtype), str(want_dtype)))
            value = convert(value, want_dtype)
        plan.writes.append((name, v, value))
    unexpected = sorted(set(source) - used) if strict and name_map is None else []
    if missing or unexpected or mismatched:
        raise StateMismatchError(
            missing, unexpected, mismatched, into="the variables", source="the arrays"
        )
    return plan
