"""A restore after a lost node loads the state from the rebuild in memory and writes the
rebuilt files afterwards, on the manager's saver thread (``parallel.manager.restore``): under
real ``mpiexec``, that write is killed midway (the leader of the lost node ends its process
with its data files staged, its parity and the manifest not), and a fresh job must still find
the step rebuildable and restore it bit for bit, rebuilding again; once that job's write is
done, ``ckptfmt verify`` finds every node's copy healthy and the rebuilt directory holds, byte
for byte, what the lost one held.

The worker is ``tests/workers/_rebuild_rewrite_worker.py`` (4 ranks, 2 simulated nodes, xor).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kit import REPO
from kit.cli import run_cli
from kit.files import committed_steps, leftover_dirs, tree_digests
from kit.launch import describe, run_mpi

from ckptfmt.storage import commit
from ckptfmt.storage.steps import step_dir_name

WORKER = str(REPO / "tests" / "workers" / "_rebuild_rewrite_worker.py")
RANKS = 4
CRASH_RANK = 2  # the leader of n1, the lost node


@dataclass
class Jobs:
    root: Path
    out: Path
    crash: Any  # the finished process of the job whose write was killed
    crash_disk: dict[str, Any]  # what n1 held right after it
    again: Any


def _results(out: Path, phase: str) -> list[dict[str, Any]]:
    got = []
    for r in range(RANKS):
        path = out / f"{phase}.rank{r}.json"
        assert path.is_file(), f"rank {r} wrote no results for {phase}"
        got.append(json.loads(path.read_text()))
    return got


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    tmp = tmp_path_factory.mktemp("rewrite")
    root, out = tmp / "ck", tmp / "out"
    out.mkdir()
    crash = run_mpi(RANKS, WORKER, str(out), str(root), "crash", timeout=120)
    n1 = root / "l1" / "n1"
    disk = {
        "committed": committed_steps(n1) if n1.exists() else [],
        "is_committed": commit.is_committed(n1 / step_dir_name(1)),
        "staged": sorted(
            p.relative_to(n1).as_posix()
            for p in (n1.rglob("*") if n1.exists() else [])
            if p.is_file() and any(".tmp-" in part for part in p.relative_to(n1).parts)
        ),
    }
    again = run_mpi(RANKS, WORKER, str(out), str(root), "again", timeout=120)
    return Jobs(root, out, crash, disk, again)


@pytest.mark.mpi
def test_write_of_rebuilt_files_killed_midway_then_rebuilt_again(jobs: Jobs) -> None:
    out = jobs.out
    # the restore returned the state, bit for bit, before the write was killed
    assert (out / "crash.crashed").read_text() == f"{CRASH_RANK} rebuild-writing", describe(
        jobs.crash
    )
    assert jobs.crash.returncode != 0, describe(jobs.crash)
    assert not (out / f"crash.rank{CRASH_RANK}.closed").exists(), "the killed rank went on"
    for res in _results(out, "crash"):
        where = f"rank {res['rank']}: {res}"
        assert (res["step"], res["level"]) == (1, 1), where
        assert res["bitwise"] and res["report_bitwise"], where
        assert res["tried"] == [], where
        [line] = res["rebuilt"]
        assert "rebuilt data of rank(s) 2, 3 and parity of rank(s) 2, 3" in line, where
        assert "recreated node(s) n1" in line, where
    # midway: rank 2's data files staged, nothing committed on n1 (never a torn step as good)
    assert jobs.crash_disk["is_committed"] is False, jobs.crash_disk
    assert jobs.crash_disk["committed"] == [], jobs.crash_disk
    staged = jobs.crash_disk["staged"]
    assert any("/c/" in p for p in staged), staged  # data files
    assert not any(p.endswith(f"ckptfmt-redundancy/{CRASH_RANK}") for p in staged), staged
    assert not any(p.endswith("ckptfmt.json") for p in staged), staged

    # a fresh job: the step is rebuilt again from the same parity and restored bit for bit
    assert jobs.again.returncode == 0, describe(jobs.again)
    for res in _results(out, "again"):
        where = f"rank {res['rank']}: {res}"
        assert (res["step"], res["level"]) == (1, 1), where
        assert res["bitwise"] and res["report_bitwise"], where
        assert res["tried"] == [], where
        [line] = res["rebuilt"]
        assert "recreated node(s) n1" in line, where
        assert res["rewrite"] == "written", where


@pytest.mark.mpi
def test_rebuilt_step_verifies_healthy_once_written(jobs: Jobs) -> None:
    assert jobs.again.returncode == 0, describe(jobs.again)
    root = jobs.root
    template = root / "l1" / "{node}" / step_dir_name(1)
    for node in ("n0", "n1"):
        assert committed_steps(root / "l1" / node) == [1], node
    # every node's copy together: data, parity and metadata, every CRC
    result = run_cli("verify", "--json", template)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["healthy"] is True, doc
    # the rebuilt directory holds what the lost one did, byte for byte, and nothing else
    rebuilt = tree_digests(root / "l1" / "n1" / step_dir_name(1))
    assert rebuilt == tree_digests(root / "aside" / "n1" / step_dir_name(1))
    assert leftover_dirs(root / "l1") == []
