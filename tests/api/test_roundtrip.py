"""save -> load and save -> open are bit-exact; destination rules; hostile names."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit.arrays import (
    assert_bit_equal,
    assert_state_equal,
    assert_value_equal,
    iter_tensors,
    make_state,
    random_array,
    raw_bytes,
    special_floats,
)
from kit.files import manifest_doc, tree_snapshot, write_manifest
from kit.guards import track_opens

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.dtypes import DTYPES
from ckptfmt.errors import (
    CkptError,
    DestinationExistsError,
    InvalidNameError,
    ManifestError,
    UnsupportedDtypeError,
    UnsupportedValueError,
)
from ckptfmt.storage import commit

SMALL = {"write": WriteOptions(chunk_bytes=24, shard_bytes=96, fsync=False)}


def roundtrip(tmp_path: Path, state: dict[str, Any], **kw: Any) -> dict[str, Any]:
    root = tmp_path / "rt"
    ckptfmt.save(state, root, **kw)
    return ckptfmt.load(root)


def tensor_entry(root: Path, name: str) -> dict[str, Any]:
    for e in manifest_doc(root)["entries"]:
        if e["kind"] == "tensor" and "/".join(e["name"]) == name:
            return e
    raise KeyError(name)


# --- tensors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("kw", [{}, SMALL], ids=["default-grid", "small-grid"])
def test_every_dtype_bit_exact(tmp_path: Path, name: str, kw: dict[str, Any]) -> None:
    arr = random_array(np.random.default_rng(len(name)), DTYPES[name].numpy, (13, 6))
    got = roundtrip(tmp_path, {"x": arr}, **kw)["x"]
    assert_bit_equal(got, arr)
    assert got.dtype == DTYPES[name].numpy


def test_whole_state_bit_exact(tmp_path: Path) -> None:
    state = make_state(1)
    got = roundtrip(tmp_path, state, **SMALL)
    assert_state_equal(got, state)


@pytest.mark.parametrize("name", sorted(special_floats()))
def test_nan_payloads_and_negative_zero_kept(tmp_path: Path, name: str) -> None:
    arr = special_floats()[name]
    got = roundtrip(tmp_path, {"x": arr, "x0": arr[1]}, **SMALL)
    assert got["x"].view(np.uint8).tobytes() == arr.view(np.uint8).tobytes()
    assert got["x0"].shape == () and got["x0"].tobytes() == arr[1:2].tobytes()


def _poison_small_buffers(nbytes: int) -> None:
    """Leave freed buffers of ``nbytes`` full of 0xA5 behind, so a tensor that is allocated but
    never filled shows up (numpy reuses small freed buffers)."""
    junk = [np.full(nbytes, 0xA5, np.uint8) for _ in range(32)]
    del junk


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_zero_d_tensors(tmp_path: Path, name: str) -> None:
    rng = np.random.default_rng(7)
    arr = random_array(rng, DTYPES[name].numpy, ())
    while raw_bytes(arr) == b"\xa5" * arr.itemsize:
        arr = random_array(rng, DTYPES[name].numpy, ())
    root = tmp_path / "c"
    ckptfmt.save({"s": arr}, root, write=WriteOptions(fsync=False))
    _poison_small_buffers(arr.itemsize)
    got = ckptfmt.load(root)["s"]
    assert_bit_equal(got, arr)
    view = ckptfmt.open(root)["s"]
    assert view.shape == () and view.nbytes == arr.itemsize
    _poison_small_buffers(arr.itemsize)
    assert_bit_equal(view[()], arr)
    assert_bit_equal(view[...], arr)
    assert_bit_equal(np.asarray(view), arr)
    assert ckptfmt.verify(root).healthy


def test_many_zero_d_tensors(tmp_path: Path) -> None:
    """Distinct 0-d tensors of every dtype in one checkpoint each come back with their own bytes."""
    rng = np.random.default_rng(17)
    state = {
        f"{n}_{i}": random_array(rng, d.numpy, ()) for n, d in DTYPES.items() for i in range(3)
    }
    got = roundtrip(tmp_path, state, write=WriteOptions(fsync=False))
    assert_state_equal(got, state)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4, 5), (2, 0, 3), (1, 1, 0, 1)])
def test_empty_tensors(tmp_path: Path, shape: tuple[int, ...]) -> None:
    arr = np.zeros(shape, dtype=ml_dtypes.bfloat16)
    root = tmp_path / "c"
    ckptfmt.save(
        {"e": arr, "f": np.zeros(shape, np.complex128)}, root, write=WriteOptions(fsync=False)
    )
    got = ckptfmt.load(root)
    assert_bit_equal(got["e"], arr)
    assert_bit_equal(got["f"], np.zeros(shape, np.complex128))
    ck = ckptfmt.open(root)
    assert ck["e"].shape == shape and ck["e"].nbytes == 0
    assert_bit_equal(ck["e"][...], arr)
    assert ckptfmt.verify(root).healthy


@pytest.mark.parametrize("dt", [">f4", ">f8", ">i2", ">i8", ">u4", ">c8", ">c16", ">f2"])
def test_big_endian_input_comes_back_native(tmp_path: Path, dt: str) -> None:
    native = np.dtype(dt).newbyteorder("=")
    values = random_array(np.random.default_rng(3), native, (4, 5))
    arr = values.astype(dt)
    assert arr.dtype.byteorder == ">"
    got = roundtrip(tmp_path, {"x": arr}, **SMALL)["x"]
    assert got.dtype == native and got.dtype.byteorder in "=|"
    assert got.tobytes() == values.tobytes()  # the same numbers, little-endian bytes


def test_non_contiguous_inputs(tmp_path: Path) -> None:
    base = random_array(np.random.default_rng(4), np.float32, (8, 9, 5))
    cases = {
        "transposed": base.T,
        "sliced": base[1:7:2, ::3, 1:],
        "reversed": base[::-1, :, ::-2],
        "fortran": np.asfortranarray(base),
        "bf16_t": random_array(np.random.default_rng(5), ml_dtypes.bfloat16, (6, 4)).T,
    }
    assert not any(a.flags.c_contiguous for k, a in cases.items() if k != "fortran")
    got = roundtrip(tmp_path, cases, **SMALL)
    for k, a in cases.items():
        assert got[k].flags.c_contiguous
        assert_bit_equal(got[k], a)


def test_numpy_scalars_come_back_as_0d_arrays(tmp_path: Path) -> None:
    scalars = {
        "f32": np.float32(1.5),
        "i64": np.int64(-3),
        "b": np.bool_(True),
        "c64": np.complex64(1 - 2j),
        "bf16": ml_dtypes.bfloat16(0.75),
        "e4m3": ml_dtypes.float8_e4m3fn(-2),
        "u8": np.uint8(255),
    }
    got = roundtrip(tmp_path, scalars, write=WriteOptions(fsync=False))
    for k, s in scalars.items():
        assert isinstance(got[k], np.ndarray) and got[k].shape == ()
        assert_bit_equal(got[k], np.asarray(s))


def test_padded_edges_and_multi_axis_shards(tmp_path: Path) -> None:
    arr = random_array(np.random.default_rng(8), np.float32, (7, 5, 3))
    root = tmp_path / "c"
    ckptfmt.save({"w": arr}, root, write=WriteOptions(chunk_bytes=8, shard_bytes=16, fsync=False))
    e = tensor_entry(root, "w")
    files = [f["path"] for r in e["regions"] for f in r["files"]]
    cells = [tuple(int(x) for x in p.split("/c/")[1].split("/")) for p in files]
    # shards along more than one axis, and a chunk shape that leaves padded edges
    assert len({c[0] for c in cells}) > 1 and len({c[1] for c in cells}) > 1
    assert any(s % c for s, c in zip(e["shape"], e["chunk_shape"]))
    assert any(s % h for s, h in zip(e["shape"], e["shard_shape"]))
    assert_bit_equal(ckptfmt.load(root)["w"], arr)
    assert ckptfmt.verify(root).healthy


def test_row_bigger_than_a_chunk(tmp_path: Path) -> None:
    arr = random_array(np.random.default_rng(9), np.float64, (3, 100))
    root = tmp_path / "c"
    ckptfmt.save({"w": arr}, root, write=WriteOptions(chunk_bytes=64, shard_bytes=256, fsync=False))
    e = tensor_entry(root, "w")
    assert e["chunk_shape"][0] == 1 and e["chunk_shape"][1] < 100  # split axis 1
    assert_bit_equal(ckptfmt.load(root)["w"], arr)
    ck = ckptfmt.open(root)
    assert_bit_equal(ck["w"][1, 13:77], arr[1, 13:77])


def test_element_bigger_than_a_chunk(tmp_path: Path) -> None:
    arr = random_array(np.random.default_rng(10), np.complex128, (3, 4))
    root = tmp_path / "c"
    ckptfmt.save({"w": arr}, root, write=WriteOptions(chunk_bytes=4, shard_bytes=4, fsync=False))
    assert tensor_entry(root, "w")["chunk_shape"] == [1, 1]
    assert_bit_equal(ckptfmt.load(root)["w"], arr)


# --- structure and values ------------------------------------------------------------------------


def test_nested_and_empty_mappings(tmp_path: Path) -> None:
    state = {
        "z": {"y": {"x": {"w": np.arange(3)}}},
        "empty": {},
        "deep_empty": {"a": {"b": {}}},
        "a": 1,
        "mixed": {"t": np.ones(2, np.int8), "v": "s", "e": {}},
    }
    got = roundtrip(tmp_path, state, write=WriteOptions(fsync=False))
    assert_state_equal(got, state)
    assert list(got) == ["z", "empty", "deep_empty", "a", "mixed"]


def test_empty_state(tmp_path: Path) -> None:
    root = tmp_path / "c"
    ckptfmt.save({}, root, write=WriteOptions(fsync=False))
    assert ckptfmt.load(root) == {}
    assert ckptfmt.verify(root).healthy


# Every mapping of the state is a level of the names; dicts are values only inside lists.
VALUES: dict[str, Any] = {
    "int": 7,
    "neg": -12,
    "big": 2**200 + 1,
    "neg_big": -(2**70),
    "float": 0.1,
    "tiny": 5e-324,
    "negzero": -0.0,
    "inf": float("inf"),
    "ninf": float("-inf"),
    "nan": float("nan"),
    "list": [1, 2.5, float("nan"), float("-inf"), "x", None, True, [float("inf")]],
    "dicts": [
        {"a": float("nan"), "b/c": float("inf"), "~d": [float("-inf"), {"e": -0.0}]},
        {"~1": float("nan"), "~0/": float("inf"), "": float("-inf")},
    ],
    "str": 'héllo wörld ✓ 𝄞 \u2028 "quotes" \\ \n\t',
    "empty_str": "",
    "true": True,
    "false": False,
    "none": None,
    "nested": [[], {}, [[1, {"x": [], "y": {"z": [float("nan")]}}]]],
    "unicode_keys": [{"ключ": 1, "": 2, "/": 3, "~": 4}],
    "empty_list": [],
}


def test_values_roundtrip(tmp_path: Path) -> None:
    got = roundtrip(
        tmp_path, {"v": VALUES, "top_nan": float("nan")}, write=WriteOptions(fsync=False)
    )
    assert_value_equal(got["top_nan"], float("nan"))
    assert list(got["v"]) == list(VALUES)
    for k, want in VALUES.items():
        assert_value_equal(got["v"][k], want, k)
    assert math.copysign(1.0, got["v"]["negzero"]) == -1.0
    assert math.copysign(1.0, got["v"]["dicts"][0]["~d"][1]["e"]) == -1.0
    # the same through ckptfmt.open
    ck = ckptfmt.open(tmp_path / "rt")
    assert_value_equal(ck["v/dicts"], VALUES["dicts"])


@pytest.mark.parametrize("value", ["\ud800x", {"k\udfff": 1}, ["a", "\udc00"]])
def test_invalid_unicode_refused(tmp_path: Path, value: Any) -> None:
    """Strings must be valid Unicode (strict JSON readers elsewhere reject lone surrogates)."""
    with pytest.raises((UnsupportedValueError, InvalidNameError)):  # a dict in state is a name
        ckptfmt.save({"v": value}, tmp_path / "rt")
    assert not (tmp_path / "rt").exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", [True, False, None, 0, "", 0.0, []])
def test_falsy_and_bool_top_level_values(tmp_path: Path, value: Any) -> None:
    """A leaf that is True/False/None (or another falsy value) comes back as itself, not as an
    empty mapping and not as an unreadable manifest."""
    got = roundtrip(tmp_path, {"flag": value, "g": {"x": value}}, write=WriteOptions(fsync=False))
    assert_value_equal(got["flag"], value)
    assert_value_equal(got["g"]["x"], value)
    assert ckptfmt.open(tmp_path / "rt")["flag"] == value


def test_tuples_come_back_as_tuples(tmp_path: Path) -> None:
    got = roundtrip(
        tmp_path,
        {"t": (1, (2.5, "x"), ()), "d": [{"k": (1, (2,))}], "l": [1, [2, [3]]]},
        write=WriteOptions(fsync=False),
    )
    assert got["t"] == (1, (2.5, "x"), ())
    assert got["d"] == [{"k": (1, (2,))}]
    assert type(got["d"]) is list and type(got["d"][0]["k"][1]) is tuple
    assert got["l"] == [1, [2, [3]]] and type(got["l"][1]) is list


def test_numpy_scalars_inside_values_become_python(tmp_path: Path) -> None:
    got = roundtrip(
        tmp_path,
        {"v": [np.float32(0.5), np.int16(-4), np.bool_(False)]},
        write=WriteOptions(fsync=False),
    )
    assert_value_equal(got["v"], [0.5, -4, False])


@pytest.mark.parametrize(
    "value",
    [
        1 + 2j,
        [{1: "int key"}],
        object(),
        {1.5},
        [{"a": [{2: 3}]}],
        [np.complex64(1j)],
        float,
        [[[[set()]]]],
    ],
    ids=[
        "complex",
        "int-key",
        "object",
        "set",
        "nested-int-key",
        "complex-scalar-in-list",
        "type",
        "deep-set",
    ],
)
def test_unsupported_values_refused(tmp_path: Path, value: Any) -> None:
    root = tmp_path / "c"
    with pytest.raises(UnsupportedValueError):
        ckptfmt.save({"ok": np.zeros(3), "deep": {"x": {"y": value}}}, root)
    assert not root.exists()
    assert list(tmp_path.iterdir()) == []


def test_too_deep_value_refused(tmp_path: Path) -> None:
    value: Any = 1
    for _ in range(200):
        value = [value]
    with pytest.raises(CkptError):
        ckptfmt.save({"v": value}, tmp_path / "c")
    assert list(tmp_path.iterdir()) == []


def test_huge_int_value_refused_or_roundtrips(tmp_path: Path) -> None:
    """An int JSON readers cannot parse back (Python's default limit: 4300 digits) must be refused
    at save as a CkptError, not escape as a ValueError from json.dumps."""
    root = tmp_path / "c"
    value = 10**5000
    try:
        ckptfmt.save({"v": value}, root, write=WriteOptions(fsync=False))
    except CkptError:
        assert not root.exists() and list(tmp_path.iterdir()) == []
    else:
        assert ckptfmt.load(root)["v"] == value


@pytest.mark.parametrize(
    "arr",
    [
        np.zeros(3, np.longdouble),
        np.array([object()], dtype=object),
        np.array(["a", "b"]),
        np.zeros(2, "datetime64[s]"),
        np.zeros(2, [("a", "i4")]),
        np.array([b"x"]),
    ],
    ids=["longdouble", "object", "str", "datetime", "structured", "bytes"],
)
def test_unsupported_dtypes_refused(tmp_path: Path, arr: np.ndarray) -> None:
    root = tmp_path / "c"
    with pytest.raises(CkptError) as info:
        ckptfmt.save({"a": np.ones(4), "g": {"bad": arr}}, root)
    assert isinstance(info.value, (UnsupportedDtypeError, UnsupportedValueError))
    assert not root.exists()
    assert list(tmp_path.iterdir()) == []


# --- hypothesis: any shape, dtype and grid -------------------------------------------------------

shapes = st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    shape=shapes,
    dtype=st.sampled_from(sorted(DTYPES)),
    chunk=st.integers(1, 300),
    shard_factor=st.integers(1, 8),
    seed=st.integers(0, 2**32 - 1),
)
def test_roundtrip_property(
    tmp_path_factory: pytest.TempPathFactory,
    shape: tuple[int, ...],
    dtype: str,
    chunk: int,
    shard_factor: int,
    seed: int,
) -> None:
    root = tmp_path_factory.mktemp("prop") / "c"
    arr = random_array(np.random.default_rng(seed), DTYPES[dtype].numpy, shape)
    ckptfmt.save(
        {"t": arr},
        root,
        write=WriteOptions(chunk_bytes=chunk, shard_bytes=chunk * shard_factor, fsync=False),
    )
    assert_bit_equal(ckptfmt.load(root)["t"], arr)
    assert_bit_equal(ckptfmt.open(root)["t"][...], arr)
    report = ckptfmt.verify(root)
    assert report.healthy, report.problems
    assert report.unexpected_files == []


# --- open ----------------------------------------------------------------------------------------


def test_open_metadata_without_data(saved: tuple[Path, dict[str, Any]]) -> None:
    root, state = saved
    want = dict(iter_tensors(state))
    # remove every data file: metadata must still come from the manifest alone
    for p in list(root.rglob("*")):
        if p.is_file() and p.name not in ("zarr.json", "ckptfmt.json"):
            p.unlink()
    ck = ckptfmt.open(root)
    tensors = ck.tensors()
    assert set(tensors) == set(want)
    for name, arr in want.items():
        v = tensors[name]
        assert v.name == name
        assert v.shape == arr.shape
        assert v.dtype == arr.dtype
        assert v.nbytes == arr.nbytes
    assert ck["optimizer/step"] == 1234
    keys = list(ck.keys())
    assert "optimizer/lr" in keys and "model/dtypes/bfloat16" in keys
    assert "empty_group" not in keys
    with pytest.raises(KeyError):
        ck["nope"]


def test_contains_agrees_with_getitem(saved: tuple[Path, dict[str, Any]]) -> None:
    """``name in ck`` is true exactly for the names ``ck[name]`` returns (the keys)."""
    root, _ = saved
    ck = ckptfmt.open(root)
    for name in [*ck.keys(), "empty_group", "model", "model/dtypes", "nope"]:
        try:
            ck[name]
            found = True
        except KeyError:
            found = False
        assert (name in ck) == found, name
        assert (name in list(ck.keys())) == found, name


@st.composite
def basic_index(draw: st.DrawFn, shape: tuple[int, ...]) -> tuple[Any, ...]:
    parts: list[Any] = []
    for d in shape:
        kind = draw(st.sampled_from(["int", "slice", "full"]))
        if kind == "int":
            parts.append(draw(st.integers(-d, d - 1)))
        elif kind == "slice":
            a = draw(st.none() | st.integers(-d - 2, d + 2))
            b = draw(st.none() | st.integers(-d - 2, d + 2))
            parts.append(slice(a, b))
        else:
            parts.append(slice(None))
    # drop trailing axes, or replace a run of axes by Ellipsis
    how = draw(st.sampled_from(["all", "prefix", "ellipsis"]))
    if how == "prefix":
        parts = parts[: draw(st.integers(0, len(parts)))]
    elif how == "ellipsis":
        i = draw(st.integers(0, len(parts)))
        j = draw(st.integers(i, len(parts)))
        parts = [*parts[:i], Ellipsis, *parts[j:]]
    return tuple(parts)


SLICE_SHAPE = (5, 6, 7)


@pytest.fixture(scope="module")
def sliced_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    arr = random_array(np.random.default_rng(11), ml_dtypes.bfloat16, SLICE_SHAPE)
    root = tmp_path_factory.mktemp("slice") / "c"
    ckptfmt.save({"t": arr}, root, write=WriteOptions(chunk_bytes=10, shard_bytes=40, fsync=False))
    return root, arr


@settings(max_examples=250, deadline=None)
@given(data=st.data())
def test_slicing_matches_numpy(sliced_ckpt: tuple[Path, np.ndarray], data: st.DataObject) -> None:
    root, arr = sliced_ckpt
    key = data.draw(basic_index(SLICE_SHAPE))
    key = key[0] if len(key) == 1 and data.draw(st.booleans()) else key  # bare int/slice too
    want = arr[key]
    got = ckptfmt.open(root)["t"][key]
    assert got.shape == want.shape, (key, got.shape, want.shape)
    assert raw_bytes(got) == raw_bytes(want), key


def test_slicing_ellipsis_then_int(sliced_ckpt: tuple[Path, np.ndarray]) -> None:
    """A fixed example of the property above: an int after Ellipsis drops the last axis."""
    root, arr = sliced_ckpt
    view = ckptfmt.open(root)["t"]
    for key in [(..., 1), (..., -1), (0, ..., 2), (slice(1, 3), ..., 4)]:
        got = view[key]
        assert got.shape == arr[key].shape, key
        assert raw_bytes(got) == raw_bytes(arr[key]), key


def test_reading_one_tensor_opens_only_its_files(
    saved: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, state = saved
    want = state["model"]["layer.0"]["weight"]
    # damage every other tensor beyond use: delete their data and metadata files
    for name, _ in iter_tensors(state):
        if name != "model/layer.0/weight" and (root / name / "c").exists():
            c = root / name / "c"
            if c.is_dir():
                for p in sorted(c.rglob("*"), reverse=True):
                    p.unlink() if p.is_file() else p.rmdir()
                c.rmdir()
            else:
                c.unlink()
    ck = ckptfmt.open(root)
    with track_opens(monkeypatch) as t:
        got = ck["model/layer.0/weight"][2:7, 1, :]
    assert raw_bytes(got) == raw_bytes(want[2:7, 1, :])
    opened = {os.path.relpath(p, root) for p in t.paths}
    assert opened and all(p.startswith("model/layer.0/weight/c/") for p in opened), opened


def test_open_index_errors_are_usage_errors(sliced_ckpt: tuple[Path, np.ndarray]) -> None:
    root, _ = sliced_ckpt
    view = ckptfmt.open(root)["t"]
    for key in [(5,), (-6,), (0, 0, 0, 0), (slice(None, None, 2),), ([0, 1],), (None,)]:
        with pytest.raises(CkptError):
            view[key]


# --- destination rules ---------------------------------------------------------------------------


def dot_dirs(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_existing_checkpoint_needs_overwrite(tmp_path: Path) -> None:
    root = tmp_path / "c"
    ckptfmt.save({"a": np.arange(4), "old_only": 1}, root, write=WriteOptions(fsync=False))
    before = tree_snapshot(root)
    with pytest.raises(DestinationExistsError):
        ckptfmt.save({"a": np.zeros(2)}, root, write=WriteOptions(fsync=False))
    assert tree_snapshot(root) == before
    ckptfmt.save(
        {"a": np.full(3, 9, np.int16)}, root, write=WriteOptions(fsync=False, overwrite=True)
    )
    got = ckptfmt.load(root)
    assert list(got) == ["a"]
    assert_bit_equal(got["a"], np.full(3, 9, np.int16))
    assert dot_dirs(tmp_path) == []
    assert ckptfmt.verify(root).unexpected_files == []


def test_foreign_directory_untouched(tmp_path: Path) -> None:
    root = tmp_path / "c"
    root.mkdir()
    (root / "notes.txt").write_text("mine")
    (root / "sub").mkdir()
    (root / "sub" / "x.bin").write_bytes(b"\x00\x01")
    before = tree_snapshot(root)
    for overwrite in (False, True):
        with pytest.raises(DestinationExistsError):
            ckptfmt.save({"a": np.arange(3)}, root, write=WriteOptions(overwrite=overwrite))
        assert tree_snapshot(root) == before
    assert dot_dirs(tmp_path) == []


def test_destination_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "c"
    f.write_text("x")
    with pytest.raises(DestinationExistsError):
        ckptfmt.save({"a": 1}, f, write=WriteOptions(overwrite=True))
    assert f.read_text() == "x"
    assert dot_dirs(tmp_path) == []


def test_empty_existing_directory_is_fine(tmp_path: Path) -> None:
    root = tmp_path / "c"
    root.mkdir()
    ckptfmt.save({"a": 1}, root, write=WriteOptions(fsync=False))
    assert ckptfmt.load(root) == {"a": 1}
    assert dot_dirs(tmp_path) == []


def test_failing_save_leaves_nothing(tmp_path: Path) -> None:
    root = tmp_path / "c"
    state = make_state()
    state["optimizer"]["deep"] = {"x": [1, {"y": object()}]}
    with pytest.raises(CkptError):
        ckptfmt.save(state, root)
    assert list(tmp_path.iterdir()) == []


def test_failing_overwrite_keeps_old(tmp_path: Path) -> None:
    root = tmp_path / "c"
    ckptfmt.save({"a": np.arange(5)}, root, write=WriteOptions(fsync=False))
    before = tree_snapshot(root)
    with pytest.raises(CkptError):
        ckptfmt.save(
            {"a": np.zeros(2), "b": np.zeros(2, np.longdouble)},
            root,
            write=WriteOptions(overwrite=True),
        )
    assert tree_snapshot(root) == before
    assert dot_dirs(tmp_path) == []


def test_failure_while_writing_removes_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fails after the staging directory exists leaves no trace."""
    from ckptfmt.storage import files

    real = files.write_gather
    calls = {"n": 0}

    def failing(path: Path, pieces: Any, fsync: bool = True, copy_to: Any = None) -> int:
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(28, "No space left on device (injected)")
        return real(path, pieces, fsync, copy_to)

    monkeypatch.setattr(files, "write_gather", failing)
    for mod in ("ckptfmt.storage.store.directory", "ckptfmt.storage.commit"):
        monkeypatch.setattr(f"{mod}.write_gather", failing, raising=False)
    root = tmp_path / "c"
    with pytest.raises(CkptError):
        ckptfmt.save(
            make_state(), root, write=WriteOptions(chunk_bytes=64, shard_bytes=64, fsync=False)
        )
    assert calls["n"] >= 5
    assert list(tmp_path.iterdir()) == []


def test_clean_leftovers(tmp_path: Path) -> None:
    sid = "0123456789abcdef0123456789abcdef"
    sid2 = "fedcba9876543210fedcba9876543210"
    # a save that never committed
    (tmp_path / f".a.tmp-{sid}").mkdir()
    (tmp_path / f".a.tmp-{sid}" / "junk").write_text("x")
    # an overwrite that crashed between its two renames: x is missing, .x.old holds it
    ckptfmt.save({"v": np.arange(3)}, tmp_path / "x", write=WriteOptions(fsync=False))
    os.rename(tmp_path / "x", tmp_path / f".x.old-{sid2}")
    # a finished overwrite whose old copy was not yet removed
    ckptfmt.save({"v": 1}, tmp_path / "y", write=WriteOptions(fsync=False))
    ckptfmt.save({"v": 2}, tmp_path / f".y.old-{sid}", write=WriteOptions(fsync=False))
    # things that are not leftovers
    (tmp_path / ".hidden").mkdir()
    (tmp_path / f".z.tmp-{sid}").write_text("a file, not a staging dir")

    removed = commit.clean_leftovers(tmp_path)
    assert sorted(p.name for p in removed) == sorted([f".a.tmp-{sid}", f".y.old-{sid}"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".hidden", f".z.tmp-{sid}", "x", "y"]
    )
    assert_bit_equal(ckptfmt.load(tmp_path / "x")["v"], np.arange(3))
    assert ckptfmt.load(tmp_path / "y") == {"v": 1}
    assert commit.clean_leftovers(tmp_path / "missing") == []


def test_a_save_removes_what_crashed_saves_of_its_name_left(tmp_path: Path) -> None:
    """A save killed before its rename leaves its staging directory (a whole checkpoint's
    bytes); the next save to the same path removes it, and leaves other names' alone (another
    save may be writing them)."""
    sid, sid2 = "0123456789abcdef0123456789abcdef", "fedcba9876543210fedcba9876543210"
    ckptfmt.save({"v": np.arange(3)}, tmp_path / "last", write=WriteOptions(fsync=False))
    shutil.copytree(tmp_path / "last", tmp_path / f".last.tmp-{sid}")  # killed before its rename
    shutil.copytree(tmp_path / "last", tmp_path / f".last.old-{sid2}")  # killed after it
    (tmp_path / f".other.tmp-{sid}").mkdir()
    ckptfmt.save({"v": np.arange(4)}, tmp_path / "last", write=WriteOptions(overwrite=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".other.tmp-{sid}", "last"]
    assert_bit_equal(ckptfmt.load(tmp_path / "last")["v"], np.arange(4))


def test_a_removal_finishes_the_removals_a_crash_cut_short(tmp_path: Path) -> None:
    """A removal killed after its rename leaves a whole checkpoint under ``.name.del-*``; the
    next removal in the directory deletes it (its name may never be removed again)."""
    for name in ("a", "b", "c"):
        ckptfmt.save({"v": np.arange(3)}, tmp_path / name, write=WriteOptions(fsync=False))
    os.rename(tmp_path / "a", tmp_path / f".a.del-{'0' * 32}")  # as commit.remove, then killed
    commit.remove(tmp_path / "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    assert_bit_equal(ckptfmt.load(tmp_path / "c")["v"], np.arange(3))


# --- names ---------------------------------------------------------------------------------------

BAD_COMPONENTS: list[Any] = [
    "..",
    ".",
    "",
    "...",
    "a/b",
    "a\\b",
    "\x00",
    "a\x00b",
    "__x",
    "__",
    "zarr.json",
    "ckptfmt.json",
    ".zarray",
    "a\nb",
    "\x1f",
    "\x7f",
    "\t",
    "x" * 300,
    "é" * 128,
    "\ud800",
    0,
    1,
    2.5,
    None,
    ("a",),
    b"a",
]


@pytest.mark.parametrize("bad", BAD_COMPONENTS, ids=[repr(b)[:20] for b in BAD_COMPONENTS])
@pytest.mark.parametrize("where", ["top", "nested", "value"])
def test_hostile_names_refused_at_save(tmp_path: Path, bad: Any, where: str) -> None:
    leaf = np.arange(3) if where != "value" else 1
    state: dict[Any, Any] = {bad: leaf} if where == "top" else {"g": {"h": {bad: leaf}}}
    with pytest.raises(InvalidNameError):
        ckptfmt.save(state, tmp_path / "c")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("good", ["c", "zarr", "a.b", ".x", "x..y", "_x", "ключ", "𝄞", "x" * 255])
def test_unusual_but_valid_names(tmp_path: Path, good: str) -> None:
    state = {good: np.arange(4, dtype=np.int8), "g": {good: {good: 1.5}}}
    got = roundtrip(tmp_path, state, write=WriteOptions(fsync=False))
    assert_state_equal(got, state)
    assert ckptfmt.verify(tmp_path / "rt").healthy


def _saved_for_names(tmp_path: Path) -> Path:
    root = tmp_path / "c"
    ckptfmt.save(
        {"t": np.arange(6, dtype=np.int32), "v": 1, "g": {}}, root, write=WriteOptions(fsync=False)
    )
    return root


@pytest.mark.parametrize(
    "bad",
    [
        "..",
        ".",
        "",
        "a/b",
        "\x00",
        "__x",
        "zarr.json",
        "ckptfmt.json",
        "\n",
        "x" * 300,
        5,
        None,
        ["a"],
    ],
)
@pytest.mark.parametrize("kind", ["tensor", "value", "group"])
def test_hostile_names_refused_at_load(
    tmp_path: Path, bad: Any, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _saved_for_names(tmp_path)
    doc = manifest_doc(root)
    for e in doc["entries"]:
        if e["kind"] == kind:
            e["name"] = [bad] if kind != "tensor" else ["t", bad]
            if kind == "tensor" and isinstance(bad, str):
                # keep the manifest self-consistent: path and file paths follow the name
                e["path"] = "/".join(e["name"])
                for r in e["regions"]:
                    for f in r["files"]:
                        f["path"] = e["path"] + "/c/" + f["path"].split("/c/")[1]
    write_manifest(root, doc)
    with track_opens(monkeypatch) as t:
        for fn in (ckptfmt.load, ckptfmt.open, ckptfmt.verify):
            with pytest.raises(ManifestError):
                fn(root)
    assert [os.path.relpath(p, root) for p in t.paths] == ["ckptfmt.json"] * 3


@pytest.mark.parametrize(
    "path",
    [
        "../../etc/passwd",
        "/etc/passwd",
        "t/c/../../../etc/passwd",
        "t/c/0/../../../x",
        "t/c/0/",
        "t\\c\\0",
        "t/c/00",
        "t/c/-0",
        "t/c/0\x00",
        "t/c/ 0",
        "t/c/1",
    ],
)
def test_file_paths_outside_checkpoint_refused(
    tmp_path: Path, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _saved_for_names(tmp_path)
    doc = manifest_doc(root)
    for e in doc["entries"]:
        if e["kind"] == "tensor":
            e["regions"][0]["files"][0]["path"] = path
    write_manifest(root, doc)
    with track_opens(monkeypatch) as t:
        for fn in (ckptfmt.load, ckptfmt.open, ckptfmt.verify):
            with pytest.raises(ManifestError):
                fn(root)
    assert [os.path.relpath(p, root) for p in t.paths] == ["ckptfmt.json"] * 3


@pytest.mark.parametrize("path", ["../t", "/t", "t/..", "x", "t/"])
def test_tensor_path_must_be_its_name(tmp_path: Path, path: str) -> None:
    root = _saved_for_names(tmp_path)
    doc = manifest_doc(root)
    for e in doc["entries"]:
        if e["kind"] == "tensor":
            e["path"] = path
    write_manifest(root, doc)
    with pytest.raises(ManifestError):
        ckptfmt.load(root)


def test_manifest_roundtrips_through_json(saved: tuple[Path, dict[str, Any]]) -> None:
    """The manifest file is plain strict JSON (no NaN tokens), and re-parsing it gives the same
    manifest that save returned."""
    from ckptfmt.manifest.codec import dump_manifest, parse_manifest

    root, _ = saved
    data = (root / "ckptfmt.json").read_bytes()
    json.loads(data, parse_constant=lambda t: pytest.fail(f"non-JSON token {t}"))
    m = parse_manifest(data)
    assert dump_manifest(m) == data


def test_per_rank_leaves_in_one_process(tmp_path: Path) -> None:
    """``PerRank`` leaves: a per-rank tensor (leading rank axis) and a per-rank value; one process
    sees its own row / value back through a collective load, and the whole through ``load``."""
    from ckptfmt import PerRank
    from ckptfmt.container.reader import read_manifest
    from ckptfmt.parallel.collective.load import load_collective
    from ckptfmt.transport.comm import SingleComm

    rng_state = np.arange(12, dtype=np.uint32).reshape(3, 4)
    ckptfmt.save(
        {"rng": PerRank(rng_state), "pos": PerRank({"epoch": 2, "index": 17})}, tmp_path / "c"
    )
    m = read_manifest(tmp_path / "c")
    rng_entry = next(e for e in m.tensors() if e.name == ("rng",))
    assert rng_entry.per_rank and rng_entry.shape == (1, 3, 4)
    whole = ckptfmt.load(tmp_path / "c")
    assert np.array_equal(whole["rng"], rng_state[None]) and whole["pos"] == [
        {"epoch": 2, "index": 17}
    ]
    own, _ = load_collective(SingleComm(), tmp_path / "c")
    assert own["rng"].shape == (3, 4) and np.array_equal(own["rng"], rng_state)
    assert own["pos"] == {"epoch": 2, "index": 17}


def test_read_into_fills_a_box_in_place_and_refuses_a_wrong_buffer(
    saved: tuple[Path, dict[str, Any]],
) -> None:
    """``TensorView.read_into`` is the lazy read without its allocation (the DCP reader fills a
    training tensor with it): the same bytes as indexing, into the caller's array."""
    root, _state = saved
    ckpt = ckptfmt.open(root)
    view = max(ckpt.tensors().values(), key=lambda v: v.nbytes)
    assert view.shape, "the saved state's largest tensor has dimensions"
    bounds = [(1 if d > 2 else 0, d) for d in view.shape]
    out = np.full([b - a for a, b in bounds], 7, dtype=view.dtype)
    view.read_into(out, bounds)
    np.testing.assert_array_equal(out, view[tuple(slice(a, b) for a, b in bounds)])
    with pytest.raises(ckptfmt.errors.UsageError, match="read_into needs"):
        view.read_into(np.empty([d + 1 for d in out.shape], dtype=view.dtype), bounds)
