"""A level-1 step served from a rebuild's member buffer (``engine.member_files``): what a load
checks of bytes already checked once (a survivor's member data, read with every CRC checked)
and of bytes a rebuild made (checked as from disk).

A survivor's data is not CRC'd a second time on its way from the member buffer into the state,
but the file's data CRC still binds the chunks' stored CRCs to the manifest: a buffer whose
stored CRCs are not the manifest's is refused either way, and a rebuilt buffer (``checked``
False) has every chunk's CRC computed, so a flipped payload byte is found."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ckptfmt
from ckptfmt.container.reader import geometry, read_manifest
from ckptfmt.engine.member_files import MemberFiles
from ckptfmt.errors import ChecksumError
from ckptfmt.format.chunk_reads import read_chunks
from ckptfmt.format.shard import CRC_BYTES
from ckptfmt.manifest.codec import MANIFEST_NAME
from ckptfmt.manifest.grid import shard_cell
from ckptfmt.redundancy.record import member_files


def _step(tmp_path: Path) -> tuple[Path, np.ndarray]:
    rng = np.random.default_rng(7)
    a = rng.standard_normal((64, 64)).astype(np.float32)
    root = tmp_path / "ckpt"
    ckptfmt.save({"a": a}, root, write=ckptfmt.WriteOptions(chunk_bytes=4096))
    return root, a


def _member(root: Path) -> tuple[np.ndarray, int]:
    """Rank 0's member data (its data files back to back) and the offset of tensor a's file."""
    m = read_manifest(root)
    parts, at, where = [], 0, -1
    for t, ref in member_files(m, 0):
        if t.name == ("a",):
            where = at
        parts.append(np.fromfile(root / ref.path, np.uint8))
        at += ref.size
    return np.concatenate(parts), where


def _load(root: Path, member: np.ndarray, checked: bool) -> np.ndarray:
    m = read_manifest(root)
    (t,) = [t for t in m.tensors() if t.name == ("a",)]
    geo, ref = geometry(t), t.regions[0].files[0]
    files = MemberFiles(
        root, None, m, (root / MANIFEST_NAME).read_bytes(), 0, member, checked=checked
    )
    cell = shard_cell(ref.path)
    _, slots = geo.slots(cell)
    out = np.empty(len(slots) * geo.chunk_nbytes, np.uint8)
    targets = [
        memoryview(out)[i * geo.chunk_nbytes : (i + 1) * geo.chunk_nbytes]
        for i in range(len(slots))
    ]
    read_chunks(files, geo, ref, cell, [s.slot for s in slots], targets, True, ("a",))
    return out


@pytest.mark.parametrize("checked", [False, True])
def test_member_data_loads_bit_exact(tmp_path: Path, checked: bool) -> None:
    root, a = _step(tmp_path)
    member, _ = _member(root)
    got = _load(root, member, checked)
    assert got.nbytes == a.nbytes  # chunks of whole rows: the payloads in order are the tensor
    assert np.array_equal(got.view(np.float32).reshape(a.shape), a)


def test_rebuilt_bytes_have_every_chunk_crc_computed(tmp_path: Path) -> None:
    root, _ = _step(tmp_path)
    member, at = _member(root)
    member[at + 5] ^= 0x10  # a payload byte of the first chunk, its stored CRC as it was
    with pytest.raises(ChecksumError, match="chunk 0"):
        _load(root, member, checked=False)


def test_checked_bytes_still_answer_to_the_manifest(tmp_path: Path) -> None:
    root, _ = _step(tmp_path)
    member, at = _member(root)
    m = read_manifest(root)
    (t,) = [t for t in m.tensors() if t.name == ("a",)]
    nb = geometry(t).chunk_nbytes
    member[at + nb] ^= 0x01  # the first chunk's stored CRC (right after its payload)
    assert CRC_BYTES == 4
    with pytest.raises(ChecksumError, match="data"):
        _load(root, member, checked=True)
