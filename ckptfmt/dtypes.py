"""Logical data types of the format and their numpy (and ml_dtypes) counterparts.

The names are the zarr v3 ``data_type`` names. The core zarr v3 types keep their names; the
machine-learning types use the names TensorStore's zarr3 driver already reads (``bfloat16``,
``float8_e4m3fn``, ``float8_e5m2``), so a TensorStore user needs nothing from us and a
zarr-python user needs only our data-type plugin (``ckptfmt.zarr_plugin``).

Every type is stored little-endian. ``longdouble``, ``object``, strings, datetimes and structured
dtypes are not tensor dtypes in this format.

``ml_dtypes`` is imported only when one of its types is first met (a name looked up, an array of
one of them seen): its extension takes about half a second to load, which a restart of a model
held in ``float32`` should not pay. An array can only have an ``ml_dtypes`` dtype once
``ml_dtypes`` is loaded, so the types are recognised by name, never by importing them to compare.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from ckptfmt.errors import UnsupportedDtypeError

__all__ = ["DTYPES", "ML_NAMES", "DType", "by_name", "itemsize_of", "of_array"]


@dataclass(frozen=True)
class DType:
    """One logical dtype: its on-disk name, its numpy dtype (native order) and its fill value."""

    name: str
    numpy: np.dtype
    fill_value: object  # the JSON value written as zarr ``fill_value``

    @property
    def itemsize(self) -> int:
        return int(self.numpy.itemsize)


_CORE: list[tuple[str, object, object]] = [
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
]

_ML_ITEMSIZE = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}

ML_NAMES = frozenset(_ML_ITEMSIZE)
"""The names of the types numpy gets from ``ml_dtypes`` (also their numpy ``dtype.name``)."""


class _Table(Mapping[str, DType]):
    """Every format dtype by name; the ``ml_dtypes`` entries are made on first use."""

    def __init__(self) -> None:
        self._entries = {
            name: DType(name, np.dtype(t), fill)  # type: ignore[call-overload]
            for name, t, fill in _CORE
        }
        self._by_numpy = {d.numpy: d for d in self._entries.values()}
        self._ml_loaded = False

    def load_ml(self) -> None:
        """Import ``ml_dtypes`` and add its entries (once)."""
        if self._ml_loaded:
            return
        import ml_dtypes

        for name in _ML_ITEMSIZE:
            d = DType(name, np.dtype(getattr(ml_dtypes, name)), 0.0)
            self._entries[name] = d
            self._by_numpy[d.numpy] = d
        self._ml_loaded = True

    def __getitem__(self, name: str) -> DType:
        if name in ML_NAMES:
            self.load_ml()
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._entries or name in ML_NAMES
        except TypeError:  # unhashable: no dtype has that name
            return False

    def __iter__(self) -> Iterator[str]:
        self.load_ml()
        return iter(self._entries)

    def __len__(self) -> int:
        return len(_CORE) + len(_ML_ITEMSIZE)

    def by_numpy(self, dtype: np.dtype) -> DType | None:
        found = self._by_numpy.get(dtype)
        if found is None and dtype.name in ML_NAMES and not self._ml_loaded:
            self.load_ml()
            found = self._by_numpy.get(dtype)
        return found


_TABLE = _Table()
DTYPES: Mapping[str, DType] = _TABLE
"""Every dtype the format holds, by on-disk name (iterating it loads ``ml_dtypes``)."""


def by_name(name: str) -> DType:
    """The dtype stored under ``name``; :class:`UnsupportedDtypeError` if there is none."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise UnsupportedDtypeError(name) from None


def itemsize_of(name: str) -> int:
    """The bytes per element of the dtype stored under ``name``, without loading ``ml_dtypes``;
    :class:`UnsupportedDtypeError` if there is none."""
    size = _ML_ITEMSIZE.get(name) if isinstance(name, str) else None
    return size if size is not None else by_name(name).itemsize


def of_array(dtype: np.dtype, tensor: str | None = None) -> DType:
    """The logical dtype of a numpy dtype in either byte order."""
    native = dtype.newbyteorder("=") if dtype.byteorder in "<>" else dtype
    found = _TABLE.by_numpy(native)
    if found is None:
        raise UnsupportedDtypeError(dtype, tensor)
    return found
