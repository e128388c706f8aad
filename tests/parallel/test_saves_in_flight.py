"""Several saves in flight and ``when_busy="skip"`` (``ManagerSettings.saves_in_flight``,
``when_busy``): with a level slowed down well past the loop's step, two saves are queued without
the loop waiting; with ``"skip"`` the loop is never kept long, and every save is either
committed or skipped on every rank alike (counted in ``saves_skipped``, logged, and said by its
handle and report), never lost silently; what is kept verifies and the newest committed step
restores bit-exact. In one process and under ``mpiexec -n 2``."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit import REPO
from kit.launch import assert_ok, run_mpi
from kit.managers import node_manager

import ckptfmt
from ckptfmt.errors import SaveSkippedError
from ckptfmt.storage.steps import step_dir_name

WORKER = REPO / "tests" / "workers" / "_inflight_worker.py"


def state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {
        "w": rng.standard_normal((128, 64), dtype=np.float32),
        "b": rng.integers(0, 255, 1000, dtype=np.uint8),
        "step": step,
    }


def slow(seconds: float) -> Any:
    def fault(point: str) -> None:
        if point == "written":  # every file written, the commit ahead: a slow level
            time.sleep(seconds)

    return fault


def outcome(handle: Any) -> str:
    exc = handle.committed.exception(timeout=60)
    if exc is None:
        return "committed"
    return "skipped" if isinstance(exc, SaveSkippedError) else f"{type(exc).__name__}: {exc}"


def check_kept(root: Path, committed: list[int]) -> None:
    """Every step kept on level 1 verifies, is one of the committed ones, and loads
    bit-exactly equal to what was saved; the newest committed step is among them."""
    kept = sorted(int(p.name.split("-")[1]) for p in root.glob("step-*"))
    assert kept and set(kept) <= set(committed) and max(committed) in kept, (kept, committed)
    for step in kept:
        report = ckptfmt.verify(root / step_dir_name(step))
        assert report.healthy, [p.to_json() for p in report.problems]
        got = ckptfmt.load(root / step_dir_name(step))
        want = state(step)
        assert np.array_equal(got["w"], want["w"]) and np.array_equal(got["b"], want["b"])
        assert got["step"] == step


def test_two_saves_in_flight_are_queued_without_the_loop_waiting(tmp_path: Path) -> None:
    """Each save's write lasts 0.6 s: with ``saves_in_flight=2`` the second save returns at
    once (the first is still writing) and only the third waits; with one in flight the second
    already waits. Every save is committed and verifies."""
    waited = {}
    for n in (1, 2):
        mgr = node_manager(tmp_path / str(n), shared=None, fault=slow(0.6), saves_in_flight=n)
        handles = [mgr.save(step, state(step)) for step in range(3)]
        mgr.close(flush=False)
        waited[n] = [r.waited_s for r in mgr.save_reports]
        assert [outcome(h) for h in handles] == ["committed"] * 3
        assert mgr.saves_skipped == 0 and mgr.failed_saves == []
        check_kept(tmp_path / str(n) / "l1" / "n0", [0, 1, 2])
    assert waited[1][1] > 0.3, waited  # one in flight: the second save waited for the first
    assert waited[2][1] < 0.2 and waited[2][2] > 0.3, waited


@pytest.mark.parametrize("mode", ["now", "background", "donate"])
def test_skip_keeps_the_loop_going_and_tells_every_skipped_save(
    tmp_path: Path, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Saves at every 0.05 s step while each write lasts 0.4 s, ``when_busy="skip"``: no
    save keeps the loop long (a wait would be most of a write), several are skipped, and
    every save is committed or skipped: the counts add up, each skipped one is in
    ``saves_skipped``, ``skipped_steps``, its report and a log line; none is a failure."""
    mgr = node_manager(
        tmp_path, shared=None, fault=slow(0.4), saves_in_flight=2, when_busy="skip", keep_local=3
    )
    handles, blocked = [], []
    pending = None
    with caplog.at_level(logging.WARNING, logger="ckptfmt"):
        for step in range(12):
            entered = time.perf_counter()
            if pending is not None and not pending.abandon():
                pending.wait_staged()  # its copy must be done before the state changes
            h = mgr.save(
                step, state(step), background_copy=mode == "background", donate=mode == "donate"
            )
            blocked.append(time.perf_counter() - entered)
            handles.append(h)
            # a donated state is read until its save is over: each step's state is new here
            pending = h if mode == "background" else None
            time.sleep(0.05)
        mgr.wait()
    outcomes = [outcome(h) for h in handles]
    mgr.close(flush=False)
    committed = [h.step for h, o in zip(handles, outcomes) if o == "committed"]
    skipped = [h.step for h, o in zip(handles, outcomes) if o == "skipped"]
    assert len(committed) + len(skipped) == 12, outcomes
    assert skipped and committed[0] == 0, outcomes
    assert mgr.saves_skipped == len(skipped) and mgr.skipped_steps == skipped
    assert mgr.failed_saves == []
    assert [r.step for r in mgr.save_reports if r.skipped] == skipped
    assert all(h.skipped() for h in handles if h.step in skipped)
    assert any("skipped" in r.getMessage() for r in caplog.records)
    assert max(blocked) < 0.2, blocked
    check_kept(tmp_path / "l1" / "n0", committed)


def test_a_background_save_given_up_before_its_copy_is_skipped(tmp_path: Path) -> None:
    """``SaveHandle.abandon``: a background save queued behind one still writing is given up
    (the state is the loop's again at once, nothing of it read) and skipped; one whose copy
    is done cannot be; with ``when_busy="wait"`` no save can be given up."""
    mgr = node_manager(tmp_path, shared=None, fault=slow(0.5), saves_in_flight=2, when_busy="skip")
    first = mgr.save(1, state(1), background_copy=True)
    assert first.wait_staged(30)  # its copy is done: it writes now
    second = mgr.save(2, state(2), background_copy=True)
    assert not second.staged.done()  # queued behind the write
    assert not first.abandon()
    assert second.abandon() and second.staged.done()
    with pytest.raises(SaveSkippedError, match="step 2 skipped on every rank"):
        second.result(30)
    assert first.result(30) == 1
    third = mgr.save(3, state(3), background_copy=True)  # a slot is free again
    assert third.result(30) == 3
    mgr.close(flush=False)
    assert mgr.saves_skipped == 1 and mgr.failed_saves == []
    check_kept(tmp_path / "l1" / "n0", [1, 3])

    waiting = node_manager(tmp_path / "w", shared=None, fault=slow(0.3), saves_in_flight=2)
    waiting.save(1, state(1), background_copy=True)
    h = waiting.save(2, state(2), background_copy=True)
    assert not h.abandon()
    assert h.result(30) == 2
    waiting.close(flush=False)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["now", "background"])
def test_skipped_saves_are_the_same_on_every_rank(tmp_path: Path, mode: str) -> None:
    """``mpiexec -n 2`` (``tests/workers/_inflight_worker.py``): a slow level (slower on rank 1),
    saves at every step, two in flight, ``"skip"``: the loop is never kept long, the ranks agree
    on every save's outcome and count, what is kept on level 3 verifies and a fresh manager
    restores the newest committed step bit-exact."""
    result = run_mpi(2, WORKER, str(tmp_path), mode, timeout=240)
    assert_ok(result)
    ranks = [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1], result.stdout
    first, second = ranks
    assert first["outcomes"] == second["outcomes"], (first["outcomes"], second["outcomes"])
    outcomes = first["outcomes"]
    committed = sorted(int(s) for s, o in outcomes.items() if o == "committed")
    skipped = sorted(int(s) for s, o in outcomes.items() if o == "skipped")
    assert len(committed) + len(skipped) == len(outcomes) == 10, outcomes
    assert skipped and committed, outcomes
    for r in ranks:
        assert r["failed"] == []
        assert r["saves_skipped"] == len(skipped) and r["skipped_steps"] == skipped
        assert len(r["reasons"]) == len(skipped)
        assert max(r["blocked"]) < 0.25, r["blocked"]
        assert r["restored"] == max(committed) and r["exact"], r
    kept = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "l3").glob("step-*"))
    assert kept and set(kept) <= set(committed) and max(committed) in kept
    for step in kept:
        report = ckptfmt.verify(tmp_path / "l3" / step_dir_name(step))
        assert report.healthy, [p.to_json() for p in report.problems]
