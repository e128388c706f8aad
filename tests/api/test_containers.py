"""Lists, tuples, None and bytes in a state, and objects that are none of these: they save and
load back as the same types (through ``ckptfmt.save/load`` and the manager), plain zarr readers
see the arrays, ``ckptfmt inspect`` shows them; objects are refused by key path unless pickled
on request, and a pickle is loaded only when trusted (``spec/FORMAT.md`` §11)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit.cli import run_cli
from kit.files import manifest_doc, write_manifest
from kit.managers import make_manager

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.errors import ManifestError, PickleRefusedError, UnsupportedValueError
from ckptfmt.maintenance import reshard
from ckptfmt.tree import Blob, Container, flatten, unflatten

NO_FSYNC = WriteOptions(fsync=False)


class Custom:
    """An object of the user's own class (pickled by reference to this module)."""

    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Custom) and other.x == self.x


def nested() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    return {
        "opt": [
            {"m": rng.standard_normal((3, 4)).astype(np.float32), "step": 3},
            {"m": rng.standard_normal(5), "betas": (0.9, 0.999)},
        ],
        "sched": [{"last_epoch": 2, "lrs": [0.1, 0.01]}],
        "pair": (np.arange(6, dtype=np.int16).reshape(2, 3), None, b"\x00\xffraw"),
        "empty": {"list": [], "tuple": (), "bytes": b"", "map": {}},
        "deep": [[(np.float64(2.5), [np.ones(2, np.uint8)])]],
        "none": None,
        "plain": [1, [2, "x"], {"k": None}],
    }


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Equal with the same container types at every level; arrays bit-exact, same dtype."""
    if isinstance(want, (np.ndarray, np.generic)):
        got_arr, want_arr = np.asarray(got), np.asarray(want)
        assert got_arr.dtype == want_arr.dtype and got_arr.shape == want_arr.shape, where
        assert got_arr.tobytes() == want_arr.tobytes(), where
        return
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{where}/{i}")
    else:
        assert got == want, where


def test_nested_containers_round_trip_with_their_types(tmp_path: Path) -> None:
    state = nested()
    ckptfmt.save(state, tmp_path / "c", write=NO_FSYNC)
    got = ckptfmt.load(tmp_path / "c")
    want = dict(state)
    want["deep"] = [[(np.asarray(2.5), [np.ones(2, np.uint8)])]]  # a numpy scalar is a 0-d tensor
    assert_same(got, want)
    assert ckptfmt.verify(tmp_path / "c").problems == []


def test_manifest_marks_containers_and_bytes(tmp_path: Path) -> None:
    ckptfmt.save(nested(), tmp_path / "c", write=NO_FSYNC)
    doc = manifest_doc(tmp_path / "c")
    assert doc["format_version"] == 3
    by_name = {"/".join(e["name"]): e for e in doc["entries"]}
    assert by_name["opt"] == {"kind": "group", "name": ["opt"], "container": "list"}
    assert by_name["pair"]["container"] == "tuple"
    assert by_name["empty/tuple"]["container"] == "tuple"
    assert by_name["empty/list"]["value"] == []  # a list of plain values (none) is a value
    assert by_name["opt/1/betas"]["container"] == "tuple"
    raw = by_name["pair/2"]
    assert (raw["kind"], raw["dtype"], raw["shape"], raw["encoding"]) == (
        "tensor",
        "uint8",
        [5],
        "bytes",
    )
    assert by_name["pair/1"] == {"kind": "value", "name": ["pair", "1"], "value": None}
    assert by_name["plain"]["kind"] == "value"  # a list of plain values stays one value
    names = [e["name"] for e in doc["entries"]]
    assert names.index(["opt"]) < names.index(["opt", "0", "m"])  # a container before its items


def test_a_state_without_containers_stays_version_2(tmp_path: Path) -> None:
    ckptfmt.save({"w": np.zeros(3), "v": [1, 2], "n": None}, tmp_path / "c", write=NO_FSYNC)
    doc = manifest_doc(tmp_path / "c")
    assert doc["format_version"] == 2
    assert all("container" not in e and "encoding" not in e for e in doc["entries"])


def test_zarr_python_reads_the_arrays(tmp_path: Path) -> None:
    state = nested()
    ckptfmt.save(state, tmp_path / "c", write=NO_FSYNC)
    group = zarr.open_group(str(tmp_path / "c"), mode="r")
    assert group["opt/0/m"][...].tobytes() == state["opt"][0]["m"].tobytes()
    assert group["pair/0"][...].tolist() == state["pair"][0].tolist()
    raw = group["pair/2"]
    assert raw.dtype == np.uint8 and bytes(raw[...]) == b"\x00\xffraw"
    assert group["deep/0/0/1/0"][...].tolist() == [1, 1]


def test_offline_reshard_keeps_containers_and_encodings(tmp_path: Path) -> None:
    state = nested()
    ckptfmt.save(state, tmp_path / "c", write=NO_FSYNC)
    reshard(tmp_path / "c", tmp_path / "r", 2, write=NO_FSYNC)
    doc = manifest_doc(tmp_path / "r")
    assert doc["format_version"] == 3
    by_name = {"/".join(e["name"]): e for e in doc["entries"]}
    assert by_name["pair/2"]["encoding"] == "bytes" and by_name["pair"]["container"] == "tuple"
    got = ckptfmt.load(tmp_path / "r")
    assert_same(got["pair"], state["pair"])
    assert_same(got["opt"], state["opt"])


def test_manager_round_trip(tmp_path: Path) -> None:
    state = nested()
    with make_manager(tmp_path) as mgr:
        mgr.save(5, state)
        mgr.wait()
        report = mgr.restore()
    assert report.step == 5 and report.state is not None
    assert_same(report.state["opt"], state["opt"])
    assert_same(report.state["pair"], state["pair"])
    assert_same(report.state["empty"], state["empty"])


def test_manager_restores_into_a_state_with_lists(tmp_path: Path) -> None:
    state = nested()
    target = nested()
    target["opt"][0]["m"] = np.zeros((3, 4), np.float32)
    with make_manager(tmp_path) as mgr:
        mgr.save(1, state)
        mgr.wait()
        report = mgr.restore(target)
    assert report.step == 1
    assert_same(target["opt"], state["opt"])  # a list is replaced whole by the loaded one


@pytest.mark.parametrize(
    ("value", "where"),
    [
        (argparse.Namespace(lr=0.1), "hp/args"),
        (Path("/data"), "hp/args"),
        (Custom(1), "hp/args"),
        ([1, Custom(2)], "hp/args/1"),
        ({"k": (Custom(3),)}, "hp/args/k/0"),
    ],
    ids=["namespace", "path", "custom", "in-list", "in-tuple"],
)
def test_objects_are_refused_by_key_path(tmp_path: Path, value: Any, where: str) -> None:
    with pytest.raises(UnsupportedValueError) as info:
        ckptfmt.save({"w": np.zeros(2), "hp": {"args": value}}, tmp_path / "c", write=NO_FSYNC)
    assert info.value.name == where
    assert "objects='pickle'" in str(info.value)
    assert not (tmp_path / "c").exists()
    with make_manager(tmp_path) as mgr, pytest.raises(UnsupportedValueError) as info:
        mgr.save(1, {"hp": {"args": value}})
    assert info.value.name == where


def test_pickled_objects_load_only_when_trusted(tmp_path: Path) -> None:
    state = {"w": np.arange(3.0), "hp": {"args": argparse.Namespace(lr=0.1), "p": [Path("/d")]}}
    ckptfmt.save(state, tmp_path / "c", objects="pickle", write=NO_FSYNC)
    entry = {"/".join(e["name"]): e for e in manifest_doc(tmp_path / "c")["entries"]}["hp/args"]
    assert (entry["dtype"], entry["encoding"]) == ("uint8", "pickle")
    with pytest.raises(PickleRefusedError, match="hp/args"):
        ckptfmt.load(tmp_path / "c")
    got = ckptfmt.load(tmp_path / "c", trust_pickle=True)
    assert got["hp"]["args"] == argparse.Namespace(lr=0.1) and got["hp"]["p"] == [Path("/d")]
    with make_manager(tmp_path) as mgr:
        mgr.save(2, {"hp": {"c": Custom(4)}}, objects="pickle")
        mgr.wait()
        with pytest.raises(PickleRefusedError, match="hp/c"):
            mgr.restore()
        assert mgr.restore(trust_pickle=True).state == {"hp": {"c": Custom(4)}}


UNPICKLED: list[str] = []


def _unpickled(name: str) -> str:
    UNPICKLED.append(name)
    return name


class Loud:
    """Says when it is unpickled."""

    def __reduce__(self) -> Any:
        return (_unpickled, ("loud",))


def test_nothing_is_unpickled_without_trust(tmp_path: Path) -> None:
    UNPICKLED.clear()
    ckptfmt.save({"x": [Loud()]}, tmp_path / "c", objects="pickle", write=NO_FSYNC)
    with pytest.raises(PickleRefusedError, match="x/0"):
        ckptfmt.load(tmp_path / "c")
    assert UNPICKLED == []
    assert ckptfmt.load(tmp_path / "c", trust_pickle=True) == {"x": ["loud"]}
    assert UNPICKLED == ["loud"]


def test_bad_objects_argument_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(ckptfmt.errors.UsageError):
        ckptfmt.save({"w": np.zeros(1)}, tmp_path / "c", objects="json")  # type: ignore[arg-type]


def test_inspect_shows_containers_and_bytes(tmp_path: Path) -> None:
    ckptfmt.save(nested(), tmp_path / "c", write=NO_FSYNC)
    result = run_cli("inspect", "--json", tmp_path / "c")
    assert result.exit_code == 0
    doc = json.loads(result.output)
    kinds = {c["name"]: (c["kind"], c["items"]) for c in doc["containers"]}
    assert kinds["opt"] == ("list", 2) and kinds["pair"] == ("tuple", 3)
    assert kinds["empty/tuple"] == ("tuple", 0)
    encodings = {t["name"]: t["encoding"] for t in doc["tensors"]}
    assert encodings["pair/2"] == "bytes" and encodings["opt/0/m"] is None
    table = run_cli("inspect", tmp_path / "c").output
    assert "uint8 (bytes)" in table and "opt (list of 2)" in table


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda d: d.update(format_version=2), "unknown member 'container'"),
        (lambda d: d["entries"][0].update(container="set"), "unknown container"),
        (lambda d: d["entries"].append(d["entries"].pop(0)), "listed after its items"),
        (
            lambda d: d["entries"].append({"kind": "value", "name": ["l", "5"], "value": 1}),
            "items must be named 0 to n-1",
        ),
    ],
    ids=["container-in-v2", "unknown-kind", "after-items", "gap"],
)
def test_manifest_rules_for_containers(tmp_path: Path, change: Any, reason: str) -> None:
    ckptfmt.save({"l": [np.zeros(2), 1]}, tmp_path / "c", write=NO_FSYNC)
    doc = manifest_doc(tmp_path / "c")
    change(doc)
    write_manifest(tmp_path / "c", doc)
    with pytest.raises(ManifestError, match=reason):
        ckptfmt.open(tmp_path / "c")


def test_manifest_rules_for_encoded_tensors(tmp_path: Path) -> None:
    ckptfmt.save({"b": b"xyz", "f": np.zeros(2)}, tmp_path / "c", write=NO_FSYNC)
    doc = manifest_doc(tmp_path / "c")
    doc["entries"][1]["encoding"] = "bytes"  # a float64 tensor
    write_manifest(tmp_path / "c", doc)
    with pytest.raises(ManifestError, match="1-d uint8"):
        ckptfmt.open(tmp_path / "c")


# --- flatten / unflatten over nested containers ---------------------------------------------------

_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63),
    st.text(max_size=5),
    st.binary(max_size=8),
    st.builds(lambda n: np.arange(n, dtype=np.int32), st.integers(0, 4)),
)
_keys = st.text(alphabet="abcxyz", min_size=1, max_size=3)
_trees = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(_keys, inner, max_size=4),
    ),
    max_leaves=25,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_keys, _trees, max_size=4))
def test_flatten_unflatten_round_trip(state: dict[str, Any]) -> None:
    leaves = flatten(state, "refuse")
    for _, leaf in leaves:
        assert not isinstance(leaf, (bytes, tuple)) or isinstance(leaf, Blob)
    assert_same(unflatten(leaves), state)
    containers = [leaf for _, leaf in leaves if isinstance(leaf, Container)]
    assert all(c.kind in ("list", "tuple") for c in containers)
