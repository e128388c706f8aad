"""Manager jobs whose level 3 is a bucket, under real ``mpiexec`` and ``torchrun``, against the
tests' S3 server: every rank uploads its own files at each flush; once every node's level 1 is
wiped, every rank restores its part from the bucket bit for bit (``tests/workers/_bucket_worker.py``
checks each byte); retention keeps the newest steps on the bucket; the torch adapter restores a
model and its optimizer from the bucket through the manager. Without a manager, the ranks save
straight to a bucket (``save_to_bucket``, and ``ckptfmt_torch.save`` of a URL) and load it back
bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kit.launch import assert_ok, run_mpi, run_torchrun
from kit.s3 import S3

WORKER = "tests/workers/_bucket_worker.py"


def plan(tmp_path: Path, s3: S3, tasks: list[dict[str, Any]], **extra: Any) -> Path:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    doc = {"out": str(out), "root": str(tmp_path), "url": f"{s3.url}/run", "tasks": tasks}
    doc.update(extra)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    return path


def results(tmp_path: Path, name: str, n: int) -> list[dict[str, Any]]:
    return [json.loads((tmp_path / "out" / f"{name}.rank{r}.json").read_text()) for r in range(n)]


def committed_steps(s3: S3) -> list[int]:
    return sorted(
        int(k.split("/")[1][5:]) for k in s3.keys("run/") if k.endswith("/ckptfmt-commit.json")
    )


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_mpi_ranks_flush_to_the_bucket_and_restore_from_it_bit_exact(
    tmp_path: Path, s3: S3, n: int
) -> None:
    tasks = [
        {"name": "save", "action": "save", "steps": [1, 2, 3], "keep_shared": 2},
        {"name": "wipe", "action": "wipe"},
        {"name": "restore", "action": "restore"},
    ]
    assert_ok(run_mpi(n, WORKER, "mpi", str(plan(tmp_path, s3, tasks)), timeout=240, env=s3.env))
    for r in results(tmp_path, "save", n):
        assert all(s["flushed"] and not s["warnings"] for s in r["saves"].values()), r
        assert r["requests"].get("PUT", 0) > 0  # every rank uploaded its own files
    assert committed_steps(s3) == [2, 3]  # retention on the bucket
    for r in results(tmp_path, "restore", n):
        assert (r["step"], r["level"], r["problems"]) == (3, 3, []), r
        assert r["path"].startswith(f"{s3.url}/run/step-")
    assert not (tmp_path / "l1" / "n0").exists()  # restored from the bucket alone


@pytest.mark.torch
@pytest.mark.slow
def test_torchrun_flush_to_the_bucket_and_the_torch_adapter_restores_from_it(
    tmp_path: Path, s3: S3
) -> None:
    tasks = [
        {"name": "tsave", "action": "torch-save"},
        {"name": "wipe", "action": "wipe"},
        {"name": "trestore", "action": "torch-restore"},
        {"name": "save", "action": "save", "steps": [7]},
        {"name": "wipe2", "action": "wipe"},
        {"name": "restore", "action": "restore"},
    ]
    p = plan(tmp_path, s3, tasks)
    assert_ok(run_torchrun(2, WORKER, "torch", str(p), timeout=240, env=s3.env))
    saved = results(tmp_path, "tsave", 2)
    for r, s in zip(results(tmp_path, "trestore", 2), saved, strict=True):
        assert (r["step"], r["level"]) == (3, 3)
        assert r["digest"] == s["digest"]  # model and optimizer, bit for bit
    for r in results(tmp_path, "restore", 2):
        assert (r["step"], r["level"], r["problems"]) == (7, 3, []), r


@pytest.mark.mpi
@pytest.mark.slow
def test_mpi_ranks_save_straight_to_a_bucket_and_load_it_bit_exact(tmp_path: Path, s3: S3) -> None:
    """No manager: ``save_to_bucket`` under mpiexec, every rank its files, rank 0 the commit."""
    tasks = [
        {"name": "save", "action": "url-save", "step": 6},
        {"name": "load", "action": "url-load", "step": 6},
    ]
    p = plan(tmp_path, s3, tasks)
    assert_ok(run_mpi(2, WORKER, "mpi", str(p), timeout=240, env=s3.env))
    assert len({r["save_id"] for r in results(tmp_path, "save", 2)}) == 1
    for r in results(tmp_path, "load", 2):
        assert (r["step"], r["problems"]) == (6, []), r
    assert [k for k in s3.keys("run/direct/") if k.endswith("ckptfmt-commit.json")]


@pytest.mark.slow
def test_torchrun_ranks_save_straight_to_a_bucket_through_the_torch_adapter(
    tmp_path: Path, s3: S3
) -> None:
    tasks = [
        {"name": "tsave", "action": "torch-url-save"},
        {"name": "tload", "action": "torch-url-load"},
    ]
    p = plan(tmp_path, s3, tasks)
    assert_ok(run_torchrun(2, WORKER, "torch", str(p), timeout=240, env=s3.env))
    for got, saved in zip(
        results(tmp_path, "tload", 2), results(tmp_path, "tsave", 2), strict=True
    ):
        assert (got["step"], got["value"]) == (3, 3), got
        assert got["digest"] == saved["digest"]  # model and optimizer, bit for bit
