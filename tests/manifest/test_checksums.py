"""Every metadata document is checked (``spec/FORMAT.md`` §10): the manifest carries a
CRC32C over its bytes, and every ``zarr.json`` must parse to exactly the document the manifest
implies. Each test flips real bits in real files and checks that ``load`` (a CkptError naming
the file) and ``verify`` (exit status 1) both find it, on a single directory and on every node's
copy of a level-1 checkpoint; a version-1 fixture still reads by version 1's rules."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ckptfmt_cli.exits import ExitStatus
from kit import REPO
from kit.cli import run_cli as run
from kit.faults import flipped
from kit.level1 import save_level1

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.checksum import crc32c
from ckptfmt.container.reader import read_doc
from ckptfmt.errors import (
    CkptError,
    DamagedError,
    ManifestChecksumError,
    MetadataMismatchError,
)
from ckptfmt.manifest.codec import CHECKSUM_MEMBER, dump_manifest, parse_manifest
from ckptfmt.storage.files import Inside

STATE: dict[str, Any] = {
    "model": {"w": np.arange(12, dtype=np.float32).reshape(3, 4)},
    "optim": {"lr": 1e-05, "betas": [0.9, 0.999], "step": 12, "name": "adam"},
    "step": 12,
}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    root = tmp_path / "c"
    ckptfmt.save(STATE, root, step=12, write=WriteOptions(fsync=False))
    return root


def test_the_manifest_is_sealed_with_its_crc32c(ckpt: Path) -> None:
    data = (ckpt / "ckptfmt.json").read_bytes()
    doc = json.loads(data)
    assert doc["format_version"] == 2
    assert list(doc)[-1] == CHECKSUM_MEMBER
    at = data.rindex(f'"{CHECKSUM_MEMBER}"'.encode())
    assert doc[CHECKSUM_MEMBER] == f"{crc32c(data[:at]):08x}"  # every byte before the member
    assert data[at:] == f'"{CHECKSUM_MEMBER}": "{doc[CHECKSUM_MEMBER]}"\n}}\n'.encode()
    assert dump_manifest(parse_manifest(data)) == data


def test_every_bit_flip_of_the_manifest_is_damage(ckpt: Path) -> None:
    """All 8 * size single-bit flips: parse_manifest refuses each as a damaged file (a
    ManifestChecksumError: DamagedError, and ManifestError for code that skips such copies)."""
    data = (ckpt / "ckptfmt.json").read_bytes()
    for bit in range(len(data) * 8):
        with pytest.raises(ManifestChecksumError):
            parse_manifest(flipped(data, bit), "ckptfmt.json")


@pytest.mark.parametrize(
    "old, new",
    [
        (b'"value": 12', b'"value": 13'),  # the step counter 12 -> 13 (one bit: 2 -> 3)
        (b"1e-05", b"1e-04"),  # a learning rate
        (b'"adam"', b'"adal"'),  # a string
        (b"0.999", b"0.998"),  # an item of a list (Adam's betas)
        (b'"step": 12', b'"step": 13'),  # the manifest's own step
    ],
)
def test_changed_values_are_found_by_load_and_verify(ckpt: Path, old: bytes, new: bytes) -> None:
    path = ckpt / "ckptfmt.json"
    data = path.read_bytes()
    assert old in data
    path.write_bytes(data.replace(old, new, 1))
    with pytest.raises(DamagedError) as info:
        ckptfmt.load(ckpt)
    assert info.value.path.endswith("ckptfmt.json")
    assert "CRC32C mismatch" in str(info.value)
    result = run("verify", ckpt)
    assert result.exit_code == ExitStatus.DAMAGED, result.output
    assert "ckptfmt.json" in result.output


def test_save_id_and_node_changes_are_found(ckpt: Path) -> None:
    path = ckpt / "ckptfmt.json"
    good = path.read_bytes()
    doc = json.loads(good)
    for old in (doc["save_id"], doc["world"]["ranks"][0]["node"]):
        i = good.index(old.encode())
        for bit in range(8):
            path.write_bytes(flipped(good, i * 8 + bit))
            assert run("verify", ckpt).exit_code == ExitStatus.DAMAGED
            with pytest.raises(CkptError):
                ckptfmt.load(ckpt)
    path.write_bytes(good)
    assert run("verify", ckpt).exit_code == ExitStatus.OK


def docs_of(root: Path) -> list[Path]:
    return sorted(root.rglob("zarr.json"))


def test_every_bit_flip_of_every_zarr_json_is_found(ckpt: Path) -> None:
    """Group documents included (a damaged ``attributes`` key was not found before)."""
    docs = docs_of(ckpt)
    assert {p.relative_to(ckpt).as_posix() for p in docs} == {
        "zarr.json",
        "model/zarr.json",
        "model/w/zarr.json",
        "optim/zarr.json",
    }
    manifest = ckptfmt.open(ckpt).manifest
    src = Inside(ckpt)
    for path in docs:
        rel = path.relative_to(ckpt).as_posix()
        good = path.read_bytes()
        for bit in range(len(good) * 8):
            path.write_bytes(flipped(good, bit))
            with pytest.raises(DamagedError) as info:
                read_doc(src, manifest, rel)  # what load and verify both run, for every bit
            assert info.value.path == rel
            if bit % 29 == 0:  # and the whole of both, for a sample
                report = ckptfmt.verify(ckpt)
                assert [(p.file, p.kind) for p in report.problems] == [(rel, "metadata")], bit
                with pytest.raises(DamagedError) as info:
                    ckptfmt.load(ckpt)
                assert info.value.path == rel
        path.write_bytes(good)
    assert ckptfmt.verify(ckpt).healthy


def test_the_group_attributes_key(ckpt: Path) -> None:
    path = ckpt / "model" / "zarr.json"
    good = path.read_bytes()
    path.write_bytes(good.replace(b'"attributes"', b'"attributeq"'))
    result = run("verify", ckpt)
    assert result.exit_code == ExitStatus.DAMAGED
    assert "model/zarr.json" in result.output
    with pytest.raises(MetadataMismatchError, match=r"model/zarr\.json"):
        ckptfmt.load(ckpt)


def test_a_change_that_parses_to_the_same_document_may_pass(ckpt: Path) -> None:
    for path in docs_of(ckpt):
        doc = json.loads(path.read_bytes())
        path.write_text(json.dumps(doc, indent=4, ensure_ascii=True) + "  \n")  # other spacing
    assert ckptfmt.verify(ckpt).healthy
    ckptfmt.load(ckpt)


def test_a_manifest_without_its_checksum_is_damage(ckpt: Path) -> None:
    path = ckpt / "ckptfmt.json"
    doc = json.loads(path.read_bytes())
    del doc[CHECKSUM_MEMBER]
    path.write_text(json.dumps(doc, indent=1) + "\n")
    with pytest.raises(ManifestChecksumError, match="missing"):
        ckptfmt.load(ckpt)
    assert run("verify", ckpt).exit_code == ExitStatus.DAMAGED


def test_version_1_fixture_reads_by_version_1_rules(tmp_path: Path) -> None:
    """No checksum in version 1 (it is not demanded) and its documents' attributes stay free."""
    root = tmp_path / "healthy"
    shutil.copytree(REPO / "spec" / "fixtures" / "healthy", root)
    assert ckptfmt.open(root).manifest.format_version == 1
    assert CHECKSUM_MEMBER not in json.loads((root / "ckptfmt.json").read_bytes())
    for path in docs_of(root):
        doc = json.loads(path.read_bytes())
        path.write_text(json.dumps({**doc, "attributes": {"note": "free in version 1"}}))
    assert ckptfmt.verify(root).healthy
    ckptfmt.load(root)


# --- level 1: every node's copy --------------------------------------------------------------


NODES2 = ["n0", "n1"]


@pytest.fixture(scope="module")
def level1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("l1") / "ck"
    save_level1(root, "xor", NODES2, set_size=2)
    return root


@pytest.mark.parametrize("node", NODES2)
@pytest.mark.parametrize("rel", ["ckptfmt.json", "zarr.json", "model/w/zarr.json"])
def test_each_nodes_copy_is_checked(level1: Path, tmp_path: Path, node: str, rel: str) -> None:
    root = tmp_path / "ck"
    shutil.copytree(level1, root)
    path = root / node / rel
    data = path.read_bytes()
    path.write_bytes(flipped(data, len(data) * 4 + 1))  # a bit in the middle
    result = run("verify", "--json", root / "{node}")
    assert result.exit_code == ExitStatus.DAMAGED, result.output
    problems = json.loads(result.stdout)["problems"]
    assert [(p["file"], p["node"]) for p in problems] == [(rel, node)]
    with pytest.raises(DamagedError) as info:
        ckptfmt.load(root / node)  # this node's copy alone
    assert info.value.path.endswith(rel)
