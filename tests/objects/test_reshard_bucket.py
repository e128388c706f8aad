"""The offline reshard (``ckptfmt reshard``) with a bucket at either end, against the tests' real
S3 server (moto) behind the counting proxy: a reshard into a URL puts its files under the new
save's prefix and commits by the commit object, and loads back bit for bit; a reshard from a URL
reads the chunks each new file needs with ranged GETs; neither goes through a local directory
(``TMPDIR`` stays empty, nothing is made where it runs). An overwrite at a URL stopped before its
commit (the commit put refused by the server, or the process killed there) leaves the old
checkpoint whole and loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
from kit.cli import run_cli
from kit.reshard import check_resharded as check_equal
from kit.reshard import save
from kit.s3 import S3
from kit.s3_proxy import S3Proxy

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.errors import CkptError, DamagedError, DestinationExistsError, UsageError
from ckptfmt.maintenance.reshard import reshard
from ckptfmt.redundancy import Redundancy
from ckptfmt.storage.objects import Bucket
from ckptfmt.storage.objects.commit import read_commit

WRITE = WriteOptions(chunk_bytes=1 << 10, shard_bytes=8 << 10, fsync=False)


def _ids(s3: S3, prefix: str) -> set[str]:
    """The second path component of every key under ``prefix`` (save ids, the commit object)."""
    return {k[len(prefix) :].split("/")[0] for k in s3.keys(prefix)}


@pytest.fixture
def quiet_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty ``TMPDIR``, and an empty working directory: a reshard between a directory and
    a bucket must leave both empty (no scratch copy of either end)."""
    tmp = tmp_path / "tmpdir"
    cwd = tmp_path / "cwd"
    tmp.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    monkeypatch.chdir(cwd)
    return tmp_path


def _empty(quiet_tmp: Path) -> None:
    assert list((quiet_tmp / "tmpdir").iterdir()) == []
    assert list((quiet_tmp / "cwd").iterdir()) == []


def test_a_reshard_into_a_bucket_commits_there_and_loads_bit_exact(
    s3: S3, s3_proxy: S3Proxy, quiet_tmp: Path
) -> None:
    src = save(quiet_tmp, 4, 3)
    url = f"{s3.url}/run/resharded"
    report = reshard(src, url, 3, rows=["shards/*"], write=WRITE)
    assert report.destination == [url]
    check_equal(url)
    commit = read_commit(Bucket.at(url))
    assert commit is not None
    man = ckptfmt.open(url).manifest
    assert man.world_size == 3 and commit.save_id == man.save_id
    # every object under the new save's prefix, listed by the commit; nothing else
    keys = {f"run/resharded/{commit.save_id}/{o.key}" for o in commit.objects}
    assert set(s3.keys("run/resharded/")) == keys | {"run/resharded/ckptfmt-commit.json"}
    assert s3_proxy.body_bytes["PUT"] >= report.bytes_written
    _empty(quiet_tmp)


def test_a_reshard_from_a_bucket_reads_its_objects_into_a_directory_or_a_bucket(
    s3: S3, s3_proxy: S3Proxy, quiet_tmp: Path
) -> None:
    src = f"{s3.url}/run/saved"
    reshard(save(quiet_tmp, 4, 3), src, 4, rows=["shards/*"], write=WRITE)  # 4 ranks, in a bucket
    s3_proxy.requests.clear()
    dst = quiet_tmp / "dst"
    report = reshard(src, dst, 2, rows=["shards/*"], write=WRITE)
    check_equal(dst)
    assert report.bytes_read <= 1.5 * report.data_bytes + 4096  # ranged reads, chunk by chunk
    assert s3_proxy.requests["GET"] > 0 and s3_proxy.requests["PUT"] == 0
    other = f"{s3.url}/run/again"
    reshard(src, other, 3, rows=["shards/*"], write=WRITE)  # bucket to bucket
    check_equal(other)
    assert ckptfmt.open(other).manifest.world_size == 3
    _empty(quiet_tmp)


def test_the_cli_reshards_into_and_out_of_a_bucket(s3: S3, quiet_tmp: Path) -> None:
    src = save(quiet_tmp, 2, 3)
    url = f"{s3.url}/cli/out"
    grid = ["--chunk-bytes", "1024", "--shard-bytes", "8192", "--no-fsync", "-q"]
    result = run_cli("reshard", src, url, "--ranks", "3", "--rows", "shards/*", *grid)
    assert result.exit_code == 0, result.output
    check_equal(url)
    result = run_cli("reshard", url, quiet_tmp / "back", "--ranks", "1", *grid)
    assert result.exit_code == 0, result.output
    check_equal(quiet_tmp / "back")


def test_a_checkpoint_at_the_url_is_refused_unless_overwriting_and_redundancy_needs_dirs(
    s3: S3, quiet_tmp: Path
) -> None:
    src = save(quiet_tmp, 2, 3)
    url = f"{s3.url}/run/there"
    reshard(src, url, 2, write=WRITE)
    before = sorted(s3.keys("run/there/"))
    with pytest.raises(DestinationExistsError):
        reshard(src, url, 3, write=WRITE)
    assert sorted(s3.keys("run/there/")) == before
    with pytest.raises(UsageError, match="node-local directories"):
        reshard(src, f"{s3.url}/run/red", 2, write=WRITE, redundancy=Redundancy("xor"))
    assert s3.keys("run/red/") == []
    reshard(src, url, 3, write=replace(WRITE, overwrite=True))
    assert ckptfmt.open(url).manifest.world_size == 3
    check_equal(url)
    commit = read_commit(Bucket.at(url))
    assert commit is not None  # the replaced save's objects are gone
    assert _ids(s3, "run/there/") == {commit.save_id, "ckptfmt-commit.json"}


def test_an_overwrite_whose_commit_put_is_refused_leaves_the_old_checkpoint_whole(
    s3: S3, s3_proxy: S3Proxy, quiet_tmp: Path
) -> None:
    src = save(quiet_tmp, 2, 3)
    url = f"{s3.url}/run/kept"
    reshard(src, url, 2, write=WRITE)
    old = read_commit(Bucket.at(url))
    assert old is not None
    s3_proxy.refuse(1, 403, "PUT", "ckptfmt-commit.json")
    with pytest.raises(CkptError):
        reshard(src, url, 3, write=replace(WRITE, overwrite=True))
    assert s3_proxy.faults  # the refusal was met: the commit put was the one refused
    assert read_commit(Bucket.at(url)) == old
    assert ckptfmt.open(url).manifest.world_size == 2
    check_equal(url)
    # what the failed reshard put is gone (best effort, and the server answered)
    assert _ids(s3, "run/kept/") == {old.save_id, "ckptfmt-commit.json"}


KILLED = textwrap.dedent(
    """
    import os, signal, sys
    from dataclasses import replace
    from ckptfmt.maintenance.reshard import reshard
    from ckptfmt.storage.store import bucket as store_bucket
    from test_reshard_bucket import WRITE

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)
    store_bucket.write_commit = die  # every object up, the commit object not yet
    reshard(sys.argv[1], sys.argv[2], 3, write=replace(WRITE, overwrite=True))
    """
)


def test_a_reshard_killed_before_its_commit_leaves_the_old_checkpoint_whole(
    s3: S3, quiet_tmp: Path
) -> None:
    src = save(quiet_tmp, 2, 3)
    url = f"{s3.url}/run/killed"
    reshard(src, url, 2, write=WRITE)
    old = read_commit(Bucket.at(url))
    script = quiet_tmp / "killed.py"
    script.write_text(KILLED)
    tests = Path(__file__).parents[1]
    env = {**s3.env, "PYTHONPATH": f"{tests / 'objects'}:{tests}", "PATH": os.environ["PATH"]}
    proc = subprocess.run(
        [sys.executable, script, str(src), url], env=env, timeout=180, capture_output=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-3000:]
    assert old is not None and len(_ids(s3, "run/killed/")) == 3  # it got that far
    assert read_commit(Bucket.at(url)) == old
    assert ckptfmt.open(url).manifest.world_size == 2
    check_equal(url)


def test_a_damaged_object_in_the_source_bucket_is_named_and_nothing_is_committed(
    s3: S3, s3_proxy: S3Proxy, quiet_tmp: Path
) -> None:
    src = f"{s3.url}/run/saved"
    reshard(save(quiet_tmp, 2, 3), src, 2, write=WRITE)
    s3_proxy.flip_byte("shards/w3/c/")  # every GET of that tensor's objects: one byte flipped
    dst = f"{s3.url}/run/out"
    with pytest.raises(DamagedError, match=r"s3://.*run/saved/.*shards/w3/c/"):
        reshard(src, dst, 3, write=WRITE)
    assert s3.keys("run/out/") == []  # what was put is gone; no commit object
    with pytest.raises(DamagedError):
        reshard(src, quiet_tmp / "dst", 3, write=WRITE)
    assert not (quiet_tmp / "dst").exists()
    assert [p.name for p in quiet_tmp.iterdir() if p.name.startswith(".")] == []
