"""Interop with PyTorch's own files: a ``ckptfmt_torch`` checkpoint exported to safetensors has
exactly ``model.state_dict()``'s names and bits (read back by ``safetensors.torch``, loaded
strictly into the model), casts equal ``Tensor.to``; ``--to torch`` gives a ``torch.load``-able
state dict; ``torch.save`` files import through ``weights_only=True`` only; DCP checkpoints
import only with ``trust_pickle``; the imported checkpoints load in place with
``ckptfmt_torch.load``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import ckptfmt_torch  # noqa: E402
import safetensors.torch as sttorch  # noqa: E402
from ckptfmt_cli.exits import ExitStatus  # noqa: E402
from ckptfmt_torch.interop import export_torch, import_dcp, import_torch  # noqa: E402
from kit.cli import run_cli as run  # noqa: E402
from kit.files import leftovers  # noqa: E402

import ckptfmt  # noqa: E402
from ckptfmt import WriteOptions  # noqa: E402
from ckptfmt.errors import ForeignFormatError, PickleRefusedError  # noqa: E402
from ckptfmt.interop import export_safetensors, import_safetensors  # noqa: E402

pytestmark = pytest.mark.torch


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.fc1 = torch.nn.Linear(16, 32)
        self.norm = torch.nn.BatchNorm1d(32)  # an int64 0-d buffer: num_batches_tracked
        self.fc2 = torch.nn.Linear(32, 8)
        self.half = torch.nn.Linear(8, 8).to(torch.bfloat16)


def trained(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    net = Net()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p))
    net.norm.num_batches_tracked.fill_(7)
    return net


def bits(t: Any) -> bytes:
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert bits(a[k]) == bits(b[k]), k


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Net, Path]:
    net = trained()
    opt = torch.optim.Adam(net.parameters())
    net.fc2(net.norm(net.fc1(net.embed(torch.arange(6))))).sum().backward()
    opt.step()  # optimizer tensors in the checkpoint: not exported by default
    ckptfmt_torch.save(
        {"model": net, "optim": opt, "step": 3}, tmp_path / "ck", write=WriteOptions(fsync=False)
    )
    return net, tmp_path / "ck"


def test_export_gives_state_dict_names_and_bits(saved: tuple[Net, Path], tmp_path: Path) -> None:
    net, ck = saved
    export_safetensors(ck, tmp_path / "hf", max_shard_size="2KB", write=WriteOptions(fsync=False))
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    got: dict[str, Any] = {}
    for file in dict.fromkeys(index["weight_map"].values()):
        got |= sttorch.load_file(tmp_path / "hf" / file)
    want = net.state_dict()
    assert list(index["weight_map"]) == list(want)  # state_dict order
    same_state({k: got[k] for k in want}, dict(want))
    fresh = Net()
    fresh.load_state_dict(got, strict=True)
    same_state(dict(fresh.state_dict()), dict(want))


def test_cast_matches_tensor_to(saved: tuple[Net, Path], tmp_path: Path) -> None:
    net, ck = saved
    for dtype, tdt in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        out = tmp_path / dtype
        r = export_safetensors(ck, out, dtype=dtype, write=WriteOptions(fsync=False))
        got = sttorch.load_file(out / "model.safetensors")
        for k, v in net.state_dict().items():
            want = v.to(tdt) if v.is_floating_point() else v
            assert got[k].dtype == want.dtype and bits(got[k]) == bits(want), (dtype, k)
        assert r.not_cast == ["model/norm.num_batches_tracked"]


def test_export_to_torch_save(saved: tuple[Net, Path], tmp_path: Path) -> None:
    net, ck = saved
    result = run("export", ck, tmp_path / "sd.pt", "--to", "torch", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["format"] == "torch"
    sd = torch.load(tmp_path / "sd.pt", weights_only=True)
    same_state(sd, dict(net.state_dict()))
    assert leftovers(tmp_path) == []
    assert run("export", ck, tmp_path / "sd.pt", "--to", "torch").exit_code == ExitStatus.USAGE
    r = export_torch(ck, tmp_path / "bf.pt", dtype="bfloat16", write=WriteOptions(fsync=False))
    assert r.not_cast == ["model/norm.num_batches_tracked"]
    bf = torch.load(tmp_path / "bf.pt", weights_only=True)
    want = {
        k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in net.state_dict().items()
    }
    same_state(bf, want)


@pytest.mark.parametrize("damage", ["lost node", "flipped bit"])
def test_export_to_torch_rebuilds_level1_on_the_fly(tmp_path: Path, damage: str) -> None:
    """``export --to torch`` of level-1 copies that lost a node (or hold a file that fails its
    CRC), within what the redundancy rebuilds: written whole, bit for bit, the rebuilt node
    named, the source untouched (spec/CLI.md, ``export`` 0); it used to exit 1 ("damaged")."""
    import shutil

    from kit.faults import flip
    from kit.files import tree
    from kit.level1 import NODES4, save_level1, whole

    from ckptfmt.manifest.codec import parse_manifest
    from ckptfmt.redundancy.record import member_files

    root = tmp_path / "l1"
    template = save_level1(root, "xor", NODES4)
    if damage == "lost node":
        shutil.rmtree(root / "n2")
    else:
        manifest = parse_manifest((root / "n2" / "ckptfmt.json").read_bytes())
        flip(root / "n2" / member_files(manifest, 2)[0][1].path)  # sizes fine: a CRC fails
    before = tree(root)
    result = run("export", template, tmp_path / "sd.pt", "--to", "torch", "--json")
    assert result.exit_code == ExitStatus.OK, result.output
    assert json.loads(result.output)["rebuilt_nodes"] == ["n2"]
    sd = torch.load(tmp_path / "sd.pt", weights_only=True)
    want = whole(4)
    for name in ("embed", "w"):
        assert sd[name].numpy().tobytes() == want[f"model/{name}"].tobytes(), name
    assert tree(root) == before  # the source is left as it was
    assert leftovers(tmp_path) == []


def test_import_torch_save_loads_in_place(tmp_path: Path) -> None:
    net = trained(1)
    torch.save(net.state_dict(), tmp_path / "sd.pt")
    r = import_torch(tmp_path / "sd.pt", tmp_path / "ck", write=WriteOptions(fsync=False))
    assert r.format == "torch" and set(r.names.values()) == {f"model/{k}" for k in net.state_dict()}
    fresh = Net()
    ckptfmt_torch.load({"model": fresh}, tmp_path / "ck")
    same_state(dict(fresh.state_dict()), dict(net.state_dict()))
    # a nested training checkpoint keeps its structure
    torch.save({"model": net.state_dict(), "epoch": 4}, tmp_path / "full.pt")
    result = run("import", tmp_path / "full.pt", tmp_path / "ck2")
    assert result.exit_code == 0, result.output
    fresh2 = Net()
    state: dict[str, Any] = {"model": fresh2, "epoch": 0}
    ckptfmt_torch.load(state, tmp_path / "ck2")
    assert state["epoch"] == 4
    same_state(dict(fresh2.state_dict()), dict(net.state_dict()))


class Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned > /dev/null",))


def test_import_torch_refuses_what_weights_only_refuses(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(2), "x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(ForeignFormatError, match="weights_only"):
        import_torch(tmp_path / "evil.pt", tmp_path / "ck")
    assert not (tmp_path / "ck").exists() and leftovers(tmp_path) == []
    result = run("import", tmp_path / "evil.pt", tmp_path / "ck")
    assert result.exit_code == ExitStatus.UNREADABLE and not (tmp_path / "ck").exists()
    blob = (tmp_path / "evil.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(blob[: len(blob) // 2])  # truncated
    with pytest.raises(ForeignFormatError):
        import_torch(tmp_path / "cut.pt", tmp_path / "ck")
    torch.save({"../x": torch.zeros(1)}, tmp_path / "names.pt")  # a hostile key
    with pytest.raises(ForeignFormatError, match="periods"):
        import_torch(tmp_path / "names.pt", tmp_path / "ck")
    assert not (tmp_path / "ck").exists() and leftovers(tmp_path) == []


def test_import_dcp_needs_trust_pickle(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    net = trained(2)
    dcp.save(
        {"model": net.state_dict(), "epoch": 5}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True
    )
    with pytest.raises(PickleRefusedError, match="trust_pickle"):
        import_dcp(tmp_path / "dcp", tmp_path / "ck")
    result = run("import", tmp_path / "dcp", tmp_path / "ck")
    assert result.exit_code == ExitStatus.USAGE and "--trust-pickle" in result.output
    assert not (tmp_path / "ck").exists()
    result = run("import", tmp_path / "dcp", tmp_path / "ck", "--trust-pickle", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["format"] == "dcp"
    fresh = Net()
    state: dict[str, Any] = {"model": fresh, "epoch": 0}
    ckptfmt_torch.load(state, tmp_path / "ck")
    assert state["epoch"] == 5
    same_state(dict(fresh.state_dict()), dict(net.state_dict()))


def test_import_hf_written_by_safetensors_torch(tmp_path: Path) -> None:
    net = trained(3)
    sd = {k: v.contiguous() for k, v in net.state_dict().items()}
    os.mkdir(tmp_path / "hf")
    sttorch.save_file(sd, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    result = run("import", tmp_path / "hf", tmp_path / "ck")
    assert result.exit_code == 0, result.output
    fresh = Net()
    ckptfmt_torch.load({"model": fresh}, tmp_path / "ck")
    same_state(dict(fresh.state_dict()), dict(net.state_dict()))
    assert ckptfmt.verify(tmp_path / "ck").healthy
    # and back out: the same bytes per tensor as the library wrote
    export_safetensors(tmp_path / "ck", tmp_path / "again", write=WriteOptions(fsync=False))
    same_state(
        {k: v for k, v in sttorch.load_file(tmp_path / "again" / "model.safetensors").items()},
        {k: sd[k] for k in sttorch.load_file(tmp_path / "again" / "model.safetensors")},
    )
    assert import_safetensors(
        tmp_path / "hf" / "model.safetensors", tmp_path / "ck3"
    ).tensors == len(sd)


@pytest.mark.tf
def test_hf_model_file_into_keras(tmp_path: Path) -> None:
    """The ``examples/keras_from_torch.py`` idea, from an HF model file: torch weights saved by
    ``safetensors.torch``, imported, loaded into Keras with a name map, bit for bit."""
    keras = pytest.importorskip("keras")
    import ckptfmt_keras
    import numpy as np

    torch.manual_seed(0)
    tnet = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    os.mkdir(tmp_path / "hf")
    sttorch.save_file(dict(tnet.state_dict()), tmp_path / "hf" / "model.safetensors")
    import_safetensors(tmp_path / "hf", tmp_path / "ck", write=WriteOptions(fsync=False))
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, name="fc1"), keras.layers.Dense(4, name="fc2")],
        name="net",
    )
    names = {
        "net/fc1/kernel": "model/0.weight",
        "net/fc1/bias": "model/0.bias",
        "net/fc2/kernel": "model/2.weight",
        "net/fc2/bias": "model/2.bias",
    }

    def transpose(name: str, a: Any) -> Any:
        return np.ascontiguousarray(a.T) if name.endswith("/kernel") else a

    ckptfmt_keras.load_variables(model, tmp_path / "ck", name_map=names, transform=transpose)
    sd = tnet.state_dict()
    for i, layer in ((0, "fc1"), (2, "fc2")):
        kernel = np.asarray(model.get_layer(layer).kernel)
        assert kernel.tobytes() == np.ascontiguousarray(sd[f"{i}.weight"].numpy().T).tobytes()
        assert (
            np.asarray(model.get_layer(layer).bias).tobytes() == sd[f"{i}.bias"].numpy().tobytes()
        )
