"""Under real ``mpiexec`` (4 ranks, 4 simulated nodes, xor): bytes a rebuild got wrong on ONE
rank fail the load from the rebuild on every rank before anything lands in the arrays offered
(the member check runs before the load's first vote), and the same step, rebuilt again, then
loads bit for bit. The worker is ``tests/workers/_rebuilt_check_worker.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kit import REPO
from kit.launch import assert_ok, run_mpi

WORKER = str(REPO / "tests" / "workers" / "_rebuilt_check_worker.py")
RANKS = 4


@pytest.mark.mpi
def test_wrong_rebuilt_bytes_on_one_rank_fail_every_rank_before_anything_lands(
    tmp_path: Path,
) -> None:
    out, root = tmp_path / "out", tmp_path / "ck"
    out.mkdir()
    assert_ok(run_mpi(RANKS, WORKER, str(out), str(root), timeout=120))
    for r in range(RANKS):
        got = json.loads((out / f"rank{r}.json").read_text())
        flipped, again = got["flipped"], got["again"]
        assert flipped["lost_data"] == [1] and again["lost_data"] == [1], got
        assert flipped["error"] == "LoadFailedError", got
        assert flipped["failed_ranks"] == [1], got
        assert flipped["untouched"], got  # nothing landed, on the rank that failed or any other
        if r == 1:
            assert flipped["cause"] == "ChecksumError", got
        assert again["error"] is None and again["exact"], got
