"""Incremental checkpoints in a bucket, against the tests' real S3 server (moto) behind the
counting proxy (``kit.s3_proxy``): an unchanged object is copied inside the store from the base
(a ``CopyObject``, no body on the wire) instead of uploaded, both by ``ckptfmt.save(url,
base=url)`` and by an incremental manager's flush to a bucket level 3 (its report counts the
copies as ``bytes_linked["3"]``); every step holds objects of its own, so it loads bit-exact and
verifies with its base, and every older step, deleted; retention may delete any step; a base
elsewhere or not committed is refused before anything is written; a process killed in the middle
of an incremental save or flush leaves the previous step whole."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ckptfmt_cli.exits import ExitStatus
from kit.arrays import assert_state_equal
from kit.cli import run_cli
from kit.launch import assert_ok, run_mpi
from kit.managers import node_manager
from kit.s3 import S3
from kit.s3_proxy import S3Proxy

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.errors import CkptError, NotACheckpointError, UsageError
from ckptfmt.maintenance import objects as in_bucket
from ckptfmt.storage.objects import Bucket
from ckptfmt.storage.objects.commit import read_commit
from ckptfmt.storage.objects.copies import Tally, base_for
from ckptfmt.storage.steps import step_dir_name
from ckptfmt.storage.store import MemoryStore

WORKER = "tests/workers/_incr_bucket_worker.py"
W = WriteOptions(
    fsync=False, chunk_bytes=8 << 10, shard_bytes=32 << 10, threads=1, content_hash=True
)
FROZEN = (256, 512)  # float32: 512 KiB in 16 shard files
ADAPTER = (64, 64)  # float32: 16 KiB, one shard file


def _state(k: int) -> dict[str, Any]:
    """Step ``k`` of a fine-tune: the frozen base never changes, the adapter always does, and
    the embedding table changes in row ``k`` only (one of its shard files)."""
    rng = np.random.default_rng(5)
    table = rng.standard_normal((512, 64)).astype(np.float32)  # 128 KiB, 4 shard files
    table[k % 512] += np.float32(k)
    return {
        "frozen": rng.standard_normal(FROZEN).astype(np.float32),
        "adapter": np.full(ADAPTER, k, np.float32),
        "table": table,
        "step": k,
    }


def _data_bytes(url: str) -> dict[str, int]:
    """Every data file of the checkpoint at ``url`` by path: its size."""
    return {f.path: f.size for _, f in ckptfmt.open(url).manifest.files()}


def _delete_prefix(s3: S3, prefix: str) -> None:
    client = s3.server.client()
    for key in s3.keys(prefix):
        client.delete_object(Bucket=s3.bucket, Key=key)
    assert s3.keys(prefix) == []


def test_a_save_to_a_url_copies_its_unchanged_objects_from_the_base(
    s3: S3, s3_proxy: S3Proxy
) -> None:
    base, url = f"{s3.url}/run/a", f"{s3.url}/run/b"
    s3_proxy.body_bytes.clear()
    ckptfmt.save(_state(0), base, write=W)
    full_put = s3_proxy.body_bytes["PUT"]
    assert s3_proxy.copies == []

    s3_proxy.body_bytes.clear()
    ckptfmt.save(_state(1), url, write=W, base=base)
    incr_put = s3_proxy.body_bytes["PUT"]

    sizes = _data_bytes(url)
    changed = [p for p in sizes if p.startswith("adapter/")] + ["table/c/0/0"]
    unchanged = sorted(set(sizes) - set(changed))
    copied = sorted(p.split("/", 5)[-1] for p in s3_proxy.copies)  # /bucket/run/b/<id>/<path>
    assert copied == unchanged  # every unchanged file copied, nothing else
    # what went up: the two changed shard files and the metadata (no data file copied went up)
    meta = full_put - sum(_data_bytes(base).values())
    assert incr_put <= sum(sizes[p] for p in changed) + meta + 256  # a manifest of its own
    assert full_put >= 8 * incr_put

    # the base deleted: the new checkpoint holds objects of its own
    _delete_prefix(s3, "run/a/")
    assert ckptfmt.verify(url).healthy
    assert_state_equal(ckptfmt.load(url), _state(1))


def test_a_chain_of_saves_to_a_bucket_restores_every_step_with_its_bases_deleted(
    s3: S3,
) -> None:
    urls = [f"{s3.url}/chain/s{k}" for k in range(6)]
    for k, url in enumerate(urls):
        ckptfmt.save(_state(k), url, write=W, base=urls[k - 1] if k else None)
    # oldest first: each step alive loads bit-exact and verifies after every deletion
    for k in range(len(urls)):
        for j in range(k, len(urls)):
            assert_state_equal(ckptfmt.load(urls[j]), _state(j))
        assert ckptfmt.verify(urls[k]).healthy
        _delete_prefix(s3, f"chain/s{k}/")
    # newest first, on a fresh chain: the older steps stay whole
    again = [f"{s3.url}/again/s{k}" for k in range(3)]
    for k, url in enumerate(again):
        ckptfmt.save(_state(k), url, write=W, base=again[k - 1] if k else None)
    for k in reversed(range(3)):
        _delete_prefix(s3, f"again/s{k}/")
        for j in range(k):
            assert_state_equal(ckptfmt.load(again[j]), _state(j))


def test_a_base_elsewhere_or_not_committed_is_refused_before_anything_is_written(
    s3: S3, tmp_path: Path
) -> None:
    base = f"{s3.url}/run/a"
    ckptfmt.save(_state(0), base, write=W)
    other = f"s3://{s3.server.make_bucket()}/run/a"
    ckptfmt.save(_state(0), other, write=W)
    target = f"{s3.url}/run/b"
    with pytest.raises(UsageError, match="same bucket"):
        ckptfmt.save(_state(1), target, write=W, base=other)
    with pytest.raises(UsageError, match="same bucket"):  # the base is the target itself
        ckptfmt.save(_state(1), base, write=WriteOptions(overwrite=True), base=base)
    with pytest.raises(NotACheckpointError, match="run/none"):
        ckptfmt.save(_state(1), target, write=W, base=f"{s3.url}/run/none")
    ckptfmt.save(_state(0), tmp_path / "dir", write=W)
    with pytest.raises(UsageError, match="not the path"):
        ckptfmt.save(_state(1), target, write=W, base=str(tmp_path / "dir"))
    assert s3.keys("run/b") == []
    assert_state_equal(ckptfmt.load(base), _state(0))


def test_a_base_of_the_wrong_kind_is_refused_where_it_is_handed_in(s3: S3, tmp_path: Path) -> None:
    """The base is parsed with the destination, once: a URL base for a directory, and any base
    for a store that has no incremental saves (memory), are refused before anything is made."""
    base = f"{s3.url}/run/a"
    ckptfmt.save(_state(0), base, write=W)
    with pytest.raises(UsageError, match="is a directory, not"):
        ckptfmt.save(_state(1), tmp_path / "dir", write=W, base=base)
    assert not (tmp_path / "dir").exists()
    store = MemoryStore("m")
    with pytest.raises(UsageError, match="base applies to a save into a directory or a bucket"):
        ckptfmt.save(_state(1), store, write=W, base=tmp_path)
    assert not store.is_committed()


KILLED = textwrap.dedent(
    """
    import os, signal, sys
    import ckptfmt
    from ckptfmt import WriteOptions
    from ckptfmt.storage.objects import Bucket
    from ckptfmt.storage.store import bucket as store_bucket
    from test_incremental_bucket import W, _state

    where = sys.argv[3]
    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)
    if where == "copy":  # the first copy inside the store: killed in the middle of the copies
        original = Bucket.copy_object
        done = []
        def copy_then_die(self, *args, **kwargs):
            original(self, *args, **kwargs)
            done.append(1)
            if len(done) == 3:
                die()
        Bucket.copy_object = copy_then_die
    else:  # every object up, the commit object not yet
        store_bucket.write_commit = die
    ckptfmt.save(_state(1), sys.argv[2], write=W, base=sys.argv[1])
    """
)


@pytest.mark.parametrize("where", ["copy", "commit"])
def test_a_process_killed_in_an_incremental_save_to_a_bucket_leaves_the_base_whole(
    s3: S3, tmp_path: Path, where: str
) -> None:
    base, url = f"{s3.url}/run/a", f"{s3.url}/run/b"
    ckptfmt.save(_state(0), base, write=W)
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    env = {
        **s3.env,
        "PYTHONPATH": str(Path(__file__).parent) + ":" + str(Path(__file__).parents[1]),
    }
    proc = subprocess.run(
        [sys.executable, script, base, url, where],
        env=env,
        timeout=180,
        capture_output=True,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-3000:]
    assert s3.keys("run/b/")  # it got that far: objects under its save id
    assert read_commit(Bucket.at(url)) is None  # nothing committed: no checkpoint there
    with pytest.raises(NotACheckpointError):
        ckptfmt.load(url)
    assert ckptfmt.verify(base).healthy
    assert_state_equal(ckptfmt.load(base), _state(0))
    # `ckptfmt gc` removes what the killed save left, and nothing of the base
    kept = s3.keys("run/a/")
    assert run_cli("gc", url).exit_code == ExitStatus.OK
    assert s3.keys("run/b/") == [] and s3.keys("run/a/") == kept
    # the next incremental save goes through, against the same base
    ckptfmt.save(_state(1), url, write=W, base=base)
    assert_state_equal(ckptfmt.load(url), _state(1))


def test_a_base_object_gone_before_its_copy_is_uploaded_instead(s3: S3, tmp_path: Path) -> None:
    """Retention or ``ckptfmt gc`` may remove the base between the plan and the copies: an
    object whose copy finds nothing is uploaded, and the checkpoint commits whole."""
    base, url = f"{s3.url}/run/a", f"{s3.url}/run/b"
    ckptfmt.save(_state(0), base, write=W)
    staged = tmp_path / "staged"
    manifest = ckptfmt.save(_state(1), staged, write=W)
    plan = in_bucket.copy_plan(manifest, base_for(Bucket.at(url), base))
    assert plan is not None and len(plan.refs) == 19  # 16 frozen + 3 of the table's 4
    _delete_prefix(s3, "run/a/")
    tally = Tally()
    in_bucket.publish(Bucket.at(url), staged, manifest, copies=plan, tally=tally)
    assert tally.copied_files == 0 and tally.uploaded_bytes >= sum(
        _data_bytes(str(staged)).values()
    )
    assert ckptfmt.verify(url).healthy
    assert_state_equal(ckptfmt.load(url), _state(1))


@pytest.fixture
def quiet_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty ``TMPDIR`` and an empty working directory, both to stay empty: the incremental
    save to a bucket writes through the bucket's draft, no local copy of anything. Every
    temporary directory or file made meanwhile is also noted (and made: a scratch directory
    removed before the save returns would leave ``TMPDIR`` empty again), and none may be."""
    import tempfile

    for name in ("tmpdir", "cwd"):
        (tmp_path / name).mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmpdir"))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    monkeypatch.chdir(tmp_path / "cwd")
    made: list[str] = []
    for name in ("mkdtemp", "mkstemp"):
        original = getattr(tempfile, name)

        def noted(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            out = _original(*args, **kwargs)
            made.append(str(out))
            return out

        monkeypatch.setattr(tempfile, name, noted)
    yield tmp_path
    assert made == [], made
    assert list((tmp_path / "tmpdir").iterdir()) == []
    assert list((tmp_path / "cwd").iterdir()) == []


def test_an_incremental_save_to_a_bucket_makes_no_local_directory(
    s3: S3, s3_proxy: S3Proxy, quiet_tmp: Path
) -> None:
    base, url = f"{s3.url}/run/a", f"{s3.url}/run/b"
    ckptfmt.save(_state(0), base, write=W)
    s3_proxy.copies.clear()
    ckptfmt.save(_state(1), url, write=W, base=base)
    assert len(s3_proxy.copies) == 19  # 16 frozen + 3 of the table's 4 files
    assert list((quiet_tmp / "tmpdir").iterdir()) == []
    assert list((quiet_tmp / "cwd").iterdir()) == []
    assert_state_equal(ckptfmt.load(url), _state(1))
    # the next one, against this one: a chain through the store alone
    ckptfmt.save(_state(2), f"{s3.url}/run/c", write=W, base=url)
    assert_state_equal(ckptfmt.load(f"{s3.url}/run/c"), _state(2))
    assert list((quiet_tmp / "tmpdir").iterdir()) == []


def test_an_incremental_overwrite_whose_commit_put_is_refused_keeps_the_old_checkpoint(
    s3: S3, s3_proxy: S3Proxy
) -> None:
    base, url = f"{s3.url}/run/a", f"{s3.url}/run/b"
    ckptfmt.save(_state(0), base, write=W)
    ckptfmt.save(_state(1), url, write=W, base=base)
    old = read_commit(Bucket.at(url))
    assert old is not None
    s3_proxy.refuse(1, 403, "PUT", "ckptfmt-commit.json")
    with pytest.raises(CkptError):
        ckptfmt.save(_state(2), url, write=replace(W, overwrite=True), base=base)
    assert s3_proxy.faults
    assert read_commit(Bucket.at(url)) == old
    assert_state_equal(ckptfmt.load(url), _state(1))
    assert ckptfmt.verify(url).healthy
    # what the refused save put is gone: only the old save's objects and its commit object
    assert {k.split("/")[2] for k in s3.keys("run/b/")} == {old.save_id, "ckptfmt-commit.json"}
    ckptfmt.save(_state(2), url, write=replace(W, overwrite=True), base=base)
    assert_state_equal(ckptfmt.load(url), _state(2))


@pytest.mark.mpi
def test_mpi_ranks_save_incrementally_to_a_bucket_through_no_scratch_directory(
    s3: S3, s3_proxy: S3Proxy, tmp_path: Path
) -> None:
    """``save_to_bucket(base=...)`` under ``mpiexec -n 2``: each rank's unchanged files copied
    by the store, the changed ones put; ``TMPDIR`` stays empty; each rank loads it bit-exact."""
    base, url = f"{s3.url}/mpi/a", f"{s3.url}/mpi/b"
    tmp, out = tmp_path / "tmpdir", tmp_path / "out"
    tmp.mkdir()
    out.mkdir()
    env = {**s3_proxy.env(s3.env), "TMPDIR": str(tmp)}
    proc = run_mpi(2, WORKER, base, url, str(out), timeout=240, env=env)
    assert_ok(proc)
    docs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(d["same"] and d["tmp"] == [] for d in docs), docs
    assert len({tuple(d["save_ids"]) for d in docs}) == 1
    assert list(tmp.iterdir()) == []
    manifest = ckptfmt.open(url).manifest
    owner = {f.path: r.rank for t in manifest.tensors() for r in t.regions for f in r.files}
    copied = {p.split("/", 5)[-1] for p in s3_proxy.copies if "/mpi/b/" in p}
    w0 = {p for p, r in owner.items() if p.startswith("w/") and r == 0}
    w1 = {p for p, r in owner.items() if p.startswith("w/") and r == 1}
    assert w0 and w0 <= copied  # rank 0's rows unchanged: copied in the store
    assert w1 and not w1 & copied  # rank 1's changed: put
    assert any(p.startswith("table/") for p in copied)
    assert ckptfmt.verify(url).healthy


# --- the manager ---------------------------------------------------------------------------------


def test_an_incremental_managers_flush_copies_unchanged_objects_and_keeps_steps_whole(
    tmp_path: Path, s3: S3, s3_proxy: S3Proxy
) -> None:
    mgr = node_manager(
        tmp_path, shared=None, shared_dir=f"{s3.url}/run", write=W, incremental=True, keep_shared=3
    )
    reports = []
    puts = []
    for k in range(1, 6):
        s3_proxy.body_bytes.clear()
        mgr.save(k, _state(k))
        mgr.wait()
        puts.append(s3_proxy.body_bytes["PUT"])
        assert mgr.last_save is not None and mgr.last_save.flushed
        reports.append(mgr.last_save)
    total = sum(
        f.size for _, f in ckptfmt.open(f"{s3.url}/run/{step_dir_name(5)}").manifest.files()
    )
    first, later = reports[0], reports[1:]
    assert first.bytes_written["3"] == total and not first.bytes_linked.get("3")
    changed = (16 << 10) + (32 << 10)  # the adapter and one table shard file
    for r in later:
        assert r.bytes_linked["3"] + r.bytes_written["3"] == total, r
        assert 0 < r.bytes_written["3"] <= changed + 1024, r  # shard files carry an index
    assert all(p * 5 <= puts[0] for p in puts[1:]), puts
    # retention kept the newest three; level 1 wiped: each kept step restores from the bucket
    # alone, bit-exact, its bases gone
    assert sorted(mgr.steps()) == [3, 4, 5]
    mgr.close()
    assert s3.keys(f"run/{step_dir_name(1)}/") == [] and s3.keys(f"run/{step_dir_name(2)}/") == []
    for step in (3, 4, 5):
        url = f"{s3.url}/run/{step_dir_name(step)}"
        assert ckptfmt.verify(url).healthy, step
        assert_state_equal(ckptfmt.load(url), _state(step))
    # any step deleted, the others whole: the middle one first, then the newest
    _delete_prefix(s3, f"run/{step_dir_name(4)}/")
    for step in (3, 5):
        assert_state_equal(ckptfmt.load(f"{s3.url}/run/{step_dir_name(step)}"), _state(step))
    _delete_prefix(s3, f"run/{step_dir_name(5)}/")
    assert_state_equal(ckptfmt.load(f"{s3.url}/run/{step_dir_name(3)}"), _state(3))
    fresh = node_manager(tmp_path / "fresh", shared=None, shared_dir=f"{s3.url}/run", write=W)
    state = _state(0)
    report = fresh.restore(state)
    fresh.close()
    assert (report.step, report.level) == (3, 3)
    assert_state_equal(state, _state(3))


KILLED_FLUSH = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from kit.managers import node_manager
    from test_incremental_bucket import W, _state

    seen = []
    def die(point):
        if point == sys.argv[3]:
            seen.append(point)
            if len(seen) == 2:  # the second step's flush
                os.kill(os.getpid(), signal.SIGKILL)

    mgr = node_manager(Path(sys.argv[1]), shared=None, shared_dir=sys.argv[2], write=W,
                       incremental=True, fault=die)
    for k in (1, 2):
        mgr.save(k, _state(k))
        mgr.wait()
    """
)


@pytest.mark.parametrize("point", ["flush-copied", "flush-committing"])
def test_a_process_killed_in_an_incremental_flush_leaves_the_previous_step_whole(
    s3: S3, tmp_path: Path, point: str
) -> None:
    script = tmp_path / "killed.py"
    script.write_text(KILLED_FLUSH)
    tests = Path(__file__).parents[1]
    env = {**s3.env, "PYTHONPATH": f"{Path(__file__).parent}:{tests}"}
    proc = subprocess.run(
        [sys.executable, script, tmp_path, f"{s3.url}/run", point],
        env=env,
        timeout=180,
        capture_output=True,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-3000:]
    # step 2's objects are up (copied and uploaded), its commit object is not
    assert s3.keys(f"run/{step_dir_name(2)}/")
    assert read_commit(Bucket.at(f"{s3.url}/run/{step_dir_name(2)}")) is None
    one = f"{s3.url}/run/{step_dir_name(1)}"
    assert ckptfmt.verify(one).healthy
    assert_state_equal(ckptfmt.load(one), _state(1))
    # `ckptfmt gc` of the root removes step 2's objects, and nothing of step 1
    kept = s3.keys(f"run/{step_dir_name(1)}/")
    assert run_cli("gc", f"{s3.url}/run").exit_code == ExitStatus.OK
    assert s3.keys(f"run/{step_dir_name(2)}/") == []
    assert s3.keys(f"run/{step_dir_name(1)}/") == kept
    assert_state_equal(ckptfmt.load(one), _state(1))
    # a restarted job, level 1 gone, restores step 1 from the bucket and flushes again
    fresh = node_manager(
        tmp_path / "again", shared=None, shared_dir=f"{s3.url}/run", write=W, incremental=True
    )
    state = _state(0)
    report = fresh.restore(state)
    assert (report.step, report.level) == (1, 3)
    assert_state_equal(state, _state(1))
    fresh.save(2, _state(2))
    fresh.wait()
    assert fresh.last_save is not None and fresh.last_save.flushed
    assert fresh.last_save.bytes_linked["3"] > 0
    fresh.close()
    assert_state_equal(ckptfmt.load(f"{s3.url}/run/{step_dir_name(2)}"), _state(2))


def test_a_restarted_job_copies_nothing_from_a_step_its_restore_found_damaged(
    tmp_path: Path, s3: S3
) -> None:
    """A byte flipped in an object of the newest step in the bucket: the restarted job's
    restore refuses that step and takes the one before. Its flush of the same step number
    must not copy the damaged object into the new step (a copy is not read): the base of an
    incremental flush is a step this job flushed or restored, and every new step is whole."""
    mgr = node_manager(tmp_path, shared=None, shared_dir=f"{s3.url}/run", write=W, incremental=True)
    for k in (1, 2, 3):
        mgr.save(k, _state(k))
        mgr.wait()
    mgr.close()
    three = f"{s3.url}/run/{step_dir_name(3)}"
    save_id = ckptfmt.open(three).manifest.save_id
    key = f"run/{step_dir_name(3)}/{save_id}/frozen/c/0/0"
    client = s3.server.client()
    data = bytearray(client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    data[100] ^= 0x10
    client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(data))

    fresh = node_manager(
        tmp_path / "again", shared=None, shared_dir=f"{s3.url}/run", write=W, incremental=True
    )
    try:
        state = _state(0)
        with pytest.warns(ckptfmt.CheckpointWarning, match="refused step 3"):
            report = fresh.restore(state)
        assert (report.step, report.level) == (2, 3), report.tried
        for k in (3, 4):
            fresh.save(k, _state(k))
            fresh.wait()
            assert fresh.last_save is not None and fresh.last_save.flushed
        assert fresh.last_save.bytes_linked["3"] > 0  # step 4 copied from the new step 3
    finally:
        fresh.close()
    for k in (3, 4):
        url = f"{s3.url}/run/{step_dir_name(k)}"
        assert ckptfmt.verify(url).healthy, url
        assert_state_equal(ckptfmt.load(url), _state(k))
