"""``ckptfmt_torch.save(..., base=...)``: a model fine-tuned with its base frozen saves only the
trainable part; the frozen parameters' files are hard links of the base's, and the step loads
into a fresh model bit for bit with the base deleted."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import ckptfmt_torch  # noqa: E402

import ckptfmt  # noqa: E402
from ckptfmt import WriteOptions  # noqa: E402

pytestmark = pytest.mark.torch


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(2048, 256),  # frozen
        torch.nn.Linear(256, 256),  # frozen
        torch.nn.Linear(256, 16),  # trained
    )


def test_a_frozen_base_is_linked_and_the_step_loads_alone(tmp_path: Path) -> None:
    write = WriteOptions(
        fsync=False, chunk_bytes=64 << 10, shard_bytes=256 << 10, content_hash=True
    )
    model = _model()
    for p in list(model[0].parameters()) + list(model[1].parameters()):
        p.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ckptfmt_torch.save({"model": model}, tmp_path / "s0", write=write)
    x = torch.randint(0, 2048, (8,))
    model(x).square().mean().backward()
    opt.step()
    ckptfmt_torch.save({"model": model}, tmp_path / "s1", write=write, base=tmp_path / "s0")
    m = ckptfmt.open(tmp_path / "s1").manifest
    shared = {
        f.path
        for _, f in m.files()
        if (tmp_path / "s1" / f.path).stat().st_ino == (tmp_path / "s0" / f.path).stat().st_ino
    }
    assert shared and all(p.startswith(("model/0.", "model/1.")) for p in shared)
    assert {p.split("/c/")[0] for p in shared} == {
        "model/0.weight",
        "model/1.weight",
        "model/1.bias",
    }
    shutil.rmtree(tmp_path / "s0")
    fresh = torch.nn.Sequential(
        torch.nn.Embedding(2048, 256), torch.nn.Linear(256, 256), torch.nn.Linear(256, 16)
    )
    ckptfmt_torch.load({"model": fresh}, tmp_path / "s1")
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name
