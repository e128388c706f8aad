"""An incremental manager under ``mpiexec -n 2``: after the first save each rank writes only
the shards whose rows changed and links the rest on level 1 and on level 3, the level-1 steps
kept by retention verify with their parity and load bit for bit with their bases removed, and
a fresh job restores the newest step bit for bit (``tests/workers/_incremental_worker.py``).
The last save changes no data: its parity files are hard links of the previous step's."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from kit import REPO
from kit.launch import assert_ok, run_mpi

import ckptfmt

pytestmark = pytest.mark.mpi


def test_an_incremental_manager_on_two_nodes(tmp_path: Path) -> None:
    result = run_mpi(2, REPO / "tests" / "workers" / "_incremental_worker.py", str(tmp_path))
    assert_ok(result)
    lines = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("report-*.json"))]
    assert sorted(x["rank"] for x in lines) == [0, 1]
    for x in lines:
        assert x["step"] == 5 and x["level"] == 1 and x["exact"], x
        assert [r["parity_linked"] > 0 for r in x["reports"]] == [False] * 5 + [True]
        assert x["reports"][-1]["parity_linked"] == x["reports"][-1]["parity_bytes"]
        assert x["reports"][-1]["bytes_written"]["1"] == 0
        first = x["reports"][0]
        assert first["error"] is None and not first["bytes_linked"].get("1")
    for both in zip(*(x["reports"][1:5] for x in lines)):  # a rank may have written nothing
        for r in both:
            assert r["error"] is None and r["flushed"] and r["link_refused"] == 0, r
            assert r["parity_bytes"] > 0  # the redundancy covers every step whole
        for level in ("1", "3"):
            linked = sum(r["bytes_linked"][level] for r in both)
            written = sum(r["bytes_written"][level] for r in both)
            assert linked > 2 * written > 0, both
    # retention kept two steps per level; each one whole on its own
    for k in (4, 5):
        step = f"step-{k:010d}"
        template = f"{tmp_path}/l1/{{node}}/{step}"
        assert ckptfmt.verify(template).healthy
        assert ckptfmt.verify(tmp_path / "l3" / step).healthy
    assert sorted(p.name for p in (tmp_path / "l1" / "n0").glob("step-*")) == [
        "step-0000000004",
        "step-0000000005",
    ]
    for rank in (0, 1):  # step 5's parity: the same inode as step 4's (whose base 3 is gone)
        parity = [
            tmp_path / "l1" / f"n{rank}" / f"step-{k:010d}" / "ckptfmt-redundancy" / str(rank)
            for k in (4, 5)
        ]
        assert parity[0].stat().st_ino == parity[1].stat().st_ino
    sys.path.insert(0, str(REPO / "tests" / "workers"))
    from _incremental_worker import whole

    got = ckptfmt.load(tmp_path / "l3" / "step-0000000005")
    assert np.array_equal(got["w"], whole(4)["w"]) and np.array_equal(
        got["frozen"], whole(4)["frozen"]
    )


ELASTIC = REPO / "tests" / "workers" / "_incremental_elastic_worker.py"


def _reports(root: Path, name: str, size: int) -> list[dict]:
    got = [json.loads((root / f"{name}-{size}-{r}.json").read_text()) for r in range(size)]
    assert [x["rank"] for x in got] == list(range(size))
    return got


def test_an_incremental_chain_across_a_lost_node_and_other_job_sizes(tmp_path: Path) -> None:
    """Four ranks (one node each) save steps 0..3 incrementally (xor sets of two, every step
    flushed). Node n3 is lost and the job restarts on three ranks: level 1 cannot be rebuilt at
    another size (the refusal names n3), so step 3 comes from level 3, bit for bit; the three
    ranks save steps 4..6 incrementally. Then four ranks (n3 new and empty) restore step 6
    from level 1, two ranks (n2 out of reach) from level 3, and every kept step of the chain
    on level 3 verifies and restores by ``step=`` bit for bit, at two ranks, with the steps it
    was linked from removed by retention. Tensors: bfloat16, 0-d and empty among them."""
    assert_ok(run_mpi(4, ELASTIC, str(tmp_path), "save", "0", "3"))
    shutil.rmtree(tmp_path / "l1" / "n3")
    assert_ok(run_mpi(3, ELASTIC, str(tmp_path), "save", "4", "6", "restore"))
    for x in _reports(tmp_path, "save", 3):
        r = x["restored"]
        assert (r["step"], r["level"], r["exact"]) == (3, 3, True), r
        assert "n3" in r["tried"][0] and "not supported" in r["tried"][0], r["tried"]
        assert all(s["error"] is None and s["flushed"] for s in x["saves"]), x["saves"]
    later = [s for x in _reports(tmp_path, "save", 3) for s in x["saves"][1:]]
    for level in ("1", "3"):
        assert sum(s["bytes_linked"][level] for s in later) > 0
    kept = sorted(p.name for p in (tmp_path / "l3").glob("step-*"))
    assert kept == [f"step-{k:010d}" for k in (4, 5, 6)]
    for name in kept:
        assert ckptfmt.verify(tmp_path / "l3" / name).healthy, name
    assert_ok(run_mpi(4, ELASTIC, str(tmp_path), "restore"))
    assert_ok(run_mpi(2, ELASTIC, str(tmp_path), "restore"))
    for size, level in ((4, 1), (2, 3)):
        for x in _reports(tmp_path, "restore", size):
            assert (x["restored"]["step"], x["restored"]["level"]) == (6, level), x
            assert x["restored"]["exact"], x
    for k in (4, 5):
        assert_ok(run_mpi(2, ELASTIC, str(tmp_path), "restore", str(k)))
        for x in _reports(tmp_path, f"restore-{k}", 2):
            assert (x["restored"]["step"], x["restored"]["exact"]) == (k, True), x
