"""zarr-python data-type plugin: ``bfloat16``, ``float8_e4m3fn`` and ``float8_e5m2``.

Installing ckptfmt is enough for ``zarr.open_array`` to read these arrays; the reading code never
imports ckptfmt. zarr-python is meant to load this module through the ``zarr.data_type`` entry
point declared in ``pyproject.toml``; zarr 3.1 does not (see the note at the end of this module),
so a start-up hook registers the classes when zarr is imported. The names are the ones
TensorStore's zarr3 driver uses; the numpy types come from ``ml_dtypes``. Fill values are JSON
numbers or zarr's float strings (``"NaN"``, ``"Infinity"``, ``"-Infinity"``, ``"0x..."``); zarr v2
is not supported for them.

This module imports zarr and is imported only for zarr: the rest of ckptfmt does not depend on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self, TypeGuard

import ml_dtypes
import numpy as np
from zarr.core.dtype.common import DataTypeValidationError, HasEndianness, HasItemSize
from zarr.core.dtype.wrapper import ZDType

_SPECIAL = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


@dataclass(frozen=True, kw_only=True)
class _MLFloat(ZDType[Any, Any], HasItemSize):
    """A little-endian float type from ml_dtypes, known to zarr v3 only by its name."""

    _zarr_v3_name: ClassVar[str]
    _numpy: ClassVar[np.dtype]

    @classmethod
    def _check_native_dtype(cls, dtype: object) -> TypeGuard[Any]:
        return isinstance(dtype, np.dtype) and dtype == cls._numpy

    @classmethod
    def from_native_dtype(cls, dtype: Any) -> Self:
        if cls._check_native_dtype(dtype):
            return cls()
        raise DataTypeValidationError(f"{dtype!r} is not {cls._zarr_v3_name}")

    def to_native_dtype(self) -> Any:
        return self._numpy

    @classmethod
    def _from_json_v2(cls, data: Any) -> Self:
        raise DataTypeValidationError(f"{cls._zarr_v3_name} is a zarr v3 data type only")

    @classmethod
    def _from_json_v3(cls, data: Any) -> Self:
        if data == cls._zarr_v3_name:
            return cls()
        raise DataTypeValidationError(f"expected {cls._zarr_v3_name!r}, got {data!r}")

    def to_json(self, zarr_format: Literal[2, 3]) -> Any:  # type: ignore[override]
        if zarr_format == 3:
            return self._zarr_v3_name
        raise ValueError(f"{self._zarr_v3_name} exists in zarr v3 only")

    def _check_scalar(self, data: object) -> bool:
        if isinstance(data, str):
            return data in _SPECIAL
        return isinstance(data, (int, float, np.generic))

    def cast_scalar(self, data: object) -> Any:
        if isinstance(data, str) and data in _SPECIAL:
            data = _SPECIAL[data]
        if not self._check_scalar(data):
            raise TypeError(f"cannot cast {data!r} to {self._zarr_v3_name}")
        return self._numpy.type(data)

    def default_scalar(self) -> Any:
        return self._numpy.type(0)

    def from_json_scalar(self, data: Any, *, zarr_format: Any) -> Any:
        if isinstance(data, str) and data.startswith("0x"):
            bits = np.array(int(data, 16), dtype=f"<u{self.item_size}")
            return bits.view(self._numpy)[()]
        return self.cast_scalar(data)

    def to_json_scalar(self, data: object, *, zarr_format: Any) -> Any:
        value = float(self.cast_scalar(data))
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
        return value

    @property
    def item_size(self) -> int:
        return int(self._numpy.itemsize)


@dataclass(frozen=True, kw_only=True)
class BFloat16(_MLFloat, HasEndianness):
    """``bfloat16``: 1 sign, 8 exponent, 7 mantissa bits; stored little-endian."""

    _zarr_v3_name: ClassVar[str] = "bfloat16"
    _numpy: ClassVar[np.dtype] = np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True, kw_only=True)
class Float8E4M3FN(_MLFloat):
    """``float8_e4m3fn``: 4 exponent, 3 mantissa bits, finite (NaN, no infinities)."""

    _zarr_v3_name: ClassVar[str] = "float8_e4m3fn"
    _numpy: ClassVar[np.dtype] = np.dtype(ml_dtypes.float8_e4m3fn)


@dataclass(frozen=True, kw_only=True)
class Float8E5M2(_MLFloat):
    """``float8_e5m2``: 5 exponent, 2 mantissa bits, IEEE-like (infinities and NaN)."""

    _zarr_v3_name: ClassVar[str] = "float8_e5m2"
    _numpy: ClassVar[np.dtype] = np.dtype(ml_dtypes.float8_e5m2)


PLUGIN_DTYPES = (BFloat16, Float8E4M3FN, Float8E5M2)


def register() -> None:
    """Register the data types with zarr-python's registry (idempotent)."""
    from zarr.core.dtype import data_type_registry

    for cls in PLUGIN_DTYPES:
        data_type_registry.register(cls._zarr_v3_name, cls)  # type: ignore[arg-type]


# zarr-python 3.1 collects the ``zarr.data_type`` entry points but never loads them (its
# DataTypeRegistry._lazy_load has no caller), so the classes above would stay unknown to a reader
# that never imports ckptfmt. The package therefore also installs a one-line ``.pth`` start-up hook
# (``tools/ckptfmt_zarr_dtypes.pth`` -> ``ckptfmt_zarr_hook``) that calls ``register()`` right
# after ``zarr.core.dtype`` is imported, and does nothing else: it costs one import-hook lookup
# at start-up and imports neither zarr nor numpy. The entry points stay, so a zarr that loads
# ``zarr.data_type`` the intended way finds the types without the hook.
__all__ = ["BFloat16", "Float8E4M3FN", "Float8E5M2", "register"]
