"""ckptfmt_torch with a checkpoint in a bucket (the tests' S3 server): a collective load by two
ranks reads it in place, bit-exact; a collective save by two ranks to a URL (each its files,
rank 0 the commit) loads back bit-exact, and one already there is refused unless
overwriting."""

from __future__ import annotations

import pytest
from kit.s3 import S3

import ckptfmt
from ckptfmt import WriteOptions
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


def test_two_ranks_save_to_a_url_and_load_it_back(s3: S3) -> None:
    url = f"{s3.url}/torch/direct"
    saved = _model(1)
    opt = torch.optim.AdamW(saved.parameters(), lr=1e-3)
    saved(torch.randn(4, 24)).sum().backward()
    opt.step()
    write = WriteOptions(chunk_bytes=256, fsync=False)

    def save(comm: ThreadComm) -> str:
        sd = {"model": saved, "optim": opt, "epoch": 5}
        return ckptfmt_torch.save(sd, url, step=5, write=write, comm=comm).save_id  # type: ignore[no-any-return]

    assert len(set(run_threads(2, save))) == 1
    with pytest.raises(ckptfmt.errors.SaveFailedError, match="overwrite"):
        run_threads(2, save)

    def load(comm: ThreadComm) -> dict[str, torch.Tensor]:
        fresh = _model(2)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        sd = {"model": fresh, "optim": fresh_opt, "epoch": 0}
        assert ckptfmt_torch.load(sd, url, comm=comm).step == 5 and sd["epoch"] == 5
        exp_avg = [s["exp_avg"].clone() for s in fresh_opt.state.values()]
        return {**{k: v.clone() for k, v in fresh.state_dict().items()}, "exp_avg": exp_avg}

    want_avg = [s["exp_avg"] for s in opt.state.values()]
    for got in run_threads(2, load):
        for name, want in saved.state_dict().items():
            assert torch.equal(got[name], want), name
        assert all(torch.equal(a, b) for a, b in zip(got["exp_avg"], want_avg, strict=True))
