"""The format-version-3 fixture (``spec/fixtures/v3``) reads as ``EXPECTED-v3.json`` says: lists
and tuples as the same types, byte strings as bytes, a pickled object only when trusted; plain
zarr readers see the arrays; ``verify`` and ``inspect`` take it."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import pytest
import zarr
from kit import REPO
from kit.cli import run_cli

import ckptfmt
from ckptfmt.errors import PickleRefusedError
from ckptfmt.manifest.codec import MANIFEST_NAME, dump_manifest, parse_manifest

FIXTURES = REPO / "spec" / "fixtures"
pytestmark = pytest.mark.skipif(
    not (FIXTURES / "v3").is_dir(), reason="the version-3 fixtures are not in this tree"
)


@pytest.fixture(scope="module")
def expected() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((FIXTURES / "EXPECTED-v3.json").read_text())
    assert doc["format_version"] == 3
    exp: dict[str, Any] = doc["containers"]
    return exp


def leaf(tree: Any, name: str) -> Any:
    node = tree
    for c in name.split("/"):
        node = node[int(c)] if isinstance(node, (list, tuple)) else node[c]
    return node


def test_manifest_is_version_3_as_written(expected: dict[str, Any]) -> None:
    data = (FIXTURES / expected["path"] / MANIFEST_NAME).read_bytes()
    manifest = parse_manifest(data)
    assert manifest.format_version == expected["format_version"] == 3
    assert dump_manifest(manifest) == data


def test_loads_the_same_types_when_trusted(expected: dict[str, Any]) -> None:
    got = ckptfmt.load(FIXTURES / expected["path"], trust_pickle=True)
    for name, c in expected["containers"].items():
        node = leaf(got, name)
        assert type(node) is {"list": list, "tuple": tuple}[c["kind"]], name
        assert len(node) == c["items"], name
    for name, t in expected["tensors"].items():
        node = leaf(got, name)
        if t["encoding"] == "bytes":
            assert isinstance(node, bytes) and node.hex() == t["hex"], name
        elif t["encoding"] == "pickle":
            assert repr(node) == t["unpickles_to"], name
        else:
            assert node.dtype.name == t["dtype"] and list(node.shape) == t["shape"], name
            assert hashlib.sha256(node.tobytes()).hexdigest() == t["sha256"], name
    for name, value in expected["values"].items():
        assert leaf(got, name) == value, name


def test_the_pickled_entry_is_refused_without_trust(expected: dict[str, Any]) -> None:
    pickled = [n for n, t in expected["tensors"].items() if t["encoding"] == "pickle"]
    with pytest.raises(PickleRefusedError, match=pickled[0]):
        ckptfmt.load(FIXTURES / expected["path"])


def test_zarr_python_reads_every_tensor(expected: dict[str, Any]) -> None:
    group = zarr.open_group(str(FIXTURES / expected["path"]), mode="r")
    for name, t in expected["tensors"].items():
        arr = np.ascontiguousarray(group[name][...])
        assert str(arr.dtype) == t["dtype"] and list(arr.shape) == t["shape"], name
        assert hashlib.sha256(arr.tobytes()).hexdigest() == t["sha256"], name


def test_verify_and_inspect(expected: dict[str, Any]) -> None:
    root = FIXTURES / expected["path"]
    assert ckptfmt.verify(root).problems == []
    assert run_cli("verify", root).exit_code == expected["cli_exit_status"]
    doc = json.loads(run_cli("inspect", "--json", root).output)
    assert {c["name"]: {"kind": c["kind"], "items": c["items"]} for c in doc["containers"]} == (
        expected["containers"]
    )
    assert {t["name"]: t["encoding"] for t in doc["tensors"]} == {
        n: t["encoding"] for n, t in expected["tensors"].items()
    }
