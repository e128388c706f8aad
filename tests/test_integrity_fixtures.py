"""The format-version-2 fixtures (``spec/fixtures/v2``) read as ``EXPECTED-v2.json`` says, and the
version-1 fixtures still read next to them (``tests/test_fixtures.py`` holds those to
``EXPECTED.json``). The fixtures are never changed here: damage is repaired in a copy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from ckptfmt_cli.exits import ExitStatus
from kit import REPO
from kit.arrays import assert_state_equal
from kit.cli import run_cli as run
from kit.files import tree_snapshot

import ckptfmt
from ckptfmt.errors import DamagedError, ManifestChecksumError, MetadataMismatchError
from ckptfmt.manifest.codec import CHECKSUM_MEMBER, dump_manifest, parse_manifest

FIXTURES = REPO / "spec" / "fixtures"

pytestmark = pytest.mark.skipif(
    not (FIXTURES / "v2").is_dir(), reason="the version-2 fixtures are not in this tree"
)


@pytest.fixture(scope="module")
def expected() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((FIXTURES / "EXPECTED-v2.json").read_text())
    assert doc["format_version"] == 2
    return doc


def test_healthy_is_version_1_healthy_in_version_2(expected: dict[str, Any]) -> None:
    exp = expected["healthy"]
    root = FIXTURES / exp["path"]
    data = (root / "ckptfmt.json").read_bytes()
    manifest = parse_manifest(data)
    assert manifest.format_version == 2 and CHECKSUM_MEMBER in json.loads(data)
    assert dump_manifest(manifest) == data  # written exactly as ckptfmt writes it
    v1 = FIXTURES / exp["same_as"]
    assert_state_equal(ckptfmt.load(root), ckptfmt.load(v1))
    assert ckptfmt.verify(root).healthy
    assert run("verify", root).exit_code == exp["cli_exit_status"]
    # everything but the manifest is the version-1 fixture's, byte for byte
    assert {k: v for k, v in tree_snapshot(root).items() if k != "ckptfmt.json"} == {
        k: v for k, v in tree_snapshot(v1).items() if k != "ckptfmt.json"
    }


@pytest.mark.parametrize("name", ["manifest-flip", "group-attributes"])
def test_damaged_metadata_fixtures(expected: dict[str, Any], name: str) -> None:
    exp = expected[name]
    root = FIXTURES / exp["path"]
    with pytest.raises(DamagedError) as info:
        ckptfmt.load(root)
    assert info.value.path.endswith(exp["damaged_file"])
    kind = ManifestChecksumError if exp["damaged_file"] == "ckptfmt.json" else MetadataMismatchError
    assert isinstance(info.value, kind)
    result = run("verify", root)
    assert result.exit_code == exp["cli_exit_status"] == ExitStatus.DAMAGED
    assert exp["damaged_file"] in result.output


def test_level1_fixture_is_repaired_in_a_copy(expected: dict[str, Any], tmp_path: Path) -> None:
    exp = expected["level1-xor"]
    src = FIXTURES / exp["path"]
    result = run("verify", "--json", FIXTURES / exp["template"])
    assert result.exit_code == exp["cli_exit_status"]
    found = {(p["node"], p["file"]) for p in json.loads(result.stdout)["problems"]}
    assert found == {(d["node"], d["file"]) for d in exp["damage"]}
    root = tmp_path / "l1"
    shutil.copytree(src, root)
    result = run("rebuild", "--json", "--no-fsync", root / "{node}")
    assert result.exit_code == exp["rebuild_exit_status"], result.output
    doc = json.loads(result.stdout)
    assert doc["lost_data_ranks"] == exp["lost_data_ranks"]
    assert doc["lost_parity_ranks"] == exp["lost_parity_ranks"]
    assert doc["damaged_metadata"] == [
        f"{root / f.split(': ')[0]}: {f.split(': ')[1]}" for f in exp["rewritten_metadata"]
    ]
    assert run("verify", root / "{node}").exit_code == ExitStatus.OK
    manifests = {(root / n / "ckptfmt.json").read_bytes() for n in ("n0", "n1", "n2", "n3")}
    assert len(manifests) == 1  # every copy byte-identical again
    assert manifests == {(src / "n0" / "ckptfmt.json").read_bytes()}
