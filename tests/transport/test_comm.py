"""The ``Comm`` implementations: ``SingleComm`` in-process; ``MpiComm`` under a real ``mpiexec``
and ``TorchComm`` (gloo) under ``torchrun``, each rank checking what it received and the test
checking every rank's results again against the expected values."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _comm_worker import (
    DUP_ROUNDS,
    IDLE_S,
    bcast_array,
    bcast_doc,
    bf16_array,
    json_doc,
    payload,
    ring_array,
    sha,
)
from kit import REPO
from kit.launch import assert_ok, describe, run_mpi, run_torchrun

from ckptfmt.errors import UsageError
from ckptfmt.transport.comm import SingleComm

WORKER = str(REPO / "tests" / "workers" / "_comm_worker.py")
ABORT_MESSAGE = "background thread 'inject' failed; aborting the job"


# --- checks of the ranks' results -----------------------------------------------------------------


def rank_results(out: Path, n: int) -> list[dict[str, Any]]:
    results = []
    for r in range(n):
        path = out / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no results"
        res = json.loads(path.read_text())
        assert (res["rank"], res["size"]) == (r, n)
        results.append(res)
    return results


def check_collectives(out: Path, n: int) -> None:
    want_ring_bytes = {r: ring_array((r - 1) % n).tobytes() for r in range(n)}
    want_exchange = {
        r: [
            sha(ring_array((r - d) % n, d).tobytes() + ring_array((r - d) % n, 100 + d).tobytes())
            for d in range(1, n)
        ]
        for r in range(n)
    }
    for r, res in enumerate(rank_results(out, n)):
        # every rank holds exactly every rank's bytes, its own and the empty one included
        assert res["allgather_len"] == [len(payload(j, n)) for j in range(n)]
        assert res["allgather_sha"] == [sha(payload(j, n)) for j in range(n)]
        assert res["allgather_empty"] == [0] * n
        assert res["allgather_json"] == [json_doc(j) for j in range(n)]
        assert res["exchange_sha"] == want_exchange[r], f"rank {r}: start_exchange rounds"
        assert res["bcast_json"] == bcast_doc()
        assert res["all_true_yes"] is True
        assert res["all_true_no"] is False
        assert res["min_int"] == 100 - 7 * (n - 1)
        assert res["min_int_neg"] == -(10**12)
        assert res["bcast_sha"] == sha(bcast_array(n))
        peer = r ^ 1
        if peer < n:
            assert res["bf16_peer"] == peer
            got = np.load(out / f"rank{r}_bf16.npy")
            want = bf16_array(peer, 5 if r % 2 else 6).view(np.uint16)
            assert got.dtype == np.uint16
            assert got.tobytes() == want.tobytes(), f"rank {r}: bfloat16 bits from {peer}"
        got_ring = np.load(out / f"rank{r}_ring.npy")
        assert got_ring.tobytes() == want_ring_bytes[r], f"rank {r}: ring data"


def check_dup(out: Path, n: int) -> None:
    for res in rank_results(out, n):
        assert res["counts"] == {"main": DUP_ROUNDS, "bg": DUP_ROUNDS}
        spans = res["spans"]
        overlap = min(spans["main"][1], spans["bg"][1]) - max(spans["main"][0], spans["bg"][0])
        assert overlap > 0, f"the two threads never ran at the same time: {spans}"


def check_background_abort(
    result: subprocess.CompletedProcess[str], elapsed: float, out: Path, n: int
) -> None:
    text = describe(result)
    assert result.returncode != 0, text
    assert elapsed < 60, f"the abort took {elapsed:.1f} s\n{text}"
    assert ABORT_MESSAGE in result.stderr, text
    assert "injected failure in the background thread" in result.stderr, text
    # every rank was up (and so waiting) when the job ended; none reached the end
    assert sorted(p.name for p in out.glob("rank*.started")) == [
        f"rank{r}.started" for r in range(n)
    ]
    assert not list(out.glob("rank*.json")), text


# --- SingleComm, in-process --------------------------------------------------------------------


def test_single_comm_collectives() -> None:
    comm = SingleComm()
    assert (comm.rank, comm.size) == (0, 1)
    comm.barrier()
    assert comm.allgather_bytes(b"\x00abc") == [b"\x00abc"]
    assert comm.allgather_bytes(b"") == [b""]
    assert comm.allgather_json(json_doc(0)) == [json_doc(0)]
    assert comm.bcast_json(bcast_doc()) == bcast_doc()
    assert comm.all_true(True) is True
    assert comm.all_true(False) is False
    assert comm.min_int(-5) == -5
    buf = np.arange(10, dtype=np.uint8)
    comm.bcast_buffer(buf, 0)
    assert buf.tolist() == list(range(10))
    with pytest.raises(UsageError):
        comm.bcast_buffer(buf, 1)
    with pytest.raises(ValueError):  # JSON metadata never carries NaN
        comm.allgather_json(float("nan"))


def test_single_comm_point_to_point() -> None:
    comm = SingleComm()
    data = bf16_array(0, 1).view(np.uint8)
    got = np.zeros_like(data)
    comm.sendrecv(data, 0, got, 0)
    assert got.tobytes() == data.tobytes()
    with pytest.raises(UsageError):
        comm.send(data, 0)
    with pytest.raises(UsageError):
        comm.recv(got, 0)
    with pytest.raises(UsageError):
        comm.sendrecv(data, 1, got, 0)
    dup = comm.dup()
    assert isinstance(dup, SingleComm) and dup is not comm
    assert (dup.rank, dup.size) == (0, 1)


def test_single_comm_background_failure_ends_the_process() -> None:
    code = (
        "import time\n"
        "from ckptfmt.transport.comm import SingleComm, start_background\n"
        "def fail():\n"
        "    raise RuntimeError('injected failure in the background thread')\n"
        "start_background(SingleComm(), fail, 'inject')\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert result.returncode == 70, describe(result)
    assert time.monotonic() - start < 30
    assert ABORT_MESSAGE in result.stderr
    assert "RuntimeError: injected failure" in result.stderr


# --- MpiComm under mpiexec ---------------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize("n,kind", [(2, "mpi"), (4, "mpi"), (4, "mpi-block")])
def test_mpi_collectives(tmp_path: Path, n: int, kind: str) -> None:
    assert_ok(run_mpi(n, WORKER, kind, "collectives", str(tmp_path)))
    check_collectives(tmp_path / "collectives", n)


@pytest.mark.mpi
def test_mpi_waits_sleep_instead_of_spinning(tmp_path: Path) -> None:
    """Ranks waiting on a late rank in a barrier and a vote use a fraction of a core (MPICH's
    blocking waits would spin: about a core each for the whole wait)."""
    assert_ok(run_mpi(3, WORKER, "mpi", "idle_wait", str(tmp_path)))
    waiting = rank_results(tmp_path / "idle_wait", 3)[1:]
    for res in waiting:
        assert res["wall_s"] > 0.8 * IDLE_S, res  # it did wait for rank 0
        assert res["cpu_s"] < 0.5 * res["wall_s"], res


@pytest.mark.mpi
def test_mpi_dup_keeps_background_traffic_apart(tmp_path: Path) -> None:
    assert_ok(run_mpi(3, WORKER, "mpi", "dup", str(tmp_path)))
    check_dup(tmp_path / "dup", 3)


@pytest.mark.mpi
def test_mpi_background_failure_aborts_the_job(tmp_path: Path) -> None:
    start = time.monotonic()
    result = run_mpi(3, WORKER, "mpi", "background_abort", str(tmp_path), timeout=90)
    elapsed = time.monotonic() - start
    check_background_abort(result, elapsed, tmp_path / "background_abort", 3)
    assert "MPI_Abort" in result.stdout + result.stderr, describe(result)


# --- TorchComm under torchrun (gloo) -----------------------------------------------------------


@pytest.fixture(scope="module")
def torch_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One torchrun job of 4 processes running the collectives and dup scenarios (a launch
    costs ~15 s here, mostly importing torch)."""
    out = tmp_path_factory.mktemp("torch_comm")
    assert_ok(run_torchrun(4, WORKER, "torch", "collectives,dup", str(out), timeout=150))
    return out


@pytest.mark.torch
def test_torch_collectives(torch_job: Path) -> None:
    check_collectives(torch_job / "collectives", 4)


@pytest.mark.torch
def test_torch_dup_keeps_background_traffic_apart(torch_job: Path) -> None:
    check_dup(torch_job / "dup", 4)


@pytest.mark.torch
def test_torch_background_failure_ends_the_job(tmp_path: Path) -> None:
    start = time.monotonic()
    result = run_torchrun(3, WORKER, "torch", "background_abort", str(tmp_path), timeout=90)
    elapsed = time.monotonic() - start
    check_background_abort(result, elapsed, tmp_path / "background_abort", 3)


@pytest.mark.torch
def test_torch_comm_needs_an_initialised_process_group() -> None:
    pytest.importorskip("torch")
    import torch.distributed as dist
    from ckptfmt_torch.comm import TorchComm

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(UsageError, match="init_process_group"):
        TorchComm()
