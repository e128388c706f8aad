"""A collective save straight to a bucket (``ckptfmt.parallel.save_to_bucket``): every rank puts
its own files, rank 0 commits; the checkpoint reads back bit-exact and verifies clean; one that
is there is refused on every rank unless overwriting, and replaced whole when overwriting; the
server gone in the middle of the uploads fails the save on every rank with no commit object;
the ranks' scratch directories never outlive the call. Thread ranks against the tests' real S3
server (the mpiexec and torchrun jobs are in ``test_manager_bucket_jobs.py``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit.s3 import S3
from kit.s3_proxy import S3Proxy

import ckptfmt
from ckptfmt import PerRank, Shard, WriteOptions
from ckptfmt.errors import SaveFailedError
from ckptfmt.parallel import save_to_bucket
from ckptfmt.storage.objects import Bucket
from ckptfmt.storage.objects.commit import read_commit
from ckptfmt.transport.threads import run_threads

SMALL = WriteOptions(fsync=False, chunk_bytes=4 << 10, shard_bytes=16 << 10)
FULL = np.random.default_rng(2).standard_normal((96, 70)).astype(np.float32)
FAST_FAILURE = {"retry_timeout": "2", "max_retries": "2", "connect_timeout": "1", "timeout": "5"}


def _state(rank: int, scale: float = 1.0) -> dict[str, Any]:
    rows = FULL[rank * 48 : (rank + 1) * 48] * scale
    return {
        "w": Shard(rows, (rank * 48, 0), FULL.shape),
        "b": np.arange(5, dtype=np.int64),
        "rng": PerRank(np.full(3, rank, np.int32)),
        "step": 4,
    }


def _save(url: str, scale: float = 1.0, write: WriteOptions = SMALL, **kw: Any) -> list[Any]:
    def rank(comm: Any) -> Any:
        return save_to_bucket(
            comm, _state(comm.rank, scale), url, step=4, node="host", write=write, **kw
        )

    return run_threads(2, rank)


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``TMPDIR`` for the ranks' scratch directories, to check that none is left."""
    where = tmp_path / "tmp"
    where.mkdir()
    monkeypatch.setenv("TMPDIR", str(where))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    return where


def test_every_rank_puts_its_files_and_rank_0_commits(s3: S3, scratch: Path) -> None:
    url = f"{s3.url}/run/ckpt"
    manifests = _save(url)
    assert len({m.save_id for m in manifests}) == 1
    got = ckptfmt.load(url)
    np.testing.assert_array_equal(got["w"], FULL)
    np.testing.assert_array_equal(got["b"], np.arange(5))
    assert [r.tolist() for r in got["rng"]] == [[0, 0, 0], [1, 1, 1]]
    assert got["step"] == 4
    report = ckptfmt.verify(url)
    assert not report.problems and report.files_checked > 2, report
    commit = read_commit(Bucket.at(url))
    assert commit is not None and commit.save_id == manifests[0].save_id
    keys = {o.key for o in commit.objects}
    assert set(s3.keys("run/ckpt/")) == {f"run/ckpt/{manifests[0].save_id}/{k}" for k in keys} | {
        "run/ckpt/ckptfmt-commit.json"
    }
    assert list(scratch.iterdir()) == []


def test_a_checkpoint_there_is_refused_unless_overwriting(s3: S3, scratch: Path) -> None:
    url = f"{s3.url}/run/ckpt"
    first = _save(url)[0].save_id
    with pytest.raises(SaveFailedError, match="overwrite"):
        _save(url, scale=2.0)
    assert read_commit(Bucket.at(url)).save_id == first  # type: ignore[union-attr]
    second = _save(url, scale=2.0, write=replace(SMALL, overwrite=True))
    np.testing.assert_array_equal(ckptfmt.load(url)["w"], FULL * 2.0)
    assert not [k for k in s3.keys("run/ckpt/") if f"/{first}/" in k]  # the old save is gone
    assert all(f"/{second[0].save_id}/" in k or k.endswith("commit.json") for k in s3.keys("run/"))
    assert list(scratch.iterdir()) == []


def test_the_server_gone_mid_upload_fails_the_save_on_every_rank(
    s3: S3, s3_proxy: S3Proxy, scratch: Path
) -> None:
    url = f"{s3.url}/run/ckpt"
    s3_proxy.down_after(4, method="PUT")
    errors: list[str] = []

    def rank(comm: Any) -> None:
        with pytest.raises(SaveFailedError) as err:
            save_to_bucket(
                comm,
                _state(comm.rank),
                url,
                step=4,
                node="host",
                write=SMALL,
                storage_options=FAST_FAILURE,
            )
        errors.append(str(err.value))

    run_threads(2, rank)
    s3_proxy.up()
    assert len(errors) == 2 and all("(in write)" in e for e in errors), errors
    assert not [k for k in s3.keys("run/") if k.endswith("ckptfmt-commit.json")]
    left = s3.keys("run/ckpt/")
    assert len(left) >= 4, left  # some objects were up: left for gc, which removes them
    assert ckptfmt.maintenance.gc(url).objects == len(left) and s3.keys("run/ckpt/") == []
    assert list(scratch.iterdir()) == []


def test_one_rank_failing_its_uploads_fails_the_save_everywhere_and_the_old_one_stays(
    s3: S3, scratch: Path
) -> None:
    """Rank 1 alone cannot reach the store (its storage options point nowhere): the save fails
    on both ranks, naming rank 1, in the upload phase; the checkpoint it was to replace
    (``overwrite``) still loads bit for bit; no scratch directory is left."""
    url = f"{s3.url}/run/ckpt"
    old = _save(url)[0].save_id
    nowhere = {**FAST_FAILURE, "endpoint_url": "http://127.0.0.1:9"}
    errors: list[str] = []

    def rank(comm: Any) -> None:
        with pytest.raises(SaveFailedError) as err:
            save_to_bucket(
                comm,
                _state(comm.rank, 3.0),
                url,
                step=4,
                node="host",
                write=replace(SMALL, overwrite=True),
                storage_options=nowhere if comm.rank == 1 else None,
            )
        errors.append(str(err.value))

    run_threads(2, rank)
    assert len(errors) == 2 and all("(in write)" in e and "rank 1" in e for e in errors), errors
    assert read_commit(Bucket.at(url)).save_id == old  # type: ignore[union-attr]
    np.testing.assert_array_equal(ckptfmt.load(url)["w"], FULL)
    assert list(scratch.iterdir()) == []


def test_an_incremental_save_copies_each_ranks_unchanged_files_from_the_base(
    s3: S3, s3_proxy: S3Proxy, scratch: Path
) -> None:
    hashed = replace(SMALL, content_hash=True)
    base, url = f"{s3.url}/run/a", f"{s3.url}/run/b"
    _save(base, write=hashed)

    def rank(comm: Any) -> Any:
        state = _state(comm.rank, 1.0 if comm.rank == 0 else 3.0)  # rank 1's rows change
        return save_to_bucket(comm, state, url, step=5, node="host", write=hashed, base=base)

    s3_proxy.copies.clear()
    manifest = run_threads(2, rank)[0]
    copied = sorted(p.split("/", 5)[-1] for p in s3_proxy.copies)  # /bucket/run/b/<id>/<path>
    files = {f.path: r.rank for t in manifest.tensors() for r in t.regions for f in r.files}
    w_rank0 = sorted(p for p, r in files.items() if p.startswith("w/") and r == 0)
    w_rank1 = [p for p, r in files.items() if p.startswith("w/") and r == 1]
    assert w_rank0 and set(w_rank0) <= set(copied)  # rank 0's rows: copied, not uploaded
    assert not set(w_rank1) & set(copied)  # rank 1's changed rows: uploaded
    assert any(p.startswith("b/") for p in copied)
    for key in s3.keys("run/a/"):  # the base gone: the new checkpoint stands alone
        s3.server.client().delete_object(Bucket=s3.bucket, Key=key)
    got = ckptfmt.load(url)
    np.testing.assert_array_equal(got["w"][:48], FULL[:48])
    np.testing.assert_array_equal(got["w"][48:], FULL[48:] * 3.0)
    assert ckptfmt.verify(url).healthy
    with pytest.raises(SaveFailedError, match="run/a"):  # no base any more: refused everywhere
        _save(f"{s3.url}/run/c", write=hashed, base=base)
    assert s3.keys("run/c/") == []
    assert list(scratch.iterdir()) == []
