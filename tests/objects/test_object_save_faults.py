"""A one-process ``ckptfmt.save`` to a URL and its reads through a fault-injecting proxy in front
of the S3 server (``kit.s3_proxy``): throttling is retried and the save commits; a store that
goes away in the middle of the upload fails the save clearly, with no commit object and what it
had put deleted; a byte flipped on the wire is caught by the CRC32C and named."""

from __future__ import annotations

import time

import numpy as np
import pytest
from kit.arrays import raw_bytes
from kit.s3 import S3
from kit.s3_proxy import S3Proxy

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.errors import DamagedError, ObjectStoreError
from ckptfmt.storage.objects.commit import COMMIT_NAME

SMALL = WriteOptions(chunk_bytes=4096, shard_bytes=16384, fsync=False)
FAST = {"retry_timeout": 2, "timeout": 2, "connect_timeout": 1, "init_backoff": 0.01}


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {f"w{i}": rng.standard_normal((64, 64), dtype=np.float32) for i in range(4)}


def test_throttled_puts_are_retried_and_the_save_commits(s3: S3, s3_proxy: S3Proxy) -> None:
    url = f"{s3.url}/slow"
    state = _state()
    s3_proxy.slowdown(3, method="PUT")
    ckptfmt.save(state, url, write=SMALL)
    assert s3_proxy.faults["slowdown"] == 3
    got = ckptfmt.load(url)
    assert all(raw_bytes(got[k]) == raw_bytes(v) for k, v in state.items())


def test_a_store_gone_mid_upload_fails_the_save_and_commits_nothing(
    s3: S3, s3_proxy: S3Proxy
) -> None:
    url = f"{s3.url}/gone"
    s3_proxy.reset_mid_body(1000, path_contains="/c/")  # every data object's PUT: cut off
    started = time.monotonic()
    with pytest.raises(ObjectStoreError) as err:
        ckptfmt.save(_state(), url, write=SMALL, storage_options=FAST)
    assert time.monotonic() - started < 60
    assert err.value.op == "PUT" and "/c/" in err.value.path
    assert s3_proxy.faults["reset"] >= 1
    s3_proxy.clear()
    assert s3.keys("gone/") == []  # no commit object, and what was put is deleted
    ckptfmt.save(_state(), url, write=SMALL)  # the store back: the next save commits
    assert f"gone/{COMMIT_NAME}" in s3.keys("gone/")


def test_a_byte_flipped_on_the_wire_is_named(s3: S3, s3_proxy: S3Proxy) -> None:
    url = f"{s3.url}/wire"
    manifest = ckptfmt.save(_state(), url, write=SMALL)
    ref = next(f for _, f in manifest.files())
    s3_proxy.flip_byte(f"{manifest.save_id}/{ref.path}")
    with pytest.raises(DamagedError) as err:
        ckptfmt.load(url)
    assert err.value.location == f"{url}/{manifest.save_id}/{ref.path}"
    report = ckptfmt.verify(url)
    assert [(p.file, p.kind) for p in report.problems] == [(ref.path, "checksum")]
