"""ckptfmt_torch with a checkpoint in a bucket (the tests' S3 server): a collective load by two
ranks reads it in place, bit-exact; a collective save to a URL is refused with what to do
instead (the manager's level 3, or a one-process save)."""

from __future__ import annotations

import pytest
from kit.s3 import S3

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.errors import UsageError
from ckptfmt.transport.threads import ThreadComm, run_threads

torch = pytest.importorskip("torch")
ckptfmt_torch = pytest.importorskip("ckptfmt_torch")


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 6))


def test_two_ranks_load_a_checkpoint_from_a_bucket(s3: S3) -> None:
    url = f"{s3.url}/torch/ckpt"
    saved = _model(1)
    saved[0].weight.data = saved[0].weight.data.to(torch.bfloat16)
    state = ckptfmt_torch.to_state({"model": saved, "epoch": 3})
    ckptfmt.save(state, url, step=3, write=WriteOptions(chunk_bytes=256, fsync=False))

    def rank(comm: ThreadComm) -> dict[str, torch.Tensor]:
        fresh = _model(2)
        fresh[0].weight.data = fresh[0].weight.data.to(torch.bfloat16)
        sd = {"model": fresh, "epoch": 0}
        manifest = ckptfmt_torch.load(sd, url, comm=comm)
        assert manifest.step == 3 and sd["epoch"] == 3
        return {k: v.clone() for k, v in fresh.state_dict().items()}

    for got in run_threads(2, rank):
        for name, want in saved.state_dict().items():
            assert got[name].dtype == want.dtype, name
            assert torch.equal(got[name].view(torch.uint8), want.view(torch.uint8)), name


def test_a_collective_save_to_a_url_is_refused(s3: S3) -> None:
    with pytest.raises(UsageError, match="CheckpointManager"):
        ckptfmt_torch.save({"model": _model(0)}, f"{s3.url}/x", comm=ckptfmt.SingleComm())
    assert s3.keys() == []
