"""States with every dtype and bit pattern, and comparisons that only pass bit for bit.

``random_array`` is also what the worker scripts build their states from (random bytes: NaN
payloads, -0, subnormals and infinities included, which only a byte comparison tells apart)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np


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
    from ckptfmt.dtypes import DTYPES  # here: worker scripts import this module before ckptfmt

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


def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as one level: every leaf under its '/'-joined name."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def flat_tree(tree: Any, path: str = "") -> dict[str, Any]:
    """A nest of dicts and lists as ``{"a/0/c": leaf}`` (a list's items named by index)."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flat_tree(v, f"{path}/{k}" if path else str(k)))
        return out
    if isinstance(tree, list | tuple):
        return flat_tree({str(i): v for i, v in enumerate(tree)}, path)
    return {path: tree}
