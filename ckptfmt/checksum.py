"""CRC32C (Castagnoli): the checksum of every inner chunk and shard index, and of each data file's
chunk payloads (the manifest's ``files[].crc32c``, ``spec/FORMAT.md``, "Checksums").

The bytes are hashed by ISA-L's ``crc32_iscsi`` when the optional extra ``ckptfmt[fast]`` brings
the library (``isal_library.py``), else by the ``crc32c`` package; both release the GIL. Both are
hardware CRC, but ISA-L folds with carry-less multiplies and streams from memory at 28-31 GB/s on
one core here where the package's ``crc32`` instruction loop gets 16-17 GB/s (a buffer of 512 KiB
to 4 MiB not in the cache, what a save or a load hashes); at 256 KiB: 25 against 17. From the
cache, and below 128 KiB, they are even and the ``ctypes`` call (~2 us) would cost more than it
saves, so small buffers keep to the package (``bench/bench_write_kernels.py``).

What we add is :func:`combine`: the CRC of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)``, in
O(log len) carry-less multiplications modulo the polynomial. The writer needs a CRC of each inner
chunk (zarr's ``crc32c`` codec) *and*, for the manifest, the CRC of the concatenation of a file's
chunk payloads in slot order (without the 4-byte chunk CRCs and the index); combining the chunk CRCs
gives it without a second pass over the data, which measured 4-5% of a tmpfs save per extra pass (1
GiB: ~50 ms against ~470 ms). Readers check it the same way. It is not the CRC of the whole file on
purpose: the CRC of bytes followed by their own CRC is a constant (the residue), so over a file of
``payload || crc32c(payload)`` blocks it would depend only on the block lengths and miss a swapped
or stale shard file. The ``crc32c`` package offers no combine, hence this small piece of arithmetic.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache, lru_cache

import crc32c as _crc32c
import numpy as np

from ckptfmt import isal_library

_POLY = 0x82F63B78  # CRC32C polynomial, bit-reflected
FAST_FROM = 1 << 17  # bytes from which ISA-L's kernel is called, when it is there
_CALL_MAX = 1 << 30  # bytes per ISA-L call: its length is a C int
_CHECK = (b"123456789", 0xE3069283)  # the CRC-32C check value


def crc32c(data: object, value: int = 0) -> int:
    """CRC32C of a bytes-like object, continuing from ``value`` (the CRC of what came before)."""
    try:
        view = memoryview(data)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # e.g. an array of a dtype without a buffer format
        return int(_crc32c.crc32c(data, value))  # type: ignore[arg-type]
    if view.nbytes >= FAST_FROM:
        fast = _fast_kernel()
        if fast is not None:
            return fast(view, value)
    return int(_crc32c.crc32c(view, value))


@cache
def _fast_kernel() -> Callable[[memoryview, int], int] | None:
    """ISA-L's CRC32C as ``f(view, value)``, or None without the library (looked up on first
    use, not at import: ``import ckptfmt`` stays quick for a restart; two threads racing on the
    first call bind the same function twice, harmlessly)."""
    return _bind_isal()


def _bind_isal() -> Callable[[memoryview, int], int] | None:
    lib, _, _ = isal_library.load()
    fn = getattr(lib, "crc32_iscsi", None) if lib is not None else None
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    fn.restype = ctypes.c_uint32

    def kernel(view: memoryview, value: int) -> int:
        # ISA-L takes and returns the raw register: the standard CRC's pre- and post-inversion
        # are applied here (so ``value`` continues a CRC as the package's does).
        buf = np.frombuffer(
            view.cast("B") if view.ndim != 1 or view.format != "B" else view, dtype=np.uint8
        )
        at, crc = buf.ctypes.data, (value & 0xFFFFFFFF) ^ 0xFFFFFFFF
        for start in range(0, buf.size, _CALL_MAX):
            crc = fn(at + start, min(_CALL_MAX, buf.size - start), crc)
        return int(crc ^ 0xFFFFFFFF)

    data, want = _CHECK
    if (
        kernel(memoryview(data), 0) != want
        or kernel(memoryview(data[4:]), _crc32c.crc32c(data[:4])) != want
    ):
        return None  # not the Castagnoli polynomial's CRC: keep to the package
    return kernel


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial, both as reflected 32-bit polynomials."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> list[int]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return table


_X2N = _x2n_table()


@lru_cache(maxsize=256)
def _shift_operator(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial (the operator that appends nbytes zero bytes)."""
    p = 1 << 31  # x^0
    k = 3  # 2^3 bits per byte
    n = nbytes
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


# Readers and writers combine one CRC per inner chunk, almost always of one length (the chunk's
# payload), thousands of times per file set: after a few uses a length gets byte tables for its
# operator (appending ``len_b`` zero bytes is linear in ``crc_a``), four look-ups instead of a
# loop of up to 32 steps (~1 us against ~5 us). A length used once or twice (small tensors of
# many shapes) never pays for building them.
_TABLE_AFTER = 8  # uses of a length before its tables are built
_TABLES_MAX = 64  # lengths with tables (each 4 x 256 ints)
_uses: dict[int, int] = {}
_tables: dict[int, tuple[list[int], list[int], list[int], list[int]]] = {}


def _operator_tables(nbytes: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """The product of every 32-bit value with ``_shift_operator(nbytes)``, per byte of the value
    (the product is linear over GF(2): the value's bits' products XORed)."""
    op = _shift_operator(nbytes)
    basis = [_multmodp(op, 1 << i) for i in range(32)]
    out = []
    for k in range(4):
        t = [0] * 256
        for b in range(1, 256):
            low = b & -b
            t[b] = t[b ^ low] ^ basis[8 * k + low.bit_length() - 1]
        out.append(t)
    return out[0], out[1], out[2], out[3]


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of ``A + B`` given ``crc32c(A)``, ``crc32c(B)`` and ``len(B)``."""
    if len_b == 0:
        return crc_a
    t = _tables.get(len_b)
    if t is None:
        n = _uses.get(len_b, 0) + 1
        if n < _TABLE_AFTER or len(_tables) >= _TABLES_MAX:
            if len(_uses) > 4096:  # many one-off lengths: forget them (counts only)
                _uses.clear()
            _uses[len_b] = n
            return _multmodp(_shift_operator(len_b), crc_a) ^ crc_b
        t = _tables.setdefault(len_b, _operator_tables(len_b))  # a racing thread: same tables
    t0, t1, t2, t3 = t
    return (
        t0[crc_a & 255] ^ t1[(crc_a >> 8) & 255] ^ t2[(crc_a >> 16) & 255] ^ t3[crc_a >> 24] ^ crc_b
    )
