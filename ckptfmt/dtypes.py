"""Logical data types of the format and their numpy (and ml_dtypes) counterparts.

The names are the zarr v3 ``data_type`` names. The core zarr v3 types keep their names; the
machine-learning types use the names TensorStore's zarr3 driver already reads (``bfloat16``,
``float8_e4m3fn``, ``float8_e5m2``), so a TensorStore user needs nothing from us and a
zarr-python user needs only our data-type plugin (``ckptfmt.zarr_plugin``).

Every type is stored little-endian. ``longdouble``, ``object``, strings, datetimes and structured
dtypes are not tensor dtypes in this format.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ckptfmt.errors import UnsupportedDtypeError

__all__ = ["DType", "by_name", "of_array"]


@dataclass(frozen=True)
class DType:
    """One logical dtype: its on-disk name, its numpy dtype (native order) and its fill value."""

    name: str
    numpy: np.dtype
    fill_value: object  # the JSON value written as zarr ``fill_value``

    @property
    def itemsize(self) -> int:
        return int(self.numpy.itemsize)


def _entries() -> list[DType]:
    table: list[tuple[str, object, object]] = [
        ("bool", np.bool_, False),
        ("int8", np.int8, 0),
        ("int16", np.int16, 0),
        ("int32", np.int32, 0),
        ("int64", np.int64, 0),
        ("uint8", np.uint8, 0),
        ("uint16", np.uint16, 0),
        ("uint32", np.uint32, 0),
        ("uint64", np.uint64, 0),
        ("float16", np.float16, 0.0),
        ("float32", np.float32, 0.0),
        ("float64", np.float64, 0.0),
        ("complex64", np.complex64, [0.0, 0.0]),
        ("complex128", np.complex128, [0.0, 0.0]),
        ("bfloat16", ml_dtypes.bfloat16, 0.0),
        ("float8_e4m3fn", ml_dtypes.float8_e4m3fn, 0.0),
        ("float8_e5m2", ml_dtypes.float8_e5m2, 0.0),
    ]
    return [DType(name, np.dtype(t), fill) for name, t, fill in table]  # type: ignore[call-overload]


DTYPES: dict[str, DType] = {d.name: d for d in _entries()}
"""Every dtype the format holds, by on-disk name."""

_BY_NUMPY: dict[np.dtype, DType] = {d.numpy: d for d in DTYPES.values()}


def by_name(name: str) -> DType:
    """The dtype stored under ``name``; :class:`UnsupportedDtypeError` if there is none."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise UnsupportedDtypeError(name) from None


def of_array(dtype: np.dtype, tensor: str | None = None) -> DType:
    """The logical dtype of a numpy dtype in either byte order."""
    native = dtype.newbyteorder("=") if dtype.byteorder in "<>" else dtype
    found = _BY_NUMPY.get(native)
    if found is None:
        raise UnsupportedDtypeError(dtype, tensor)
    return found
