"""Applying a loaded state to the caller's state in place: everything checked before anything
is written.

``CheckpointManager.restore(state)`` copies the checkpoint into the arrays the caller holds. A
restore that found a mismatch half-way would leave a model half old, half new; so the whole
state is compared first (names, shapes, dtypes) and only then written. Names are compared
'/'-joined; ``include``/``exclude`` are ``fnmatch`` patterns on them (a partial restore). A
dtype that differs follows the one cast policy of the adapters (``tree/casting.py``): refused
unless ``cast="safe"``/``"any"`` allows it, every conversion reported.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptfmt.errors import DtypeMismatchError, StateMismatchError
from ckptfmt.tree.casting import (
    Cast,
    Conversion,
    check_policy,
    convert,
    plan_casts,
    report_casts,
)
from ckptfmt.tree.state import Blob, PerRank, Shard, flatten


@dataclass
class ApplyReport:
    """What a restore wrote into the caller's state and what it left alone."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # in the state, not in the checkpoint
    unexpected: list[str] = field(default_factory=list)  # in the checkpoint, not in the state
    excluded: list[str] = field(default_factory=list)  # left out by include/exclude
    casts: list[Conversion] = field(default_factory=list)  # converted to the state's dtype (cast=)


def _selected(name: str, include: Sequence[str] | None, exclude: Sequence[str]) -> bool:
    if include is not None and not any(fnmatch.fnmatchcase(name, p) for p in include):
        return False
    return not any(fnmatch.fnmatchcase(name, p) for p in exclude)


def _shape_dtype(value: Any) -> tuple[tuple[int, ...], np.dtype[Any]] | None:
    """An array's shape and dtype; a numpy scalar's too (saved as a 0-d tensor, §5); None for
    any other value."""
    if isinstance(value, np.ndarray):
        return value.shape, value.dtype
    if isinstance(value, np.generic) and not isinstance(value, (np.str_, np.bytes_, np.void)):
        return (), value.dtype
    return None


def apply_loaded(
    state: Mapping[str, Any] | None,
    loaded: Mapping[str, Any],
    *,
    strict: bool = True,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    cast: Cast = "no",
) -> ApplyReport:
    """Local: write ``loaded`` (the nested state a load returned) into ``state`` in place:
    arrays copied into the caller's arrays (``Shard`` leaves: into their data; ``PerRank``
    arrays: into their value), other values replaced. An array the load read straight into
    (``landing_targets``) is the caller's already: nothing is copied.

    Raises before writing anything: :class:`StateMismatchError` when a selected array's shape
    differs from the saved one, or (``strict``, the default) when a selected name of the state
    is not in the checkpoint or a saved name is not in the state; :class:`DtypeMismatchError`
    naming every array whose dtype differs from the saved one and that ``cast``
    (``"no"``, ``"safe"``, ``"any"``: ``tree/casting.py``) does not allow converting (with other
    mismatches, they are listed in the :class:`StateMismatchError`). Conversions made are in
    the report's ``casts`` and warned of (:class:`~ckptfmt.errors.CastWarning`)."""
    plan = _plan(state, loaded, strict, include, exclude, check_policy(cast))
    for write in plan.writes:
        write()
    report_casts(plan.report.casts, stacklevel=5)  # the caller of restore
    return plan.report


def landing_targets(
    state: Mapping[str, Any] | None,
    skeleton: Mapping[str, Any],
    *,
    strict: bool = True,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    cast: Cast = "no",
) -> dict[str, np.ndarray]:
    """Local: the caller's arrays that a load may read straight into, by '/'-joined name:
    those :func:`apply_loaded` with the same arguments would copy a saved array of the same
    dtype into. ``skeleton``: what the load will return, its arrays of the right shape and
    dtype but without their data yet, its encoded entries as :class:`Blob` (the load's
    ``into`` callback). Empty when :func:`apply_loaded` would refuse the state (it then raises
    once the load is done, nothing of the caller's written), or when the checkpoint holds a
    pickled object (what it unpickles to is not known before it is read). So an excluded
    array, or a state that does not match, is never landed into."""
    if _holds_pickle(skeleton):
        return {}
    try:
        plan = _plan(state, skeleton, strict, include, exclude, check_policy(cast))
    except (StateMismatchError, DtypeMismatchError):
        return {}
    return plan.holders


def _holds_pickle(node: Any) -> bool:
    """Whether a pickled :class:`Blob` is anywhere in ``node``, inside lists and tuples too
    (a state's list is one leaf of the plan, but what it holds is unpickled, or refused,
    all the same)."""
    if isinstance(node, Blob):
        return node.encoding == "pickle"
    if isinstance(node, Mapping):
        return any(_holds_pickle(v) for v in node.values())
    if isinstance(node, list | tuple):
        return any(_holds_pickle(v) for v in node)
    return False


@dataclass
class _Plan:
    report: ApplyReport
    writes: list[Callable[[], None]]
    holders: dict[str, np.ndarray]  # name -> the caller's array a saved one of its dtype fills


def _plan(
    state: Mapping[str, Any] | None,
    loaded: Mapping[str, Any],
    strict: bool,
    include: Sequence[str] | None,
    exclude: Sequence[str],
    policy: Cast,
) -> _Plan:
    """Everything :func:`apply_loaded` checks, and the writes it then makes (none made here)."""
    plan = _Plan(ApplyReport(), [], {})
    report = plan.report
    if state is None:
        return plan
    # a list or tuple of the state is one leaf, replaced whole by the loaded one
    mine = {"/".join(n): leaf for n, leaf in flatten(state, sequences=False)}
    saved = _leaves(loaded, set(mine))
    mismatched: dict[str, tuple[str, str]] = {}  # name -> (saved, the state's)
    dtypes: list[tuple[str, np.dtype[Any], np.dtype[Any]]] = []  # (name, saved, state's)
    for name, value in saved.items():
        if not _selected(name, include, exclude):
            report.excluded.append(name)
            continue
        if name not in mine:
            report.unexpected.append(name)
            continue
        target = mine[name]
        holder = target.data if isinstance(target, Shard) else target
        holder = holder.value if isinstance(holder, PerRank) else holder
        want = _shape_dtype(value)
        # a numpy scalar of the state takes a saved 0-d tensor (what it was saved as), and is
        # replaced by a saved value as any value is
        got = None if want is None and isinstance(holder, np.generic) else _shape_dtype(holder)
        if got is not None and want is not None:
            shape_ok = got[0] == want[0] or (
                isinstance(target, Shard) and int(np.prod(got[0])) == int(np.prod(want[0]))
            )
            if not shape_ok:
                mismatched[name] = (f"{want[1]}{list(want[0])}", f"{got[1]}{list(got[0])}")
                continue
            if got[1] != want[1]:
                dtypes.append((name, want[1], got[1]))
            elif not isinstance(holder, np.generic):
                plan.holders[name] = holder
            if isinstance(holder, np.generic):  # cannot be written into: replaced, same type
                plan.writes.append(_replace_scalar(state, name.split("/"), value, target))  # type: ignore[arg-type]
            else:
                plan.writes.append(_copy_into(holder, value))
        elif got is not None or (want is not None and not isinstance(target, PerRank)):
            kinds = ("a value", "an array")
            mismatched[name] = kinds if got is not None else (kinds[1], kinds[0])
            continue
        else:
            plan.writes.append(_replace(state, name.split("/"), value, target))  # type: ignore[arg-type]
        report.loaded.append(name)
    for name in mine:
        if name not in saved and _selected(name, include, exclude):
            report.missing.append(name)
    try:
        report.casts = plan_casts(dtypes, policy)
    except DtypeMismatchError as exc:
        if not (mismatched or (strict and (report.missing or report.unexpected))):
            raise
        for n, (s, d) in exc.mismatched.items():
            shape = list(np.shape(saved[n]))
            mismatched[n] = (f"{s}{shape}", f"{d}{shape}")
    if mismatched or (strict and (report.missing or report.unexpected)):
        raise StateMismatchError(
            report.missing,
            report.unexpected,
            mismatched,
            hint="restore(..., strict=False) or include=/exclude= patterns restore part of a state",
        )
    return plan


def _leaves(loaded: Mapping[str, Any], stop: set[str]) -> dict[str, Any]:
    """The leaves of ``loaded`` by '/'-joined name, not descending into a mapping where the
    caller's state has a leaf (a ``PerRank`` value that is itself a mapping, say)."""
    out: dict[str, Any] = {}

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, Mapping) and value and name not in stop:
                walk(value, name + "/")
            else:
                out[name] = value

    walk(loaded, "")
    return out


def _copy_into(target: np.ndarray, value: np.ndarray) -> Callable[[], None]:
    """Copy ``value`` into ``target``, converted to its dtype (once the cast policy allowed it)."""
    if value is target:  # loaded straight into it (``landing_targets``)
        return lambda: None
    return lambda: np.copyto(
        target, convert(value, target.dtype).reshape(target.shape), casting="no"
    )


def _replace_scalar(
    state: MutableMapping[str, Any], parts: list[str], value: np.ndarray, target: Any
) -> Callable[[], None]:
    """Replace the numpy scalar ``target`` (in a ``PerRank`` or not) by the saved 0-d
    ``value`` as a scalar of the target's dtype (once the cast policy allowed it)."""
    holder = target.value if isinstance(target, PerRank) else target

    def write() -> None:
        scalar = convert(np.asarray(value), holder.dtype).reshape(())[()]
        _replace(state, parts, scalar, target)()

    return write


def _replace(
    state: MutableMapping[str, Any], parts: list[str], value: Any, target: Any
) -> Callable[[], None]:
    def write() -> None:
        node: Any = state
        for p in parts[:-1]:
            node = node[p]
        node[parts[-1]] = PerRank(value) if isinstance(target, PerRank) else value

    return write
