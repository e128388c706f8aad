"""``ckptfmt.maintenance.verify`` of a level-1 checkpoint node by node, with its parity
(``ckptfmt/maintenance/verify_parity.py``): every node's copy, every data file, every parity
chunk's CRC32C,
and the parity against a fresh encoding of the members' data; a level-3 copy reports the
level-1 redundancy as not present there."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from ckptfmt_cli.exits import ExitStatus
from ckptfmt_cli.main import cli
from click.testing import CliRunner
from kit.faults import flip
from kit.files import seal_if_sealed
from kit.level1 import NODES8, copy, merge, save_level1

import ckptfmt
from ckptfmt.checksum import crc32c
from ckptfmt.errors import NotACheckpointError
from ckptfmt.manifest.codec import parse_manifest
from ckptfmt.redundancy.record import member_files

SCHEMES = {"partner": "partner", "xor": "xor", "rs2": {"scheme": "rs", "m": 2}}
NODES = ("n0", "n1", "n2", "n3")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("saved")
    for name, red in SCHEMES.items():
        save_level1(base / name, red)
    return {name: base / name for name in SCHEMES}


def all_data_files(root: Path) -> int:
    manifest = parse_manifest((root / "n0" / "ckptfmt.json").read_bytes())
    return sum(len(r.files) for t in manifest.tensors() for r in t.regions)


def rewrite_manifests(root: Path, change: Any) -> None:
    """Apply ``change(doc)`` to the manifest on every node (the same bytes everywhere)."""
    doc = json.loads((root / "n0" / "ckptfmt.json").read_text())
    change(doc)
    for node in NODES:
        (root / node / "ckptfmt.json").write_bytes(seal_if_sealed(doc))


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_healthy_level1(saved: dict[str, Path], name: str, tmp_path: Path) -> None:
    root, template = copy(saved, name, tmp_path)
    report = ckptfmt.verify(template)
    assert report.healthy, report.problems
    assert report.unexpected_files == []
    assert report.nodes == {n: str(root / n) for n in NODES}
    assert report.files_checked == all_data_files(root)
    red = report.redundancy
    assert red is not None and red["status"] == "checked" and red["sets_not_compared"] == []
    assert red["scheme"] == ("rs" if name == "rs2" else name)
    assert red["sets"] == [[0, 2, 4, 6], [1, 3, 5, 7]] and red["parity_files"] == 8
    mapping = ckptfmt.verify({n: root / n for n in NODES})
    assert mapping.healthy and mapping.files_checked == report.files_checked
    doc = report.to_json()
    assert doc["nodes"] == report.nodes and doc["redundancy"] == red


def test_level3_copy_has_no_parity_by_design(saved: dict[str, Path], tmp_path: Path) -> None:
    root, _ = copy(saved, "xor", tmp_path)
    level3 = merge(root, NODES8, tmp_path / "l3")
    shutil.rmtree(level3 / "ckptfmt-redundancy")  # what a flush copies: data, metadata, manifest
    report = ckptfmt.verify(level3)
    assert report.healthy and report.unexpected_files == []
    assert report.redundancy is not None
    assert report.redundancy["status"] == "not present on this level"
    assert report.nodes is None and all(p.node is None for p in report.problems)
    result = CliRunner().invoke(cli, ["verify", str(level3)])
    assert result.exit_code == ExitStatus.OK
    assert "level-1 redundancy: xor, 2 set(s): not present on this level" in result.stdout
    # gathered in one directory with its parity: checked there, and damage in it found
    gathered = merge(root, NODES8, tmp_path / "all")
    assert ckptfmt.verify(gathered).redundancy["status"] == "checked"  # type: ignore[index]
    flip(gathered / "ckptfmt-redundancy" / "5")
    report = ckptfmt.verify(gathered)
    assert [(p.file, p.kind) for p in report.problems] == [("ckptfmt-redundancy/5", "parity")]


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_parity_crc_and_missing(saved: dict[str, Path], name: str, tmp_path: Path) -> None:
    root, template = copy(saved, name, tmp_path)
    flip(root / "n2" / "ckptfmt-redundancy" / "5", byte=1)
    (root / "n3" / "ckptfmt-redundancy" / "6").unlink()
    report = ckptfmt.verify(template)
    got = sorted((p.node, p.file, p.kind, p.tensors) for p in report.problems)
    assert got == [
        ("n2", "ckptfmt-redundancy/5", "parity", ()),
        ("n3", "ckptfmt-redundancy/6", "parity", ()),
    ]
    reasons = {p.file: p.reason for p in report.problems}
    assert "chunk 0 CRC32C mismatch" in reasons["ckptfmt-redundancy/5"]
    assert reasons["ckptfmt-redundancy/6"] == "missing"
    assert report.damaged_tensors == []  # the data is intact: only the redundancy is degraded
    result = CliRunner().invoke(cli, ["verify", "--json", template])
    assert result.exit_code == ExitStatus.DAMAGED
    problems = json.loads(result.stdout)["problems"]
    assert {p["node"] for p in problems} == {"n2", "n3"}


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_parity_that_passes_its_crc_but_not_the_data(
    saved: dict[str, Path], name: str, tmp_path: Path
) -> None:
    """A parity file whose record vouches for it (as when a parity file and its record came
    from another save, or a faulty encode wrote both) but that is not the parity of the data."""
    root, template = copy(saved, name, tmp_path)
    path = root / "n1" / "ckptfmt-redundancy" / "3"
    flip(path, byte=path.stat().st_size - 1)
    data = path.read_bytes()
    chunks = 2 if name == "rs2" else 1
    step = len(data) // chunks

    def patch(doc: dict[str, Any]) -> None:
        pf = doc["levels"]["1"]["redundancy"]["sets"][1]["parity"][1]
        assert pf["path"] == "ckptfmt-redundancy/3"
        pf["crc32c"] = [f"{crc32c(data[i * step : (i + 1) * step]):08x}" for i in range(chunks)]

    rewrite_manifests(root, patch)
    report = ckptfmt.verify(template)
    assert [(p.node, p.file, p.kind) for p in report.problems] == [
        ("n1", "ckptfmt-redundancy/3", "parity")
    ]
    reason = report.problems[0].reason
    assert f"chunk {chunks - 1} passes its CRC32C but is not the parity" in reason
    assert "ranks 1, 3, 5, 7" in reason and f"from byte {len(data) - 1}" in reason


def test_swapped_parity_files(saved: dict[str, Path], tmp_path: Path) -> None:
    root, template = copy(saved, "xor", tmp_path)
    a, b = root / "n0" / "ckptfmt-redundancy" / "0", root / "n1" / "ckptfmt-redundancy" / "2"
    assert a.stat().st_size == b.stat().st_size
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)
    report = ckptfmt.verify(template)
    assert sorted((p.node, p.file, p.kind) for p in report.problems) == [
        ("n0", "ckptfmt-redundancy/0", "parity"),
        ("n1", "ckptfmt-redundancy/2", "parity"),
    ]


def test_lost_node_and_damaged_data(saved: dict[str, Path], tmp_path: Path) -> None:
    root, template = copy(saved, "rs2", tmp_path)
    manifest = parse_manifest((root / "n0" / "ckptfmt.json").read_bytes())
    shutil.rmtree(root / "n1")
    tensor, ref = member_files(manifest, 4)[0]
    flip(root / "n2" / ref.path)
    (root / "n3" / "stray.bin").write_bytes(b"?")
    report = ckptfmt.verify(template)
    gone = [p for p in report.problems if p.node == "n1"]
    assert len(gone) == 1 and gone[0].file == "ckptfmt.json" and gone[0].kind == "missing"
    assert "rank(s) 2, 3" in gone[0].reason
    lost_by_n1 = {
        "/".join(t.name) for t in manifest.tensors() for r in t.regions if r.rank in (2, 3)
    }
    assert set(gone[0].tensors) == lost_by_n1
    flipped = [p for p in report.problems if p.node == "n2"]
    assert [(p.file, p.kind, p.tensors) for p in flipped] == [
        (ref.path, "checksum", ("/".join(tensor.name),))
    ]
    assert len(report.problems) == 2
    assert report.redundancy is not None and report.redundancy["sets_not_compared"] == [0, 1]
    assert report.unexpected_files == [f"{root / 'n3'}/stray.bin"]
    result = CliRunner().invoke(cli, ["verify", template])
    assert result.exit_code == ExitStatus.DAMAGED
    assert "not compared with the data" in result.stdout


def test_node_holding_another_save(saved: dict[str, Path], tmp_path: Path) -> None:
    root, template = copy(saved, "xor", tmp_path)
    other = tmp_path / "other"
    save_level1(other, "xor", seed=9)  # another save of the same shape
    shutil.rmtree(root / "n2")
    shutil.copytree(other / "n2", root / "n2")
    report = ckptfmt.verify(template)
    assert [(p.node, p.file, p.kind) for p in report.problems] == [
        ("n2", "ckptfmt.json", "metadata")
    ]
    assert "holds another save" in report.problems[0].reason


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(NotACheckpointError):
        ckptfmt.verify(str(tmp_path / "{node}"))
    result = CliRunner().invoke(cli, ["verify", str(tmp_path / "{node}")])
    assert result.exit_code == ExitStatus.UNREADABLE
    result = CliRunner().invoke(cli, ["verify"])
    assert result.exit_code == ExitStatus.USAGE


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_parity_compared_in_small_windows(
    saved: dict[str, Path], name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The set is re-encoded window by window (bounded memory): with 5-byte windows (odd tails,
    partner members ending mid-window) a healthy save stays healthy and a wrong byte anywhere
    is found at its offset."""
    from ckptfmt.maintenance import verify_parity

    monkeypatch.setattr(verify_parity, "WINDOW", 5)
    root, template = copy(saved, name, tmp_path)
    assert ckptfmt.verify(template).healthy
    path = root / "n2" / "ckptfmt-redundancy" / "4"
    size = path.stat().st_size
    chunks = 2 if name == "rs2" else 1
    for byte in (size // 2 + 1, size - 1):
        shutil.copytree(saved[name], tmp_path / f"b{byte}")
        root = tmp_path / f"b{byte}"
        path = root / "n2" / "ckptfmt-redundancy" / "4"
        flip(path, byte=byte)
        data = path.read_bytes()
        step = len(data) // chunks

        def patch(doc: dict[str, Any], data: bytes = data, step: int = step) -> None:
            pf = doc["levels"]["1"]["redundancy"]["sets"][0]["parity"][2]
            pf["crc32c"] = [f"{crc32c(data[i * step : (i + 1) * step]):08x}" for i in range(chunks)]

        rewrite_manifests(root, patch)
        report = ckptfmt.verify(str(root / "{node}"))
        assert [(p.node, p.file, p.kind) for p in report.problems] == [
            ("n2", "ckptfmt-redundancy/4", "parity")
        ], byte
        assert report.problems[0].reason.endswith(f"from byte {byte}"), report.problems[0].reason
