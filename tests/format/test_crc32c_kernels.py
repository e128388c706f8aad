"""CRC32C has two kernels (``ckptfmt/checksum.py``): ISA-L's ``crc32_iscsi`` through ``ctypes``
for buffers of ``FAST_FROM`` bytes or more when the library is installed, the ``crc32c`` package
otherwise. Every checksum in the format must be the same whichever computed it: these tests hold
ISA-L's results to the package's (the reference the format was written with) on lengths around
the switch, unaligned starts, continued CRCs, views of other shapes and types, read-only bytes,
and buffers cut into several C calls."""

from __future__ import annotations

import crc32c as reference
import numpy as np
import pytest

from ckptfmt import checksum, isal_library
from ckptfmt.checksum import FAST_FROM, combine, crc32c

DATA = np.random.default_rng(36).integers(0, 256, 3 * FAST_FROM + 4099, dtype=np.uint8)


@pytest.fixture
def fast() -> None:
    """ISA-L's kernel is in use (the project's environment installs ``ckptfmt[fast]``)."""
    lib, path, why = isal_library.load()
    assert lib is not None, why
    assert checksum._fast_kernel() is not None, f"{path} has no working crc32_iscsi"


@pytest.mark.parametrize(
    "start, n",
    [
        (0, FAST_FROM),
        (0, FAST_FROM - 1),
        (1, FAST_FROM + 1),
        (3, 2 * FAST_FROM + 7),
        (17, 3 * FAST_FROM),
        (0, DATA.size),
    ],
)
def test_isal_matches_the_package(fast: None, start: int, n: int) -> None:
    view = memoryview(DATA)[start : start + n]
    assert crc32c(view) == reference.crc32c(view)
    assert crc32c(bytes(view)) == reference.crc32c(bytes(view))


def test_a_continued_crc_is_the_crc_of_the_whole(fast: None) -> None:
    head, tail = DATA[:1001], DATA[1001:]
    assert tail.nbytes >= FAST_FROM
    assert crc32c(tail, crc32c(head)) == reference.crc32c(DATA)
    assert crc32c(tail, 0xDEADBEEF) == reference.crc32c(tail, 0xDEADBEEF)


def test_views_of_other_shapes_and_types(fast: None) -> None:
    floats = DATA[: 2 * FAST_FROM].view(np.float32).reshape(64, -1)
    assert crc32c(floats) == reference.crc32c(DATA[: 2 * FAST_FROM])
    assert crc32c(memoryview(floats)) == reference.crc32c(DATA[: 2 * FAST_FROM])
    with pytest.raises((TypeError, ValueError, BufferError)):
        crc32c(floats[:, ::2])  # not contiguous: refused, never hashed wrong


def test_a_buffer_longer_than_one_call(fast: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """ISA-L's length is a C int: longer buffers are hashed in several calls (shrunk here)."""
    monkeypatch.setattr(checksum, "_CALL_MAX", 4096 + 3)
    assert crc32c(DATA) == reference.crc32c(DATA)


def test_without_isal_the_package_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksum, "_fast_kernel", lambda: None)
    assert crc32c(DATA) == reference.crc32c(DATA)
    assert crc32c(DATA[FAST_FROM:], crc32c(DATA[:FAST_FROM])) == reference.crc32c(DATA)


def test_combine_agrees_with_either_kernel(fast: None) -> None:
    a, b = DATA[:5000], DATA[5000:]
    assert combine(crc32c(a), crc32c(b), b.nbytes) == reference.crc32c(DATA)


def test_arrays_without_a_buffer_format() -> None:
    """An ml_dtypes array has no buffer format for memoryview: it is hashed as the package
    hashes it (its bytes)."""
    import ml_dtypes

    a = np.arange(FAST_FROM, dtype=np.float32).astype(ml_dtypes.bfloat16)
    assert crc32c(a) == reference.crc32c(a.view(np.uint8))
