"""A collective load from a bucket checks the commit's objects without a HEAD pass before it
reads: what some rank reads is checked by reading it (a whole GET shows the size, every chunk's
CRC32C is checked), what no rank reads is HEADed beside the reads, each object once, the ranks
sharing them; one missing or of another size fails the load on every rank, naming its key.
Thread ranks against the tests' real S3 server."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from kit.s3 import S3

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.errors import LoadFailedError, NotACheckpointError
from ckptfmt.parallel.collective.load import load_collective
from ckptfmt.storage.objects import Bucket
from ckptfmt.storage.objects.commit import read_commit
from ckptfmt.storage.objects.source import ObjectInside
from ckptfmt.transport.threads import run_threads

# 256 x 256 float32 in shards of 32 rows (8 shard objects), chunks of 4 rows
SMALL = WriteOptions(chunk_bytes=4096, shard_bytes=32768, fsync=False)
FULL = np.random.default_rng(5).standard_normal((256, 256)).astype(np.float32)
BOX = ((0, 0), (8, 256))  # rows of the first shard object only


def _saved(s3: S3, name: str) -> tuple[str, list[str]]:
    url = f"{s3.url}/{name}"
    ckptfmt.save({"w": FULL}, url, write=SMALL)
    commit = read_commit(Bucket.at(url))
    assert commit is not None
    shards = sorted(o.key for o in commit.objects if "/c/" in o.key)
    assert len(shards) == 8, shards
    return url, [f"{name}/{commit.save_id}/{k}" for k in shards]


def _load_first_rows(url: str) -> list[Any]:
    def rank(comm: Any) -> tuple[np.ndarray, dict[str, int]]:
        bucket = Bucket.at(url)
        commit = read_commit(bucket)
        assert commit is not None
        src = ObjectInside(bucket, commit)  # not HEADed at open (what a restore opens)
        got, _ = load_collective(comm, src.root, {"w": BOX}, source=src)
        return got["w"], dict(bucket.requests)

    return run_threads(2, rank)


def test_objects_no_rank_reads_are_headed_once_beside_the_reads(s3: S3) -> None:
    url, _ = _saved(s3, "partial")
    results = _load_first_rows(url)
    for got, _ in results:
        np.testing.assert_array_equal(got, FULL[:8])
    heads = [requests.get("HEAD", 0) for _, requests in results]
    assert sum(heads) == 7, heads  # the 7 shard objects no box needs, once each
    assert all(h >= 3 for h in heads), heads  # shared between the ranks


def test_an_unread_object_missing_fails_the_load_on_every_rank(s3: S3) -> None:
    url, keys = _saved(s3, "torn-unread")
    s3.server.client().delete_object(Bucket=s3.bucket, Key=keys[-1])  # a shard no box needs
    errors: list[str] = []

    def rank(comm: Any) -> None:
        bucket = Bucket.at(url)
        commit = read_commit(bucket)
        assert commit is not None
        src = ObjectInside(bucket, commit)
        with pytest.raises(LoadFailedError) as err:
            load_collective(comm, src.root, {"w": BOX}, source=src)
        errors.append(str(err.value))

    run_threads(2, rank)
    assert len(errors) == 2
    checkpoint, file = keys[-1].rsplit("/", 4)[0], keys[-1].split("/", 2)[2]
    for message in errors:  # the checkpoint (its objects' URL) and the object in it
        assert f"{s3.url}/{checkpoint}: {file}: missing" in message, message


@pytest.mark.parametrize("fault", ["missing", "longer", "shorter"])
def test_a_read_object_missing_or_resized_fails_the_load_on_every_rank(s3: S3, fault: str) -> None:
    url, keys = _saved(s3, f"torn-read-{fault}")
    client = s3.server.client()
    if fault == "missing":
        client.delete_object(Bucket=s3.bucket, Key=keys[0])  # the shard the box needs
    else:  # read in part (two of its chunks): the answers' stated size tells, no HEAD
        body = client.get_object(Bucket=s3.bucket, Key=keys[0])["Body"].read()
        body = body + b"\0" if fault == "longer" else body[:-1]
        client.put_object(Bucket=s3.bucket, Key=keys[0], Body=body)
    with pytest.raises(LoadFailedError, match=r"MissingFileError|SizeMismatchError") as err:
        _load_first_rows(url)
    assert keys[0].split("/", 2)[2] in str(err.value), err.value
    # the one-process load says it is no checkpoint, naming the key, as the HEADs of open do
    with pytest.raises(NotACheckpointError, match="not whole") as err2:
        ckptfmt.load(url)
    assert keys[0] in str(err2.value)
