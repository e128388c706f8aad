"""CheckpointManager in one process (the many-rank behaviour is in test_manager_mpi.py): async
saves that snapshot the state, restores in place, failed saves reported at the next call, the
flush at close; and what a new user hits: misuse refused at the call, restores that check
everything before writing, the flush cadence across restarts."""

from __future__ import annotations

import errno
import logging
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit.full_disk import in_full_tmpfs
from kit.managers import NO_EXIT_HOOKS
from kit.managers import make_manager as _mgr
from kit.managers import node_manager as manager

import ckptfmt
from ckptfmt import CheckpointManager, CheckpointWarning, ExitPolicy, WriteOptions
from ckptfmt.errors import (
    CollectiveError,
    ImplicitSingleProcessError,
    SaveFailedError,
    StateMismatchError,
    StorageError,
    UnsupportedValueError,
    UsageError,
)
from ckptfmt.parallel.collective.launch import launcher_world_size, refuse_implicit_single
from ckptfmt.storage.steps import list_step_dirs, step_dir_name
from ckptfmt.transport.threads import run_threads


def state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((64, 33)).astype(np.float32), "step": seed, "h": [seed]}


def test_async_save_snapshots_the_state_at_save_time(tmp_path: Path) -> None:
    mgr = manager(tmp_path, flush_every=2)
    s = state(1)
    expected = s["w"].copy()
    mgr.save(1, s)
    s["w"] += 100  # the training loop goes on at once
    mgr.save(2, s)
    mgr.wait()
    assert mgr.latest() == (2, tmp_path / "l1" / "n0" / step_dir_name(2))  # level 1 first
    one = ckptfmt.load(tmp_path / "l1" / "n0" / step_dir_name(1))
    assert one["w"].tobytes() == expected.tobytes()
    assert ckptfmt.verify(tmp_path / "l3" / step_dir_name(2)).healthy  # the 2nd save flushed
    assert not (tmp_path / "l3" / step_dir_name(1)).exists()
    mgr.delete(2, levels=[1])
    newest = mgr.latest()  # a StepRef: where this rank sees the newest step, else level 3
    assert newest is not None and newest == (2, tmp_path / "l3" / step_dir_name(2))
    assert (newest.step, newest.path) == tuple(newest)
    mgr.close()


def test_restore_fills_the_given_state_in_place(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    mgr.save(7, state(7))
    mgr.close()
    fresh = manager(tmp_path)
    target = state(0)
    buffer = target["w"]
    assert fresh.restore(target).step == 7
    assert target["w"] is buffer  # arrays are copied into, not replaced
    assert target["w"].tobytes() == state(7)["w"].tobytes()
    assert target["step"] == 7 and target["h"] == [7]
    assert fresh.last_restore is not None and fresh.last_restore.level == 1
    fresh.close()


def test_a_failed_save_warns_at_the_next_call_and_keeps_older_checkpoints(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    mgr.save(1, state(1))
    mgr.wait()
    blocker = tmp_path / "l1" / "n0" / step_dir_name(2)
    blocker.write_text("not a directory")  # the next save cannot create its step directory
    mgr.save(2, state(2))
    with pytest.warns(CheckpointWarning, match="step 2"):
        mgr.wait()
    assert mgr.failed_saves and mgr.failed_saves[0][0] == 2
    assert ckptfmt.load(tmp_path / "l1" / "n0" / step_dir_name(1))["step"] == 1
    blocker.unlink()
    mgr.close()


def test_on_error_raise_raises_at_the_next_call(tmp_path: Path) -> None:
    mgr = manager(tmp_path, on_error="raise")
    (tmp_path / "l1" / "n0").mkdir(parents=True)
    (tmp_path / "l1" / "n0" / step_dir_name(3)).write_text("x")
    mgr.save(3, state(3))
    with pytest.raises(SaveFailedError):
        mgr.save(4, state(4))  # the next call reports the failure of step 3
    mgr.close()


def test_a_copy_under_the_wrong_step_name_is_refused(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    mgr.save(1, state(1))
    mgr.save(2, state(2))
    mgr.close()
    root = tmp_path / "l1" / "n0"
    shutil.copytree(root / step_dir_name(1), root / step_dir_name(9))  # misplaced
    fresh = manager(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert fresh.restore().step == 2
    assert fresh.last_restore is not None
    assert any("step 9" in reason and "not 9" in reason for reason in fresh.last_restore.tried)
    fresh.close()


def test_close_flushes_the_newest_checkpoint(tmp_path: Path) -> None:
    mgr = manager(tmp_path, flush_every=100, at_exit=ExitPolicy(sigterm=False))
    mgr.save(5, state(5))
    mgr.close()
    assert ckptfmt.load(tmp_path / "l3" / step_dir_name(5))["step"] == 5
    with pytest.raises(ckptfmt.errors.UsageError):
        mgr.save(6, state(6))  # closed


EXIT_WITH_A_SAVE_IN_FLIGHT = """
import sys, time
import numpy as np
from ckptfmt import CheckpointManager, WriteOptions
root = sys.argv[1]
mgr = CheckpointManager(
    local_dir=root + "/l1",
    shared_dir=root + "/l3",
    write=WriteOptions(fsync=False, threads=2, chunk_bytes=64 << 10, shard_bytes=256 << 10),
)
state = {"w": np.arange(1 << 20, dtype=np.float32)}
# the save's write starts once the script has returned: the interpreter is exiting
mgr.save(1, state, ready=lambda: time.sleep(1.0))
"""


def test_a_save_in_flight_when_the_script_returns_is_committed_and_flushed(
    tmp_path: Path,
) -> None:
    """A script that returns with a background save in flight (nothing closes its manager):
    the manager is closed at exit before the interpreter shuts its thread pools (the writers'),
    so the save is committed on level 1 and flushed to level 3, bit for bit, and nothing is
    told of a failure."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", EXIT_WITH_A_SAVE_IN_FLIGHT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "failed" not in out.stderr, out.stderr[-3000:]
    want = np.arange(1 << 20, dtype=np.float32).tobytes()
    for level in ("l1", "l3"):
        assert ckptfmt.load(tmp_path / level / step_dir_name(1))["w"].tobytes() == want


def test_a_save_restored_at_another_size_is_not_flushed_as_this_jobs(tmp_path: Path) -> None:
    """4 ranks save to level 1 only; 2 ranks restore it and close with a flush: level 3 must not
    get a copy holding only the files of the ranks that happen to be here (it would not
    verify); the flush is not attempted and, called directly, refused."""
    from ckptfmt import ExitPolicy, WriteOptions
    from ckptfmt.container.reader import read_manifest
    from ckptfmt.parallel.levels.layout import flush_collective
    from ckptfmt.parallel.manager.checkpoint_manager import CheckpointManager as Manager
    from ckptfmt.transport.threads import run_threads

    root = tmp_path

    def save(comm: Any) -> None:
        m = Manager(
            f"{root}/l1/{{node}}",
            f"{root}/l3",
            comm=comm,
            node=f"n{comm.rank % 2}",
            flush_every=100,
            async_save=False,
            write=WriteOptions(fsync=False),
            at_exit=ExitPolicy(flush=False, sigterm=False),
        )
        m.save(7, {"w": np.arange(4000, dtype=np.float32), "d": np.full(7000, 3, np.float32)})
        m.close(flush=False)

    def restore(comm: Any) -> tuple[Any, ...]:
        m = Manager(
            f"{root}/l1/{{node}}",
            f"{root}/l3",
            comm=comm,
            node=f"n{comm.rank}",
            async_save=False,
            write=WriteOptions(fsync=False),
            at_exit=ExitPolicy(sigterm=False),
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = m.restore().step
            m.close(flush=True)
        manifest = read_manifest(root / "l1" / f"n{comm.rank}" / "step-0000000007")
        try:
            flush_collective(comm, manifest, root / "l1" / f"n{comm.rank}", root / "l3")
            refused = ""
        except SaveFailedError as exc:
            refused = str(exc)
        return step, [str(w.message) for w in caught], refused

    run_threads(4, save)
    results = run_threads(2, restore)
    for step, caught, refused in results:
        assert step == 7 and caught == []
        assert "cannot flush a save of 4 ranks with 2" in refused
    assert not (root / "l3" / "step-0000000007").exists()


def _state(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {
        "model": {"w": rng.standard_normal((16, 8)).astype(np.float32), "b": np.arange(8.0)},
        "step": step,
        "lr": 1e-3 * step,
    }


def test_restore_refuses_a_mismatched_state_and_writes_nothing(tmp_path: Path) -> None:
    with _mgr(tmp_path) as mgr:
        mgr.save(3, _state(3))
    before = _state(0)
    before["model"]["w"] = np.full((16, 4), 7.0, np.float32)  # another shape
    keep_b = before["model"]["b"].copy()
    mgr = _mgr(tmp_path)
    with pytest.raises(StateMismatchError) as exc:
        mgr.restore(before)
    assert "model/w" in str(exc.value) and "float32[16, 8]" in str(exc.value)
    # nothing was written: not the matching array, not the values
    assert np.array_equal(before["model"]["b"], keep_b) and before["step"] == 0
    assert np.all(before["model"]["w"] == 7.0)
    mgr.close(flush=False)


def test_restore_names_missing_and_unexpected_entries_unless_not_strict(tmp_path: Path) -> None:
    with _mgr(tmp_path) as mgr:
        mgr.save(3, _state(3))
    state = _state(0)
    state["model"]["extra"] = np.zeros(3)
    del state["lr"]
    w_before = state["model"]["w"].copy()
    mgr = _mgr(tmp_path)
    with pytest.raises(StateMismatchError) as exc:
        mgr.restore(state)
    assert exc.value.missing == ("model/extra",) and exc.value.unexpected == ("lr",)
    assert np.array_equal(state["model"]["w"], w_before)  # untouched
    report = mgr.restore(state, strict=False)
    assert report.step == 3 and report.restored
    assert np.array_equal(state["model"]["w"], _state(3)["model"]["w"])
    assert report.applied is not None and mgr.last_restore is report
    assert report.applied.missing == ["model/extra"]
    assert report.applied.unexpected == ["lr"]
    mgr.close(flush=False)


def test_a_partial_restore_by_pattern_loads_only_what_it_names(tmp_path: Path) -> None:
    with _mgr(tmp_path) as mgr:
        mgr.save(3, _state(3))
    state = _state(0)
    mgr = _mgr(tmp_path)
    report = mgr.restore(state, include=["model/*"])
    assert report.step == 3
    assert np.array_equal(state["model"]["w"], _state(3)["model"]["w"])
    assert state["step"] == 0 and state["lr"] == 0.0  # not selected: untouched
    assert report.applied is not None
    assert sorted(report.applied.excluded) == ["lr", "step"]
    mgr.close(flush=False)


def test_flush_cadence_follows_the_jobs_save_number_across_restarts(tmp_path: Path) -> None:
    """4 runs of 2 saves each with flush_every=3: the 3rd and 6th saves of the job reach
    level 3, although no single process makes 3 saves (a per-process count never flushed)."""
    step = 0
    for _run in range(4):
        mgr = _mgr(
            tmp_path, flush_every=3, keep_local=10, keep_shared=10, at_exit=ExitPolicy(flush=False)
        )
        step = mgr.restore(_state(0), strict=False).step or 0
        for _ in range(2):
            step += 1
            mgr.save(step, _state(step))
        mgr.close(flush=False)
    assert [s for s, _ in list_step_dirs(tmp_path / "l3")] == [3, 6]
    assert [s for s, _ in list_step_dirs(tmp_path / "l1")] == list(range(1, 9))


def test_the_options_objects_reach_the_files(tmp_path: Path) -> None:
    """``write=WriteOptions(...)`` sets the grid of the saved files (what the manifest and the
    files say), ``at_exit=ExitPolicy(flush=False)`` leaves level 3 without the step at close."""
    write = WriteOptions(chunk_bytes=1 << 10, shard_bytes=4 << 10, fsync=False, threads=1)
    mgr = CheckpointManager(
        local_dir=tmp_path / "l1",
        shared_dir=tmp_path / "l3",
        flush_every=100,
        write=write,
        at_exit=ExitPolicy(flush=False, sigterm=False),
    )
    mgr.save(1, _state(1))
    mgr.close()
    assert list_step_dirs(tmp_path / "l3") == []
    step = tmp_path / "l1" / "step-0000000001"
    files = [p for p in step.rglob("*") if p.is_file() and p.parent.name == "c"]
    assert files and all(p.stat().st_size <= 4 << 10 for p in files)
    doc = ckptfmt.open(step)
    assert doc.step == 1 and np.array_equal(doc["model/w"][...], _state(1)["model"]["w"])
    with pytest.raises(UsageError, match="budget_s"):
        ExitPolicy(budget_s=-1)
    with pytest.raises(UsageError, match="on_error is 'warn' or 'raise'"):
        CheckpointManager(local_dir=tmp_path / "x", on_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="WriteOptions"):
        CheckpointManager(local_dir=tmp_path / "x", write={"fsync": False})  # type: ignore[arg-type]


@pytest.mark.parametrize("keyword", ["fsync", "shard_bytes", "exit_flush", "handle_sigterm"])
def test_the_options_objects_are_the_only_spelling(tmp_path: Path, keyword: str) -> None:
    """How files are written and what happens at exit are ``write=`` and ``at_exit=`` only: a
    loose keyword is an unknown argument, refused before anything is written."""
    with pytest.raises(TypeError, match=keyword):
        CheckpointManager(local_dir=tmp_path / "l1", **{keyword: False})  # type: ignore[arg-type]
    assert not (tmp_path / "l1").exists()


def test_a_multi_rank_launch_without_a_comm_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ImplicitSingleProcessError, match="TorchComm"):
        _mgr(tmp_path)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("PMI_SIZE", "4")
    with pytest.raises(ImplicitSingleProcessError, match="MpiComm"):
        _mgr(tmp_path)
    monkeypatch.setenv("PMI_SIZE", "1")
    _mgr(tmp_path).close(flush=False)  # one rank: fine


@pytest.mark.parametrize(
    "env, launcher",
    [
        ({"PMI_SIZE": "2"}, "MPICH"),
        ({"PMIX_SIZE": "3"}, "PMIx"),
        ({"OMPI_COMM_WORLD_SIZE": "4"}, "Open MPI"),
        ({"MV2_COMM_WORLD_SIZE": "2"}, "MVAPICH2"),
        ({"SLURM_NTASKS": "8", "SLURM_STEP_ID": "0"}, "srun"),
        ({"WORLD_SIZE": "2"}, "torchrun"),
    ],
)
def test_every_launcher_is_recognised(env: dict[str, str], launcher: str) -> None:
    n, said = launcher_world_size(env)
    assert n == int(next(iter(env.values()))) and launcher in said
    with pytest.raises(ImplicitSingleProcessError, match="no comm was given"):
        refuse_implicit_single((n, said))


def test_one_process_launches_are_not_refused() -> None:
    assert launcher_world_size({}) == (1, "")
    assert launcher_world_size({"SLURM_NTASKS": "8"}) == (1, "")  # sbatch's script, no step
    assert launcher_world_size({"PMI_SIZE": "1", "WORLD_SIZE": "x"}) == (1, "")


@pytest.mark.mpi
@pytest.mark.torch
@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_a_real_multi_rank_launch_without_a_comm_is_refused(tmp_path: Path, launcher: str) -> None:
    """Under a real ``mpiexec -n 2`` / ``torchrun --nproc-per-node 2``: every rank is refused
    with the comm to pass, and nothing is written."""
    from kit.launch import assert_ok, run_mpi, run_torchrun

    script = tmp_path / "no_comm.py"
    script.write_text(
        "import sys\n"
        "from ckptfmt import CheckpointManager\n"
        "from ckptfmt.errors import ImplicitSingleProcessError\n"
        "try:\n"
        f"    CheckpointManager(local_dir={str(tmp_path / 'l1')!r})\n"
        "except ImplicitSingleProcessError as exc:\n"
        "    print('REFUSED', exc, flush=True)\n"
    )
    run = run_mpi if launcher == "mpiexec" else run_torchrun
    done = run(2, script, timeout=120)
    assert_ok(done)
    said = "mpiexec (PMI" if launcher == "mpiexec" else "torchrun started"
    assert done.stdout.count("REFUSED") == 2, done.stdout  # each rank (lines may interleave)
    assert done.stdout.count(said) == 2 and "started 2 ranks" in done.stdout, done.stdout
    assert not (tmp_path / "l1").exists()


def test_a_url_is_refused_where_no_bucket_can_serve(tmp_path: Path) -> None:
    """Level 1 is node-local: never a URL. Level 3 may be a bucket (tests/objects), but only
    behind a level 1 (it takes flushes), and never of a scheme without conditional writes."""
    with pytest.raises(UsageError, match="s3"):
        CheckpointManager(local_dir="s3://bucket/x")
    with pytest.raises(UsageError, match="local_dir"):
        CheckpointManager(shared_dir="s3://bucket/ckpt")
    with pytest.raises(UsageError, match="ftp"):
        CheckpointManager(local_dir=tmp_path / "l1", shared_dir="ftp://host/ckpt")
    assert not Path("s3:").exists() and not Path("ftp:").exists()
    assert not (tmp_path / "l1").exists()  # refused before anything was made


def test_an_unsupported_value_is_raised_at_the_call_whatever_on_error_says(
    tmp_path: Path,
) -> None:
    mgr = _mgr(tmp_path, on_error="warn")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning either: it is raised
        with pytest.raises(UnsupportedValueError, match="model"):
            mgr.save(1, {"model": object()})
    mgr.save(2, _state(2))
    mgr.wait()
    assert mgr.failed_saves == [] and mgr.latest().step == 2
    mgr.close(flush=False)


def test_an_allocation_failure_while_staging_is_reported_and_training_goes_on(
    tmp_path: Path,
) -> None:
    mgr = _mgr(tmp_path, on_error="warn")
    real = mgr._stager.stage

    def failing(*args: Any, **kwargs: Any) -> dict:
        mgr._stager.stage = real  # type: ignore[method-assign]
        raise MemoryError("injected")

    mgr._stager.stage = failing  # type: ignore[method-assign]
    with pytest.warns(UserWarning, match="step 1"):
        mgr.save(1, _state(1))
    [(step, exc)] = mgr.failed_saves
    assert step == 1 and isinstance(exc, SaveFailedError)
    assert exc.rank_failures[0].type == "MemoryError" and exc.rank_failures[0].phase == "copy"
    mgr.save(2, _state(2))
    mgr.close(flush=False)
    assert [s for s, _ in list_step_dirs(tmp_path / "l1")] == [2]


def test_each_save_reports_what_it_cost_and_wrote(tmp_path: Path) -> None:
    seen: list = []
    mgr = _mgr(tmp_path, redundancy=None, flush_every=2, on_save=seen.append)
    for step in (1, 2):
        mgr.save(step, _state(step))
    mgr.wait()
    assert [r.step for r in seen] == [1, 2] and mgr.last_save is seen[-1]
    one, two = seen
    nbytes = sum(a.nbytes for a in _state(1)["model"].values())
    assert one.level == 1 and not one.flushed and one.error is None
    assert one.staged_bytes == nbytes and one.bytes_written["1"] >= nbytes
    assert two.flushed and two.bytes_written["3"] == two.bytes_written["1"]
    assert two.waited_s >= 0 and two.blocked_s >= two.waited_s and two.background_s > 0
    assert json_roundtrips(two.to_json())
    mgr.close(flush=False)


def test_a_save_that_waited_and_its_parity_are_reported(tmp_path: Path) -> None:
    """Telemetry of a save that had to wait for the previous one (its background part is
    slowed down here) and of one with parity (two thread ranks on two nodes, xor over a
    partner pair): ``waited_s`` says how long, ``parity_bytes`` is the parity file's size."""

    def slow(point: str) -> None:
        if point == "written":
            time.sleep(0.3)

    mgr = _mgr(tmp_path, fault=slow, flush_every=100)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))  # the first save is still in its background part
    mgr.close(flush=False)
    first, second = mgr.save_reports
    assert first.waited_s < 0.1 and second.waited_s >= 0.2, (first, second)
    assert second.blocked_s >= second.waited_s

    def body(comm: Any) -> list[dict]:
        with CheckpointManager(
            local_dir=f"{tmp_path}/p/{{node}}",
            comm=comm,
            node=f"n{comm.rank}",
            redundancy="partner",
            write=WriteOptions(fsync=False),
            at_exit=ExitPolicy(sigterm=False),
        ) as m:
            m.save(3, _state(3))
            m.wait()
            return [r.to_json() for r in m.save_reports]

    for rank, [report] in enumerate(run_threads(2, body)):
        parity = tmp_path / "p" / f"n{rank}" / "step-0000000003"
        size = sum(f.stat().st_size for f in (parity / "ckptfmt-redundancy").rglob("*"))
        assert report["redundancy"] == "partner" and report["parity_bytes"] == size > 0, report


def test_the_manager_reports_progress_of_its_saves_and_restores(tmp_path: Path) -> None:
    events: list = []
    mgr = _mgr(tmp_path, progress=events.append, flush_every=100)
    mgr.save(1, _state(1))
    mgr.close(flush=False)
    saves = [e for e in events if e.op == "save"]
    nbytes = sum(a.nbytes for a in _state(1)["model"].values())
    assert saves and saves[-1].final and saves[-1].done == saves[-1].total >= nbytes
    assert [e.done for e in saves] == sorted(e.done for e in saves)  # never goes back
    events.clear()
    mgr = _mgr(tmp_path, progress=events.append)
    assert mgr.restore(_state(0)).step == 1
    mgr.close(flush=False)
    loads = [e for e in events if e.op == "load"]
    assert loads and loads[-1].final and loads[-1].done == loads[-1].total >= nbytes


def json_roundtrips(doc: dict) -> bool:
    import json

    return json.loads(json.dumps(doc)) == doc


def _fail_once(exc: Exception, at: str = "written") -> Any:
    """A manager's ``fault`` hook raising ``exc`` at the first ``at`` point of a save."""
    armed = {"on": True}

    def fault(point: str) -> None:
        if armed["on"] and point == at:
            armed["on"] = False
            raise exc

    return fault


def test_a_level_1_that_cannot_be_written_falls_back_to_level_3(tmp_path: Path) -> None:
    """A storage failure (an ``OSError``) while writing level 1 sends the step to level 3,
    bit for bit, with a notice instead of a failure."""
    fault = _fail_once(OSError(28, "No space left on device (injected)"))
    mgr = _mgr(tmp_path, fault=fault, flush_every=100)
    mgr.save(4, _state(4))
    with pytest.warns(UserWarning, match="step 4 failed, so it was written to level 3"):
        mgr.wait()
    report = mgr.last_save
    assert report is not None and report.level == 3 and report.fell_back
    assert "No space left" in (report.error or "")
    assert mgr.failed_saves == []
    assert mgr.steps() == {4: {"level1": False, "level3": True}}
    mgr.close(flush=False)
    state = _state(0)
    restored = _mgr(tmp_path).restore(state)
    assert (restored.step, restored.level) == (4, 3)
    saved = _state(4)
    for k in ("w", "b"):
        got, want = state["model"][k], saved["model"][k]
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), k
    assert (state["step"], state["lr"]) == (saved["step"], saved["lr"])


def test_a_bug_in_a_level_1_save_is_its_failure_not_a_fallback(tmp_path: Path) -> None:
    """A ``ValueError`` (not a storage failure) while writing level 1 fails the save, told as
    such; nothing is written to level 3 in its place, and the next save goes to level 1."""
    fault = _fail_once(ValueError("injected bug"))
    mgr = _mgr(tmp_path, fault=fault, flush_every=100, on_error="raise")
    mgr.save(4, _state(4))
    with pytest.raises(SaveFailedError, match="injected bug") as exc:
        mgr.wait()
    assert [f.type for f in exc.value.rank_failures.values()] == ["ValueError"]
    assert [f.kind for f in exc.value.rank_failures.values()] == ["other"]
    report = mgr.last_save
    assert report is not None and not report.fell_back and report.level is None
    assert [s for s, _ in mgr.failed_saves] == [4]
    assert mgr.steps() == {}
    assert not (tmp_path / "l3").exists() or list_step_dirs(tmp_path / "l3") == []
    mgr.save(5, _state(5))
    mgr.wait()
    assert mgr.steps() == {5: {"level1": True, "level3": False}}
    mgr.close(flush=False)


def test_steps_delete_and_prune_take_step_names(tmp_path: Path) -> None:
    mgr = _mgr(tmp_path, keep_local=10, keep_shared=10, flush_every=2)
    for step in (10, 20, 30, 40):
        mgr.save(step, _state(step))
    mgr.wait()
    assert mgr.steps() == {
        10: {"level1": True, "level3": False},
        20: {"level1": True, "level3": True},
        30: {"level1": True, "level3": False},
        40: {"level1": True, "level3": True},
    }
    mgr.delete("step-20", levels=[3])
    mgr.delete("step-0000000030")
    assert mgr.steps()[20] == {"level1": True, "level3": False} and 30 not in mgr.steps()
    mgr.prune(keep_local=1)
    assert mgr.steps() == {40: {"level1": True, "level3": True}}
    with pytest.raises(UsageError, match="not a step"):
        mgr.delete("latest")
    mgr.close(flush=False)


def test_delete_all_removes_the_checkpoints_and_nothing_else(tmp_path: Path) -> None:
    """``delete_all`` removes every step from both levels, what a crashed save left, level 1's
    spare directories and the levels record; a level's root that also holds the user's files
    (a dataset on the node's scratch disk) keeps them, byte for byte, and a root that held
    only checkpoints goes."""
    local, shared = tmp_path / "l1", tmp_path / "l3"
    local.mkdir()
    data = np.random.default_rng(0).bytes(10_000)
    (local / "dataset.bin").write_bytes(data)
    (local / "step-0000000099").mkdir()  # a directory of that name without a manifest
    (local / "step-0000000099" / "mine.txt").write_text("not a checkpoint")
    mgr = _mgr(tmp_path, keep_local=1, keep_shared=2, flush_every=1, at_exit=NO_EXIT_HOOKS)
    for step in (10, 20, 30):
        mgr.save(step, _state(step))
    mgr.wait()
    assert (local / ".slots").is_dir()  # retention recycled older steps into spares
    crashed = local / f".{step_dir_name(40)}.tmp-{'ab' * 16}"
    crashed.mkdir()
    (crashed / "x").write_bytes(b"torn")
    assert mgr.steps() == {
        20: {"level1": False, "level3": True},
        30: {"level1": True, "level3": True},
    }

    left = mgr.delete_all()
    assert sorted(left) == sorted([str(local / "dataset.bin"), str(local / "step-0000000099")])
    assert mgr.steps() == {}
    assert sorted(p.name for p in local.iterdir()) == ["dataset.bin", "step-0000000099"]
    assert (local / "dataset.bin").read_bytes() == data
    assert (local / "step-0000000099" / "mine.txt").read_text() == "not a checkpoint"
    assert not shared.exists()  # held checkpoints and the levels record only
    assert mgr.restore().step is None
    mgr.close(flush=False)


def test_kept_steps_outlive_the_retention(tmp_path: Path) -> None:
    """A step given to ``keep`` (a trainer's best checkpoint) stays on both levels while the
    newest ``keep_local``/``keep_shared`` steps roll on, bit for bit; once no longer kept, the
    next retention removes it."""
    mgr = _mgr(tmp_path, keep_local=1, keep_shared=1, flush_every=1)
    mgr.keep(["step-10"])
    for step in (10, 20, 30):
        mgr.save(step, _state(step))
    mgr.wait()
    both = {"level1": True, "level3": True}
    assert mgr.steps() == {10: both, 30: both}
    for level in ("l1", "l3"):
        kept = ckptfmt.load(tmp_path / level / step_dir_name(10))["model"]["w"]
        assert kept.tobytes() == _state(10)["model"]["w"].tobytes()
    mgr.keep([])
    mgr.save(40, _state(40))
    mgr.wait()
    assert mgr.steps() == {40: both}
    mgr.close(flush=False)


def test_restore_of_one_step_takes_that_step_or_none(tmp_path: Path) -> None:
    """``restore(step=...)`` loads the step asked for, bit for bit, from level 1, or from level
    3 once its level-1 copy is gone, though a newer step is there; a step on no level restores
    nothing and says so."""
    mgr = _mgr(tmp_path, keep_local=10, keep_shared=10, flush_every=1)
    for step in (10, 20, 30):
        mgr.save(step, _state(step))
    mgr.wait()
    want = _state(20)["model"]["w"].tobytes()
    for level in (1, 3):
        if level == 3:
            shutil.rmtree(tmp_path / "l1" / step_dir_name(20))
        report = mgr.restore(step="step-20")
        assert (report.step, report.level) == (20, level)
        assert report.state is not None and report.state["model"]["w"].tobytes() == want
    report = mgr.restore(step=25)
    assert report.step is None and report.state is None
    assert report.tried == ["step 25: no committed copy on any level"]
    assert mgr.restore().step == 30
    mgr.close(flush=False)


def test_latest_and_list_take_the_step_names_the_readme_uses(tmp_path: Path) -> None:
    """The README saves to ``ckpt/step-100``: ``latest`` and ``ckptfmt list`` see it (they used
    to see only ``step-0000000100``); the canonical name wins when both hold one step."""
    root = tmp_path / "ckpt"
    ckptfmt.save({"w": np.arange(4.0)}, root / "step-100", step=100)
    ckptfmt.save({"w": np.arange(5.0)}, root / "step-20", step=20)
    (root / "step-1x").mkdir()  # not a step name: ignored
    assert ckptfmt.latest(root) == (100, root / "step-100")
    doc = ckptfmt.list_levels(root)
    assert sorted(doc["steps"]) == ["100", "20"]
    assert all(e["level3"] == "flushed" for e in doc["steps"].values()), doc
    ckptfmt.save({"w": np.arange(6.0)}, root / "step-0000000100", step=100)
    assert ckptfmt.latest(root) == (100, root / "step-0000000100")
    assert list(ckptfmt.load(ckptfmt.latest(root)[1])["w"]) == list(np.arange(6.0))


def test_a_restore_that_falls_back_to_an_older_step_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A warning and a log line name the newer step refused and why; the log goes through the
    ``ckptfmt`` logger, whose messages do not repeat its name (``INFO:ckptfmt:ckptfmt: ...``
    was printed)."""
    caplog.set_level(logging.INFO, logger="ckptfmt")
    mgr = CheckpointManager(
        local_dir=tmp_path / "l1", write=WriteOptions(fsync=False), keep_local=5
    )
    mgr.save(4, _state(4))
    mgr.save(5, _state(5))
    mgr.close()
    newest = tmp_path / "l1" / "step-0000000005"
    victim = next(p for p in newest.rglob("*") if p.is_file() and p.parent.name == "c")
    victim.unlink()  # a data file of step 5: no redundancy to rebuild it from
    state = _state(0)
    mgr = CheckpointManager(local_dir=tmp_path / "l1", write=WriteOptions(fsync=False))
    with pytest.warns(UserWarning, match="fell back to step 4: refused step 5"):
        assert mgr.restore(state).step == 4
    assert np.array_equal(state["model"]["w"], _state(4)["model"]["w"])
    mgr.close(flush=False)
    records = [r.getMessage() for r in caplog.records if r.name.startswith("ckptfmt")]
    assert any("step 5" in m for m in records), records
    assert [m for m in records if m.lower().startswith("ckptfmt")] == []


def test_a_full_level_1_is_named_with_its_level_and_the_bytes_needed(tmp_path: Path) -> None:
    """A manager's save into a full node-local tmpfs (no level 3 to fall back to): every rank
    is told of a StorageFullError naming the level, the directory, the bytes the save needed
    and the space free, and no staging directory is left."""
    code = """
import json, os, warnings
import numpy as np
from ckptfmt import CheckpointManager, ExitPolicy, WriteOptions
mgr = CheckpointManager(
    local_dir=MNT,
    write=WriteOptions(fsync=False),
    on_error="warn",
    at_exit=ExitPolicy(sigterm=False),
)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    mgr.save(1, {"w": np.ones((1024, 1024), np.float32)})
    mgr.wait()
[(step, exc)] = mgr.failed_saves
f = exc.rank_failures[0]
mgr.close(flush=False)
print(json.dumps({"step": step, "type": f.type, "fields": f.fields, "message": f.message,
                  "warned": [str(w.message) for w in caught], "left": os.listdir(MNT)}))
"""
    out = in_full_tmpfs(tmp_path, "size=512k", code)
    assert out["step"] == 1 and out["type"] == "StorageFullError", out
    fields = out["fields"]
    assert isinstance(fields, dict) and fields["level"] == "level 1 (local_dir)", out
    assert fields["needed"] >= 4 << 20 and fields["free"] < 512 << 10, out
    assert "level 1 (local_dir)" in str(out["message"]) and "write" in str(out["message"])
    assert any("step 1" in w for w in out["warned"])  # type: ignore[union-attr]
    assert [n for n in out["left"] if ".tmp-" in n] == [], out  # type: ignore[union-attr]


def test_delete_all_forgets_the_newest_step_on_every_rank_of_a_node(tmp_path: Path) -> None:
    """Two ranks on one node (thread ranks; rank 1 is not the node's leader, which clears the
    node's level 1): after ``delete_all`` no rank holds a newest level-1 step any more, so a
    ``close()`` that flushes finds nothing to flush on every rank alike. Rank 1 alone still
    held the deleted step: its close called the flush's roll call alone and waited out the
    deadline, then logged a timeout."""
    local, shared = tmp_path / "l1", tmp_path / "l3"
    took: dict[int, float] = {}

    def job(comm: Any) -> None:
        mgr = CheckpointManager(
            local_dir=str(local),
            shared_dir=str(shared),
            comm=comm,
            node="n0",
            flush_every=10,  # step 1 is on level 1 only
            write=WriteOptions(fsync=False),
            async_save=False,
            on_error="raise",
            deadline_s=20,
            at_exit=ExitPolicy(flush=False, sigterm=False),
        )
        rows = np.full((4, 8), comm.rank + 1, np.float32)
        mgr.save(1, {"w": ckptfmt.Shard(rows, (4 * comm.rank, 0), (8, 8))})
        mgr.delete_all()
        started = time.perf_counter()
        mgr.close(flush=True)  # the newest level-1 step, if any rank still held one
        took[comm.rank] = time.perf_counter() - started

    run_threads(2, job)
    assert max(took.values()) < 10, took
    assert not local.exists() and not shared.exists()


@pytest.mark.parametrize("operation", ["delete_all", "delete"])
def test_a_deletion_that_fails_on_one_rank_raises_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, operation: str
) -> None:
    """Two ranks on two nodes; ``delete_all()`` or ``delete(1)``: rank 0's removal at level 3
    fails (a step the file system will
    not rename: EACCES, injected). Every rank raises, instead of rank 0 raising the OS's bare
    ``PermissionError`` while rank 1 waited at the closing barrier for it.
    Rank 0 raises ckptfmt's ``StorageError`` (its own), rank 1 a ``CollectiveError`` naming
    it; the managers close after it."""
    from ckptfmt.storage import commit as commit_module

    real = commit_module.remove
    shared = tmp_path / "l3"

    def remove(path: Path) -> None:
        if Path(path).parent == shared:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        real(path)

    errors: dict[int, BaseException] = {}

    def job(comm: Any) -> None:
        mgr = CheckpointManager(
            local_dir=str(tmp_path / "l1" / "{node}"),
            shared_dir=str(shared),
            comm=comm,
            node=f"n{comm.rank}",
            flush_every=1,
            write=WriteOptions(fsync=False),
            async_save=False,
            on_error="raise",
            deadline_s=20,
            at_exit=ExitPolicy(flush=False, sigterm=False),
        )
        rows = np.full((4, 8), comm.rank + 1, np.float32)
        mgr.save(1, {"w": ckptfmt.Shard(rows, (4 * comm.rank, 0), (8, 8))})
        comm.barrier()
        if comm.rank == 0:
            monkeypatch.setattr(commit_module, "remove", remove)
        comm.barrier()
        try:
            if operation == "delete":
                mgr.delete(1)
            else:
                mgr.delete_all()
        except BaseException as exc:
            errors[comm.rank] = exc
        mgr.close(flush=False)

    run_threads(2, job)
    monkeypatch.undo()
    assert sorted(errors) == [0, 1], errors
    mine, theirs = errors[0], errors[1]
    assert isinstance(mine, StorageError) and "step-0000000001" in str(mine), repr(mine)
    assert isinstance(theirs, CollectiveError) and theirs.failed_ranks == (0,), repr(theirs)
    assert "step-0000000001" in str(theirs), str(theirs)
