"""``torch.distributed.checkpoint`` through ckptfmt's storage plugin on several ranks
(``torchrun``, gloo, CPU; ``tests/workers/_dcp_worker.py``): a state holding a data-parallel
replica, tensor-parallel DTensors sharded over the ranks, an int and a tuple is saved by 2 ranks
with ``dcp.save(..., storage_writer=Writer(path))`` (and with ``dcp.async_save``) and loaded
bit for bit on 1 rank (this process, into whole tensors), 2 and 4 ranks (DTensors sharded
another way: DCP's resharding through ``Reader``). The result is a ckptfmt checkpoint that
``ckptfmt verify`` passes, with every tensor one array at its global shape, every element
written once (each DTensor shard by the rank holding it), and that zarr-python reads as plain
arrays."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.distributed.checkpoint as dcp  # noqa: E402
from _dcp_worker import expected  # noqa: E402
from ckptfmt_torch.dcp import Reader  # noqa: E402
from kit import REPO  # noqa: E402
from kit.launch import describe, run_torchrun  # noqa: E402
from kit.zarr_reader import zarr_read  # noqa: E402

import ckptfmt  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

WORKER = str(REPO / "tests" / "workers" / "_dcp_worker.py")
JOB_TIMEOUT = 150


def job(tmp: Path, task: str, n: int) -> None:
    plan = tmp / f"{task}-{n}.plan.json"
    paths = {"ckpt": str(tmp / "ckpt"), "ckpt_async": str(tmp / "ckpt-async"), "out": str(tmp)}
    plan.write_text(json.dumps({"task": task, **paths}))
    result = run_torchrun(n, WORKER, str(plan), timeout=JOB_TIMEOUT)
    assert result.returncode == 0, describe(result)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("dcp")
    job(tmp, "save", 2)
    return tmp


def bits(t: Any) -> Any:
    """The tensor's bytes, so that equality is bitwise (NaNs and -0.0 included)."""
    return t.contiguous().view(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def assert_same(got: Any, want: Any, name: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), name
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(bits(got), bits(want)), name
    elif isinstance(want, dict):
        assert set(got) == set(want), name
        for k in want:
            assert_same(got[k], want[k], f"{name}/{k}")
    else:
        assert got == want and type(got) is type(want), name


def test_saved_by_two_ranks_is_a_ckptfmt_checkpoint(saved: Path, tmp_path: Path) -> None:
    ckpt = saved / "ckpt"
    report = ckptfmt.verify(ckpt)
    assert not report.problems
    m = report.manifest
    assert m.step == 5 and m.world_size == 2
    want = expected()
    tensors = {"/".join(t.name): t for t in m.tensors()}
    for group in ("ddp", "tp"):
        for k, v in want[group].items():
            t = tensors[f"{group}/{k}"]
            assert t.shape == tuple(v.shape)  # one array at its global shape
            covered = sum(int(np.prod(r.shape)) for r in t.regions)
            assert covered == v.numel()  # every element written once
    # each rank wrote its own DTensor shard, at its offset
    assert {r.rank for r in tensors["tp/w"].regions} == {0, 1}
    assert m.values() == {"step": 5}  # the int is a plain value; the tuple is DCP's bytes
    arrays = zarr_read(tmp_path, ckpt)
    assert arrays["tp/w"]["array_shape"] == [8, 6]
    assert arrays["ddp/fc.weight"]["dtype"] == "float32"


def test_loads_on_one_rank(saved: Path) -> None:
    want = expected()
    target: dict[str, Any] = {
        "ddp": {k: torch.zeros_like(v) for k, v in want["ddp"].items()},
        "tp": {k: torch.zeros_like(v) for k, v in want["tp"].items()},
        "step": 0,
        "meta": {"betas": None},
    }
    dcp.load(target, storage_reader=Reader(saved / "ckpt"), no_dist=True)
    assert_same(target, want)


@pytest.mark.parametrize("n", [2, 4])
def test_loads_on_n_ranks(saved: Path, n: int) -> None:
    job(saved, "load", n)
    got = torch.load(saved / f"loaded-{n}.pt", weights_only=True)
    assert_same(got, expected())


def test_async_save_on_two_ranks_holds_the_same(saved: Path) -> None:
    assert not ckptfmt.verify(saved / "ckpt-async").problems
    a, b = ckptfmt.load(saved / "ckpt"), ckptfmt.load(saved / "ckpt-async")
    flat_a, flat_b = dict(_leaves(a)), dict(_leaves(b))
    assert set(flat_a) == set(flat_b)
    for k, v in flat_a.items():
        w = flat_b[k]
        if isinstance(v, np.ndarray):
            assert v.dtype == w.dtype and v.tobytes() == w.tobytes(), k
        else:
            assert v == w, k


def _leaves(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(tree, dict):
        return [x for k, v in tree.items() for x in _leaves(v, f"{prefix}/{k}")]
    return [(prefix, tree)]


def test_the_writer_makes_no_collective_of_its_own(tmp_path: Path) -> None:
    """``dcp.save`` on two ranks with ckptfmt's ``Writer`` makes the torch.distributed
    collectives that DCP's ``FileSystemWriter`` does, no more (DCP's gather and scatter of the
    plans, its gather of the write results and the broadcast of the outcome), the same every
    save; a save whose object rank 0 cannot serialise (in ``write_data``: rank 0 alone knows)
    fails on both ranks and leaves nothing behind; a save onto a committed checkpoint is refused
    on both ranks with the coordinator's ``DestinationExistsError`` (DCP pickles it: a
    ``CkptError`` whose constructor takes its fields must still unpickle)."""
    job(tmp_path, "count", 2)
    report = json.loads((tmp_path / "count-2.json").read_text())
    ours, theirs = report["ckptfmt"]["counts"], report["filesystem"]["counts"]
    assert all(c == theirs[0] for c in theirs), theirs
    assert all(c == theirs[0] for c in ours), (ours, theirs[0])
    assert sum(theirs[0].values()) > 0  # the counting sees DCP's own
    for outcome in report["failed"]:  # every rank raised, naming rank 0's error
        assert outcome and "lambda" in " ".join(outcome), report["failed"]
    assert report["failed_left"] == []
    for outcome in report["onto_existing"]:  # the coordinator's error, rebuilt on every rank
        assert outcome and all("DestinationExistsError: refusing to save to" in o for o in outcome)
    assert not (tmp_path / "count-failed").exists()
    print(  # the figures (run with -s to see them)
        f"dcp.save on 2 ranks: collectives {ours[0]} (FileSystemWriter: {theirs[0]}); "
        f"median s: ckptfmt {report['ckptfmt']['median_s']:.4f}, "
        f"FileSystemWriter {report['filesystem']['median_s']:.4f}"
    )
    for i in range(len(ours)):
        assert not ckptfmt.verify(tmp_path / f"count-ckptfmt-{i}").problems
