"""SIGTERM while ``close()`` flushes: the step on level 3 stays whole.

A scheduler's SIGTERM may come while the training loop is already closing its manager, in the
middle of close's flush of the newest step to level 3. ckptfmt's SIGTERM watch then flushes the
same step (``parallel.manager.exit``). The two flushes must never copy into the same staging
directory side by side: before they were serialized on the saver thread, the SIGTERM flush
committed a whole copy, and close's flush, resumed on the main thread once a user's handler that
only sets a flag returned, committed over it a step that lacked the files it had copied before
the signal (the manifest named 8 files, 3 were missing).

Each test runs ``tests/workers/_close_sigterm_worker.py`` in real processes (one, or two under
``mpiexec``) that send themselves a real SIGTERM after close's flush copied its third shard
file, then reads level 3 from here: the step is committed once, healthy, bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from kit import REPO
from kit.files import committed_steps
from kit.launch import describe, run_mpi, with_kit_path

import ckptfmt
from ckptfmt.errors import UsageError

WORKER = str(REPO / "tests" / "workers" / "_close_sigterm_worker.py")
TENSORS, N = 8, 150_000  # the worker's


def check_level3(
    root: Path, ranks: int, proc: subprocess.CompletedProcess[str], step: int = 1
) -> None:
    """Level 3 holds ``step`` alone, whole (every file its manifest names, every CRC good) and
    bit for bit what the ranks saved."""
    l3 = root / "l3"
    assert committed_steps(l3) == [step], f"{committed_steps(l3)}\n{describe(proc)}"
    path = l3 / f"step-{step:010d}"
    report = ckptfmt.verify(path)
    assert report.healthy, f"{report.problems}\n{describe(proc)}"
    got = ckptfmt.load(path)
    for i in range(TENSORS):
        want = np.stack([np.arange(N, dtype=np.float32) + 1000 * i + r for r in range(ranks)])
        assert got[f"t{i}"].dtype == want.dtype and got[f"t{i}"].tobytes() == want.tobytes()
    assert not [p.name for p in l3.iterdir() if p.name.startswith(".step-")], "a leftover"


def run_single(tmp_path: Path, handler: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    out, root = tmp_path / "out", tmp_path / "ck"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, WORKER, "single", handler, str(out), str(root)],
        cwd=REPO,
        env=with_kit_path(os.environ),
        capture_output=True,
        text=True,
        timeout=90,
    )
    return proc, root


def test_sigterm_during_close_flush_with_a_handler_that_returns(tmp_path: Path) -> None:
    """The user's handler sets a flag and returns: close() goes on and returns, the step on
    level 3 is whole and no flush is reported failed (it was flushed once)."""
    proc, root = run_single(tmp_path, "flag")
    assert proc.returncode == 0, describe(proc)
    check_level3(root, 1, proc)
    doc = json.loads((tmp_path / "out" / "closed.rank0.json").read_text())
    assert doc["signals"] == [signal.SIGTERM], doc  # the handler ran once
    assert doc["warnings"] == [], doc
    assert doc["copied"] == TENSORS, doc  # each file was copied once: one flush, not two


def test_sigterm_during_close_flush_ends_the_process_with_the_step_whole(tmp_path: Path) -> None:
    """No handler of the user's: the process ends as SIGTERM ends it, once the step is whole on
    level 3."""
    proc, root = run_single(tmp_path, "none")
    assert proc.returncode in (128 + signal.SIGTERM, -signal.SIGTERM), describe(proc)
    check_level3(root, 1, proc)


@pytest.mark.mpi
def test_sigterm_during_close_flush_under_mpiexec(tmp_path: Path) -> None:
    """2 ranks on 2 nodes, each signalled in the middle of its part of close's collective flush,
    with handlers that return: both close, and level 3 holds the step whole."""
    out, root = tmp_path / "out", tmp_path / "ck"
    out.mkdir()
    proc = run_mpi(2, WORKER, "mpi", "flag", str(out), str(root), timeout=120)
    assert proc.returncode == 0, describe(proc)
    for r in range(2):
        doc = json.loads((out / f"closed.rank{r}.json").read_text())
        assert doc["signals"] == [signal.SIGTERM] and doc["warnings"] == [], doc
    check_level3(root, 2, proc)


RESTORE_WORKER = str(REPO / "tests" / "workers" / "_restore_sigterm_worker.py")


def test_a_sigterm_flush_whose_staging_a_restore_cleans_commits_nothing(tmp_path: Path) -> None:
    """The user's handler on top of ckptfmt's returns, so the main thread goes on into
    ``restore()`` while the watcher's flush runs on the saver thread; the restore's clean-up of
    level-3 leftovers removes that flush's staging directory after its first file. The flush
    must not commit what is left (it did: step 1 on level 3 without ``t0``, reported flushed,
    so that ``close`` did not flush it again); it fails and is told, and ``close`` flushes the
    step whole."""
    out, root = tmp_path / "out", tmp_path / "ck"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, RESTORE_WORKER, str(out), str(root)],
        cwd=REPO,
        env=with_kit_path(os.environ),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, describe(proc)
    doc = json.loads((out / "result.json").read_text())
    assert doc["raced"] and doc["signals"] == [signal.SIGTERM] and doc["restored"] == 1, doc
    check_level3(root, 1, proc)
    assert doc["failed_flushes"] == [1], doc  # the SIGTERM flush failed, and was told
    assert any("staging directory was removed" in w for w in doc["warnings"]), doc


def test_close_waits_for_a_save_another_thread_is_in(tmp_path: Path) -> None:
    """A save made on another thread (an ``AsyncCheckpointIO`` worker, say) that is waiting for
    its slot when ``close()`` begins on the main thread (the interpreter's exit, say) is taken
    before the close's flush, so that it is the step flushed: it used to be queued behind the
    flush, committed on level 1 and never flushed. A save begun once ``close()`` has is refused
    (``UsageError``), never queued behind it."""
    gate, entered = threading.Event(), threading.Event()

    def hold_the_first_save(point: str) -> None:
        if point == "manifest":
            gate.wait(30)

    mgr = ckptfmt.CheckpointManager(
        local_dir=tmp_path / "ck" / "l1",
        shared_dir=tmp_path / "ck" / "l3",
        flush_every=100,
        saves_in_flight=1,
        fault=hold_the_first_save,
    )
    state = {f"t{i}": np.arange(N, dtype=np.float32) + 1000 * i for i in range(TENSORS)}
    mgr.save(1, {k: np.zeros_like(v) for k, v in state.items()})  # in flight, held
    got: dict[str, object] = {}

    def other_thread() -> None:
        entered.set()
        handle = mgr.save(2, state)  # waits for the slot step 1 holds
        got["step 2"] = handle.committed.result(timeout=60)

    thread = threading.Thread(target=other_thread)
    thread.start()
    assert entered.wait(10)
    # the thread is counted in save() (not merely about to call it) before close() begins:
    # else its save would be refused as one begun after close
    deadline = time.monotonic() + 10
    while not mgr._saving and time.monotonic() < deadline:
        time.sleep(0.005)
    assert mgr._saving, "the other thread's save never began"
    threading.Timer(0.5, gate.set).start()  # let step 1 finish while close() waits
    mgr.close()
    thread.join(60)
    assert got == {"step 2": 2}, got
    with pytest.raises(UsageError):
        mgr.save(3, state)
    proc = subprocess.CompletedProcess([], 0, "", "")
    check_level3(tmp_path / "ck", 1, proc, step=2)  # flushed at close, whole, bit for bit
