"""SIGTERM with several managers in one process (``ckptfmt.parallel.manager.exit``: one registry per
process, one SIGTERM watch, one ``atexit`` hook).

Each test runs ``tests/workers/_sigterm_managers_worker.py`` in a real process (one, or two under
``mpiexec``) that opens, saves to and closes managers in a given order and then sends itself a
real SIGTERM. Every manager open at that moment must have its newest step on its level 3 (whole,
bit for bit, and only that step: ``flush_every=100``), whichever was opened first; a closed one
(closed with ``flush=False``) must have nothing there; the process must end as SIGTERM ends it
(status 143), or by the user's handler, which runs once, after the flushes. With no manager open,
SIGTERM's handler and the wake-up fd must be what they were before the first manager.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from kit import REPO
from kit.files import committed_steps
from kit.launch import describe, run_mpi, with_kit_path

import ckptfmt

WORKER = str(REPO / "tests" / "workers" / "_sigterm_managers_worker.py")
ENDED_BY_SIGTERM = (128 + signal.SIGTERM, -signal.SIGTERM)  # by the watcher's _exit / the signal
USER_STATUS = 7  # the worker's handler raises SystemExit(7)


def value(name: str, step: int) -> float:
    """What every element of manager ``name``'s step holds (the worker's ``value``)."""
    return float(100 * (ord(name) - ord("A") + 1) + step)


def run_single(tmp_path: Path, ops: str) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    """The worker in one process (no communicator); returns it, its out dir and its root."""
    out, root = tmp_path / "out", tmp_path / "ck"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, WORKER, "single", str(out), str(root), *ops.split()],
        cwd=REPO,
        env=with_kit_path(os.environ),
        capture_output=True,
        text=True,
        timeout=90,
    )
    return proc, out, root


def check_level3(
    root: Path, expect: dict[str, int | None], proc: subprocess.CompletedProcess[str]
) -> None:
    """Manager ``name``'s level 3 holds exactly step ``expect[name]`` (None: nothing), whole and
    bit for bit."""
    for name, step in expect.items():
        l3 = root / name / "l3"
        assert committed_steps(l3) == ([] if step is None else [step]), f"{name}\n{describe(proc)}"
        if step is not None:
            path = l3 / f"step-{step:010d}"
            assert ckptfmt.verify(path).healthy, path
            got = ckptfmt.load(path)["w"]
            want = np.full((64, 64), value(name, step), np.float32)
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), path


def check_ended(out: Path, proc: subprocess.CompletedProcess[str], ranks: int = 1) -> None:
    for r in range(ranks):
        assert (out / f"killing.rank{r}").is_file(), describe(proc)
        assert not (out / f"survived.rank{r}").exists(), f"rank {r} survived\n{describe(proc)}"


# ops, then each manager's expected level-3 step (None: closed, nothing flushed)
SCENARIOS = {
    # the loss that was reported: the closed manager's watcher ended the process first
    "closed-then-open": ("open:A save:A:1 close:A open:B save:B:1 save:B:2", {"A": None, "B": 2}),
    "open-then-closed": ("open:A save:A:1 open:B save:B:2 close:B", {"A": 1, "B": None}),
    "three-first-closed-between": (
        "open:A save:A:1 open:B save:B:1 save:B:2 close:A open:C save:C:3",
        {"A": None, "B": 2, "C": 3},
    ),
    "three-last-closed": (
        "open:A save:A:1 open:B save:B:2 open:C save:C:3 close:C",
        {"A": 1, "B": 2, "C": None},
    ),
    "three-two-closed": (
        "open:A save:A:1 open:B save:B:2 close:B open:C save:C:3 save:A:4 close:A",
        {"A": None, "B": None, "C": 3},
    ),
    "three-all-open": (
        "open:C save:C:1 open:A save:A:2 open:B save:B:3 save:C:4",
        {"A": 2, "B": 3, "C": 4},
    ),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_sigterm_flushes_every_open_manager(tmp_path: Path, scenario: str) -> None:
    ops, expect = SCENARIOS[scenario]
    proc, out, root = run_single(tmp_path, ops)
    assert proc.returncode in ENDED_BY_SIGTERM, describe(proc)
    check_ended(out, proc)
    check_level3(root, expect, proc)


def test_with_every_manager_closed_sigterm_is_as_before(tmp_path: Path) -> None:
    """Three managers opened and closed in another order: SIGTERM's handler and the wake-up fd
    are back to the defaults, and SIGTERM ends the process at once, flushing nothing."""
    ops = "open:A save:A:1 open:B save:B:2 open:C save:C:3 close:B close:A close:C disposition"
    proc, out, root = run_single(tmp_path, ops)
    assert proc.returncode == -signal.SIGTERM, describe(proc)  # the default action itself
    check_ended(out, proc)
    disposition = json.loads((out / "disposition.rank0.json").read_text())
    assert disposition == {"handler": "default", "wakeup_fd": -1}
    check_level3(root, {"A": None, "B": None, "C": None}, proc)


def handler_runs(out: Path) -> list[dict[str, list[str]]]:
    return [json.loads(line) for line in (out / "handler.rank0.txt").read_text().splitlines()]


def test_the_users_handler_installed_before_runs_once_after_the_flushes(tmp_path: Path) -> None:
    """The user's handler, installed before the first manager, runs once, when the open
    manager's newest step is already on level 3, and ends the process with its own status."""
    proc, out, root = run_single(tmp_path, "handler open:A save:A:1 open:B save:B:2 close:A")
    assert proc.returncode == USER_STATUS, describe(proc)
    check_ended(out, proc)
    assert handler_runs(out) == [{"A": [], "B": ["step-0000000002"]}]
    check_level3(root, {"A": None, "B": 2}, proc)


def test_the_users_handler_installed_after_runs_once_and_the_flushes_finish(
    tmp_path: Path,
) -> None:
    """The user's handler, installed over ckptfmt's, is left in place: it runs once (from the
    main thread, while the flushes go on) and raises SystemExit; the interpreter's exit waits for
    the flushes, so both open managers' newest steps are on level 3 when the process ends with
    the handler's status."""
    proc, out, root = run_single(tmp_path, "open:A save:A:1 open:B save:B:2 handler")
    assert proc.returncode == USER_STATUS, describe(proc)
    check_ended(out, proc)
    assert len(handler_runs(out)) == 1
    check_level3(root, {"A": 1, "B": 2}, proc)


def test_with_no_manager_open_the_users_handler_is_back_in_place(tmp_path: Path) -> None:
    proc, out, root = run_single(tmp_path, "handler open:A save:A:1 close:A disposition")
    assert proc.returncode == USER_STATUS, describe(proc)
    disposition = json.loads((out / "disposition.rank0.json").read_text())
    assert disposition == {"handler": "user", "wakeup_fd": -1}
    assert handler_runs(out) == [{"A": []}]
    check_level3(root, {"A": None}, proc)


def test_a_manager_made_off_the_main_thread_is_flushed_with_one_made_on_it(tmp_path: Path) -> None:
    proc, out, root = run_single(tmp_path, "open-thread:A save:A:1 open:B save:B:2")
    assert proc.returncode in ENDED_BY_SIGTERM, describe(proc)
    check_ended(out, proc)
    check_level3(root, {"A": 1, "B": 2}, proc)


def test_a_manager_made_off_the_main_thread_alone_cannot_act_on_sigterm(tmp_path: Path) -> None:
    """Only the main thread may install a signal handler: alone, such a manager leaves SIGTERM
    as it was (the process ends at once, nothing flushed) and a warning says so."""
    proc, out, root = run_single(tmp_path, "open-thread:A save:A:1")
    assert proc.returncode == -signal.SIGTERM, describe(proc)
    check_ended(out, proc)
    assert "off the main thread cannot install the SIGTERM handler" in proc.stderr
    check_level3(root, {"A": None}, proc)


MPI_SCENARIOS = {
    "closed-then-open": ("open:A save:A:1 close:A open:B save:B:1 save:B:2", {"A": None, "B": 2}),
    "open-then-closed": (
        "open:A save:A:1 open:B save:B:2 close:B save:A:3",
        {"A": 3, "B": None},
    ),
}


@pytest.mark.mpi
@pytest.mark.parametrize("scenario", sorted(MPI_SCENARIOS))
def test_sigterm_flushes_every_open_manager_under_mpiexec(tmp_path: Path, scenario: str) -> None:
    """2 ranks on 2 nodes, two managers (collective on COMM_WORLD), one of them closed; every
    rank sends itself SIGTERM: each open manager's newest step is flushed (collectively, on its
    saver threads' communicator) and the job ends."""
    ops, expect = MPI_SCENARIOS[scenario]
    out, root = tmp_path / "out", tmp_path / "ck"
    out.mkdir()
    proc = run_mpi(2, WORKER, "mpi", str(out), str(root), *ops.split(), timeout=90)
    assert proc.returncode != 0, describe(proc)
    check_ended(out, proc, ranks=2)
    for name in expect:
        assert committed_steps(root / name / "l1" / "n0") == committed_steps(
            root / name / "l1" / "n1"
        )
    check_level3(root, expect, proc)
