"""A manager whose level 3 is a bucket (``shared_dir="s3://..."``), in this process, against the
tests' real S3 server: the flush commits each step with a commit object and moves the latest
pointer; restore falls back to the bucket once level 1 is gone, bit for bit; a step whose
objects are missing, mis-sized or damaged is not restored (an older one is, the report names
why); retention deletes old steps, commit object first; a bucket out of reach is told at the
start; a manager left open when its script ends has its save in flight and its flush finished at
exit. The multi-process jobs (mpiexec, torchrun) and the faults through the proxy are in
``test_manager_bucket_jobs.py``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit import REPO
from kit.arrays import assert_state_equal, random_array
from kit.managers import NO_EXIT_HOOKS, NO_FSYNC, node_manager
from kit.s3 import S3
from kit.s3_proxy import S3Proxy

import ckptfmt
from ckptfmt import CheckpointManager, Shard, WriteOptions
from ckptfmt.errors import StorageError
from ckptfmt.storage.steps import step_dir_name
from ckptfmt.transport.threads import run_threads

SMALL = WriteOptions(fsync=False, chunk_bytes=16 << 10, shard_bytes=64 << 10)  # many objects


def _state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng([step, 7])
    return {
        "model": {
            "w": random_array(rng, np.float32, (300, 200)),
            "b": random_array(rng, np.float32, (200,)),
        },
        "step": step,
        "name": "bucket",
    }


def _template() -> dict[str, Any]:
    zero = _state(0)
    return {
        "model": {k: np.zeros_like(v) for k, v in zero["model"].items()},
        "step": -1,
        "name": "",
    }


def _mgr(tmp_path: Path, s3: S3, **kw: Any) -> CheckpointManager:
    opts: dict[str, Any] = {"shared_dir": f"{s3.url}/run", "write": SMALL}
    opts.update(kw)
    return node_manager(tmp_path, shared=None, **opts)


def _commit(s3: S3, step: int) -> dict[str, Any]:
    body = s3.server.client().get_object(
        Bucket=s3.bucket, Key=f"run/{step_dir_name(step)}/ckptfmt-commit.json"
    )["Body"]
    return json.loads(body.read())


def _steps_on_bucket(s3: S3) -> list[int]:
    return sorted(
        int(k.split("/")[1][5:]) for k in s3.keys("run/") if k.endswith("/ckptfmt-commit.json")
    )


def _wipe_level1(tmp_path: Path) -> None:
    shutil.rmtree(tmp_path / "l1")


def test_the_flush_commits_each_step_on_the_bucket_and_moves_the_pointer(
    tmp_path: Path, s3: S3
) -> None:
    mgr = _mgr(tmp_path, s3)
    for step in (1, 2):
        mgr.save(step, _state(step))
        mgr.wait()
        assert mgr.last_save is not None and mgr.last_save.flushed
    mgr.close()
    assert _steps_on_bucket(s3) == [1, 2]
    client = s3.server.client()
    pointer = json.loads(
        client.get_object(Bucket=s3.bucket, Key="run/ckptfmt-latest.json")["Body"].read()
    )
    commit = _commit(s3, 2)
    assert pointer == {"step": 2, "save_id": commit["save_id"]}
    assert commit["step"] == 2
    # every object of the level-1 copy but nothing else, with its size and CRC32C
    local = tmp_path / "l1" / "n0" / step_dir_name(2)
    want = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    assert [o["key"] for o in commit["objects"]] == want
    from ckptfmt.checksum import crc32c

    for o in commit["objects"]:
        data = (local / o["key"]).read_bytes()
        assert (o["size"], o["crc32c"]) == (len(data), crc32c(data))
    prefix = f"run/{step_dir_name(2)}/{commit['save_id']}/"
    assert sorted(k[len(prefix) :] for k in s3.keys(prefix)) == want
    assert "run/ckptfmt-levels.json" in s3.keys("run/")


def test_restore_falls_back_to_the_bucket_bit_exact_once_level_1_is_gone(
    tmp_path: Path, s3: S3
) -> None:
    mgr = _mgr(tmp_path, s3)
    for step in (3, 4):
        mgr.save(step, _state(step))
    mgr.close()
    _wipe_level1(tmp_path)
    mgr = _mgr(tmp_path, s3)
    state = _template()
    report = mgr.restore(state)
    assert (report.step, report.level) == (4, 3)
    assert all("level 1" in t for t in report.tried), report.tried  # wiped: refused at once
    assert report.path is not None and report.path.startswith(f"{s3.url}/run/step-")
    assert_state_equal(state, _state(4))
    # the restored job goes on: its next save flushes again
    mgr.save(5, _state(5))
    mgr.close()
    assert _steps_on_bucket(s3) == [3, 4, 5]


def test_restore_of_one_step_lists_the_bucket_past_its_pointer(tmp_path: Path, s3: S3) -> None:
    """``restore(step=3)``, level 1 gone: the bucket's pointer names step 4, so the bucket is
    listed and step 3 restored from it, bit for bit."""
    mgr = _mgr(tmp_path, s3, keep_shared=0)
    for step in (3, 4):
        mgr.save(step, _state(step))
    mgr.close()
    _wipe_level1(tmp_path)
    mgr = _mgr(tmp_path, s3)
    state = _template()
    report = mgr.restore(state, step=3)
    assert (report.step, report.level) == (3, 3)
    assert_state_equal(state, _state(3))
    mgr.close(flush=False)


def test_a_step_whose_object_is_missing_or_mis_sized_is_not_offered(tmp_path: Path, s3: S3) -> None:
    mgr = _mgr(tmp_path, s3)
    for step in (1, 2, 3):
        mgr.save(step, _state(step))
    mgr.close()
    _wipe_level1(tmp_path)
    client = s3.server.client()
    c3, c2 = _commit(s3, 3), _commit(s3, 2)
    shard3 = next(o["key"] for o in c3["objects"] if "/c/" in o["key"])
    client.delete_object(Bucket=s3.bucket, Key=f"run/{step_dir_name(3)}/{c3['save_id']}/{shard3}")
    shard2 = next(o["key"] for o in c2["objects"] if "/c/" in o["key"])
    key2 = f"run/{step_dir_name(2)}/{c2['save_id']}/{shard2}"
    body = client.get_object(Bucket=s3.bucket, Key=key2)["Body"].read()
    client.put_object(Bucket=s3.bucket, Key=key2, Body=body + b"x")  # another size
    looker = _mgr(tmp_path, s3)  # latest and steps do not offer them either
    ref = looker.latest()
    assert ref is not None and ref.step == 1, ref
    assert looker.steps() == {1: {"level1": False, "level3": True}}
    looker.close(flush=False)
    state = _template()
    with pytest.warns(ckptfmt.CheckpointWarning, match="fell back to step 1"):
        report = _mgr(tmp_path, s3).restore(state)
    assert (report.step, report.level) == (1, 3)
    assert_state_equal(state, _state(1))
    assert any("step 3 level 3" in t and shard3 in t for t in report.tried), report.tried
    assert any("step 2 level 3" in t and shard2 in t for t in report.tried), report.tried


def test_a_flipped_byte_in_a_shard_object_is_detected_and_named(tmp_path: Path, s3: S3) -> None:
    mgr = _mgr(tmp_path, s3)
    for step in (1, 2):
        mgr.save(step, _state(step))
    mgr.close()
    _wipe_level1(tmp_path)
    client = s3.server.client()
    c2 = _commit(s3, 2)
    shard = next(o for o in c2["objects"] if o["key"].startswith("model/w/c/"))
    key = f"run/{step_dir_name(2)}/{c2['save_id']}/{shard['key']}"
    body = bytearray(client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    body[100] ^= 0x10  # same size: only the checksums can tell
    client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(body))
    state = _template()
    with pytest.warns(ckptfmt.CheckpointWarning, match="fell back to step 1"):
        report = _mgr(tmp_path, s3).restore(state)
    assert (report.step, report.level) == (1, 3)
    assert_state_equal(state, _state(1))
    [why] = [t for t in report.tried if "step 2 level 3" in t]
    assert "ChecksumError" in why and shard["key"] in why and "model/w" in why, why


def test_the_latest_pointer_is_read_and_the_bucket_listed_only_when_needed(
    tmp_path: Path, s3: S3
) -> None:
    mgr = _mgr(tmp_path, s3)
    for step in (1, 2):
        mgr.save(step, _state(step))
    mgr.close()
    _wipe_level1(tmp_path)
    mgr = _mgr(tmp_path, s3)
    bucket = mgr._retention.shared.root  # type: ignore[union-attr]
    bucket.requests.clear()
    assert mgr.restore(_template()).step == 2
    assert bucket.requests["LIST"] == 0, bucket.requests  # the pointer said where
    # one HEAD (the pointer's commit object): the objects are checked by reading them
    assert bucket.requests["HEAD"] == 1, bucket.requests
    # without a pointer, rank 0 lists the steps
    s3.server.client().delete_object(Bucket=s3.bucket, Key="run/ckptfmt-latest.json")
    bucket.requests.clear()
    assert mgr.restore(_template()).step == 2
    assert bucket.requests["LIST"] >= 1
    mgr.close(flush=False)


def test_retention_on_the_bucket_keeps_the_newest_and_leaves_nothing_of_the_others(
    tmp_path: Path, s3: S3
) -> None:
    mgr = _mgr(tmp_path, s3, keep_shared=2, keep_local=1)
    for step in range(1, 6):
        mgr.save(step, _state(step))
    mgr.close()
    assert _steps_on_bucket(s3) == [4, 5]
    for step in (1, 2, 3):
        assert s3.keys(f"run/{step_dir_name(step)}/") == []
    assert sorted(mgr.steps()) == [4, 5] or sorted(mgr.steps()) == [5]
    mgr = _mgr(tmp_path, s3)
    mgr.delete(5, levels=[3])
    assert _steps_on_bucket(s3) == [4]
    mgr.close(flush=False)


def test_retention_deletes_a_steps_commit_object_before_its_objects(
    tmp_path: Path, s3: S3, s3_proxy: S3Proxy
) -> None:
    """Seen on the wire: the commit object of a step retention removes goes first, so a step
    half deleted is never one a reader takes for whole."""
    mgr = _mgr(tmp_path, s3, keep_shared=1, keep_local=1)
    mgr.save(1, _state(1))
    mgr.wait()
    start = len(s3_proxy.deleted)
    mgr.save(2, _state(2))
    mgr.close()
    assert _steps_on_bucket(s3) == [2] and s3.keys(f"run/{step_dir_name(1)}/") == []
    gone = [k for k in s3_proxy.deleted[start:] if f"/{step_dir_name(1)}/" in k]
    assert gone and gone[0].endswith("ckptfmt-commit.json"), gone
    assert len(gone) == len(set(gone)) >= 3, gone  # then every other object, each once


def test_a_flush_of_a_step_already_on_the_bucket_uploads_nothing(tmp_path: Path, s3: S3) -> None:
    mgr = _mgr(tmp_path, s3, flush_every=100)
    mgr.save(1, _state(1))
    mgr.wait()
    assert _steps_on_bucket(s3) == []  # not due
    mgr.close(flush=True)  # the exit flush
    assert _steps_on_bucket(s3) == [1]
    from ckptfmt.container.reader import read_manifest
    from ckptfmt.parallel.levels.bucket import flush_to_bucket
    from ckptfmt.storage.objects import Bucket
    from ckptfmt.transport.comm import SingleComm

    local = tmp_path / "l1" / "n0" / step_dir_name(1)
    root = Bucket.at(f"{s3.url}/run")
    flush_to_bucket(SingleComm(), read_manifest(local), local, root)
    assert root.requests["PUT"] == 0, root.requests


def test_a_bucket_out_of_reach_is_told_at_the_start(tmp_path: Path, s3: S3) -> None:
    with pytest.raises(StorageError, match="no-such-bucket-here"):
        _mgr(tmp_path, s3, shared_dir="s3://no-such-bucket-here/run")
    dead = {"endpoint_url": "http://127.0.0.1:9", "retry_timeout": "1", "connect_timeout": "1"}
    with pytest.raises(StorageError, match="level 3"):
        _mgr(tmp_path, s3, storage_options=dead)
    with pytest.raises(ckptfmt.errors.UsageError, match="storage_options"):
        _mgr(tmp_path, s3, shared_dir=tmp_path / "l3", storage_options={"region": "x"})


def _rank_mgr(tmp_path: Path, s3: S3, comm: Any, node: str, **kw: Any) -> CheckpointManager:
    """A thread rank's manager: level 1 in ``tmp_path/l1/{node}``, level 3 the bucket's
    ``run/``, small shards, no exit hooks."""
    return CheckpointManager(
        f"{tmp_path}/l1/{{node}}",
        f"{s3.url}/run",
        comm=comm,
        node=node,
        write=SMALL,
        at_exit=NO_EXIT_HOOKS,
        **kw,
    )


def test_two_ranks_flush_their_own_files_and_restore_their_shards(tmp_path: Path, s3: S3) -> None:
    """Two thread ranks on two simulated nodes, each holding half of a sharded tensor: each
    uploads its own files; after both nodes' level 1 is wiped, each restores its own half."""
    full = np.random.default_rng(3).standard_normal((64, 500)).astype(np.float32)

    def state_of(rank: int, step: int, zero: bool = False) -> dict[str, Any]:
        rows = full[rank * 32 : (rank + 1) * 32] * step
        return {"w": Shard(np.zeros_like(rows) if zero else rows, (rank * 32, 0), full.shape)}

    def job(comm: Any, restore: bool) -> Any:
        mgr = _rank_mgr(tmp_path, s3, comm, f"n{comm.rank}")
        if restore:
            st = state_of(comm.rank, 0, zero=True)
            report = mgr.restore(st)
            mgr.close(flush=False)
            return report.step, report.level, st["w"].data
        for step in (1, 2):
            mgr.save(step, state_of(comm.rank, step))
        mgr.close()
        return mgr._retention.shared.root.requests["PUT"]  # type: ignore[union-attr]

    puts = run_threads(2, lambda c: job(c, False))
    assert all(p > 0 for p in puts)  # both ranks uploaded
    _wipe_level1(tmp_path)
    for rank, (step, level, got) in enumerate(run_threads(2, lambda c: job(c, True))):
        assert (step, level) == (2, 3)
        np.testing.assert_array_equal(got, full[rank * 32 : (rank + 1) * 32] * 2)


def test_level_1_parity_stays_on_the_nodes_and_both_levels_restore(tmp_path: Path, s3: S3) -> None:
    """Four thread ranks on two simulated nodes with XOR parity: the flush puts the data, never
    the parity; with one node's level 1 gone the step is rebuilt from the parity on level 1;
    with every node's gone it comes from the bucket; bit for bit both times."""
    full = np.random.default_rng(4).standard_normal((64, 300)).astype(np.float32)

    def state_of(rank: int, zero: bool = False) -> dict[str, Any]:
        rows = full[rank * 16 : (rank + 1) * 16]
        return {"w": Shard(np.zeros_like(rows) if zero else rows, (rank * 16, 0), full.shape)}

    def job(comm: Any, restore: bool) -> Any:
        mgr = _rank_mgr(tmp_path, s3, comm, f"n{comm.rank // 2}", redundancy="xor")
        if not restore:
            mgr.save(1, state_of(comm.rank))
            mgr.close()
            return None
        st = state_of(comm.rank, zero=True)
        report = mgr.restore(st)
        mgr.close(flush=False)
        return report.step, report.level, st["w"].data

    run_threads(4, lambda c: job(c, False))
    assert _steps_on_bucket(s3) == [1]
    assert not [k for k in s3.keys("run/") if "ckptfmt-redundancy" in k]
    assert list((tmp_path / "l1" / "n0").rglob("ckptfmt-redundancy/*"))  # on level 1
    shutil.rmtree(tmp_path / "l1" / "n1")
    for want_level in (1, 3):
        if want_level == 3:
            _wipe_level1(tmp_path)
        for rank, (step, level, got) in enumerate(run_threads(4, lambda c: job(c, True))):
            assert (step, level) == (1, want_level), (rank, level)
            np.testing.assert_array_equal(got, full[rank * 16 : (rank + 1) * 16])


def test_a_bucket_needs_level_1(s3: S3) -> None:
    with pytest.raises(ckptfmt.errors.UsageError, match="local_dir"):
        CheckpointManager(shared_dir=f"{s3.url}/run", write=NO_FSYNC)


def test_latest_and_steps_name_the_bucket_steps(tmp_path: Path, s3: S3) -> None:
    mgr = _mgr(tmp_path, s3)
    mgr.save(1, _state(1))
    mgr.close()
    _wipe_level1(tmp_path)
    mgr = _mgr(tmp_path, s3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ref = mgr.latest()
    assert ref is not None and ref.step == 1
    assert str(ref.path) == f"{s3.url}/run/{step_dir_name(1)}"
    assert mgr.steps() == {1: {"level1": False, "level3": True}}
    mgr.close(flush=False)


def test_list_levels_of_a_bucket_root_shows_each_steps_state(tmp_path: Path, s3: S3) -> None:
    """``ckptfmt.list_levels`` (``ckptfmt list``) of a bucket root: flushed steps, a damaged one
    (an object missing) and a prefix without a commit object, beside the level-1 copies."""
    mgr = _mgr(tmp_path, s3)
    for step in (1, 2):
        mgr.save(step, _state(step))
    mgr.close()
    client = s3.server.client()
    c2 = _commit(s3, 2)
    key = next(o["key"] for o in c2["objects"] if "/c/" in o["key"])
    client.delete_object(Bucket=s3.bucket, Key=f"run/{step_dir_name(2)}/{c2['save_id']}/{key}")
    client.put_object(
        Bucket=s3.bucket, Key=f"run/{step_dir_name(3)}/{'0' * 32}/zarr.json", Body=b"{}"
    )
    doc = ckptfmt.list_levels(f"{s3.url}/run")
    assert doc["shared"] == f"{s3.url}/run"
    assert doc["steps"]["1"] == {"level3": "flushed", "level1": {"n0": "complete"}}
    assert (
        doc["steps"]["2"]["level3"].startswith("damaged: 1 object(s) missing")
        and key in doc["steps"]["2"]["level3"]
    )
    assert doc["steps"]["3"]["level3"] == "not committed"


def test_a_commit_object_that_does_not_parse_is_refused_and_retention_removes_it(
    tmp_path: Path, s3: S3
) -> None:
    mgr = _mgr(tmp_path, s3)
    for step in (1, 2):
        mgr.save(step, _state(step))
    mgr.close()
    _wipe_level1(tmp_path)
    key = f"run/{step_dir_name(2)}/ckptfmt-commit.json"
    s3.server.client().put_object(Bucket=s3.bucket, Key=key, Body=b"{not json")
    state = _template()
    with pytest.warns(ckptfmt.CheckpointWarning, match="fell back to step 1"):
        report = _mgr(tmp_path, s3).restore(state)
    assert (report.step, report.level) == (1, 3)
    assert_state_equal(state, _state(1))
    [why] = [t for t in report.tried if "step 2 level 3" in t]
    assert "ckptfmt-commit.json" in why and "not JSON" in why, why
    mgr = _mgr(tmp_path, s3)
    mgr.prune(keep_shared=1)  # step 2 is the newest, broken or not: step 1 goes
    assert _steps_on_bucket(s3) == [2] and s3.keys(f"run/{step_dir_name(1)}/") == []
    mgr.delete(2, levels=[3])  # a commit object that does not parse is removed all the same
    assert s3.keys(f"run/{step_dir_name(2)}/") == []
    mgr.close(flush=False)


LEFT_OPEN = """
import sys
import numpy as np
from ckptfmt import CheckpointManager, WriteOptions
local, url = sys.argv[1], sys.argv[2]
small = WriteOptions(fsync=False, chunk_bytes=16 << 10, shard_bytes=64 << 10)
mgr = CheckpointManager(local, url, node="n0", write=small, flush_every=10)
rng = np.random.default_rng(11)
mgr.save(5, {"w": rng.standard_normal((300, 200), dtype=np.float32), "step": 5})
"""  # the script's end: neither waited for nor closed, and step 5 is not due for a flush


def test_a_manager_left_open_at_the_scripts_end_saves_and_flushes_its_step(
    tmp_path: Path, s3: S3
) -> None:
    """The exit policy's flush (``ExitPolicy(flush=True)``, the default): the interpreter's
    exit closes the manager, which waits for the save in flight and uploads the step to the
    bucket (Python refuses thread pools new work once the main thread has ended: neither may
    need it). The bucket's copy restores bit for bit once level 1 is gone."""
    done = subprocess.run(
        [sys.executable, "-c", LEFT_OPEN, str(tmp_path / "l1" / "{node}"), f"{s3.url}/run"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, **s3.env},
    )
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr, done.stderr
    assert _steps_on_bucket(s3) == [5]
    _wipe_level1(tmp_path)
    mgr = _mgr(tmp_path, s3, at_exit=NO_EXIT_HOOKS)
    state = {"w": np.zeros((300, 200), np.float32), "step": -1}
    report = mgr.restore(state)
    mgr.close(flush=False)
    assert (report.step, report.level) == (5, 3)
    rng = np.random.default_rng(11)
    assert_state_equal(state, {"w": rng.standard_normal((300, 200), dtype=np.float32), "step": 5})
