"""ISA-L's GF(2^8) erasure-code kernels, called through ctypes (optional; ``spec/redundancy.md``).

Intel's ISA-L multiplies blocks by GF(2^8) constants with SIMD table lookups (SSE to AVX-512 and
GFNI, picked at run time by its own dispatcher), far faster than numpy's pair tables. ckptfmt does
not build C: it loads the copy that ``pyeclib``'s wheel bundles
(``pyeclib.libs/libisal-pyeclib.so.2``, the optional extra ``ckptfmt[fast]``), without importing
pyeclib or its C module. ISA-L uses the same field polynomial as ckptfmt (0x11D, checked once on
load), so its products are ckptfmt's bytes. When the library is absent or does not load,
:func:`available` is False and :mod:`ckptfmt.redundancy.gf256` keeps to numpy.

The wrappers are thin: they check in Python what C would not (uint8, C-contiguous, writable
outputs, equal lengths, table shape), raising :class:`~ckptfmt.errors.UsageError`, then pass the
arrays' own memory (``arr.ctypes.data``): nothing is copied. ctypes releases the GIL during a
call, so threads can encode in parallel. ``gf_vect_mad`` is deliberately not wrapped: its
non-GFNI kernels silently do nothing below 32 or 64 bytes; ``ec_encode_data_update`` with one row
does the same work and falls back to scalar code for short blocks.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptfmt import isal_library
from ckptfmt.errors import UsageError
from ckptfmt.isal_library import LIBRARY_NAME, find_library

TABLE_BYTES = 32  # ISA-L's expanded table per coefficient (both its GFNI and its shuffle kernels)
MAX_CALL = 1 << 30  # bytes per C call: ISA-L's lengths are C ints

_vp = ctypes.c_void_p
_int = ctypes.c_int
_uchar = ctypes.c_ubyte


def _load() -> tuple[ctypes.CDLL | None, str | None, str | None]:
    lib, path, error = isal_library.load()
    if lib is None:
        return None, path, error
    try:
        lib.ec_init_tables.argtypes = [_int, _int, _vp, _vp]
        lib.ec_init_tables.restype = None
        lib.ec_encode_data.argtypes = [_int, _int, _int, _vp, _vp, _vp]
        lib.ec_encode_data.restype = None
        lib.ec_encode_data_update.argtypes = [_int, _int, _int, _int, _vp, _vp, _vp]
        lib.ec_encode_data_update.restype = None
        lib.gf_vect_mul_init.argtypes = [_uchar, _vp]
        lib.gf_vect_mul_init.restype = None
        lib.gf_mul.argtypes = [_uchar, _uchar]
        lib.gf_mul.restype = _uchar
        lib.gf_gen_cauchy1_matrix.argtypes = [_vp, _int, _int]
        lib.gf_gen_cauchy1_matrix.restype = None
    except (OSError, AttributeError) as e:
        return None, path, f"cannot load {path}: {e}"
    if lib.gf_mul(2, 0x80) != 0x1D:  # x * x^7 = x^8 = x^4 + x^3 + x^2 + 1 modulo 0x11D
        return None, path, f"{path} does not use the field polynomial 0x11D"
    return lib, path, None


_LIB, _PATH, _ERROR = _load()


def available() -> bool:
    """True when ISA-L was found and loaded."""
    return _LIB is not None


def library_path() -> str | None:
    """The path of the loaded (or found but unloadable) library, None when none was found."""
    return _PATH


def load_error() -> str | None:
    """Why :func:`available` is False (None when it is True)."""
    return _ERROR


def version() -> str | None:
    """ISA-L's version string, e.g. ``"2.32.0"`` (None when unavailable or too old to say)."""
    if _LIB is None or not hasattr(_LIB, "isal_get_version_str"):
        return None
    fn = _LIB.isal_get_version_str
    fn.argtypes = []
    fn.restype = ctypes.c_char_p
    v = fn()
    return v.decode() if isinstance(v, bytes) else None


def _lib() -> ctypes.CDLL:
    if _LIB is None:
        raise UsageError(f"ISA-L is not available: {_ERROR}")
    return _LIB


def _addr(a: np.ndarray, what: str, *, writable: bool = False) -> int:
    if not isinstance(a, np.ndarray) or a.dtype != np.uint8:
        raise UsageError(f"{what} must be a numpy uint8 array, got {getattr(a, 'dtype', type(a))}")
    if not a.flags.c_contiguous:
        raise UsageError(f"{what} must be C-contiguous")
    if writable and not a.flags.writeable:
        raise UsageError(f"{what} must be writable")
    return int(a.ctypes.data)


def _addrs(arrays: Sequence[np.ndarray], n: int, what: str, *, writable: bool) -> list[int]:
    """The data addresses of ``arrays``, each checked: uint8, C-contiguous, ``n`` bytes long
    and (``writable``) writable. Messages are built only on failure: this runs per call."""
    out = []
    for i, a in enumerate(arrays):
        if (
            not isinstance(a, np.ndarray)
            or a.dtype != np.uint8
            or not a.flags.c_contiguous
            or (writable and not a.flags.writeable)
        ):
            _addr(a, f"{what}[{i}]", writable=writable)  # raises the precise error
        if a.size != n:
            raise UsageError(f"{what}[{i}] has {a.size} bytes, the first input {n}: lengths differ")
        out.append(_pointer(a))
    return out


def _pointer(a: np.ndarray) -> int:
    """``a.ctypes.data``, 3x faster for writable non-empty arrays (a temporary buffer export:
    the same address, nothing copied)."""
    if a.flags.writeable and a.size:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))  # type: ignore[arg-type]
    return int(a.ctypes.data)


_PTR_ARRAYS: dict[int, type[ctypes.Array[ctypes.c_void_p]]] = {}


def _pointers(addrs: Sequence[int], off: int) -> ctypes.Array[ctypes.c_void_p]:
    t = _PTR_ARRAYS.get(len(addrs))
    if t is None:
        t = _PTR_ARRAYS[len(addrs)] = _vp * len(addrs)
    return t(*addrs) if off == 0 else t(*(a + off for a in addrs))


@dataclass(frozen=True)
class Tables:
    """ISA-L's expanded form of a ``rows x k`` coefficient matrix (``ec_init_tables``)."""

    k: int
    rows: int
    buf: np.ndarray  # rows * k * TABLE_BYTES bytes


def init_tables(coeffs: np.ndarray) -> Tables:
    """``ec_init_tables`` of a ``rows x k`` uint8 matrix (row r: the coefficients of output r)."""
    c = np.ascontiguousarray(coeffs, np.uint8)
    if c.ndim != 2 or c.shape[0] < 1 or c.shape[1] < 1 or max(c.shape) > 256:
        raise UsageError(f"coefficients must be a rows x k matrix, 1..256 each; got {c.shape}")
    rows, k = c.shape
    buf = np.zeros(rows * k * TABLE_BYTES, np.uint8)
    _lib().ec_init_tables(k, rows, c.ctypes.data, buf.ctypes.data)
    buf.setflags(write=False)
    return Tables(k, rows, buf)


def mul_table(c: int) -> np.ndarray:
    """``gf_vect_mul_init``: the 32-byte table of one constant (= :func:`init_tables` of [[c]])."""
    if not 0 <= c <= 255:
        raise UsageError(f"a GF(2^8) constant is 0..255, got {c}")
    buf = np.zeros(TABLE_BYTES, np.uint8)
    _lib().gf_vect_mul_init(c, buf.ctypes.data)
    return buf


def gf_mul(a: int, b: int) -> int:
    """``gf_mul``: ISA-L's scalar product ``a * b`` (for checking the field)."""
    if not (0 <= a <= 255 and 0 <= b <= 255):
        raise UsageError(f"GF(2^8) elements are 0..255, got {a}, {b}")
    return int(_lib().gf_mul(a, b))


def cauchy1_matrix(k: int, m: int) -> np.ndarray:
    """``gf_gen_cauchy1_matrix``: ISA-L's (k + m) x k systematic Cauchy encoding matrix."""
    if k < 1 or m < 0 or k + m > 256:
        raise UsageError(f"need k >= 1, m >= 0, k + m <= 256; got k={k}, m={m}")
    a = np.zeros((k + m, k), np.uint8)
    _lib().gf_gen_cauchy1_matrix(a.ctypes.data, k + m, k)
    return a


def _check_tables(t: Tables) -> int:
    if not isinstance(t, Tables) or t.buf.size != t.rows * t.k * TABLE_BYTES:
        raise UsageError("tables must come from init_tables")
    return _addr(t.buf, "tables")


def encode_data(
    tables: Tables, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray]
) -> None:
    """``ec_encode_data``: ``outputs[r] = sum_t C[r, t] * inputs[t]`` bytewise, overwriting.

    ``len(inputs) == tables.k``, ``len(outputs) == tables.rows``; every array uint8,
    C-contiguous, of one length; outputs writable and not overlapping the inputs.
    """
    tbl = _check_tables(tables)
    if len(inputs) != tables.k or len(outputs) != tables.rows:
        raise UsageError(
            f"tables are for {tables.k} inputs and {tables.rows} outputs; "
            f"got {len(inputs)} and {len(outputs)}"
        )
    n = inputs[0].size if isinstance(inputs[0], np.ndarray) else -1
    src = _addrs(inputs, n, "inputs", writable=False)
    dst = _addrs(outputs, n, "outputs", writable=True)
    fn = _lib().ec_encode_data
    for off in range(0, n, MAX_CALL):
        fn(
            min(MAX_CALL, n - off),
            tables.k,
            tables.rows,
            tbl,
            _pointers(src, off),
            _pointers(dst, off),
        )


def encode_data_update(
    tables: Tables, vec_i: int, block: np.ndarray, outputs: Sequence[np.ndarray]
) -> None:
    """``ec_encode_data_update``: ``outputs[r] ^= C[r, vec_i] * block`` bytewise.

    The contribution of input ``vec_i`` alone, added into ``outputs`` (``tables.rows`` of them);
    the same checks as :func:`encode_data`.
    """
    tbl = _check_tables(tables)
    if not 0 <= vec_i < tables.k or len(outputs) != tables.rows:
        raise UsageError(
            f"tables are for {tables.k} inputs and {tables.rows} outputs; "
            f"got input {vec_i} and {len(outputs)} outputs"
        )
    src = _addr(block, "block")
    n = block.size
    dst = _addrs(outputs, n, "outputs", writable=True)
    fn = _lib().ec_encode_data_update
    for off in range(0, n, MAX_CALL):
        fn(
            min(MAX_CALL, n - off),
            tables.k,
            tables.rows,
            vec_i,
            tbl,
            src + off,
            _pointers(dst, off),
        )


def crc64_available() -> bool:
    """True when ISA-L is loaded and exports ``crc64_ecma_refl`` (CRC-64/XZ)."""
    return _CRC64 is not None


def crc64(data: object, value: int = 0) -> int:
    """CRC-64/XZ (ECMA-182 polynomial, reflected; ``crc64("123456789") = 0x995DC9BBDF1939FA``)
    of a bytes-like object, continuing from ``value`` (the CRC of what came before), with ISA-L's
    carry-less-multiply kernel (about 30 GB/s on one core here, several times the CRC32C
    package). The incremental save's content hash (``format/incremental.py``). The GIL is
    released during the call; nothing is copied."""
    if _CRC64 is None:
        raise UsageError(f"ISA-L's crc64 is not available: {_ERROR or 'not exported'}")
    view = memoryview(data).cast("B")  # type: ignore[arg-type]
    n = len(view)
    if not n:
        return value
    buf = np.frombuffer(view, dtype=np.uint8)
    return int(_CRC64(value, int(buf.ctypes.data), n))


def _load_crc64() -> Any:
    if _LIB is None or not hasattr(_LIB, "crc64_ecma_refl"):
        return None
    fn = _LIB.crc64_ecma_refl
    fn.argtypes = [ctypes.c_uint64, _vp, ctypes.c_uint64]
    fn.restype = ctypes.c_uint64
    if fn(0, b"123456789", 9) != 0x995DC9BBDF1939FA:  # the CRC-64/XZ check value
        return None
    return fn


_CRC64 = _load_crc64()


__all__ = [
    "LIBRARY_NAME",
    "MAX_CALL",
    "TABLE_BYTES",
    "Tables",
    "available",
    "cauchy1_matrix",
    "crc64",
    "crc64_available",
    "encode_data",
    "encode_data_update",
    "find_library",
    "gf_mul",
    "init_tables",
    "library_path",
    "load_error",
    "mul_table",
    "version",
]
