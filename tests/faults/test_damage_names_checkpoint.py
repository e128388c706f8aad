"""A flipped byte is reported naming the checkpoint (its directory or URL) and the file in it,
the same way by every reader and on a directory as on a bucket: ``ckptfmt.load``,
``ckptfmt.open`` and a slice, ``ckptfmt.verify``, ``CheckpointManager.restore`` (a damaged
level-1 copy, a damaged level-3 step) and ``ckptfmt_torch.load``. The message reads
``<checkpoint>: <file>: chunk ... CRC32C mismatch``; the error's ``checkpoint`` and ``path``
fields hold the two, ``location`` the file whole."""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit.managers import node_manager
from kit.s3 import S3

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.errors import CheckpointWarning, ChecksumError, CkptError, DamagedError
from ckptfmt.storage.steps import step_dir_name

SMALL = WriteOptions(chunk_bytes=1024, shard_bytes=4096, fsync=False)


def _state(step: int) -> dict[str, Any]:
    w = np.arange(2048, dtype=np.float32) + step
    return {"model": {"w": w.reshape(32, 64)}, "step": step}


def _template() -> dict[str, Any]:
    return {"model": {"w": np.zeros((32, 64), np.float32)}, "step": -1}


def _flip_file(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[10] ^= 0x10  # inside the first chunk's payload: the size stays, the CRC fails
    path.write_bytes(bytes(data))


def _flip_object(s3: S3, key: str) -> None:
    client = s3.server.client()
    data = bytearray(client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    data[10] ^= 0x10
    client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(data))


def _first_file(manifest: ckptfmt.Manifest) -> str:
    return next(f.path for _, f in manifest.files())


def _assert_names(exc: BaseException, checkpoint: str, file: str) -> None:
    """``exc`` is a checksum error whose message and fields name ``checkpoint`` and ``file``."""
    assert isinstance(exc, ChecksumError), repr(exc)
    assert (exc.checkpoint, exc.path) == (checkpoint, file), (exc.checkpoint, exc.path)
    assert str(exc).startswith(f"{checkpoint}: {file}: chunk "), str(exc)
    assert "CRC32C mismatch" in str(exc) and exc.tensors == ("model/w",)
    assert exc.location == f"{checkpoint}/{file}"


def _torch_load(where: str) -> None:
    torch = pytest.importorskip("torch")
    ckptfmt_torch = pytest.importorskip("ckptfmt_torch")
    ckptfmt_torch.load({"model": {"w": torch.zeros(32, 64)}, "step": 0}, where)


READERS: dict[str, Callable[[str], object]] = {
    "load": ckptfmt.load,
    "open and slice": lambda where: ckptfmt.open(where)["model/w"][1:3, 5:9],
    "ckptfmt_torch.load": _torch_load,
}


@pytest.mark.parametrize("reader", list(READERS))
def test_a_reader_of_a_directory_names_it(tmp_path: Path, reader: str) -> None:
    root = tmp_path / "ckpt" / "step-100"
    file = _first_file(ckptfmt.save(_state(100), root, write=SMALL))
    _flip_file(root / file)
    with pytest.raises(CkptError) as info:
        READERS[reader](str(root))
    exc = info.value
    if reader == "ckptfmt_torch.load":  # a collective load: each rank's error, by rank
        assert f"{os.path.realpath(root)}: {file}: chunk " in str(exc), str(exc)
        return
    _assert_names(exc, os.path.realpath(root), file)


@pytest.mark.parametrize("reader", list(READERS))
def test_a_reader_of_a_bucket_names_it(s3: S3, reader: str) -> None:
    url = f"{s3.url}/run/step-100"
    manifest = ckptfmt.save(_state(100), url, write=SMALL)
    file = _first_file(manifest)
    _flip_object(s3, f"run/step-100/{manifest.save_id}/{file}")
    with pytest.raises(CkptError) as info:
        READERS[reader](url)
    checkpoint = f"{url}/{manifest.save_id}"  # where the commit says its objects are
    if reader == "ckptfmt_torch.load":
        assert f"{checkpoint}: {file}: chunk " in str(info.value), str(info.value)
        return
    _assert_names(info.value, checkpoint, file)


def test_verify_names_the_checkpoint_and_the_file(tmp_path: Path, s3: S3) -> None:
    root = tmp_path / "step-100"
    file = _first_file(ckptfmt.save(_state(100), root, write=SMALL))
    _flip_file(root / file)
    url = f"{s3.url}/v/step-100"
    manifest = ckptfmt.save(_state(100), url, write=SMALL)
    _flip_object(s3, f"v/step-100/{manifest.save_id}/{file}")
    for where, checkpoint in ((root, str(root)), (url, f"{url}/{manifest.save_id}")):
        report = ckptfmt.verify(where)
        assert not report.healthy and report.path == checkpoint
        assert [(p.file, p.kind) for p in report.problems] == [(file, "checksum")]


def _restore_quietly(mgr: ckptfmt.CheckpointManager) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        return mgr.restore(_template())


def test_restore_names_a_damaged_level1_copy(tmp_path: Path) -> None:
    mgr = node_manager(tmp_path, write=SMALL)
    mgr.save(1, _state(1))
    mgr.close()
    step = tmp_path / "l1" / "n0" / step_dir_name(1)
    file = _first_file(ckptfmt.open(step).manifest)
    _flip_file(step / file)
    report = _restore_quietly(node_manager(tmp_path, write=SMALL))
    assert (report.step, report.level) == (1, 3)  # the level-3 copy, whole
    [why] = [t for t in report.tried if "level 1" in t]
    assert f"ChecksumError: {os.path.realpath(step)}: {file}: chunk " in why, why


def test_restore_names_a_damaged_level3_step(tmp_path: Path) -> None:
    mgr = node_manager(tmp_path, local=None, write=SMALL)
    for n in (1, 2):
        mgr.save(n, _state(n))
    mgr.close()
    step = tmp_path / "l3" / step_dir_name(2)
    file = _first_file(ckptfmt.open(step).manifest)
    _flip_file(step / file)
    state = _template()
    with pytest.warns(CheckpointWarning, match=f"{os.path.realpath(step)}: {file}: chunk "):
        report = node_manager(tmp_path, local=None, write=SMALL).restore(state)
    assert report.step == 1 and state["model"]["w"][0, 0] == 1  # the older step, not step 2
    [why] = [t for t in report.tried if "step 2 level 3" in t]
    assert f"{os.path.realpath(step)}: {file}: chunk " in why, why


def test_restore_names_a_damaged_step_in_a_bucket(tmp_path: Path, s3: S3) -> None:
    root = f"{s3.url}/run"
    mgr = node_manager(tmp_path, shared=None, shared_dir=root, write=SMALL)
    for n in (1, 2):
        mgr.save(n, _state(n))
    mgr.close()
    shutil.rmtree(tmp_path / "l1")  # the node is gone: the bucket is all there is
    step_url = f"{root}/{step_dir_name(2)}"
    manifest = ckptfmt.open(step_url).manifest
    file = _first_file(manifest)
    _flip_object(s3, f"run/{step_dir_name(2)}/{manifest.save_id}/{file}")
    report = _restore_quietly(node_manager(tmp_path, shared=None, shared_dir=root, write=SMALL))
    assert report.step == 1
    [why] = [t for t in report.tried if "step 2 level 3" in t]
    assert f"{step_url}/{manifest.save_id}: {file}: chunk " in why, why


def test_an_error_names_its_checkpoint_once() -> None:
    exc = ChecksumError("w/c/0", "chunk 0", 1, 2, ("w",))
    assert exc.checkpoint is None and exc.location == "w/c/0"
    exc.in_checkpoint("/ckpt/step-1").in_checkpoint("/elsewhere")
    assert str(exc).startswith("/ckpt/step-1: w/c/0: chunk 0 CRC32C mismatch")
    assert isinstance(exc, DamagedError) and exc.location == "/ckpt/step-1/w/c/0"
