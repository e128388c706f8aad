"""ckptfmt.save / load / open / verify / latest with an ``s3://`` URL, against the tests' real S3
server (moto on 127.0.0.1): round trips bit for bit, lazy reads that fetch only the inner
chunks asked for, and damage injected into the bucket for real (a flipped byte, a missing or
resized object, no commit object), each detected and named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from kit.arrays import assert_state_equal, make_state, raw_bytes
from kit.s3 import S3

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.errors import (
    DamagedError,
    DestinationExistsError,
    NotACheckpointError,
    UrlNotSupportedError,
    UsageError,
)
from ckptfmt.storage.objects import Bucket
from ckptfmt.storage.objects.commit import COMMIT_NAME, LATEST_NAME, Commit

SMALL = WriteOptions(chunk_bytes=4096, shard_bytes=32768, fsync=False)


def _state() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    return {
        "model": {
            "w": rng.standard_normal((64, 256), dtype=np.float32),
            "bf": rng.standard_normal((33, 17)).astype(ml_dtypes.bfloat16),
            "b": np.arange(5, dtype=np.int64),
        },
        "opt": [np.array(0.5, np.float32), (np.zeros((0, 3), np.float16), b"\x00raw")],
        "step": 12,
        "name": "run",
        "none": None,
    }


def _same(got: Any, want: Any, path: str = "") -> None:
    """The same structure and types (lists, tuples, dicts, bytes, None), arrays bit for bit."""
    if isinstance(want, np.ndarray | np.generic):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype, (path, got)
        assert got.shape == np.shape(want) and raw_bytes(got) == raw_bytes(want), path
    elif isinstance(want, dict):
        assert type(got) is dict and list(got) == list(want), (path, got)
        for k in want:
            _same(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, list | tuple):
        assert type(got) is type(want) and len(got) == len(want), (path, got)
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{path}/{i}")
    else:
        assert type(got) is type(want) and got == want, (path, got, want)


def _commit(s3: S3, prefix: str) -> dict[str, Any]:
    body = s3.server.client().get_object(Bucket=s3.bucket, Key=f"{prefix}/{COMMIT_NAME}")
    return json.loads(body["Body"].read())  # type: ignore[no-any-return]


def test_save_load_open_round_trip_bit_exact(s3: S3) -> None:
    url = f"{s3.url}/run/ckpt"
    state = _state()
    manifest = ckptfmt.save(state, url, step=12, write=SMALL)
    _same(ckptfmt.load(url), state)
    commit = _commit(s3, "run/ckpt")
    assert commit["save_id"] == manifest.save_id and commit["step"] == 12
    keys = s3.keys("run/ckpt/")
    assert f"run/ckpt/{COMMIT_NAME}" in keys
    listed = {f"run/ckpt/{manifest.save_id}/{o['key']}" for o in commit["objects"]}
    assert listed | {f"run/ckpt/{COMMIT_NAME}"} == set(keys)  # nothing else, nothing missing
    assert f"run/ckpt/{manifest.save_id}/ckptfmt.json" in listed
    ckpt = ckptfmt.open(url)
    assert ckpt.step == 12
    assert raw_bytes(ckpt["model/bf"][...]) == raw_bytes(state["model"]["bf"])
    assert raw_bytes(ckpt["model/w"][5:40, 3:200]) == raw_bytes(state["model"]["w"][5:40, 3:200])
    assert ckpt["model/bf"].dtype == np.dtype(ml_dtypes.bfloat16)
    report = ckptfmt.verify(url)
    assert report.healthy, report.problems
    assert report.files_checked == len(list(manifest.files()))


def test_lazy_open_reads_only_the_chunks_it_needs(s3: S3) -> None:
    url = f"{s3.url}/lazy"
    w = np.arange(256 * 256, dtype=np.float32).reshape(256, 256)  # 256 KiB: 8 shards, 64 chunks
    ckptfmt.save({"w": w}, url, write=SMALL)
    ckpt = ckptfmt.open(url)
    requests = ckpt._src.objects.requests  # type: ignore[union-attr]
    requests.clear()
    row = ckpt["w"][3, :]
    assert raw_bytes(row) == raw_bytes(w[3, :])
    # a row lies in one shard row, one chunk row: per shard touched, its index and one chunk
    shards = ckpt.manifest.tensors()[0].shard_shape
    chunks = ckpt.manifest.tensors()[0].chunk_shape
    touched = -(-256 // shards[1])
    assert requests == {"GET": 2 * touched}, (requests, shards, chunks)
    requests.clear()
    assert float(ckpt["w"][100, 7]) == float(w[100, 7])
    assert requests == {"GET": 2}  # the shard's index, then the one chunk
    requests.clear()
    whole = ckpt["w"].read()
    assert raw_bytes(whole) == raw_bytes(w)
    n_files = len(list(ckpt.manifest.files())) - 0
    assert requests["GET"] <= 2 * n_files  # each shard: its index and its chunks in one GET


def test_load_reads_each_shard_in_one_request(s3: S3) -> None:
    url = f"{s3.url}/whole"
    w = np.random.default_rng(1).standard_normal((512, 512)).astype(np.float32)  # 1 MiB
    ckptfmt.save({"w": w}, url, write=WriteOptions(chunk_bytes=16384, fsync=False))
    bucket = Bucket.at(url)
    commit = Commit.from_bytes(bucket.get(COMMIT_NAME), url)
    got = ckptfmt.load(url)
    assert raw_bytes(got["w"]) == raw_bytes(w)
    data_objects = [o for o in commit.objects if "/c" in o.key]
    assert len(data_objects) == 1  # one 1 MiB shard of 64 chunks, read whole below
    ckpt = ckptfmt.open(url)
    requests = ckpt._src.objects.requests  # type: ignore[union-attr]
    requests.clear()
    ckpt["w"].read()
    assert requests == {"GET": 1}  # the shard object whole: its index and every chunk


def test_flipped_byte_in_a_shard_object_is_named(s3: S3) -> None:
    url = f"{s3.url}/flip"
    state = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64)}
    manifest = ckptfmt.save(state, url, write=SMALL)
    ref = next(f for _, f in manifest.files())
    key = f"flip/{manifest.save_id}/{ref.path}"
    client = s3.server.client()
    data = bytearray(client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    data[100] ^= 0x10  # inside the first chunk's payload; same size, so the commit still holds
    client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(data))
    with pytest.raises(DamagedError) as err:
        ckptfmt.load(url)
    # the checkpoint (the URL its objects are under) and the object in it, as for a directory
    assert (err.value.checkpoint, err.value.path) == (f"{url}/{manifest.save_id}", ref.path)
    assert err.value.location == f"{s3.url}/{key}"
    assert str(err.value).startswith(f"{url}/{manifest.save_id}: {ref.path}: ")
    assert "CRC32C" in str(err.value)
    report = ckptfmt.verify(url)
    assert not report.healthy
    assert [(p.file, p.kind) for p in report.problems] == [(ref.path, "checksum")]
    assert report.path.endswith(manifest.save_id)
    with pytest.raises(DamagedError) as lazy:
        ckptfmt.open(url)["w"][0, 0]
    assert lazy.value.location == f"{s3.url}/{key}"


@pytest.mark.parametrize("fault", ["missing", "resized"])
def test_commit_naming_a_missing_or_resized_object_is_no_checkpoint(s3: S3, fault: str) -> None:
    url = f"{s3.url}/torn"
    manifest = ckptfmt.save({"w": np.ones((64, 64), np.float32)}, url, write=SMALL)
    ref = next(f for _, f in manifest.files())
    key = f"torn/{manifest.save_id}/{ref.path}"
    client = s3.server.client()
    if fault == "missing":
        client.delete_object(Bucket=s3.bucket, Key=key)
    else:
        body = client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
        client.put_object(Bucket=s3.bucket, Key=key, Body=body[:-1])
    why = "missing" if fault == "missing" else f"size {ref.size - 1}, the commit says {ref.size}"
    for reader in (ckptfmt.load, ckptfmt.open):
        with pytest.raises(NotACheckpointError) as err:
            reader(url)
        assert key in str(err.value) and why in str(err.value)
    report = ckptfmt.verify(url)
    assert [(p.file, p.kind) for p in report.problems] == [
        (ref.path, "missing" if fault == "missing" else "size")
    ]
    assert why in report.problems[0].reason


def test_no_commit_object_is_no_checkpoint(s3: S3) -> None:
    url = f"{s3.url}/uncommitted"
    ckptfmt.save({"w": np.ones(3, np.float32)}, url, write=SMALL)
    s3.server.client().delete_object(Bucket=s3.bucket, Key=f"uncommitted/{COMMIT_NAME}")
    for reader in (ckptfmt.load, ckptfmt.open, ckptfmt.verify):
        with pytest.raises(NotACheckpointError, match=COMMIT_NAME):
            reader(url)
    with pytest.raises(NotACheckpointError, match=COMMIT_NAME):
        ckptfmt.load(f"{s3.url}/nothing-here")


def test_save_refuses_a_committed_url_unless_overwriting(s3: S3) -> None:
    url = f"{s3.url}/over"
    first = ckptfmt.save({"w": np.zeros(4, np.float32)}, url, write=SMALL)
    with pytest.raises(DestinationExistsError, match="overwrite"):
        ckptfmt.save({"w": np.ones(4, np.float32)}, url, write=SMALL)
    assert ckptfmt.load(url)["w"].tolist() == [0, 0, 0, 0]
    second = ckptfmt.save(
        {"w": np.ones(4, np.float32)},
        url,
        write=WriteOptions(chunk_bytes=4096, shard_bytes=32768, fsync=False, overwrite=True),
    )
    assert ckptfmt.load(url)["w"].tolist() == [1, 1, 1, 1]
    keys = s3.keys("over/")
    assert not any(first.save_id in k for k in keys)  # the old save is gone whole
    assert any(second.save_id in k for k in keys)


def test_failed_save_leaves_nothing_committed(s3: S3) -> None:
    url = f"{s3.url}/bad"
    with pytest.raises(ckptfmt.errors.UnsupportedValueError):
        ckptfmt.save({"w": np.ones(3), "obj": object()}, url, write=SMALL)
    assert s3.keys("bad/") == []


def test_latest_reads_the_pointer(s3: S3) -> None:
    root = f"{s3.url}/run"
    assert ckptfmt.latest(root) is None
    for step in (100, 200):
        ckptfmt.save({"w": np.full(3, step, np.float32)}, f"{root}/step-{step:010d}", step=step)
    found = ckptfmt.latest(root)  # no pointer: the newest whole step, by one LIST
    assert found is not None and found.step == 200
    assert ckptfmt.load(str(found.path))["w"].tolist() == [200, 200, 200]
    commit = _commit(s3, "run/step-0000000100")
    s3.server.client().put_object(
        Bucket=s3.bucket,
        Key=f"run/{LATEST_NAME}",
        Body=json.dumps({"step": 100, "save_id": commit["save_id"]}).encode(),
    )
    found = ckptfmt.latest(root)
    assert found is not None and found.step == 100  # what the pointer says, without a LIST
    assert str(found.path) == f"{root}/step-0000000100"


def test_storage_options_override_the_environment(s3: S3, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"{s3.url}/opts"
    options = {
        "endpoint_url": s3.server.endpoint,
        "aws_access_key_id": s3.env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": s3.env["AWS_SECRET_ACCESS_KEY"],
        "region": s3.env["AWS_REGION"],
        "allow_http": "true",
    }
    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    state = {"w": np.arange(6, dtype=np.int32)}
    ckptfmt.save(state, url, write=SMALL, storage_options=options)
    assert_state_equal(ckptfmt.load(url, storage_options=options), state)
    assert ckptfmt.open(url, storage_options=options)["w"][2] == 2
    assert ckptfmt.verify(url, storage_options=options).healthy


def test_other_urls_and_misplaced_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UrlNotSupportedError):
        ckptfmt.load("http://example.com/ckpt")
    with pytest.raises(UrlNotSupportedError):
        ckptfmt.save({"w": np.ones(2)}, "file:///tmp/x")
    with pytest.raises(UsageError, match="storage_options"):
        ckptfmt.save({"w": np.ones(2)}, tmp_path / "c", storage_options={"region": "x"})


def test_a_large_state_round_trips(s3: S3) -> None:
    state = make_state(2)
    url = f"{s3.url}/kit"
    ckptfmt.save(state, url, write=WriteOptions(chunk_bytes=24, shard_bytes=96, fsync=False))
    assert_state_equal(ckptfmt.load(url), state)
    assert ckptfmt.verify(url).healthy


def test_without_the_cloud_extra_a_url_says_what_to_install(tmp_path: Path) -> None:
    """The core imports without obstore; a URL then raises CloudNotInstalledError (a usage
    error) naming the extra, in a process where obstore cannot be imported."""
    program = (
        "import sys; sys.modules['obstore'] = None\n"
        "import numpy as np, ckptfmt\n"
        "for call in (lambda: ckptfmt.load('s3://b/x'), lambda: ckptfmt.open('s3://b/x'),\n"
        "             lambda: ckptfmt.save({'w': np.ones(2)}, 's3://b/x')):\n"
        "    try:\n"
        "        call()\n"
        "    except ckptfmt.errors.UsageError as exc:\n"
        "        print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3, out.stdout
    assert all("CloudNotInstalledError" in x and "ckptfmt[cloud]" in x for x in lines)
    assert list(tmp_path.iterdir()) == []
