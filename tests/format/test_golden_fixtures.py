"""The golden fixtures of spec/fixtures read exactly as spec/fixtures/EXPECTED.json (format
version 1) and spec/fixtures/EXPECTED-v2.json (format version 2) say.

The fixtures are never regenerated or changed by the tests (damage is repaired in a copy); every
version of ckptfmt must read them.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ckptfmt_cli.exits import ExitStatus
from kit import REPO
from kit.arrays import assert_state_equal, assert_value_equal
from kit.cli import run_cli
from kit.files import tree_snapshot

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.errors import (
    DamagedError,
    ManifestChecksumError,
    MetadataMismatchError,
    NotACheckpointError,
)
from ckptfmt.manifest.codec import CHECKSUM_MEMBER, dump_manifest, parse_manifest
from ckptfmt.manifest.values import decode_value

FIXTURES = REPO / "spec" / "fixtures"

pytestmark = pytest.mark.skipif(
    not FIXTURES.is_dir(), reason=f"{FIXTURES} is absent: the golden fixtures are not in this tree"
)


@pytest.fixture(scope="module")
def expected() -> dict[str, Any]:
    doc = json.loads((FIXTURES / "EXPECTED.json").read_text())
    assert doc["format_version"] == 1
    for key in ("healthy", "bitflip", "torn"):
        assert key in doc, key
    return doc


def sha256_le(arr: np.ndarray) -> str:
    a = np.asarray(arr)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def get(state: dict[str, Any], name: list[str]) -> Any:
    node: Any = state
    for c in name:
        node = node[c]
    return node


def manifest_files(ck: ckptfmt.Checkpoint, name: str) -> list[str]:
    view = ck.tensors()[name]
    return [f.path for r in view.entry.regions for f in r.files]


def test_healthy_manifest(expected: dict[str, Any]) -> None:
    exp = expected["healthy"]
    root = FIXTURES / exp["path"]
    assert (root / "ckptfmt.json").is_file() == exp["committed"]
    ck = ckptfmt.open(root)
    assert ck.step == exp["step"]
    assert ck.manifest.save_id == exp["save_id"]
    assert ck.manifest.world_size == exp["world_size"]
    assert ck.manifest.format_version == expected["format_version"]
    tensors = ck.tensors()
    assert sorted(tensors) == sorted("/".join(t["name"]) for t in exp["tensors"])
    for t in exp["tensors"]:
        name = "/".join(t["name"])
        view = tensors[name]
        assert view.entry.dtype == t["dtype"], name
        assert list(view.shape) == t["shape"], name
        assert list(view.entry.shard_shape) == t["shard_shape"], name
        assert list(view.entry.chunk_shape) == t["chunk_shape"], name
        assert view.entry.per_rank == t["per_rank"], name
        assert manifest_files(ck, name) == t["files"], name
        for f in t["files"]:
            assert (root / f).is_file(), f


def test_healthy_tensors_bit_exact(expected: dict[str, Any]) -> None:
    exp = expected["healthy"]
    root = FIXTURES / exp["path"]
    state = ckptfmt.load(root)
    ck = ckptfmt.open(root)
    for t in exp["tensors"]:
        name = "/".join(t["name"])
        arr = get(state, t["name"])
        assert isinstance(arr, np.ndarray), name
        assert list(arr.shape) == t["shape"], name
        assert sha256_le(arr) == t["sha256"], f"load: {name}"
        assert sha256_le(ck[name][...]) == t["sha256"], f"open: {name}"


def test_healthy_values_and_groups(expected: dict[str, Any]) -> None:
    exp = expected["healthy"]
    root = FIXTURES / exp["path"]
    state = ckptfmt.load(root)
    ck = ckptfmt.open(root)
    for v in exp["values"]:
        want = decode_value(copy.deepcopy(v["value"]), v.get("nonfinite", {}), "EXPECTED.json")
        assert_value_equal(get(state, v["name"]), want, "/".join(v["name"]))
        assert_value_equal(ck["/".join(v["name"])], want, "/".join(v["name"]))
    for v in exp["per_rank_values"]:
        assert get(state, v["name"]) == v["values"]
        assert ck["/".join(v["name"])] == v["values"]
    for g in exp["groups"]:
        assert get(state, g) == {}


def test_healthy_verifies(expected: dict[str, Any]) -> None:
    exp = expected["healthy"]
    report = ckptfmt.verify(FIXTURES / exp["path"])
    assert report.healthy == exp["healthy"] is True, report.problems
    assert report.unexpected_files == []
    assert report.files_checked == sum(len(t["files"]) for t in exp["tensors"])


def test_bitflip(expected: dict[str, Any]) -> None:
    exp = expected["bitflip"]
    root = FIXTURES / exp["path"]
    healthy = FIXTURES / expected[exp["manifest_same_as"]]["path"]
    assert (root / "ckptfmt.json").read_bytes() == (healthy / "ckptfmt.json").read_bytes()
    # the damage is exactly the documented bit
    for d in exp["damaged_files"]:
        a, b = (healthy / d["file"]).read_bytes(), (root / d["file"]).read_bytes()
        assert len(a) == len(b)
        diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        assert diff == [d["byte_offset"]]
        assert a[d["byte_offset"]] ^ b[d["byte_offset"]] == d["bit_mask"]

    report = ckptfmt.verify(root)
    assert report.healthy == exp["healthy"] is False
    got = sorted((p.file, p.kind, list(p.tensors)) for p in report.problems)
    assert got == sorted((d["file"], d["kind"], d["tensors"]) for d in exp["damaged_files"])
    assert report.damaged_tensors == sorted(exp["damaged_tensors"])

    with pytest.raises(DamagedError) as info:
        ckptfmt.load(root)
    assert info.value.path in {d["file"] for d in exp["damaged_files"]}
    assert list(info.value.tensors) == exp["damaged_tensors"]

    # every other tensor and value reads back as in healthy
    ck, good = ckptfmt.open(root), ckptfmt.open(healthy)
    for name, view in ck.tensors().items():
        if name in exp["damaged_tensors"]:
            with pytest.raises(DamagedError):
                view[...]
        else:
            assert sha256_le(view[...]) == sha256_le(good[name][...]), name
    for name in list(ck.keys()):
        if name not in ck.tensors():
            assert repr(ck[name]) == repr(good[name]), name


def test_torn(expected: dict[str, Any]) -> None:
    exp = expected["torn"]
    root = FIXTURES / exp["path"]
    assert root.is_dir()
    assert exp["committed"] is False
    assert not (root / "ckptfmt.json").exists()
    for fn in (ckptfmt.load, ckptfmt.open, ckptfmt.verify):
        with pytest.raises(NotACheckpointError):
            fn(root)


# --- level-1 fixtures with redundancy (spec/redundancy.md; made by redundancy_fixtures.py) -------

LEVEL1 = ("level1-partner", "level1-xor", "level1-rs2")
BEYOND = "level1-xor-beyond"


def copy_fixture(name: str, tmp_path: Path) -> Path:
    root = tmp_path / name
    shutil.copytree(FIXTURES / name, root)
    return root


def merged(root: Path, nodes: list[str], dest: Path) -> Path:
    """One directory with every node's files (all nodes hold the same manifest and metadata)."""
    for node in nodes:
        shutil.copytree(root / node, dest, dirs_exist_ok=True)
    return dest


def test_level1_fixtures_are_small_and_documented(expected: dict[str, Any]) -> None:
    for name in (*LEVEL1, BEYOND):
        exp = expected[name]
        root = FIXTURES / exp["path"]
        assert sum(len(b) for b in tree_snapshot(root).values()) < 64 << 10, name
        for d in exp["damage"]:
            where = root / d["node"]
            if "file" not in d:
                assert not where.exists(), (name, d)
            elif d["what"] == "removed":
                assert not (where / d["file"]).exists(), (name, d)
            else:
                assert (where / d["file"]).is_file(), (name, d)
        present = [n for n in exp["nodes"] if (root / n).is_dir()]
        manifests = {(root / n / "ckptfmt.json").read_bytes() for n in present}
        assert len(manifests) == 1, name  # the same manifest on every node
        ck = ckptfmt.open(root / present[0])
        assert ck.manifest.save_id == exp["save_id"] and ck.step == exp["step"]
        assert {r.node for r in ck.manifest.ranks} == set(exp["nodes"])
        red = ck.manifest.levels["1"]["redundancy"]
        assert red["scheme"] == exp["redundancy"]["scheme"] and red["m"] == exp["redundancy"]["m"]
        assert [s["members"] for s in red["sets"]] == exp["redundancy"]["sets"]


@pytest.mark.parametrize("name", LEVEL1)
def test_level1_fixture_verify_finds_the_damage(
    expected: dict[str, Any], name: str, tmp_path: Path
) -> None:
    exp = expected[name]
    root = copy_fixture(name, tmp_path)
    report = ckptfmt.verify(str(root / "{node}"))
    assert not report.healthy
    found = {(p.node, p.file): p for p in report.problems}
    for d in exp["damage"]:
        if "file" not in d:  # a whole directory: one problem naming the node
            p = found[(d["node"], "ckptfmt.json")]
            assert p.kind == "missing" and "no copy of the step" in p.reason
        else:
            p = found[(d["node"], d["file"])]
            assert p.kind == (
                "parity"
                if d["file"].startswith("ckptfmt-redundancy/")
                else "missing"
                if d["what"] == "removed"
                else "checksum"
            ), p
    assert len(report.problems) == len(exp["damage"]), report.problems
    assert report.to_json()["redundancy"]["status"] == "checked"


@pytest.mark.parametrize("name", LEVEL1)
def test_level1_fixture_rebuilds_bit_exact(
    expected: dict[str, Any], name: str, tmp_path: Path
) -> None:
    exp = expected[name]
    root = copy_fixture(name, tmp_path)
    template = str(root / "{node}")

    result = run_cli("rebuild", "--json", "--no-fsync", template)
    assert result.exit_code == exp["rebuild_exit_status"] == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["status"] == "repaired" and doc["step"] == exp["step"]
    assert doc["scheme"] == exp["redundancy"]["scheme"]
    assert doc["lost_data_ranks"] == exp["lost_data_ranks"]
    assert doc["lost_parity_ranks"] == exp["lost_parity_ranks"]
    assert sorted(Path(d).name for d in doc["recreated"]) == exp["recreated_nodes"]
    assert doc["files_written"]

    result = run_cli("verify", "--json", template)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["healthy"] and report["problems"] == [] and report["unexpected_files"] == []
    assert report["redundancy"]["status"] == "checked"
    assert report["redundancy"]["sets_not_compared"] == []

    # every tensor, read from all the nodes' files together, is the healthy original's
    whole = merged(root, list(exp["nodes"]), tmp_path / "merged")
    state = ckptfmt.load(whole)
    for t in exp["healthy_tensors"]:
        arr = get(state, t["name"])
        assert isinstance(arr, np.ndarray), t["name"]
        assert str(arr.dtype) == t["dtype"] and list(arr.shape) == t["shape"], t["name"]
        assert sha256_le(arr) == t["sha256"], t["name"]
    # the gathered directory (parity included) verifies as one level-1 directory too
    gathered = ckptfmt.verify(whole)
    assert gathered.healthy and gathered.unexpected_files == [], gathered.problems
    assert gathered.redundancy is not None and gathered.redundancy["status"] == "checked"

    again = run_cli("rebuild", template)
    assert again.exit_code == 0 and "healthy, nothing to do" in again.stdout


def test_level1_fixture_beyond_tolerance_names_ranks_and_tensors(
    expected: dict[str, Any], tmp_path: Path
) -> None:
    exp = expected[BEYOND]
    root = copy_fixture(BEYOND, tmp_path)
    template = str(root / "{node}")
    before = tree_snapshot(tmp_path)

    result = run_cli("rebuild", "--no-fsync", template)
    assert result.exit_code == exp["rebuild_exit_status"] == 1, result.output
    out = result.stdout
    assert "UNRECOVERABLE" in out and "nothing was written" in out
    assert f"lost ranks: {', '.join(map(str, exp['lost_ranks']))}" in out
    assert f"lost nodes: {', '.join(exp['lost_nodes'])}" in out
    assert f"lost tensors: {', '.join(exp['lost_tensors'])}" in out

    result = run_cli("rebuild", "--json", template)
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["status"] == "unrecoverable" and doc["written"] is False
    assert doc["lost_ranks"] == exp["lost_ranks"]
    assert doc["lost_nodes"] == exp["lost_nodes"]
    assert doc["lost_tensors"] == exp["lost_tensors"]
    assert tree_snapshot(tmp_path) == before  # nothing written
    listing = sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))
    assert listing == sorted(
        p.relative_to(FIXTURES / BEYOND).as_posix() for p in (FIXTURES / BEYOND).rglob("*")
    )  # no staging left behind
    assert run_cli("verify", "-q", template).exit_code == 1


def test_zarr_python_reads_a_rebuilt_node_directory(
    expected: dict[str, Any], tmp_path: Path
) -> None:
    """zarr-python lists the groups of a rebuilt node directory in spite of its
    ``ckptfmt-redundancy/`` (a directory without ``zarr.json``: skipped, with a warning as for
    ``ckptfmt.json``), and reads the rebuilt node's regions bit for bit; all the nodes' files
    together read as the healthy original. (Regions on other nodes read as the fill value: zarr
    treats an absent shard as unwritten, it cannot tell a lost one.)"""
    from kit.zarr_reader import zarr_read

    from ckptfmt.maintenance.repair import rebuild

    name = "level1-rs2"
    exp = expected[name]
    root = copy_fixture(name, tmp_path)
    report = rebuild(str(root / "{node}"), write=WriteOptions(fsync=False))
    assert [Path(d).name for d in report.recreated] == ["n1"]
    node_dir = root / "n1"
    assert (node_dir / "ckptfmt-redundancy").is_dir()
    want = {"/".join(t["name"]): t for t in exp["healthy_tensors"]}

    whole = merged(root, list(exp["nodes"]), tmp_path / "merged")
    (tmp_path / "whole").mkdir()
    got = zarr_read(tmp_path / "whole", whole)
    assert sorted(got) == sorted(want)
    for t, w in want.items():
        assert got[t]["sha256"] == w["sha256"] and got[t]["shape"] == w["shape"], t

    # the node's own view: its ranks' regions, zeros (the fill value) elsewhere
    state = ckptfmt.load(whole)  # bit-exact: the digests above
    manifest = ckptfmt.open(node_dir).manifest
    ranks_here = {r.rank for r in manifest.ranks if r.node == "n1"}
    (tmp_path / "node").mkdir()
    got = zarr_read(tmp_path / "node", node_dir)
    assert sorted(got) == sorted(want)  # every array is listed: all metadata is on every node
    covered = 0
    for t in manifest.tensors():
        full = np.asarray(get(state, list(t.name)))
        view = np.zeros_like(full)
        for r in t.regions:
            if r.rank in ranks_here:
                box = tuple(slice(o, o + n) for o, n in zip(r.offset, r.shape))
                view[box] = full[box]
                covered += 1
        assert got["/".join(t.name)]["sha256"] == sha256_le(view), t.name
    assert covered  # the rebuilt node's ranks wrote regions, and zarr-python reads them


# --- format version 2: EXPECTED-v2.json ---------------------------------------------------------
# The version-2 fixtures (``spec/fixtures/v2``) read as ``EXPECTED-v2.json`` says, and the
# version-1 fixtures above still read next to them. Damage is repaired in a copy.

needs_v2 = pytest.mark.skipif(
    not (FIXTURES / "v2").is_dir(), reason="the version-2 fixtures are not in this tree"
)


@pytest.fixture(scope="module")
def expected_v2() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((FIXTURES / "EXPECTED-v2.json").read_text())
    assert doc["format_version"] == 2
    return doc


@needs_v2
def test_healthy_is_version_1_healthy_in_version_2(expected_v2: dict[str, Any]) -> None:
    exp = expected_v2["healthy"]
    root = FIXTURES / exp["path"]
    data = (root / "ckptfmt.json").read_bytes()
    manifest = parse_manifest(data)
    assert manifest.format_version == 2 and CHECKSUM_MEMBER in json.loads(data)
    assert dump_manifest(manifest) == data  # written exactly as ckptfmt writes it
    v1 = FIXTURES / exp["same_as"]
    assert_state_equal(ckptfmt.load(root), ckptfmt.load(v1))
    assert ckptfmt.verify(root).healthy
    assert run_cli("verify", root).exit_code == exp["cli_exit_status"]
    # everything but the manifest is the version-1 fixture's, byte for byte
    assert {k: v for k, v in tree_snapshot(root).items() if k != "ckptfmt.json"} == {
        k: v for k, v in tree_snapshot(v1).items() if k != "ckptfmt.json"
    }


@needs_v2
@pytest.mark.parametrize("name", ["manifest-flip", "group-attributes"])
def test_damaged_metadata_fixtures(expected_v2: dict[str, Any], name: str) -> None:
    exp = expected_v2[name]
    root = FIXTURES / exp["path"]
    with pytest.raises(DamagedError) as info:
        ckptfmt.load(root)
    assert info.value.path.endswith(exp["damaged_file"])
    kind = ManifestChecksumError if exp["damaged_file"] == "ckptfmt.json" else MetadataMismatchError
    assert isinstance(info.value, kind)
    result = run_cli("verify", root)
    assert result.exit_code == exp["cli_exit_status"] == ExitStatus.DAMAGED
    assert exp["damaged_file"] in result.output


@needs_v2
def test_level1_fixture_is_repaired_in_a_copy(expected_v2: dict[str, Any], tmp_path: Path) -> None:
    exp = expected_v2["level1-xor"]
    src = FIXTURES / exp["path"]
    result = run_cli("verify", "--json", FIXTURES / exp["template"])
    assert result.exit_code == exp["cli_exit_status"]
    found = {(p["node"], p["file"]) for p in json.loads(result.stdout)["problems"]}
    assert found == {(d["node"], d["file"]) for d in exp["damage"]}
    root = tmp_path / "l1"
    shutil.copytree(src, root)
    result = run_cli("rebuild", "--json", "--no-fsync", root / "{node}")
    assert result.exit_code == exp["rebuild_exit_status"], result.output
    doc = json.loads(result.stdout)
    assert doc["lost_data_ranks"] == exp["lost_data_ranks"]
    assert doc["lost_parity_ranks"] == exp["lost_parity_ranks"]
    assert doc["damaged_metadata"] == [
        f"{root / f.split(': ')[0]}: {f.split(': ')[1]}" for f in exp["rewritten_metadata"]
    ]
    assert run_cli("verify", root / "{node}").exit_code == ExitStatus.OK
    manifests = {(root / n / "ckptfmt.json").read_bytes() for n in ("n0", "n1", "n2", "n3")}
    assert len(manifests) == 1  # every copy byte-identical again
    assert manifests == {(src / "n0" / "ckptfmt.json").read_bytes()}
