"""Damaged checkpoints: every kind of damage is found, named (file and tensor) and typed."""

from __future__ import annotations

import contextlib
import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit.arrays import raw_bytes
from kit.faults import flip_bit
from kit.files import manifest_doc, write_manifest

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.errors import (
    ChecksumError,
    CkptError,
    DamagedError,
    FormatVersionError,
    ManifestError,
    MissingFileError,
    NotACheckpointError,
    SizeMismatchError,
)

# "t": float32 (10,), chunk (4,), shard (8,): t/c/0 holds chunks [0:4] [4:8] (slots 0, 1);
# t/c/1 holds the padded chunk [8:12] (slot 0) and an absent slot 1.
# Each file: chunk | crc | chunk | crc ... | index (2 slots x 16 bytes) | index crc.
T = np.arange(10, dtype=np.float32) * 1.5 - 3
U = np.arange(10, dtype=np.float32)[::-1].copy()
S = np.array(7.25, dtype=np.float64)
INDEX = 2 * 16 + 4


def make(tmp_path: Path) -> Path:
    root = tmp_path / "c"
    ckptfmt.save(
        {"t": T, "u": U, "s": S, "v": {"x": 1}},
        root,
        write=WriteOptions(chunk_bytes=16, shard_bytes=32, fsync=False),
    )
    e = next(e for e in manifest_doc(root)["entries"] if e["name"] == ["t"])
    assert e["chunk_shape"] == [4] and e["shard_shape"] == [8]
    assert (root / "t/c/0").stat().st_size == 2 * 20 + INDEX
    assert (root / "t/c/1").stat().st_size == 20 + INDEX
    assert ckptfmt.verify(root).healthy
    return root


def assert_found(
    root: Path,
    file: str,
    tensor: str,
    kind: str | None = None,
    exc_type: type[DamagedError] = DamagedError,
) -> None:
    """load, verify and open all find the damage, name the file and the tensor."""
    with pytest.raises(exc_type) as info:
        ckptfmt.load(root)
    assert info.value.path == file
    assert info.value.tensors == (tensor,)
    report = ckptfmt.verify(root)
    assert not report.healthy
    assert [(p.file, p.tensors) for p in report.problems] == [(file, (tensor,))]
    assert report.damaged_tensors == [tensor]
    if kind is not None:
        assert report.problems[0].kind == kind
    assert report.to_json()["healthy"] is False
    json.dumps(report.to_json())
    with pytest.raises(exc_type) as info:
        ckptfmt.open(root)[tensor][...]
    assert info.value.path == file
    assert info.value.tensors == (tensor,)


DAMAGE = {
    "chunk-payload": ("t/c/0", 5),
    "chunk-payload-last-byte": ("t/c/0", 20 + 15),
    "chunk-crc": ("t/c/0", 16),
    "chunk-crc-second": ("t/c/0", 20 + 19),
    "padded-chunk-padding": ("t/c/1", 12),
    "padded-chunk-data": ("t/c/1", 1),
    "index-offset": ("t/c/0", -INDEX),
    "index-offset-high-byte": ("t/c/0", -INDEX + 7),
    "index-nbytes": ("t/c/0", -INDEX + 8),
    "index-absent-slot": ("t/c/1", -INDEX + 16),
    "index-crc": ("t/c/0", -1),
    "index-crc-first-byte": ("t/c/1", -4),
    "0d-payload": ("s/c", 0),
    "0d-crc": ("s/c", -1),
}


@pytest.mark.parametrize("where", sorted(DAMAGE))
@pytest.mark.parametrize("bit", [0, 7])
def test_bit_flip(tmp_path: Path, where: str, bit: int) -> None:
    root = make(tmp_path)
    file, offset = DAMAGE[where]
    flip_bit(root / file, offset, bit)
    assert_found(root, file, file.split("/")[0])


def test_bit_flip_leaves_other_shards_readable(tmp_path: Path) -> None:
    root = make(tmp_path)
    flip_bit(root / "t/c/0", 3)
    ck = ckptfmt.open(root)
    assert raw_bytes(ck["t"][8:]) == raw_bytes(T[8:])
    assert raw_bytes(ck["u"][...]) == raw_bytes(U)
    with pytest.raises(ChecksumError):
        ck["t"][7:9]


def test_every_single_bit_flip_is_found(tmp_path: Path) -> None:
    """Exhaustive over one shard file: no flipped bit anywhere goes unnoticed by load."""
    root = make(tmp_path)
    path = root / "t/c/1"
    original = path.read_bytes()
    for offset in range(len(original)):
        for bit in range(8):
            flip_bit(path, offset, bit)
            with pytest.raises(DamagedError) as info:
                ckptfmt.load(root)
            assert (info.value.path, info.value.tensors) == ("t/c/1", ("t",)), (offset, bit)
            path.write_bytes(original)
    assert ckptfmt.verify(root).healthy


def test_truncated_file(tmp_path: Path) -> None:
    root = make(tmp_path)
    p = root / "t/c/0"
    p.write_bytes(p.read_bytes()[:-1])
    assert_found(root, "t/c/0", "t", "size", SizeMismatchError)


def test_empty_file(tmp_path: Path) -> None:
    root = make(tmp_path)
    (root / "u/c/1").write_bytes(b"")
    assert_found(root, "u/c/1", "u", "size", SizeMismatchError)


def test_file_with_extra_bytes(tmp_path: Path) -> None:
    root = make(tmp_path)
    p = root / "t/c/1"
    p.write_bytes(p.read_bytes() + b"\x00")
    assert_found(root, "t/c/1", "t", "size", SizeMismatchError)


def test_deleted_shard(tmp_path: Path) -> None:
    root = make(tmp_path)
    (root / "t/c/1").unlink()
    assert_found(root, "t/c/1", "t", "missing", MissingFileError)


def test_deleted_0d_chunk(tmp_path: Path) -> None:
    root = make(tmp_path)
    (root / "s/c").unlink()
    assert_found(root, "s/c", "s", "missing", MissingFileError)


def test_shard_replaced_by_directory(tmp_path: Path) -> None:
    root = make(tmp_path)
    (root / "t/c/1").unlink()
    (root / "t/c/1").mkdir()
    assert_found(root, "t/c/1", "t", "missing", MissingFileError)


def test_shard_directory_replaced_by_file(tmp_path: Path) -> None:
    """t/c is a file where the directory of t's shards should be: t/c/0 and t/c/1 are missing,
    and every reader says so with a MissingFileError, not a bare NotADirectoryError."""
    root = make(tmp_path)
    shutil.rmtree(root / "t/c")
    (root / "t/c").write_bytes(b"not a directory")
    with pytest.raises(MissingFileError) as info:
        ckptfmt.load(root)
    assert info.value.path == "t/c/0" and info.value.tensors == ("t",)
    with pytest.raises(MissingFileError):
        ckptfmt.open(root)["t"][0:2]
    report = ckptfmt.verify(root)
    assert [(p.file, p.kind, p.tensors) for p in report.problems] == [
        ("t/c/0", "missing", ("t",)),
        ("t/c/1", "missing", ("t",)),
    ]


def test_shard_swapped_with_sibling(tmp_path: Path) -> None:
    """Two shard files of one tensor with the same layout, swapped: every chunk still matches its
    own CRC32C and the files keep their sizes, but the tensor is wrong. The manifest's per-file
    CRC32C must catch it (it is what ties a file's content to its place)."""
    root = tmp_path / "c"
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    ckptfmt.save({"w": a}, root, write=WriteOptions(chunk_bytes=16, shard_bytes=32, fsync=False))
    f0, f1 = root / "w/c/0/0/0", root / "w/c/1/0/0"
    b0, b1 = f0.read_bytes(), f1.read_bytes()
    assert len(b0) == len(b1) and b0 != b1
    f0.write_bytes(b1)
    f1.write_bytes(b0)
    with pytest.raises(DamagedError) as info:
        ckptfmt.load(root)
    assert info.value.path in ("w/c/0/0/0", "w/c/1/0/0")
    assert info.value.tensors == ("w",)
    report = ckptfmt.verify(root)
    assert sorted(p.file for p in report.problems) == ["w/c/0/0/0", "w/c/1/0/0"]


def test_shard_from_another_checkpoint(tmp_path: Path) -> None:
    """A shard file copied in from another save of the same layout (a stale file after a botched
    restore) is internally consistent but not the file the manifest describes."""
    root = make(tmp_path)
    other = tmp_path / "other"
    ckptfmt.save(
        {"t": T + 100, "u": U, "s": S, "v": {"x": 1}},
        other,
        write=WriteOptions(chunk_bytes=16, shard_bytes=32, fsync=False),
    )
    shutil.copy(other / "t/c/0", root / "t/c/0")
    assert_found(root, "t/c/0", "t")


def test_two_tensors_damaged(tmp_path: Path) -> None:
    root = make(tmp_path)
    flip_bit(root / "t/c/1", 0)
    (root / "u/c/0").unlink()
    report = ckptfmt.verify(root)
    assert sorted((p.file, p.kind, p.tensors) for p in report.problems) == [
        ("t/c/1", "checksum", ("t",)),
        ("u/c/0", "missing", ("u",)),
    ]
    assert report.damaged_tensors == ["t", "u"]


# --- metadata ------------------------------------------------------------------------------------


def edit_json(path: Path, fn: Any) -> None:
    doc = json.loads(path.read_text())
    path.write_text(json.dumps(fn(doc)))


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: {**d, "shape": [11]},
        lambda d: {**d, "data_type": "float64"},
        lambda d: {**d, "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4]}}},
        lambda d: {**d, "fill_value": 1.0},
        lambda d: {**d, "node_type": "group"},
        lambda d: {k: v for k, v in d.items() if k != "codecs"},
        lambda d: [d],
        lambda d: None,
    ],
    ids=["shape", "dtype", "grid", "fill", "node-type", "no-codecs", "list", "null"],
)
def test_array_metadata_edited(tmp_path: Path, edit: Any) -> None:
    root = make(tmp_path)
    edit_json(root / "t/zarr.json", edit)
    report = ckptfmt.verify(root)
    assert [(p.file, p.kind, p.tensors) for p in report.problems] == [
        ("t/zarr.json", "metadata", ("t",))
    ]
    assert not report.healthy


def test_array_metadata_attributes_are_checked(tmp_path: Path) -> None:
    """Format version 2 covers every zarr.json whole, attributes included (FORMAT.md §10);
    version 1 left them free (tests/manifest/test_checksums.py reads such a fixture)."""
    root = make(tmp_path)
    edit_json(root / "t/zarr.json", lambda d: {**d, "attributes": {"note": "mine"}})
    report = ckptfmt.verify(root)
    assert [(p.file, p.kind) for p in report.problems] == [("t/zarr.json", "metadata")]


@pytest.mark.parametrize("content", [b"", b"\xff\xfe garbage", b"{", b"[" * 100_000])
def test_array_metadata_garbage(tmp_path: Path, content: bytes) -> None:
    root = make(tmp_path)
    (root / "u/zarr.json").write_bytes(content)
    report = ckptfmt.verify(root)
    assert [(p.file, p.kind, p.tensors) for p in report.problems] == [
        ("u/zarr.json", "metadata", ("u",))
    ]


def test_array_metadata_missing(tmp_path: Path) -> None:
    root = make(tmp_path)
    (root / "t/zarr.json").unlink()
    report = ckptfmt.verify(root)
    assert [(p.file, p.kind, p.tensors) for p in report.problems] == [
        ("t/zarr.json", "missing", ("t",))
    ]


@pytest.mark.parametrize(
    "content",
    [
        b"[1, 2]",
        b"42",
        b"null",
        b'"group"',
        b'{"zarr_format": 2, "node_type": "group"}',
        b"[" * 100_000,
    ],
)
@pytest.mark.parametrize("group", ["zarr.json", "v/zarr.json"])
def test_group_metadata_edited(tmp_path: Path, content: bytes, group: str) -> None:
    root = make(tmp_path)
    (root / group).write_bytes(content)
    report = ckptfmt.verify(root)
    assert [(p.file, p.kind) for p in report.problems] == [(group, "metadata")]


def test_unexpected_file_is_reported_not_damage(tmp_path: Path) -> None:
    root = make(tmp_path)
    (root / "t/c/7").write_bytes(b"x")
    (root / "stray.txt").write_bytes(b"x")
    report = ckptfmt.verify(root)
    assert report.healthy
    assert report.unexpected_files == ["stray.txt", "t/c/7"]


def test_verify_counts(tmp_path: Path) -> None:
    root = make(tmp_path)
    seen: list[ckptfmt.Progress] = []
    report = ckptfmt.verify(root, progress=seen.append)
    files = [
        f
        for e in manifest_doc(root)["entries"]
        if e["kind"] == "tensor"
        for r in e["regions"]
        for f in r["files"]
    ]
    assert report.files_checked == len(files) == 5
    assert report.bytes_checked == sum(f["size"] for f in files) == seen[-1].done
    assert [p.op for p in seen] == ["verify"] * len(seen)
    assert seen[-1].final and seen[-1].total == seen[-1].done
    assert all(a.done <= b.done for a, b in itertools.pairwise(seen))


# --- the manifest --------------------------------------------------------------------------------

ALL_READERS = [ckptfmt.load, ckptfmt.open, ckptfmt.verify]


@pytest.mark.parametrize("fn", ALL_READERS, ids=["load", "open", "verify"])
def test_manifest_missing(tmp_path: Path, fn: Any) -> None:
    root = make(tmp_path)
    (root / "ckptfmt.json").unlink()
    with pytest.raises(NotACheckpointError):
        fn(root)


@pytest.mark.parametrize("fn", ALL_READERS, ids=["load", "open", "verify"])
def test_not_a_directory(tmp_path: Path, fn: Any) -> None:
    with pytest.raises(NotACheckpointError):
        fn(tmp_path / "nothing-here")
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotACheckpointError):
        fn(tmp_path / "f")


@pytest.mark.parametrize("fn", ALL_READERS, ids=["load", "open", "verify"])
def test_manifest_is_a_directory(tmp_path: Path, fn: Any) -> None:
    root = make(tmp_path)
    (root / "ckptfmt.json").unlink()
    (root / "ckptfmt.json").mkdir()
    with pytest.raises((NotACheckpointError, ManifestError)):
        fn(root)


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"garbage",
        b"\x00" * 100,
        b"{}",
        b"[]",
        b"null",
        b'{"format": "ckptfmt"}',
        b"\xef\xbb\xbf{}",
        b"{" * 100_000,
        b'{"format": "ckptfmt", "format_version": NaN}',
    ],
)
@pytest.mark.parametrize("fn", ALL_READERS, ids=["load", "open", "verify"])
def test_manifest_garbage(tmp_path: Path, fn: Any, content: bytes) -> None:
    root = make(tmp_path)
    (root / "ckptfmt.json").write_bytes(content)
    with pytest.raises(ManifestError):
        fn(root)


def test_manifest_bit_flips_never_escape(tmp_path: Path) -> None:
    """Flipping any single bit of the manifest gives a ManifestError or a checkpoint that still
    loads (a flip inside a free-form string); never another exception."""
    root = make(tmp_path)
    path = root / "ckptfmt.json"
    original = path.read_bytes()
    for offset in range(0, len(original), 3):
        flip_bit(path, offset, offset % 8)
        with contextlib.suppress(CkptError):
            ckptfmt.load(root)
        path.write_bytes(original)


@pytest.mark.parametrize("version", [99, 0, 4, -1, "1", 1.5, None, True, [1]])
@pytest.mark.parametrize("fn", ALL_READERS, ids=["load", "open", "verify"])
def test_format_version(tmp_path: Path, fn: Any, version: Any) -> None:
    root = make(tmp_path)
    doc = manifest_doc(root)
    doc["format_version"] = version
    write_manifest(root, doc)
    with pytest.raises(FormatVersionError) as info:
        fn(root)
    assert info.value.actual == version


def test_format_version_missing(tmp_path: Path) -> None:
    root = make(tmp_path)
    doc = manifest_doc(root)
    del doc["format_version"]
    write_manifest(root, doc)
    with pytest.raises(ManifestError):
        ckptfmt.load(root)


def test_wrong_format_id(tmp_path: Path) -> None:
    root = make(tmp_path)
    doc = manifest_doc(root)
    doc["format"] = "zarr"
    write_manifest(root, doc)
    with pytest.raises(ManifestError):
        ckptfmt.load(root)


def test_manifest_crc_edited(tmp_path: Path) -> None:
    """The manifest's file CRC is checked: edit it and the file it describes is reported."""
    root = make(tmp_path)
    doc = manifest_doc(root)
    for e in doc["entries"]:
        if e["name"] == ["u"]:
            f = e["regions"][0]["files"][1]
            f["crc32c"] = f"{int(f['crc32c'], 16) ^ 1:08x}"
    write_manifest(root, doc)
    assert_found(root, "u/c/1", "u", "checksum", ChecksumError)


def test_manifest_size_edited(tmp_path: Path) -> None:
    root = make(tmp_path)
    doc = manifest_doc(root)
    for e in doc["entries"]:
        if e["name"] == ["u"]:
            e["regions"][0]["files"][0]["size"] += 16
    write_manifest(root, doc)
    assert_found(root, "u/c/0", "u", "size", SizeMismatchError)
