"""The fault matrix of the error boundary: one rank fails, every rank is told, nothing is torn.

For each scenario (``tests/workers/_fault_worker.py``), on the last rank only: a ``ValueError``
raised in the data write, the parity encoding, the manifest, the commit and the flush; a
``MemoryError`` while the manager copies the state; a shape disagreement found while planning (a
``UsageError``); a ``MemoryError`` while a restore allocates its buffers. Under ``mpiexec -n 2`` and
``-n 4`` (``MpiComm``) and ``torchrun`` (``TorchComm``), 2 simulated nodes with XOR parity,
``on_error="warn"``. Every rank must be told of the failure within seconds (no rank waits for a
transport timeout), naming the failing rank and its error type; the next save must commit; the
restore must give the newest step bit for bit; no staging directory may be left; the previous step
must verify and load bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from ckptfmt_cli.main import cli
from click.testing import CliRunner
from kit import REPO
from kit.launch import assert_ok, describe, run_mpi, run_torchrun

import ckptfmt

WORKER = str(REPO / "tests" / "workers" / "_fault_worker.py")
SAVE_SCENARIOS = {
    "data-value": ("ValueError", "write"),
    "parity-value": ("ValueError", "encode"),
    "manifest-value": ("ValueError", "manifest"),
    "commit-value": ("ValueError", "commit"),
    "flush-value": ("ValueError", "flush-copy"),
    "data-enospc": ("OSError", "write"),
    "manifest-erofs": ("OSError", "manifest"),
    "stage-memory": ("MemoryError", "copy"),
    "plan-usage": ("UsageError", "plan"),
}
DEADLINE_S = 20.0  # far below any transport timeout (gloo: 30 min; MPI: none)


def _results(out: Path, name: str, n: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(n)]


def _check_save(out: Path, name: str, n: int) -> None:
    want_type, want_phase = SAVE_SCENARIOS[name]
    results = _results(out, name, n)
    failing = str(n // 2 if name == "commit-value" else n - 1)
    for res in results:
        where = f"{name}, rank {res['rank']} of {n}"
        assert res["raised"] is None, where
        assert res.get("step") == 2, f"{where}: told of {res}"
        assert res["error"] in ("SaveFailedError",), where
        ranks = res["ranks"]
        if name == "plan-usage":  # the plan is the same everywhere: every rank fails alike
            assert set(ranks.values()) == {want_type}, where
        else:
            assert ranks == {failing: want_type}, f"{where}: {ranks}"
            assert res["phases"][failing] == want_phase, f"{where}: {res['phases']}"
        assert any("step 2" in w for w in res["warnings"]), where
        # a failed flush is told as such (a FlushWarning), never as a failed save
        assert res["flush_failed"] == ([2] if name == "flush-value" else []), where
        assert res["seconds"] < DEADLINE_S, f"{where}: told after {res['seconds']:.1f} s"
        # committed nowhere; a failed flush leaves the level-1 save, whole on every node
        whole_l1 = ["l1/n0/step-0000000002", "l1/n1/step-0000000002"]
        want = whole_l1 if name == "flush-value" else []
        assert res["step2_committed"] == want, f"{where}: {res['step2_committed']}"
        assert res["after"] == [], f"{where}: the next save failed"
        assert res["restored_step"] == 3 and res["restored_level"] == 1, where
        assert res["bitwise"], where
        assert res["step1_bitwise"] and res["step1_healthy"], where
    assert results[0]["leftovers"] == [], f"{name}: {results[0]['leftovers']}"


def _check_restore(out: Path, n: int) -> None:
    for res in _results(out, "restore-memory", n):
        where = f"restore-memory, rank {res['rank']} of {n}"
        assert res.get("error") == "LoadFailedError", f"{where}: {res}"
        assert res["ranks"] == {str(n - 1): "MemoryError"}, where
        assert res["seconds"] < DEADLINE_S, where
        assert res["again"] == 2 and res["bitwise"], where


ALL = [*SAVE_SCENARIOS, "restore-memory"]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_one_rank_failing_in_each_phase_under_mpi(tmp_path: Path, n: int) -> None:
    out = tmp_path / "out"
    out.mkdir()
    assert_ok(run_mpi(n, WORKER, "mpi", str(out), str(tmp_path / "ck"), *ALL, timeout=400))
    for name in SAVE_SCENARIOS:
        _check_save(out, name, n)
    _check_restore(out, n)


@pytest.mark.torch
@pytest.mark.slow
def test_one_rank_failing_in_each_phase_under_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    assert_ok(run_torchrun(2, WORKER, "torch", str(out), str(tmp_path / "ck"), *ALL, timeout=400))
    for name in SAVE_SCENARIOS:
        _check_save(out, name, 2)
    _check_restore(out, 2)


@pytest.mark.mpi
@pytest.mark.slow
def test_a_replaced_host_resumes_from_level_1_under_its_old_or_a_new_name(tmp_path: Path) -> None:
    """4 ranks on 4 nodes, level 1 only: a lost node replaced by a spare of the same name, of a
    new name, and a second node replaced at the next restart: each restart restores the newest
    step from level 1, rebuilt from parity, bit for bit (xor, rs with m=2, partner)."""
    out = tmp_path / "out"
    out.mkdir()
    schemes = ["replace-xor", "replace-rs", "replace-partner"]
    assert_ok(run_mpi(4, WORKER, "mpi", str(out), str(tmp_path / "ck"), *schemes, timeout=400))
    for name in schemes:
        for res in _results(out, name, 4):
            for label in ("same", "new", "second"):
                got = res[label]
                where = f"{name} {label}, rank {res['rank']}: {got}"
                assert got["step"] == 7 and got["level"] == 1, where
                assert got["rebuilt"] and got["bitwise"], where


HANG_WORKER = str(REPO / "tests" / "workers" / "_hang_worker.py")


def _hang(kind: str, scenario: str, tmp_path: Path) -> list[dict[str, Any]]:
    out = tmp_path / "out"
    out.mkdir()
    args = (HANG_WORKER, kind, scenario, str(out), str(tmp_path / "ck"))
    if kind == "mpi":
        assert_ok(run_mpi(2, *args, timeout=120))
    else:
        assert_ok(run_torchrun(2, *args, timeout=120))
    ranks = [0] if scenario.startswith("one-rank") else [0, 1]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in ranks]


@pytest.mark.mpi
@pytest.mark.torch
@pytest.mark.parametrize("kind", ["mpi", "torch"])
@pytest.mark.parametrize("background", [False, True], ids=["copy-now", "background-copy"])
def test_save_on_one_rank_only_is_reported_within_the_deadline(
    kind: str, background: bool, tmp_path: Path
) -> None:
    """Rank 1 never calls ``save``: rank 0 is told within the manager's deadline (3 s), under
    MpiComm and TorchComm alike (gloo's own timeout is 30 minutes), naming the step and the
    rank; ``wait()`` never reports success for the save that did not happen (under torchrun
    too), and the manager refuses further collective calls. With ``background_copy=True``
    the agreement runs on the saver thread: ``save`` returns at once, and ``wait()`` tells."""
    [res] = _hang(kind, "one-rank-bg" if background else "one-rank", tmp_path)
    if background:
        assert res["returned_s"] < 1.0, res  # nothing collective on the training thread
    assert res["seconds"] < 6, res  # the deadline is 3 s; rank 1 would have come at 6 s
    [(step, kind_, message, missing)] = res["failed"]
    assert (step, kind_, missing) == (5, "CollectiveTimeoutError", [1]), res
    assert "step 5" in message and "rank(s) 1 did not arrive" in message, message
    assert any("step 5" in w for w in res["warnings"]), res
    assert res["latest"] is None and res["on_disk"] == [], res
    assert res["next"] == "ManagerBrokenError", res


@pytest.mark.mpi
@pytest.mark.torch
@pytest.mark.parametrize("kind", ["mpi", "torch"])
def test_ranks_saving_different_steps_are_told_not_paired(kind: str, tmp_path: Path) -> None:
    """Rank 0 saves step 5 while rank 1 saves step 6: the roll call compares the calls, every
    rank raises OutOfStepError naming both, nothing is written, and no later call is made."""
    results = _hang(kind, "other-step", tmp_path)
    for rank, res in enumerate(results):
        [(step, kind_, message, _missing)] = res["failed"]
        assert (step, kind_) == (6 if rank else 5, "OutOfStepError"), res
        assert "rank 0 in 'save step=5 call=1'" in message, message
        assert "rank 1 in 'save step=6 call=1'" in message, message
        assert res["seconds"] < 3, res  # told at once, not at the deadline
        assert res["latest"] is None and res["on_disk"] == [], res
        assert res["next"] == "ManagerBrokenError", res


@pytest.mark.mpi
@pytest.mark.torch
@pytest.mark.parametrize("kind", ["mpi", "torch"])
def test_restore_on_one_rank_while_the_other_saves_is_told(kind: str, tmp_path: Path) -> None:
    """Rank 0 restores while rank 1 saves: the restore's messages must not pair up with the
    save's (data exchanged between different calls); both ranks are told which calls met."""
    restorer, saver = _hang(kind, "restore-vs-save", tmp_path)
    name, message = restorer["raised"]
    assert name == "OutOfStepError", restorer
    assert "'restore call=1'" in message and "'save step=5 call=1'" in message, message
    [(step, kind_, _message, _missing)] = saver["failed"]
    assert (step, kind_) == (5, "OutOfStepError"), saver
    assert saver["on_disk"] == [] and saver["latest"] is None, saver
    assert restorer["next"] == saver["next"] == "ManagerBrokenError", (restorer, saver)


@pytest.mark.mpi
def test_sigterm_is_acted_on_while_the_main_thread_sleeps(tmp_path: Path) -> None:
    """SIGTERM arrives on another thread while the main thread sleeps 30 s: the newest step is
    flushed to level 3 and the process ends at once, without waiting for the sleep to end."""
    import time

    out = tmp_path / "out"
    out.mkdir()
    root = tmp_path / "ck"
    started = time.monotonic()
    proc = run_mpi(
        2, str(REPO / "tests" / "workers" / "_sigterm_worker.py"), str(out), str(root), timeout=120
    )
    took = time.monotonic() - started
    assert proc.returncode != 0 and took < 25, (took, proc.stdout[-2000:], proc.stderr[-2000:])
    assert sorted(p.name for p in out.iterdir()) == ["rank0.sent", "rank1.sent"]
    assert (root / "l3" / "step-0000000002" / "ckptfmt.json").is_file()
    import ckptfmt

    assert ckptfmt.verify(root / "l3" / "step-0000000002").healthy


@pytest.mark.mpi
def test_one_rank_failing_while_the_restore_rebuilds(tmp_path: Path) -> None:
    """4 ranks on 4 nodes, xor: a lost node is rebuilt in memory and the restore returns the
    step bit for bit; then rank 3 fails with a ValueError while the saver thread writes the
    rebuilt files. Every rank records the same error naming rank 3 and the phase, nothing is
    left half-written, and the next restore rebuilds the step again (bit for bit) and writes
    it."""
    out = tmp_path / "out"
    out.mkdir()
    assert_ok(run_mpi(4, WORKER, "mpi", str(out), str(tmp_path / "ck"), "rebuild-value"))
    results = _results(out, "rebuild-value", 4)
    for res in results:
        where = f"rank {res['rank']}: {res}"
        assert res["restored_step"] == 7 and res["first_bitwise"], where
        assert res["rewrite"] == "failed", where
        assert res.get("error") == "SaveFailedError", where
        assert res["ranks"] == {"3": ["ValueError", "rebuild-write"]}, where
        assert res["seconds"] < DEADLINE_S, where
        assert res["again"] == 7 and res["again_rebuilt"] and res["bitwise"], where
        assert res["again_rewrite"] == "written", where
    assert results[0]["leftovers"] == [], results[0]


# --- SIGKILL and SIGTERM on one rank, during a save and during a restore ----------------------

SIGNAL_WORKER = str(REPO / "tests" / "workers" / "_signal_worker.py")
SIGNAL_SCENARIOS = ["save-sigkill", "save-sigterm", "restore-sigkill", "restore-sigterm"]
# the step a restarted job restores: the newest complete before the fault, except that SIGTERM
# lets the save in flight finish (the rank then ends as SIGTERM ends it, after its exit flush)
SIGNAL_RESTORES = {"save-sigkill": 2, "save-sigterm": 3, "restore-sigkill": 2, "restore-sigterm": 2}
JOB_END_S = 40.0  # signal -> the launcher has ended the job (torchrun: SIGTERM, then SIGKILL)


def _launch(kind: str, n: int, *args: str) -> subprocess.CompletedProcess[str]:
    if kind == "mpi":
        return run_mpi(n, SIGNAL_WORKER, kind, *args, timeout=200)
    return run_torchrun(n, SIGNAL_WORKER, kind, *args, timeout=200)


def _level1_states(root: Path) -> dict[str, dict[str, Any]]:
    """``ckptfmt list <root>/l3 --json``'s steps."""
    result = CliRunner().invoke(cli, ["list", str(root / "l3"), "--json"], prog_name="ckptfmt")
    assert result.exit_code == 0, result.output
    steps: dict[str, dict[str, Any]] = json.loads(result.output)["steps"]
    return steps


def _never_complete_on_some_nodes_only(root: Path, where: str) -> dict[str, dict[str, Any]]:
    steps = _level1_states(root)
    for step, entry in steps.items():
        states = set(entry["level1"].values())
        assert "complete" not in states or states == {"complete"}, f"{where}: step {step} {entry}"
        assert entry["level3"] != "flushing", f"{where}: step {step} {entry}"
    return steps


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,n",
    [
        pytest.param("mpi", 2, id="mpiexec-2"),
        pytest.param("mpi", 4, id="mpiexec-4"),
        pytest.param("torch", 2, id="torchrun-2", marks=pytest.mark.torch),
    ],
)
def test_sigkill_and_sigterm_on_one_rank_during_a_save_and_a_restore(
    tmp_path: Path, kind: str, n: int
) -> None:
    """The last rank gets SIGKILL or SIGTERM while step 3 is being saved (after writing its data) or
    while a restore reads its chunks (``tests/workers/_signal_worker.py``). The launcher ends the
    job within seconds of the signal (no rank lives on to the end of its sleep); a rank that is told
    before it is ended is told by a CkptError (under torchrun the transport's failure:
    ``ManagerBrokenError``), never a raw transport error. SIGKILL during a save leaves step 2 the
    newest complete step; SIGTERM during a save lets the save in flight finish on every rank first
    (step 3); a signal during a restore changes no file on any level. ``ckptfmt list`` never shows a
    step complete on some nodes only. A restarted job then restores that step from level 1 bit for
    bit, leaves no staging directory, changes nothing of what was there before the fault, and its
    next save commits; every complete step verifies node by node."""
    out, ck = tmp_path / "out", tmp_path / "ck"
    out.mkdir()
    for name in SIGNAL_SCENARIOS:
        proc = _launch(kind, n, str(out), str(ck), "fault", name)
        ended = time.time()
        where = f"{name} ({kind} -n {n})"
        signal_file = out / f"{name}.signal"
        assert signal_file.is_file(), f"{where}: the signal was never sent\n{describe(proc)}"
        assert proc.returncode != 0, f"{where}: the job ended normally\n{describe(proc)}"
        took = ended - json.loads(signal_file.read_text())["time"]
        assert took < JOB_END_S, f"{where}: the job ended {took:.1f} s after the signal"
        assert not list(out.glob(f"{name}.rank*.survived")), f"{where}\n{describe(proc)}"
        for told in out.glob(f"{name}.rank*.told.json"):
            doc = json.loads(told.read_text())
            assert not doc.get("escaped"), f"{where}: {told.name}: {doc}"
        root = ck / name
        before = json.loads((out / f"{name}.before.json").read_text())
        now = _digests(root)
        if name.startswith("restore-"):
            assert now == before, f"{where}: the interrupted restore changed files"
        else:
            assert {k: now.get(k) for k in before} == before, f"{where}: steps 1, 2 changed"
        _never_complete_on_some_nodes_only(root, f"{where}, after the fault")

    assert_ok(_launch(kind, n, str(out), str(ck), "check", ",".join(SIGNAL_SCENARIOS)))
    for name in SIGNAL_SCENARIOS:
        where = f"{name} ({kind} -n {n}), restarted"
        root = ck / name
        for r in range(n):
            res = json.loads((out / f"{name}.check.rank{r}.json").read_text())
            assert res["step"] == SIGNAL_RESTORES[name], f"{where}, rank {r}: {res}"
            assert res["level"] == 1 and res["bitwise"], f"{where}, rank {r}: {res}"
            assert res["failed_after"] == [], f"{where}, rank {r}: {res}"
            if r == 0:
                assert res["leftovers"] == [], f"{where}: {res['leftovers']}"
        before = json.loads((out / f"{name}.before.json").read_text())
        after = json.loads((out / f"{name}.after-restore.json").read_text())
        if name.startswith("restore-"):
            assert after == before, f"{where}: the restore changed files"
        else:
            assert {k: after.get(k) for k in before} == before, f"{where}: steps 1, 2 changed"
        steps = _never_complete_on_some_nodes_only(root, where)
        assert steps["10"]["level3"] == "flushed", f"{where}: {steps['10']}"
        for step, entry in steps.items():
            nodes = {nd: s for nd, s in entry["level1"].items()}
            if set(nodes.values()) == {"complete"}:
                dirs = {nd: root / "l1" / nd / f"step-{int(step):010d}" for nd in nodes}
                report = ckptfmt.verify(dirs)
                assert report.healthy, f"{where}: step {step}: {report.problems}"
        assert set(steps["10"]["level1"].values()) == {"complete"}, f"{where}: {steps['10']}"
