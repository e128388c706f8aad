"""Arithmetic in GF(2^8) with the polynomial x^8 + x^4 + x^3 + x^2 + 1 (0x11D), in numpy.

Elements are bytes; addition is XOR; multiplication is polynomial multiplication modulo 0x11D,
tabulated once as a 256 x 256 product table (64 KiB). Bulk work multiplies whole byte arrays by
one constant through a 65,536-entry *pair table* per constant (two bytes per lookup), the fastest
pure-numpy form measured (~1 GB/s for RS 8+2 on one core; ``bench/README.md``, ``bench_gf.py``).
Where ISA-L is available (:mod:`ckptfmt.redundancy.isal`, from the optional ``pyeclib`` wheel),
the bulk functions :func:`mul_add_blocks` and :func:`mul_xor_into` run on it instead, with the same
bytes as the numpy path (``bench/README.md``: many times faster); :func:`set_backend` pins one.

Encoding matrices (``spec/redundancy.md``, "Reed-Solomon"): :func:`cauchy_matrix` is the one ckptfmt
writes; :func:`scr_vandermonde_matrix` rebuilds SCR/redset's for comparison and tests.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from ckptfmt.errors import UsageError
from ckptfmt.redundancy import isal

POLY = 0x11D
SLICE = 1 << 20  # bytes per slice in bulk operations: keeps the working set in cache

_exp = np.zeros(512, np.uint8)
_log = np.zeros(256, np.int64)
_v = 1
for _i in range(255):
    _exp[_i] = _v
    _log[_v] = _i
    _v <<= 1
    if _v & 0x100:
        _v ^= POLY
_exp[255:510] = _exp[:255]
EXP: np.ndarray = _exp  # EXP[i] = 2^i, for i in 0..509 (doubled so log sums need no modulo)
LOG: np.ndarray = _log  # LOG[a] for a != 0; LOG[0] is unused

_a = np.arange(256)
MUL: np.ndarray = np.where(
    (_a[:, None] != 0) & (_a[None, :] != 0), EXP[(LOG[_a][:, None] + LOG[_a][None, :]) % 255], 0
).astype(np.uint8)  # MUL[a, b] = a * b
MUL.setflags(write=False)
INV: np.ndarray = np.zeros(256, np.uint8)  # INV[a] = 1 / a for a != 0; INV[0] = 0 (no inverse)
INV[1:] = EXP[(255 - LOG[1:]) % 255]
INV.setflags(write=False)


def mul(a: int, b: int) -> int:
    """a * b in GF(2^8)."""
    return int(MUL[a, b])


def inv(a: int) -> int:
    """1 / a in GF(2^8); raises :class:`ZeroDivisionError` for 0."""
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(2^8)")
    return int(INV[a])


def power(a: int, n: int) -> int:
    """a ** n in GF(2^8), with 0 ** 0 = 1."""
    if n == 0:
        return 1
    if a == 0:
        return 0
    return int(EXP[(int(LOG[a]) * n) % 255])


def mul_arrays(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise product of two uint8 arrays (broadcasting)."""
    return MUL[a, b]  # type: ignore[no-any-return]


@lru_cache(maxsize=1024)
def pair_table(c: int) -> np.ndarray:
    """65,536-entry uint16 table: two adjacent bytes (as a native uint16) times ``c``, bytewise."""
    pairs = np.arange(65536, dtype=np.uint16).view(np.uint8)
    t: np.ndarray = MUL[c][pairs].view(np.uint16)
    t.setflags(write=False)
    return t


def mat_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Matrix product over GF(2^8) of uint8 matrices ``a`` (r x n) and ``b`` (n x c)."""
    a = np.asarray(a, np.uint8)
    b = np.asarray(b, np.uint8)
    out = np.zeros((a.shape[0], b.shape[1]), np.uint8)
    for t in range(a.shape[1]):
        out ^= MUL[a[:, t][:, None], b[t][None, :]]
    return out


def mat_inv(a: np.ndarray) -> np.ndarray:
    """Inverse of a square uint8 matrix over GF(2^8) by Gauss-Jordan elimination.

    Raises :class:`ZeroDivisionError` when the matrix is singular.
    """
    a = np.array(a, np.uint8)
    n = a.shape[0]
    if a.shape != (n, n):
        raise UsageError(f"mat_inv needs a square matrix, got shape {a.shape}")
    aug = np.concatenate([a, np.eye(n, dtype=np.uint8)], axis=1)
    for col in range(n):
        nz = np.nonzero(aug[col:, col])[0]
        if nz.size == 0:
            raise ZeroDivisionError(f"matrix is singular (no pivot in column {col})")
        p = col + int(nz[0])
        if p != col:
            aug[[col, p]] = aug[[p, col]]
        aug[col] = MUL[INV[aug[col, col]], aug[col]]
        factors = aug[:, col].copy()
        factors[col] = 0
        aug ^= MUL[factors[:, None], aug[col][None, :]]
    return aug[:, n:].copy()


def cauchy_matrix(k: int, m: int) -> np.ndarray:
    """Systematic (k + m) x k encoding matrix: the identity on top of an m x k Cauchy block.

    Row ``k + i`` (parity ``i``), column ``j`` (data member ``j``) is ``1 / (x_i + y_j)`` with
    ``x_i = k + i`` and ``y_j = j`` as field elements (``+`` is XOR). The k + m points are distinct,
    so every square submatrix of the Cauchy block is invertible and any k rows of the whole matrix
    are: the code is MDS for every k, m with k + m <= 256. This is the matrix of ISA-L's
    ``gf_gen_cauchy1_matrix`` (same polynomial).
    """
    _check_km(k, m)
    g = np.zeros((k + m, k), np.uint8)
    g[:k] = np.eye(k, dtype=np.uint8)
    x = np.arange(k, k + m)[:, None]
    y = np.arange(k)[None, :]
    g[k:] = INV[x ^ y]
    return g


def vandermonde_matrix(k: int, m: int) -> np.ndarray:
    """(k + m) x k Vandermonde matrix over the points 0..k+m-1: entry (i, j) = i ** j."""
    _check_km(k, m)
    return np.array([[power(i, j) for j in range(k)] for i in range(k + m)], np.uint8)


def scr_vandermonde_matrix(k: int, m: int) -> np.ndarray:
    """SCR/redset's encoding matrix: :func:`vandermonde_matrix` times the inverse of its top k x k
    block, so the top is the identity (column operations keep every k-row minor non-zero: MDS)."""
    v = vandermonde_matrix(k, m)
    return mat_mul(v, mat_inv(v[:k]))


def isal_rs_matrix(k: int, m: int) -> np.ndarray:
    """ISA-L's ``gf_gen_rs_matrix``: the identity on top of rows ``(2^i) ** j`` for i = 0..m-1.

    Not reduced, so not MDS in general for m >= 5; kept to show why ckptfmt uses Cauchy.
    """
    _check_km(k, m)
    g = np.zeros((k + m, k), np.uint8)
    g[:k] = np.eye(k, dtype=np.uint8)
    for i in range(m):
        g[k + i] = [power(power(2, i), j) for j in range(k)]
    return g


def _check_km(k: int, m: int) -> None:
    if k < 1 or m < 0 or k + m > 256:
        raise UsageError(f"need k >= 1, m >= 0, k + m <= 256; got k={k}, m={m}")


BACKENDS = ("auto", "isal", "numpy")
_backend = "auto"


def set_backend(name: str) -> None:
    """Choose what computes :func:`mul_add_blocks` and :func:`mul_xor_into`: ``"isal"`` (raises
    :class:`UsageError` when ISA-L is not available), ``"numpy"``, or ``"auto"`` (the default:
    ISA-L when available). Process-wide; for tests and benchmarks."""
    global _backend
    if name not in BACKENDS:
        raise UsageError(f"unknown GF(2^8) backend {name!r} (known: {list(BACKENDS)})")
    if name == "isal" and not isal.available():
        raise UsageError(f"ISA-L is not available: {isal.load_error()}")
    _backend = name


def backend() -> str:
    """The backend in use: ``"isal"`` or ``"numpy"``."""
    if _backend == "numpy" or (_backend == "auto" and not isal.available()):
        return "numpy"
    return "isal"


_local = threading.local()


def _scratch(n: int) -> np.ndarray:
    """A per-thread scratch buffer of at least ``n`` bytes, kept between calls: freshly
    allocated memory is slow to fault in on the machines measured (``bench/README.md``)."""
    buf: np.ndarray | None = getattr(_local, "buf", None)
    if buf is None or buf.size < n:
        buf = np.empty(max(n, 1), np.uint8)
        _local.buf = buf
    return buf[:n]


@lru_cache(maxsize=256)
def _isal_tables(shape: tuple[int, int], coeffs: bytes) -> isal.Tables:
    return isal.init_tables(np.frombuffer(coeffs, np.uint8).reshape(shape))


def _check_blocks(arrays: Sequence[np.ndarray], n: int, what: str, *, writable: bool) -> None:
    for i, a in enumerate(arrays):
        if not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.ndim != 1:
            raise UsageError(f"{what}[{i}] must be a 1-D numpy uint8 array")
        if not a.flags.c_contiguous:
            raise UsageError(f"{what}[{i}] must be contiguous")
        if a.size != n:
            raise UsageError(f"{what}[{i}] has {a.size} bytes, expected {n}")
        if writable and not a.flags.writeable:
            raise UsageError(f"{what}[{i}] must be writable")


def mul_add_blocks(
    coeffs: np.ndarray, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray]
) -> None:
    """``outputs[r] = sum_t coeffs[r, t] * inputs[t]`` over GF(2^8), bytewise, in place.

    ``coeffs`` is ``len(outputs) x len(inputs)``; all arrays are contiguous 1-D uint8 of one
    length (else :class:`UsageError`, before anything is written); the outputs must not overlap
    the inputs. Runs on ISA-L (``ec_encode_data``) when :func:`backend` is ``"isal"``, else on
    numpy (:func:`_mul_add_blocks_numpy`); the bytes are the same.
    """
    c = np.asarray(coeffs)
    if c.shape != (len(outputs), len(inputs)):
        raise UsageError(
            f"coefficients of shape {c.shape} for {len(inputs)} inputs and {len(outputs)} outputs"
        )
    if (
        c.dtype != np.uint8
        and c.size
        and (c.dtype.kind not in "iu" or c.min() < 0 or c.max() > 255)
    ):
        raise UsageError("coefficients must be integers 0..255")
    n = getattr(outputs[0], "size", -1) if outputs else 0
    n = getattr(inputs[0], "size", -1) if inputs else n
    _check_blocks(inputs, n, "inputs", writable=False)
    _check_blocks(outputs, n, "outputs", writable=True)
    if not outputs or n == 0:
        return
    if not inputs:  # the empty sum
        for out in outputs:
            out[:] = 0
        return
    if backend() == "isal":
        isal.encode_data(_isal_tables(c.shape, c.astype(np.uint8).tobytes()), inputs, outputs)
        return
    _mul_add_blocks_numpy(c, inputs, outputs)


def mul_xor_into(out: np.ndarray, c: int, block: np.ndarray) -> None:
    """``out ^= c * block`` over GF(2^8), bytewise, in place (c = 0: nothing; c = 1: XOR).

    Both contiguous 1-D uint8 of one length, not overlapping. ISA-L (``ec_encode_data_update``
    with one row) when :func:`backend` is ``"isal"``, else numpy pair tables.
    """
    if not 0 <= c <= 255:
        raise UsageError(f"a GF(2^8) constant is 0..255, got {c}")
    n = getattr(block, "size", -1)
    _check_blocks([block], n, "block", writable=False)
    _check_blocks([out], n, "out", writable=True)
    if c == 0 or block.size == 0:
        return
    if backend() == "isal":
        isal.encode_data_update(_isal_tables((1, 1), bytes([c])), 0, block, [out])
        return
    _mul_xor_into_numpy(out, c, block)


def _mul_xor_into_numpy(out: np.ndarray, c: int, block: np.ndarray) -> None:
    """The numpy form of :func:`mul_xor_into` (no checks)."""
    n = block.size
    if c == 0 or n == 0:
        return
    if c == 1:
        for start in range(0, n, SLICE):
            o = out[start : start + SLICE]
            np.bitwise_xor(o, block[start : start + SLICE], out=o)
        return
    step = min(SLICE, n)
    step += step & 1
    tmp = _scratch(step)
    table = pair_table(c)
    for start in range(0, n, step):
        stop = min(start + step, n)
        even = (stop - start) & ~1
        i = block[start:stop]
        t8 = tmp[: stop - start]
        if even:
            np.take(table, i[:even].view(np.uint16), out=tmp[:even].view(np.uint16))
        if even != stop - start:
            t8[even:] = MUL[c][i[even:]]
        o = out[start:stop]
        np.bitwise_xor(o, t8, out=o)


def _mul_add_blocks_numpy(
    coeffs: np.ndarray, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray]
) -> None:
    """The numpy form of :func:`mul_add_blocks` (no checks): through :data:`SLICE`-byte
    slices and pair tables, with one reused scratch buffer, so no allocation grows with the
    data."""
    n = inputs[0].size if inputs else 0
    if n == 0 or not outputs:
        return
    step = min(SLICE, n)
    step += step & 1
    tmp = _scratch(step)
    for out in outputs:
        out[:] = 0
    for start in range(0, n, step):
        stop = min(start + step, n)
        even = (stop - start) & ~1
        t8 = tmp[: stop - start]
        t16 = tmp[:even].view(np.uint16)
        for r, out in enumerate(outputs):
            o = out[start:stop]
            for t, inp in enumerate(inputs):
                c = int(coeffs[r, t])
                i = inp[start:stop]
                if c == 0:
                    continue
                if c == 1:
                    np.bitwise_xor(o, i, out=o)
                    continue
                if even:
                    np.take(pair_table(c), i[:even].view(np.uint16), out=t16)
                if even != stop - start:
                    t8[even:] = MUL[c][i[even:]]
                np.bitwise_xor(o, t8, out=o)
