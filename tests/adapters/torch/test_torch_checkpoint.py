"""The PyTorch adapter in one process: every dtype bit-exact and without copies, state dicts and
statefuls (modules, optimizers, schedulers, scalers, ``TrainingState``) loaded in place and
training on bitwise as before, the same tensors as ``torch.distributed.checkpoint``, refusals of
what JSON cannot hold, a checkpoint that opens with no torch import, RNG state and
``ResumableSampler`` positions. Multi-process DDP/FSDP2: ``test_torch_parallel.py``."""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ckptfmt_torch  # noqa: E402
from ckptfmt_torch import ResumableSampler, TrainingState  # noqa: E402
from ckptfmt_torch.convert import tensor_to_numpy  # noqa: E402

import ckptfmt  # noqa: E402
from ckptfmt.errors import CkptError, UnsupportedValueError, UsageError  # noqa: E402

pytestmark = pytest.mark.torch

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
OTHERS = [torch.float64, torch.int8, torch.int64, torch.uint8, torch.bool, torch.complex64]
ON_DISK = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}


def bits_tensor(dtype: Any, shape: tuple[int, ...], seed: int = 0) -> Any:
    """A tensor whose bytes are random: NaN payloads, -0, subnormals and infinities included."""
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def same_bits(a: Any, b: Any) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().reshape(-1).contiguous(), b.detach().reshape(-1).contiguous()
    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def mlp(seed: int, dtype: Any = torch.float32) -> Any:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 3)
    ).to(dtype)


def step(model: Any, opt: Any, sched: Any = None, scaler: Any = None, seed: int = 0) -> str:
    """One training step on data drawn from every random source; the loss as float.hex."""
    x = torch.randn(5, 8) + float(np.random.standard_normal()) + random.random()
    loss = model(x.to(next(model.parameters()).dtype)).float().pow(2).mean()
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    if sched is not None:
        sched.step()
    return float(loss.detach()).hex()


# --- dtypes and views -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS + OTHERS, ids=str)
def test_every_dtype_round_trips_bit_exact(tmp_path: Path, dtype: Any) -> None:
    t = bits_tensor(dtype, (6, 10), seed=3)
    strided = bits_tensor(dtype, (10, 6), seed=4).t()  # a non-contiguous view
    scalar = bits_tensor(dtype, (), seed=5)
    ckptfmt_torch.save({"t": t, "strided": strided, "scalar": scalar}, tmp_path / "c")
    target = {
        "t": torch.zeros_like(t),
        "strided": torch.zeros(10, 6, dtype=dtype).t(),
        "scalar": torch.zeros((), dtype=dtype),
    }
    keep = {k: v for k, v in target.items()}
    ckptfmt_torch.load(target, tmp_path / "c")
    for name, want in (("t", t), ("strided", strided), ("scalar", scalar)):
        assert target[name] is keep[name], "loaded into the tensor given, in place"
        assert same_bits(target[name], want), name
    if dtype in ON_DISK:
        m = ckptfmt.open(tmp_path / "c").manifest
        assert {t.dtype for t in m.tensors()} == {ON_DISK[dtype]}


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_conversion_shares_memory(dtype: Any) -> None:
    t = bits_tensor(dtype, (4, 8), seed=1)
    a = tensor_to_numpy(t)
    assert a.__array_interface__["data"][0] == t.data_ptr()
    assert a.dtype.name == ON_DISK[dtype] and a.shape == (4, 8)
    strided = t.t()
    b = tensor_to_numpy(strided)
    assert b.__array_interface__["data"][0] == t.data_ptr() and not b.flags.c_contiguous
    back = ckptfmt_torch.numpy_to_tensor(a)
    assert back.data_ptr() == t.data_ptr() and back.dtype == dtype
    state = ckptfmt_torch.to_state({"w": torch.nn.Parameter(t.float().to(dtype), False)})
    assert state["w"].dtype.name == ON_DISK[dtype]


def test_refuses_what_json_cannot_hold(tmp_path: Path) -> None:
    bad: list[Any] = [
        object(),
        lambda: 0,
        {1, 2},
        torch.device("cpu"),
        1 + 2j,
        [torch.zeros(3, 3).to_sparse()],  # inside a list: named by its index
        torch.zeros(3, 3).to_sparse(),
    ]
    for value in bad:
        path = tmp_path / "c"
        with pytest.raises(UnsupportedValueError) as info:
            ckptfmt_torch.save({"model": {"w": torch.zeros(2)}, "x": value}, path)
        assert isinstance(info.value, CkptError)
        assert "x" in str(info.value)
        assert not path.exists()
    with pytest.raises(UnsupportedValueError):
        ckptfmt_torch.save({"m": {(1, 2): torch.zeros(2)}}, tmp_path / "c")
    with pytest.raises(CkptError):
        ckptfmt_torch.save({"t": torch.zeros(2, dtype=torch.float8_e4m3fnuz)}, tmp_path / "c")
    assert not (tmp_path / "c").exists()


# --- state dicts and statefuls --------------------------------------------------------------------


def test_statefuls_and_values_load_in_place(tmp_path: Path) -> None:
    model = mlp(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20)
    for _ in range(3):
        step(model, opt, sched)
    cfg = {"betas": (0.8, 0.95), "name": "run", "best": float("inf"), "none": None}
    ckptfmt_torch.save(
        {"model": model, "optim": opt, "sched": sched, "cfg": cfg, "step": 3},
        tmp_path / "c",
        step=3,
    )
    model2 = mlp(1)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1.0, betas=(0.8, 0.95))
    sched2 = torch.optim.lr_scheduler.OneCycleLR(opt2, max_lr=0.1, total_steps=20)
    params = [p for p in model2.parameters()]
    target = {
        "model": model2,
        "optim": opt2,
        "sched": sched2,
        "cfg": {"betas": (0.0, 0.0)},  # tuples where the target has them, the rest added
        "step": 0,
    }
    assert not opt2.state  # fresh: its state comes from the checkpoint alone
    assert ckptfmt_torch.load(target, tmp_path / "c").step == 3
    assert [p for p in model2.parameters()] == params  # the same parameters, loaded into
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert same_bits(a, b)
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert sorted(s1["state"]) == sorted(s2["state"]) == [0, 1, 2, 3]  # int keys, as torch has
    for k in s1["state"]:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert same_bits(s1["state"][k][name], s2["state"][k][name])
    assert isinstance(s2["param_groups"][0]["betas"], tuple)  # OneCycleLR cycles beta1
    assert s1["param_groups"] == s2["param_groups"]
    assert sched2.state_dict() == sched.state_dict()
    assert target["cfg"] == cfg and isinstance(target["cfg"]["betas"], tuple)
    assert target["step"] == 3
    # training goes on bitwise as it would have
    seed_all(9)
    a = [step(model, opt, sched) for _ in range(3)]
    seed_all(9)
    b = [step(model2, opt2, sched2) for _ in range(3)]
    assert a == b


def test_missing_names_are_an_error_extra_ones_are_added(tmp_path: Path) -> None:
    ckptfmt_torch.save({"w": torch.ones(3), "extra": {"n": 1}}, tmp_path / "c")
    with pytest.raises(UsageError, match="no entry 'b'"):
        ckptfmt_torch.load({"w": torch.zeros(3), "b": torch.zeros(3)}, tmp_path / "c")
    target: dict[str, Any] = {"w": torch.zeros(3)}
    ckptfmt_torch.load(target, tmp_path / "c")
    assert target["extra"] == {"n": 1} and torch.equal(target["w"], torch.ones(3))
    with pytest.raises(UsageError, match="shape"):
        ckptfmt_torch.load({"w": torch.zeros(4)}, tmp_path / "c")


def test_training_state_resumes_bitwise(tmp_path: Path) -> None:
    """Model, optimizer, scheduler, scaler, counters, RNG and data position: a restored run
    trains on with exactly the same losses and the same batches."""

    def make(seed: int) -> tuple[Any, Any]:
        model = mlp(seed, torch.bfloat16)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=2)
        sampler = ResumableSampler(40, seed=3)
        ts = TrainingState(
            model,
            opt,
            scheduler=sched,
            scaler=scaler,
            sampler=sampler,
            counters={"step": 0, "tokens": 0},
        )
        loader = torch.utils.data.DataLoader(
            torch.arange(40), batch_size=4, sampler=sampler, generator=torch.Generator()
        )
        return ts, loader

    def train(ts: Any, loader: Any, n: int) -> list[Any]:
        out = []
        for batch in loader:
            loss = step(ts.model, ts.optimizers[0], ts.scheduler, ts.scaler)
            ts.counters["step"] += 1
            ts.counters["tokens"] += int(batch.numel())
            out.append((loss, batch.tolist()))
            if len(out) == n:
                break
        return out

    seed_all(0)
    ts, loader = make(0)
    train(ts, loader, 4)
    ckptfmt_torch.save({"train": ts}, tmp_path / "c", step=4)
    after = train(ts, loader, 4)
    seed_all(5)  # the restart's own seeding
    ts2, loader2 = make(1)
    ckptfmt_torch.load({"train": ts2}, tmp_path / "c")
    assert ts2.counters == {"step": 4, "tokens": 16}
    assert ts2.sampler.state_dict() == {
        "kind": "global",
        "epoch": 0,
        "consumed": 16,
        "length": 40,
        "seed": 3,
        "shuffle": True,
        "world_size": 1,
    }
    assert ts2.scaler.get_scale() == 4.0 * 2 * 2  # grew twice: 4 good steps, interval 2
    assert train(ts2, loader2, 4) == after


def test_rng_state_round_trip(tmp_path: Path) -> None:
    def draws() -> Any:
        return torch.rand(4).tolist(), np.random.standard_normal(3).tolist(), random.random()

    ckptfmt_torch.save({"train": TrainingState()}, tmp_path / "c")  # generators only
    want = draws()
    ckptfmt_torch.load({"train": TrainingState()}, tmp_path / "c")  # sets them
    assert draws() == want
    loaded: dict[str, Any] = {}  # or by hand, from a plain load
    ckptfmt_torch.load(loaded, tmp_path / "c")
    ckptfmt_torch.set_rng_state(loaded["train"]["rng"])
    assert draws() == want
    m = ckptfmt.open(tmp_path / "c").manifest
    kinds = {"/".join(e.name): type(e).__name__ for e in m.entries}
    assert kinds["train/rng/torch"] == "TensorEntry"
    assert kinds["train/rng/python/meta"] == "PerRankValueEntry"
    assert all(t.per_rank for t in m.tensors())


def test_dtensor_placements(tmp_path: Path) -> None:
    """A one-rank mesh: replicated DTensors are plain arrays; Partial sums are refused."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        t = bits_tensor(torch.bfloat16, (4, 6))
        for placement in (Replicate(), Shard(0)):
            leaf = ckptfmt_torch.to_state({"w": distribute_tensor(t, mesh, [placement])})["w"]
            assert isinstance(leaf, np.ndarray) and leaf.tobytes() == tensor_to_numpy(t).tobytes()
        partial = DTensor.from_local(t, mesh, [Partial()])
        with pytest.raises(UnsupportedValueError, match="placement"):
            ckptfmt_torch.to_state({"w": partial})
        target = {"w": distribute_tensor(torch.zeros(4, 6, dtype=torch.bfloat16), mesh, [Shard(0)])}
        ckptfmt_torch.save({"w": distribute_tensor(t, mesh, [Shard(0)])}, tmp_path / "c")
        ckptfmt_torch.load(target, tmp_path / "c")
        assert same_bits(target["w"].to_local(), t)
    finally:
        dist.destroy_process_group()


def test_same_tensors_as_torch_distributed_checkpoint(tmp_path: Path) -> None:
    """The same state through DCP and through ckptfmt: both load back the same bits."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = mlp(0, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        step(model, opt)
    msd, osd = get_state_dict(model, opt)
    extra = {"f8": bits_tensor(torch.float8_e5m2, (7, 3)), "h": bits_tensor(torch.float16, (5,))}
    dcp.save({"model": msd, "optim": osd, **extra}, checkpoint_id=tmp_path / "dcp")
    ckptfmt_torch.save({"model": msd, "optim": osd, **extra}, tmp_path / "ck")

    def fresh() -> tuple[Any, Any, dict[str, Any]]:
        m = mlp(1, torch.bfloat16)
        o = torch.optim.AdamW(m.parameters(), lr=1e-2)
        ms, os_ = get_state_dict(m, o)
        return (
            m,
            o,
            {
                "model": ms,
                "optim": os_,
                "f8": torch.zeros(7, 3, dtype=torch.float8_e5m2),
                "h": torch.zeros(5, dtype=torch.float16),
            },
        )

    m1, o1, via_dcp = fresh()
    dcp.load(via_dcp, checkpoint_id=tmp_path / "dcp")
    set_state_dict(m1, o1, model_state_dict=via_dcp["model"], optim_state_dict=via_dcp["optim"])
    m2, o2, via_ck = fresh()
    ckptfmt_torch.load(via_ck, tmp_path / "ck")
    set_state_dict(m2, o2, model_state_dict=via_ck["model"], optim_state_dict=via_ck["optim"])
    flat_dcp = flat_tensors({"model": m1.state_dict(), "optim": o1.state_dict()["state"], **extra})
    flat_ck = flat_tensors(
        {
            "model": m2.state_dict(),
            "optim": o2.state_dict()["state"],
            "f8": via_ck["f8"],
            "h": via_ck["h"],
        }
    )
    flat_orig = flat_tensors(
        {"model": model.state_dict(), "optim": opt.state_dict()["state"], **extra}
    )
    assert flat_dcp.keys() == flat_ck.keys() == flat_orig.keys() and len(flat_ck) == 4 + 4 * 3 + 2
    for k in flat_orig:
        assert same_bits(flat_ck[k], flat_orig[k]), k
        assert same_bits(flat_dcp[k], flat_ck[k]), k


def flat_tensors(tree: Any, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}/{k}"
        if isinstance(v, torch.Tensor):
            out[name] = v
        elif isinstance(v, dict):
            out.update(flat_tensors(v, name))
    return out


# --- the checkpoint without torch ----------------------------------------------------------------

READER = textwrap.dedent(
    """
    import hashlib, json, sys
    import numpy as np
    import zarr
    import ckptfmt

    ck = ckptfmt.open(sys.argv[1])
    out = {"ckptfmt": {}, "zarr": {}, "values": {}}
    for name, view in ck.tensors().items():
        data = np.ascontiguousarray(view.read())
        out["ckptfmt"][name] = [list(view.shape), view.dtype.name,
                                hashlib.sha256(data.tobytes()).hexdigest()]
    for name in ck.keys():
        if name not in out["ckptfmt"]:
            out["values"][name] = ck[name]
    group = zarr.open_group(sys.argv[1], mode="r")
    for name, node in group.members(max_depth=None):
        if isinstance(node, zarr.Array):
            data = np.ascontiguousarray(node[...])
            out["zarr"][name] = [list(node.shape), str(data.dtype),
                                 hashlib.sha256(data.tobytes()).hexdigest()]
    out["torch_imported"] = "torch" in sys.modules
    print(json.dumps(out))
    """
)


def test_checkpoint_opens_without_torch(tmp_path: Path) -> None:
    model = mlp(0)
    opt = torch.optim.AdamW(model.parameters())
    step(model, opt)
    state = {
        "model": model,
        "optim": opt,
        "lowp": {str(d).split(".")[1]: bits_tensor(d, (3, 5), i) for i, d in enumerate(FLOATS)},
        "step": 1,
    }
    ckptfmt_torch.save(state, tmp_path / "c", step=1)
    want = {}
    for name, leaf in ckptfmt.tree.state.flatten(ckptfmt_torch.to_state(state)):
        if isinstance(leaf, np.ndarray):
            data = np.ascontiguousarray(leaf)
            want["/".join(name)] = [
                list(leaf.shape),
                leaf.dtype.name,
                hashlib.sha256(data.tobytes()).hexdigest(),
            ]
    done = subprocess.run(
        [sys.executable, "-c", READER, str(tmp_path / "c")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["torch_imported"] is False
    assert got["ckptfmt"] == want
    assert got["zarr"] == want
    assert "model/0.weight" in want and "optim/state/0/exp_avg" in want
    assert want["lowp/bfloat16"][1] == "bfloat16" and want["lowp/float8_e5m2"][1] == "float8_e5m2"
    assert got["values"]["step"] == 1
    # param_groups hold a tuple (betas): a list container, its groups name levels
    assert got["values"]["optim/param_groups/0/params"] == [0, 1, 2, 3]


# --- the data-loader position ---------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize(("n", "replicas"), [(23, 4), (24, 3), (5, 2)])
def test_sampler_order_is_distributed_samplers(
    n: int, replicas: int, shuffle: bool, drop_last: bool
) -> None:
    from torch.utils.data import DistributedSampler

    for rank in range(replicas):
        ours = ResumableSampler(
            n, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=11, drop_last=drop_last
        )
        theirs = DistributedSampler(
            range(n),
            num_replicas=replicas,
            rank=rank,
            shuffle=shuffle,
            seed=11,
            drop_last=drop_last,
        )
        for epoch in range(3):
            theirs.set_epoch(epoch)
            ours.set_epoch(epoch)
            assert list(ours) == list(theirs), (rank, epoch)


def test_sampler_resumes_on_the_next_batch() -> None:
    """Cut anywhere (mid-epoch, at an epoch's end), restored from the JSON of its state, the
    sampler continues with exactly the batches an uninterrupted one gives."""

    def batches(s: ResumableSampler, k: int) -> list[list[int]]:
        out: list[list[int]] = []
        while len(out) < k:  # one DataLoader pass per epoch, as a training loop does
            for b in torch.utils.data.DataLoader(torch.arange(30), batch_size=4, sampler=s):
                out.append(b.tolist())
                if len(out) == k:
                    break
        return out

    def sampler() -> ResumableSampler:
        return ResumableSampler(30, num_replicas=2, rank=1, seed=2)

    full = batches(sampler(), 13)  # 15 indices a rank: batches of 4, 4, 4, 3 per epoch
    assert len({tuple(b) for b in full[:4]} | {tuple(b) for b in full[4:8]}) == 8
    assert full[:4] != full[4:8]  # each epoch its own order
    for cut in range(13):
        s = sampler()
        head = batches(s, cut)
        saved = json.loads(json.dumps(s.state_dict()))
        r = sampler()
        r.load_state_dict(saved)
        assert head + batches(r, 13 - cut) == full, cut
