"""Shared helpers of the test suite: states with every dtype, bit-exact comparison, byte damage,
a memory cap for code that must not allocate without bound, and an open() tracker."""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import os
import resource
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import ckptfmt
from ckptfmt.dtypes import DTYPES

REPO = Path(__file__).resolve().parents[1]


# --- arrays --------------------------------------------------------------------------------------


def random_array(rng: np.random.Generator, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """An array of ``dtype`` whose bytes are random (any bit pattern, NaN payloads included);
    bool arrays hold 0/1 only, the values a bool may have."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    if dt == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def raw_bytes(a: Any) -> bytes:
    """The bytes of an array in C order (what bit-exactness compares)."""
    return np.ascontiguousarray(np.asarray(a)).tobytes()


def assert_bit_equal(got: Any, want: Any) -> None:
    """``got`` is a native-order ndarray with ``want``'s logical dtype, shape and exact bytes."""
    want = np.asarray(want)
    native = want.dtype.newbyteorder("=") if want.dtype.byteorder in "<>" else want.dtype
    assert isinstance(got, np.ndarray), type(got)
    assert got.dtype == native, (got.dtype, native)
    assert got.dtype.byteorder in "=|", got.dtype.byteorder
    assert got.shape == want.shape, (got.shape, want.shape)
    assert raw_bytes(got) == raw_bytes(want.astype(native)), "bytes differ"


def special_floats() -> dict[str, np.ndarray]:
    """Float arrays whose bit patterns a value-based comparison would miss: NaN payloads
    (quiet, signalling, negative), negative zero, infinities, subnormals."""
    f32 = np.array(
        [
            0x7FC00001,
            0xFFC12345,
            0x7F800001,
            0x80000000,
            0x7F800000,
            0xFF800000,
            0x00000001,
            0x7FFFFFFF,
        ],
        dtype=np.uint32,
    ).view(np.float32)
    f64 = np.array(
        [
            0x7FF8000000000001,
            0xFFF0000000000001,
            0x8000000000000000,
            0x0000000000000001,
            0x7FF0000000000000,
            0xFFF8DEADBEEF0000,
        ],
        dtype=np.uint64,
    ).view(np.float64)
    f16 = np.array([0x7E01, 0xFC01, 0x8000, 0x0001, 0x7C00, 0xFD55], dtype=np.uint16).view(
        np.float16
    )
    bf16 = np.array([0x7FC1, 0xFF81, 0x8000, 0x0001, 0x7F80, 0xFFFF], dtype=np.uint16).view(
        ml_dtypes.bfloat16
    )
    e4m3 = np.array([0x7F, 0xFF, 0x80, 0x01, 0x7E], dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    e5m2 = np.array([0x7D, 0xFE, 0x80, 0x01, 0x7C, 0xFC], dtype=np.uint8).view(
        ml_dtypes.float8_e5m2
    )
    c64 = np.array([0x7FC00001, 0x80000000, 0xFFC00002, 0x7F800000], dtype=np.uint32).view(
        np.complex64
    )
    c128 = f64.view(np.complex128)
    return {
        "f32": f32,
        "f64": f64,
        "f16": f16,
        "bf16": bf16,
        "e4m3": e4m3,
        "e5m2": e5m2,
        "c64": c64,
        "c128": c128,
    }


def make_state(seed: int = 0) -> dict[str, Any]:
    """A training-state-like nested mapping: every dtype (random bytes, shapes that give padded
    edge chunks with small chunk targets), special floats, 0-d and empty tensors, values and an
    empty mapping."""
    rng = np.random.default_rng(seed)
    tensors = {name: random_array(rng, d.numpy, (5, 7)) for name, d in DTYPES.items()}
    return {
        "model": {
            "dtypes": tensors,
            "layer.0": {
                "weight": random_array(rng, np.float32, (9, 6, 3)),
                "bias": random_array(rng, ml_dtypes.bfloat16, (11,)),
            },
        },
        "special": special_floats(),
        "scalar": np.array(2.5, dtype=np.float64),
        "empty_t": np.zeros((3, 0, 2), dtype=np.int32),
        "optimizer": {
            "step": 1234,
            "lr": 0.001,
            "betas": [0.9, 0.999],
            "name": "adamw",
            "nan_here": [float("nan"), {"x": float("-inf")}],
            "nothing": None,
        },
        "empty_group": {},
    }


def iter_tensors(state: Any, prefix: str = "") -> Iterator[tuple[str, np.ndarray]]:
    """``(name, array)`` of every array in a nested mapping, names joined by '/'."""
    for k, v in state.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from iter_tensors(v, name + "/")
        elif isinstance(v, (np.ndarray, np.generic)):
            yield name, np.asarray(v)


def assert_state_equal(got: Any, want: Any, path: str = "") -> None:
    """Structure, key order, tensors bit-exact, values equal (NaN equal to NaN, -0.0 kept)."""
    if isinstance(want, dict):
        assert isinstance(got, dict), (path, type(got))
        assert list(got) == list(want), (path, list(got), list(want))
        for k in want:
            assert_state_equal(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, (np.ndarray, np.generic)):
        assert_bit_equal(got, want)
    else:
        assert_value_equal(got, want, path)


def assert_value_equal(got: Any, want: Any, path: str = "") -> None:
    """JSON-like value equality; tuples come back as lists; floats compared by repr (so NaN,
    -0.0 and every digit count)."""
    if isinstance(want, (list, tuple)):
        assert type(got) is list, (path, got)
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_value_equal(g, w, f"{path}/{i}")
    elif isinstance(want, dict):
        assert type(got) is dict and list(got) == list(want), (path, got)
        for k in want:
            assert_value_equal(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, float):
        assert type(got) is float and repr(got) == repr(want), (path, got, want)
    else:
        assert type(got) is type(want) and got == want, (path, got, want)


# --- files ---------------------------------------------------------------------------------------


def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    """Flip one bit of a file in place; a negative offset counts from the end."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def manifest_doc(root: Path) -> dict[str, Any]:
    return json.loads((root / "ckptfmt.json").read_text())


def write_manifest(root: Path, doc: Any) -> None:
    """Write ``doc`` as the manifest, as a writer would: sealed with its checksum when its
    format version has one (an edit that is not resealed is damage, see test_integrity_*)."""
    (root / "ckptfmt.json").write_bytes(seal_if_sealed(doc))


def seal_if_sealed(doc: Any) -> bytes:
    """``doc``'s bytes: sealed with the manifest checksum when its ``format_version`` is an
    integer from 2 on, else plain JSON without a checksum member (as version 1 is written)."""
    from ckptfmt.manifest.codec import seal

    if not isinstance(doc, dict):
        return json.dumps(doc).encode()
    version = doc.get("format_version")
    if type(version) is int and version >= 2:
        return seal(doc)
    return json.dumps({k: v for k, v in doc.items() if k != "manifest_crc32c"}).encode()


def tree_snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (relative paths)."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A checkpoint of :func:`make_state` with small chunks (many shard files, padded edges)."""
    state = make_state()
    root = tmp_path / "ckpt"
    ckptfmt.save(state, root, chunk_bytes=24, shard_bytes=96, fsync=False)
    return root, state


# --- guards --------------------------------------------------------------------------------------


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def memory_cap(extra: int = 3 << 30) -> Iterator[None]:
    """Cap this process's address space at its current size plus ``extra`` bytes, so that an
    unbounded allocation fails at once (MemoryError) instead of swapping the machine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _vm_size() + extra
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


class Hang(Exception):
    """Raised by :func:`time_limit` when the code under test runs too long."""


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """Turn a hang into a test failure (SIGALRM; main thread only)."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise Hang(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


class OpenTracker:
    """Records every path opened through builtins.open / io.open / os.open while active."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def outside(self, root: Path) -> list[str]:
        base = os.path.realpath(root)
        return [p for p in self.paths if os.path.commonpath([base, os.path.realpath(p)]) != base]


@contextlib.contextmanager
def track_opens(monkeypatch: pytest.MonkeyPatch) -> Iterator[OpenTracker]:
    tracker = OpenTracker()
    real_open, real_os_open = builtins.open, os.open

    def fake_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, (str, bytes, os.PathLike)):
            tracker.paths.append(os.fsdecode(file))
        return real_open(file, *args, **kwargs)

    def fake_os_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("dir_fd") is None:
            tracker.paths.append(os.fsdecode(path))
        return real_os_open(path, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(builtins, "open", fake_open)
        m.setattr(io, "open", fake_open)
        m.setattr(os, "open", fake_os_open)
        yield tracker


# --- MPICH's shared-memory segments left by killed jobs ------------------------------------------
# A rank killed while MPICH sets up its intra-node shared memory (the fault, SIGKILL and host tests
# kill ranks on purpose) leaves its /dev/shm/mpich_shm_* segment behind: about 3 MiB each, 220
# of them (690 MiB of RAM) after two full runs here. The session removes the ones made while it
# ran that no process has mapped any more.

_SHM = Path("/dev/shm")
_SESSION_START = 0.0


def pytest_sessionstart(session: pytest.Session) -> None:
    global _SESSION_START
    _SESSION_START = time.time()


def _mapped_shm() -> set[str]:
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            mapped.update(
                line.rsplit(" ", 1)[-1].strip()
                for line in maps.read_text().splitlines()
                if "/dev/shm/mpich_shm_" in line
            )
    return mapped


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _SHM.is_dir() or not _SESSION_START:
        return
    mapped = _mapped_shm()
    for seg in _SHM.glob("mpich_shm_*"):
        with contextlib.suppress(OSError):
            if seg.stat().st_mtime >= _SESSION_START and str(seg) not in mapped:
                seg.unlink()
