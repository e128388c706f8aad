"""The one dtype policy for loading saved tensors into existing destinations.

A load into a destination (a PyTorch tensor, a Keras variable, an array the caller owns) is
bit-exact only when the dtypes agree, so a mismatch is refused by default. The caller may ask:

* ``cast="no"`` (the default): dtypes must be equal;
* ``cast="safe"``: convert where every value of the saved dtype is exactly representable in the
  destination's (``bfloat16`` -> ``float32``, ``int16`` -> ``int32``, ``float8_e4m3fn`` ->
  ``float16``), so no value changes;
* ``cast="any"``: convert whatever numpy can convert (``float32`` -> ``bfloat16`` rounds).

Every conversion made is reported (:class:`CastWarning`, carrying the list of
:class:`Conversion`), and a refusal names every mismatched tensor at once
(:class:`ckptfmt.errors.DtypeMismatchError`), before anything is written. The adapters
(``ckptfmt_torch``, ``ckptfmt_keras``) and the core call :func:`plan_casts` first, write only
when it returns, then :func:`report_casts`.

Framework-free: dtypes are numpy dtypes (``ml_dtypes`` for ``bfloat16`` and ``float8_*``, which
are recognised by name so that ``ml_dtypes`` is imported only when one of them is met).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np

from ckptfmt.dtypes import ML_NAMES
from ckptfmt.errors import CastWarning, DtypeMismatchError, UsageError

Cast = Literal["no", "safe", "any"]
"""The dtype policy of every load into existing destinations: the type of each ``cast=``."""

POLICIES: tuple[Cast, ...] = get_args(Cast)
"""The values ``cast=`` takes."""


def _is_ml(dt: np.dtype) -> bool:
    """Whether ``dt`` is one of the ``ml_dtypes`` floats (all real)."""
    return dt.name in ML_NAMES


@dataclass(frozen=True)
class Conversion:
    """One conversion made by a load: tensor ``name`` saved as ``saved``, stored as ``target``."""

    name: str
    saved: str
    target: str

    def __str__(self) -> str:
        return f"{self.name}: {self.saved} -> {self.target}"


def check_policy(cast: object) -> Cast:
    """``cast`` as one of :data:`POLICIES`; a :class:`UsageError` for anything else (``None``
    included: "no conversion" is spelled ``"no"``)."""
    for policy in POLICIES:
        if cast == policy and isinstance(cast, str):
            return policy
    raise UsageError(f"cast must be one of {', '.join(map(repr, POLICIES))}, got {cast!r}")


def _float_info(dt: np.dtype) -> Any:
    if not _is_ml(dt):
        return np.finfo(dt)
    import ml_dtypes  # loaded already: ``dt`` is one of its types

    return ml_dtypes.finfo(dt)  # type: ignore[no-untyped-call]


def is_safe(saved: np.dtype, target: np.dtype) -> bool:
    """True when every value of ``saved`` is exactly a value of ``target`` (NaN and infinities
    included where ``saved`` has them), so converting changes no number."""
    saved, target = np.dtype(saved), np.dtype(target)
    if saved == target:
        return True
    if saved.kind == "b":
        return target.kind in "biufc" or _is_ml(target)
    if not _is_ml(saved) and not _is_ml(target):
        return bool(np.can_cast(saved, target, casting="safe"))
    t_float = _is_ml(target) or target.kind in "fc"
    if not t_float:
        return False  # a float into an integer or bool is never exact
    t_info = _float_info(target if target.kind != "c" else np.dtype(f"f{target.itemsize // 2}"))
    if saved.kind in "iu":  # an integer: exact when its magnitude fits the significand
        bits = saved.itemsize * 8 - (1 if saved.kind == "i" else 0)
        return bits <= int(t_info.nmant) + 1
    if saved.kind == "c":
        return False  # a complex into a real (ml_dtypes floats are all real)
    s_info = _float_info(saved)
    # a float: at least its precision, its range and its smallest subnormal; NaN/inf kept
    has_inf = not str(saved).endswith("fn")
    target_inf = not str(target).endswith("fn")
    return (
        int(t_info.nmant) >= int(s_info.nmant)
        and float(t_info.max) >= float(s_info.max)
        and float(t_info.smallest_subnormal) <= float(s_info.smallest_subnormal)
        and (target_inf or not has_inf)
    )


def allowed(saved: np.dtype, target: np.dtype, cast: Cast) -> bool:
    """Whether policy ``cast`` lets a tensor saved as ``saved`` go into a ``target`` destination."""
    policy = check_policy(cast)
    saved, target = np.dtype(saved), np.dtype(target)
    if saved == target:
        return True
    if policy == "no":
        return False
    if policy == "safe":
        return is_safe(saved, target)
    return True


def plan_casts(pairs: Iterable[tuple[str, Any, Any]], cast: Cast) -> list[Conversion]:
    """The conversions a load of ``(name, saved dtype, destination dtype)`` triples makes under
    policy ``cast``; raises :class:`DtypeMismatchError` naming every refused one (so the caller
    raises before it writes into any destination)."""
    policy = check_policy(cast)
    casts: list[Conversion] = []
    refused: dict[str, tuple[str, str]] = {}
    for name, saved, target in pairs:
        s, t = np.dtype(saved), np.dtype(target)
        if s == t:
            continue
        if allowed(s, t, policy):
            casts.append(Conversion(name, str(s), str(t)))
        else:
            refused[name] = (str(s), str(t))
    if refused:
        raise DtypeMismatchError(refused, policy)
    return casts


def report_casts(casts: list[Conversion], stacklevel: int = 3) -> None:
    """Tell the caller what a load converted (a :class:`CastWarning`); nothing when nothing was."""
    if casts:
        warnings.warn(CastWarning(casts), stacklevel=stacklevel)


def convert(a: np.ndarray, target: Any) -> np.ndarray:
    """``a`` as dtype ``target`` (``a`` itself when it already is), once the policy allowed it."""
    target = np.dtype(target)
    if a.dtype == target:
        return a
    return np.asarray(a).astype(target, casting="unsafe")
