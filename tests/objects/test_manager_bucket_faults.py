"""A manager whose level 3 is a bucket, with faults injected for real on the wire by the proxy
in front of the tests' S3 server (``kit.s3_proxy``): ``503 SlowDown`` answers are retried and the
flush commits; a connection reset in the middle of a multipart upload's part is retried; the
server gone during a flush fails that flush on every rank, leaves no commit object and level 1
untouched, the previous step on the bucket still restores, and the next flush commits once the
server is back; a byte flipped on its way from the bucket is found by its checksum and named,
and the older step restored.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit.arrays import assert_state_equal
from kit.launch import assert_ok, run_mpi
from kit.managers import node_manager
from kit.s3 import S3
from kit.s3_proxy import S3Proxy
from test_manager_bucket import _commit as _commit_of
from test_manager_bucket_jobs import WORKER, committed_steps, plan, results

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.storage.steps import step_dir_name

FAST_FAILURE = {"retry_timeout": "2", "max_retries": "2", "connect_timeout": "1", "timeout": "10"}


@contextmanager
def on_marks(out: Path, actions: dict[str, Callable[[], None]]) -> Iterator[None]:
    """While the block runs: when a job's rank 0 writes ``out/<mark>``, run ``actions[mark]``
    and answer with ``out/<mark>.go`` (the job waits for it)."""
    stop = threading.Event()

    def watch() -> None:
        left = dict(actions)
        while left and not stop.wait(0.05):
            for mark in [m for m in left if (out / m).exists()]:
                left.pop(mark)()
                (out / f"{mark}.go").write_text("go")

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(5)


@pytest.mark.mpi
@pytest.mark.slow
def test_slowdown_answers_are_retried_and_every_flush_commits(
    tmp_path: Path, s3: S3, s3_proxy: S3Proxy
) -> None:
    s3_proxy.slowdown(6, method="PUT")  # shard objects, commit objects, the pointer
    s3_proxy.slowdown(3, method="GET", path_contains="step-")  # commit reads, restore's reads
    s3_proxy.slowdown(2, method="HEAD")  # the restore's check of the commit's objects
    tasks = [
        {"name": "save", "action": "save", "steps": [1, 2]},
        {"name": "wipe", "action": "wipe"},
        {"name": "restore", "action": "restore"},
    ]
    p = plan(tmp_path, s3, tasks)
    assert_ok(run_mpi(2, WORKER, "mpi", str(p), timeout=240, env=s3_proxy.env(s3.env)))
    assert s3_proxy.faults["slowdown"] == 11
    for r in results(tmp_path, "save", 2):
        assert all(s["flushed"] and not s["warnings"] for s in r["saves"].values()), r
    assert committed_steps(s3) == [1, 2]
    for r in results(tmp_path, "restore", 2):
        assert (r["step"], r["level"], r["problems"]) == (2, 3, []), r


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("when", ["at-start", "mid-upload"])
def test_the_server_gone_during_a_flush_fails_it_everywhere_and_the_next_one_commits(
    tmp_path: Path, s3: S3, s3_proxy: S3Proxy, when: str
) -> None:
    """``at-start``: gone before step 2's flush (its first request, rank 0's read of the
    commit, fails); ``mid-upload``: gone once 3 of step 2's objects are up (every rank is
    uploading)."""

    def gone() -> None:
        if when == "at-start":
            s3_proxy.down()
        else:
            s3_proxy.down_after(3, method="PUT", path_contains=f"/{step_dir_name(2)}/")

    tasks = [
        {"name": "save", "action": "save", "steps": [1, 2], "hold": {"1": "gone", "2": "back"}},
        {"name": "local", "action": "restore"},  # level 1 untouched: step 2 is there
        {"name": "wipe", "action": "wipe"},
        {"name": "shared", "action": "restore"},  # the bucket's previous step
        {"name": "again", "action": "save", "steps": [3]},
    ]
    p = plan(tmp_path, s3, tasks, options=FAST_FAILURE)
    out = tmp_path / "out"
    with on_marks(out, {"gone": gone, "back": s3_proxy.up}):
        job = run_mpi(2, WORKER, "mpi", str(p), timeout=300, env=s3_proxy.env(s3.env))
    assert_ok(job)
    for r in results(tmp_path, "save", 2):  # every rank is told
        assert r["saves"]["1"] == {"flushed": True, "warnings": []}, r
        assert not r["saves"]["2"]["flushed"], r
        [told] = r["saves"]["2"]["warnings"]
        # a failed flush is no failed save: step 2 is committed on level 1
        assert "step 2 is saved on level 1" in told and "flush to level 3 failed" in told, told
    for r in results(tmp_path, "local", 2):
        assert (r["step"], r["level"], r["problems"]) == (2, 1, []), r
    for r in results(tmp_path, "shared", 2):
        assert (r["step"], r["level"], r["problems"]) == (1, 3, []), r
    for r in results(tmp_path, "again", 2):
        assert r["saves"]["3"] == {"flushed": True, "warnings": []}, r
    assert committed_steps(s3) == [1, 3]  # no commit object of step 2, ever
    left = s3.keys(f"run/{step_dir_name(2)}/")  # what the failed flush put, no commit names
    if when == "mid-upload":
        assert len(left) >= 3, left
    removed = ckptfmt.maintenance.gc(f"{s3.url}/run")
    assert s3.keys(f"run/{step_dir_name(2)}/") == [] and removed.objects == len(left), removed
    assert committed_steps(s3) == [1, 3]


def _big(step: int) -> dict[str, Any]:
    rng = np.random.default_rng([step, 9])
    return {"w": rng.standard_normal((48 << 20) // 4, dtype=np.float32), "step": step}


@pytest.mark.slow
def test_a_connection_reset_in_a_multipart_upload_is_retried(
    tmp_path: Path, s3: S3, s3_proxy: S3Proxy
) -> None:
    """A 48 MiB shard goes up in 8 MiB parts; two parts' connections are reset half way
    through their bodies: each part is sent again, the flush commits, the restore is exact."""
    write = WriteOptions(fsync=False, shard_bytes=64 << 20, chunk_bytes=4 << 20)
    s3_proxy.reset_mid_body(2, method="PUT", min_body=1 << 20)
    mgr = node_manager(tmp_path, shared=None, shared_dir=f"{s3.url}/run", write=write)
    mgr.save(1, _big(1))
    mgr.close()
    assert s3_proxy.faults["reset"] == 2
    assert mgr.last_save is not None and mgr.last_save.flushed
    assert committed_steps(s3) == [1]
    shutil.rmtree(tmp_path / "l1")
    state = {"w": np.zeros((48 << 20) // 4, np.float32), "step": -1}
    report = node_manager(tmp_path, shared=None, shared_dir=f"{s3.url}/run").restore(state)
    assert (report.step, report.level) == (1, 3)
    assert_state_equal(state, _big(1))


def test_a_byte_flipped_on_the_way_from_the_bucket_is_found_and_named(
    tmp_path: Path, s3: S3, s3_proxy: S3Proxy
) -> None:
    small = WriteOptions(fsync=False, chunk_bytes=16 << 10, shard_bytes=64 << 10)
    mgr = node_manager(tmp_path, shared=None, shared_dir=f"{s3.url}/run", write=small)
    states = {s: {"w": np.full(40_000, s, np.float32), "step": s} for s in (1, 2)}
    for s, st in states.items():
        mgr.save(s, st)
    mgr.close()
    shutil.rmtree(tmp_path / "l1")
    save_id = _commit_of(s3, 2)["save_id"]
    s3_proxy.flip_byte(f"{save_id}/w/c/", n=None)  # every read of step 2's shards
    state = {"w": np.zeros(40_000, np.float32), "step": -1}
    with pytest.warns(ckptfmt.CheckpointWarning, match="fell back to step 1"):
        report = node_manager(tmp_path, shared=None, shared_dir=f"{s3.url}/run").restore(state)
    assert (report.step, report.level) == (1, 3)
    assert_state_equal(state, states[1])
    assert s3_proxy.faults["flip"] >= 1
    [why] = [t for t in report.tried if "step 2 level 3" in t]
    assert "w/c/" in why and ("ChecksumError" in why or "Damaged" in why or "CRC" in why), why
