"""A Lightning-shaped checkpoint dict (optimizer and scheduler states in lists, callbacks,
hyper-parameters, counters) through ``ckptfmt_torch.save/load/restore`` and the manager:
bit-exact tensors, the same container types, objects refused by key path unless pickled on
request and loaded only when trusted."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import ckptfmt_torch  # noqa: E402
from kit.managers import make_manager  # noqa: E402

import ckptfmt  # noqa: E402
from ckptfmt import WriteOptions  # noqa: E402
from ckptfmt.errors import PickleRefusedError, UnsupportedValueError  # noqa: E402

NO_FSYNC = WriteOptions(fsync=False)


def trained(seed: int) -> tuple[Any, Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def lightning_dict(model: Any, opt: Any, sched: Any, **extra: Any) -> dict[str, Any]:
    """What ``Trainer.save_checkpoint`` builds (``_CheckpointConnector.dump_checkpoint``)."""
    return {
        "epoch": 1,
        "global_step": 10,
        "pytorch-lightning_version": "2.6.0",
        "state_dict": model.state_dict(),
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"current": {"ready": 1}}}},
        "callbacks": {
            "ModelCheckpoint{'monitor': 'loss'}": {
                "best_model_score": torch.tensor(0.25),
                "best_k_models": {"a.ckpt": torch.tensor(0.25)},
                "dirpath": "/ckpt",
                "last_model_path": "",
            }
        },
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [sched.state_dict()],
        "hyper_parameters": {"lr": 1e-2, "layers": (4, 8, 2), "name": None, **extra},
    }


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Equal, the same container types; tensors bit-exact (dtype, shape, bytes)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert got.view(-1).view(torch.uint8).equal(want.view(-1).view(torch.uint8)), where
        return
    if isinstance(want, dict):  # an OrderedDict (a module's state dict) loads as a dict
        assert isinstance(got, dict) and list(got) == list(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), f"{where}: {type(got)}"
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{where}/{i}")
    else:
        assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
        assert got == want, where


def test_lightning_dict_round_trips_into_an_empty_dict(tmp_path: Path) -> None:
    ck = lightning_dict(*trained(0))
    ckptfmt_torch.save(ck, tmp_path / "c", write=NO_FSYNC)
    got: dict[str, Any] = {}
    ckptfmt_torch.load(got, tmp_path / "c")
    assert_same(got, ck)
    _model, opt, sched = trained(1)
    opt.load_state_dict(got["optimizer_states"][0])  # the state keyed by parameter index again
    sched.load_state_dict(got["lr_schedulers"][0])
    assert_same(opt.state_dict(), ck["optimizer_states"][0])


def test_lightning_dict_loads_in_place(tmp_path: Path) -> None:
    ck = lightning_dict(*trained(0))
    ckptfmt_torch.save(ck, tmp_path / "c", write=NO_FSYNC)
    target = lightning_dict(*trained(1))
    exp_avg = target["optimizer_states"][0]["state"][0]["exp_avg"]
    ckptfmt_torch.load(target, tmp_path / "c")
    assert target["optimizer_states"][0]["state"][0]["exp_avg"] is exp_avg  # copied into
    assert_same(target, ck)


def test_core_load_gives_numpy_in_the_same_containers(tmp_path: Path) -> None:
    ck = lightning_dict(*trained(0))
    ckptfmt_torch.save(ck, tmp_path / "c", write=NO_FSYNC)
    got = ckptfmt.load(tmp_path / "c")
    assert type(got["optimizer_states"]) is list and type(got["lr_schedulers"]) is list
    assert got["hyper_parameters"]["layers"] == (4, 8, 2)
    assert got["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.999)
    want = ck["optimizer_states"][0]["state"][0]["exp_avg"].numpy()
    assert got["optimizer_states"][0]["state"]["0"]["exp_avg"].tobytes() == want.tobytes()


def test_manager_and_restore(tmp_path: Path) -> None:
    ck = lightning_dict(*trained(0), blob=b"\x01\x02")
    with make_manager(tmp_path) as mgr:
        mgr.save(10, ckptfmt_torch.to_state(ck))
        mgr.wait()
        target = lightning_dict(*trained(1), blob=b"")
        report = ckptfmt_torch.restore(target, mgr)
    assert report.step == 10
    assert_same(target, ck)


def test_tensors_inside_lists_and_tuples(tmp_path: Path) -> None:
    sd = {"pair": (torch.arange(4), [torch.ones(2, dtype=torch.bfloat16), None]), "b": b"xy"}
    ckptfmt_torch.save(sd, tmp_path / "c", write=NO_FSYNC)
    got: dict[str, Any] = {}
    ckptfmt_torch.load(got, tmp_path / "c")
    assert_same(got, sd)


def test_objects_refused_by_key_path(tmp_path: Path) -> None:
    ck = lightning_dict(*trained(0), args=argparse.Namespace(lr=0.1))
    with pytest.raises(UnsupportedValueError) as info:
        ckptfmt_torch.save(ck, tmp_path / "c", write=NO_FSYNC)
    assert info.value.name == "hyper_parameters/args"
    assert "objects='pickle'" in str(info.value)
    assert not (tmp_path / "c").exists()


def test_pickled_objects_only_when_trusted(tmp_path: Path) -> None:
    ck = lightning_dict(*trained(0), args=argparse.Namespace(lr=0.1), root=Path("/data"))
    ckptfmt_torch.save(ck, tmp_path / "c", objects="pickle", write=NO_FSYNC)
    with pytest.raises(PickleRefusedError, match="hyper_parameters/args"):
        ckptfmt_torch.load({}, tmp_path / "c")
    got: dict[str, Any] = {}
    ckptfmt_torch.load(got, tmp_path / "c", trust_pickle=True)
    assert_same(got, ck)
    with make_manager(tmp_path) as mgr:
        mgr.save(1, ckptfmt_torch.to_state(ck, objects="pickle"), objects="pickle")
        mgr.wait()
        with pytest.raises(PickleRefusedError):
            ckptfmt_torch.restore({}, mgr)
        target: dict[str, Any] = {}
        assert ckptfmt_torch.restore(target, mgr, trust_pickle=True).step == 1
    assert target["hyper_parameters"]["args"] == argparse.Namespace(lr=0.1)
