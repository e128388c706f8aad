"""Staging for the training loop: buffers reused across saves and managers, the order
of staging and mutation (copy now, background copy, donate), save handles, and PyTorch staging
(pinned device-to-host copies on a side stream where CUDA exists; the same path on CPU here)."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit.managers import node_manager

import ckptfmt
from ckptfmt import CheckpointManager, CheckpointWarning
from ckptfmt.errors import SaveFailedError, UsageError
from ckptfmt.parallel.collective.staging import BufferPool, SaveHandle, default_pool
from ckptfmt.storage.steps import step_dir_name


def state(seed: int, n: int = 4, size: int = 4096) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "w": {str(i): rng.standard_normal(size).astype(np.float32) for i in range(n)},
        "step": seed,
    }


def manager(tmp_path: Path, **kw: Any) -> CheckpointManager:
    """A manager of level 1 only (nothing flushed to level 3 behind the staging measured)."""
    return node_manager(tmp_path, shared=None, **kw)


def on_disk(tmp_path: Path, step: int) -> dict[str, Any]:
    return ckptfmt.load(tmp_path / "l1" / "n0" / step_dir_name(step))


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a["w"][k].tobytes() == b["w"][k].tobytes() for k in b["w"])


# --- buffer reuse ---------------------------------------------------------------------------------


def test_staging_buffers_are_the_same_memory_in_every_save(tmp_path: Path) -> None:
    pool = BufferPool()
    mgr = manager(tmp_path, pool=pool)
    mgr.save(1, state(1)).result()
    first = sorted(pool.free_addresses())
    assert len(first) == 4 and pool.made == 4
    seen: list[list[int]] = []
    # while the second save runs, its buffers are out of the pool: the same ones as before
    mgr.save(2, state(2), ready=lambda: seen.append(sorted(pool.free_addresses()))).result()
    assert seen == [[]]
    assert sorted(pool.free_addresses()) == first
    assert pool.made == 4 and pool.reused == 4
    assert same(on_disk(tmp_path, 2), state(2))
    mgr.close()


def test_a_second_manager_reuses_the_first_managers_buffers(tmp_path: Path) -> None:
    pool = BufferPool()
    one = manager(tmp_path / "a", pool=pool)
    one.save(1, state(1)).result()
    one.close()
    addresses = sorted(pool.free_addresses())
    two = manager(tmp_path / "b", pool=pool)
    two.save(1, state(5)).result()
    two.close()
    assert sorted(pool.free_addresses()) == addresses and pool.made == 4
    assert same(on_disk(tmp_path / "b", 1), state(5))


def test_managers_share_the_default_pool_and_never_one_buffer_at_once(tmp_path: Path) -> None:
    pool = default_pool()
    pool.clear()
    a, b = manager(tmp_path / "a"), manager(tmp_path / "b")
    gate = threading.Event()
    held: list[int] = []
    ha = a.save(1, state(1), ready=gate.wait)  # a's buffers stay out until the gate opens
    held = sorted(set(pool.free_addresses()))
    hb = b.save(1, state(2))  # meanwhile b needs buffers of the same shapes: new ones
    hb.result()
    gate.set()
    ha.result()
    assert held == []  # nothing free while a holds its buffers
    assert len(pool.free_addresses()) == 8  # both sets came back, distinct memory
    assert len(set(pool.free_addresses())) == 8
    assert same(on_disk(tmp_path / "a", 1), state(1)) and same(on_disk(tmp_path / "b", 1), state(2))
    a.close()
    b.close()
    pool.clear()


def test_a_pool_over_its_budget_drops_what_comes_back() -> None:
    pool = BufferPool(max_free_bytes=100)
    bufs = [pool.take((10,), np.float32), pool.take((10,), np.float32)]  # 40 bytes each
    assert all(b.flags.c_contiguous and b.shape == (10,) for b in bufs)
    pool.give([*bufs, pool.take((30,), np.float32)])  # 120 bytes would exceed 100
    assert pool.free_bytes == 80
    with pytest.raises(UsageError):
        BufferPool(max_free_bytes=-1)


# --- ordering of staging and mutation -------------------------------------------------------------


def test_mutation_after_staged_never_reaches_the_checkpoint(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    for mode in ({}, {"background_copy": True}):
        s = state(3, n=64, size=16384)  # 4 MiB in 64 arrays: the copy takes a while
        expected = {"w": {k: v.copy() for k, v in s["w"].items()}}
        step = 10 if mode else 11
        h = mgr.save(step, s, **mode)
        assert h.wait_staged(30)
        for v in s["w"].values():
            v += 1.0  # the optimizer step, as soon as the handle allows it
        assert h.result(60) == step
        assert same(on_disk(tmp_path, step), expected), mode
    mgr.close()


def test_background_copy_returns_before_the_copy_and_staged_follows_it(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    gate = threading.Event()
    s = state(4)
    h = mgr.save(4, s, background_copy=True, ready=gate.wait)
    assert not h.staged.done() and not h.done()  # the saver thread has not copied yet
    gate.set()
    assert h.wait_staged(30)
    for v in s["w"].values():
        v *= -1
    assert h.result(30) == 4
    assert same(on_disk(tmp_path, 4), state(4))
    mgr.close()


def test_donate_skips_the_copy_and_is_staged_only_when_the_save_is_done(tmp_path: Path) -> None:
    pool = BufferPool()
    mgr = manager(tmp_path, pool=pool)
    gate = threading.Event()
    s = state(6)
    h = mgr.save(6, s, donate=True, ready=gate.wait)
    assert not h.staged.done()
    gate.set()
    assert h.wait_staged(30)
    assert h.committed.done()  # the writer was reading the caller's arrays until the end
    for v in s["w"].values():
        v += 7
    assert same(on_disk(tmp_path, 6), state(6))
    assert pool.made == 0  # no staging buffer was made
    with pytest.raises(UsageError, match="one of them"):
        mgr.save(7, s, donate=True, background_copy=True)
    mgr.close()


# --- handles --------------------------------------------------------------------------------------


def check_handle_order(mgr: CheckpointManager, tmp_path: Path, kw: dict[str, Any]) -> None:
    order: list[str] = []
    seen: list[int] = []
    called = threading.Event()
    step = len(mgr.steps()) + 1
    h = mgr.save(step, state(step), **kw)
    h.staged.add_done_callback(lambda f: order.append("staged"))

    def committed(f: Any) -> None:
        order.append("committed")
        seen.append(mgr.latest().step)
        called.set()

    h.committed.add_done_callback(committed)
    assert isinstance(h, SaveHandle) and h.result(30) == step and h.done()
    assert mgr.latest().step == step
    assert called.wait(30)
    assert order == ["staged", "committed"], kw
    assert seen == [step]  # committed: latest() shows it already
    assert ckptfmt.verify(tmp_path / "l1" / "n0" / step_dir_name(step)).healthy
    staged, done = h  # the (stage_future, write_future) pair
    assert staged.done() and done.result() == step


def test_staged_completes_before_committed_and_committed_means_on_disk(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    for kw in ({}, {"background_copy": True}, {"donate": True}):
        check_handle_order(mgr, tmp_path, kw)
    mgr.close()


def test_a_failed_save_makes_the_handle_raise_and_still_warns(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    mgr.save(1, state(1)).result()
    blocker = tmp_path / "l1" / "n0" / step_dir_name(2)
    blocker.write_text("not a directory")  # the save cannot create its step directory
    h = mgr.save(2, state(2))
    assert h.wait(30)  # wait never raises
    with pytest.raises(SaveFailedError) as err:
        h.result()
    assert err.value.rank_failures
    assert h.staged.done()
    with pytest.warns(CheckpointWarning, match="step 2"):
        mgr.wait()  # reported by the next call as before
    assert mgr.latest().step == 1
    blocker.unlink()
    mgr.close()


def test_a_failure_in_ready_fails_the_save(tmp_path: Path) -> None:
    mgr = manager(tmp_path)

    def broken() -> None:
        raise RuntimeError("device copy failed")

    h = mgr.save(3, state(3), ready=broken)
    with pytest.raises(SaveFailedError, match="device copy failed"):
        h.result(30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mgr.wait()
    assert mgr.latest() is None
    mgr.close()


def test_result_times_out_while_the_save_waits(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    gate = threading.Event()
    h = mgr.save(1, state(1), ready=gate.wait)
    assert not h.wait(0.05)
    with pytest.raises(TimeoutError):
        h.result(0.05)
    gate.set()
    assert h.result(30) == 1
    mgr.close()


# --- PyTorch --------------------------------------------------------------------------------------

torch = pytest.importorskip("torch")
ckptfmt_torch = pytest.importorskip("ckptfmt_torch")
from ckptfmt_torch.staging import TorchStager, save_async  # noqa: E402

CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"
)


def torch_state(seed: int, device: str = "cpu") -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "bf16": torch.randn(257, 33, generator=g).to(torch.bfloat16).to(device),
        "f8": torch.randn(1000, generator=g).to(torch.float8_e4m3fn).to(device),
        "f32": torch.randn(64, 64, generator=g).to(device),
        "nested": {"i64": torch.arange(10).to(device)},
        "count": seed,
    }


def bits(t: Any) -> bytes:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    elif t.dtype.itemsize == 1 and t.dtype.is_floating_point:
        t = t.view(torch.uint8)
    return bytes(t.contiguous().numpy().tobytes())


def assert_bit_exact(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k in ("bf16", "f8", "f32"):
        assert a[k].dtype == b[k].dtype and bits(a[k]) == bits(b[k]), k
    assert bits(a["nested"]["i64"]) == bits(b["nested"]["i64"])


def roundtrip(tmp_path: Path, device: str, background: bool) -> None:
    stager = TorchStager()
    mgr = manager(tmp_path)
    sd = torch_state(1, device)
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    expected["nested"] = {"i64": sd["nested"]["i64"].clone()}
    h = save_async(mgr, 5, sd, stager, background_copy=background)
    assert h.wait_staged(30)
    with torch.no_grad():  # the next optimizer step, on the current stream
        sd["f32"].add_(1.0)
        sd["bf16"].mul_(2)
    assert h.result(30) == 5
    mgr.close()
    target = torch_state(2, device)  # other values: all overwritten in place
    keep = target["bf16"]
    fresh = manager(tmp_path)
    assert ckptfmt_torch.restore(target, fresh).step == 5
    assert target["bf16"] is keep and target["bf16"].device.type == device
    assert_bit_exact(target, expected)
    assert target["count"] == 1
    fresh.close()


@pytest.mark.parametrize("background", [False, True])
def test_torch_staging_round_trip_is_bit_exact_on_cpu(tmp_path: Path, background: bool) -> None:
    roundtrip(tmp_path, "cpu", background)


def test_torch_stager_reuses_its_buffers_across_saves(tmp_path: Path) -> None:
    stager = TorchStager()
    mgr = manager(tmp_path)
    sd = torch_state(1)
    save_async(mgr, 1, sd, stager).result(30)
    _, _, first = stager.stage(sd)
    pointers = sorted(b.data_ptr() for b in first)
    stager.release(first)
    save_async(mgr, 2, sd, stager).result(30)
    _, _, second = stager.stage(sd)
    assert sorted(b.data_ptr() for b in second) == pointers
    assert stager.made == len(first)
    stager.release(second)
    mgr.close()


def test_torch_background_copy_waits_for_the_saver_thread(tmp_path: Path) -> None:
    stager = TorchStager()
    mgr = manager(tmp_path)
    sd = torch_state(3)
    _, event, taken = stager.stage(sd, background_copy=True)
    assert not event.done()  # the CPU copies wait for wait()
    event.wait()
    assert event.done()
    stager.release(taken)
    mgr.close()


def test_map_location_places_tensors_only_the_checkpoint_has(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    save_async(mgr, 1, torch_state(1)).result(30)
    mgr.close()
    fresh = manager(tmp_path)
    target: dict[str, Any] = {"f32": torch.zeros(64, 64)}
    placed: list[str] = []

    def where(name: str) -> str:
        placed.append(name)
        return "cpu"

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ckptfmt_torch.restore(target, fresh, map_location=where).step == 1
    assert sorted(placed) == ["bf16", "f8", "nested/i64"]
    assert bits(target["bf16"]) == bits(torch_state(1)["bf16"])
    fresh.close()


@CUDA
@pytest.mark.parametrize("background", [False, True])
def test_cuda_staging_round_trip_is_bit_exact(tmp_path: Path, background: bool) -> None:
    roundtrip(tmp_path, "cuda", background)


@CUDA
def test_cuda_staging_uses_pinned_buffers_and_waits_for_queued_kernels(tmp_path: Path) -> None:
    stager = TorchStager()
    assert stager.pin_memory
    x = torch.zeros(4096, 4096, device="cuda")
    # a long kernel chain queued on the current stream: staging must see its final result
    for _ in range(20):
        x.add_(1.0)
    host, event, taken = stager.stage({"x": x})
    assert all(b.is_pinned() for b in taken)
    event.wait()
    assert float(np.asarray(host["x"]).min()) == 20.0
    x.add_(1.0)  # after staged: the host copy keeps 20
    torch.cuda.synchronize()
    assert float(np.asarray(host["x"]).max()) == 20.0
    stager.release(taken)


@CUDA
def test_cuda_map_location_moves_new_tensors_to_the_device(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    save_async(mgr, 1, torch_state(1, "cuda")).result(30)
    mgr.close()
    fresh = manager(tmp_path)
    target: dict[str, Any] = {"f32": torch.zeros(64, 64)}  # a CPU model loads a GPU checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ckptfmt_torch.restore(target, fresh, map_location="cuda").step == 1
    assert target["f32"].device.type == "cpu" and target["bf16"].device.type == "cuda"
    assert bits(target["bf16"]) == bits(torch_state(1)["bf16"])
    fresh.close()


def test_torch_staging_of_modules_optimizers_and_dtensors(tmp_path: Path) -> None:
    """Statefuls go through their state_dict(), DTensors by their local shard (a one-rank mesh):
    the restored model, optimizer and DTensor are bit-exact, mutated after staged or not."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard as ShardPlacement
    from torch.distributed.tensor import distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 8).to(torch.bfloat16)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.randn(4, 16, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
        d = distribute_tensor(torch.randn(6, 4), mesh, [ShardPlacement(0)])
        want_w = bits(model.weight)
        want_m = bits(opt.state[model.weight]["exp_avg"])
        want_d = bits(d.to_local())
        mgr = manager(tmp_path / "m")
        h = save_async(mgr, 1, {"model": model, "optim": opt, "d": d}, TorchStager())
        assert h.wait_staged(30)
        opt.step()  # changes the weights and the moments in place
        with torch.no_grad():
            d.to_local().add_(1.0)
        assert h.result(30) == 1
        mgr.close()
        assert bits(model.weight) != want_w
        fresh = manager(tmp_path / "m")
        assert ckptfmt_torch.restore({"model": model, "optim": opt, "d": d}, fresh).step == 1
        fresh.close()
        assert bits(model.weight) == want_w
        assert bits(opt.state[model.weight]["exp_avg"]) == want_m
        assert bits(d.to_local()) == want_d
    finally:
        dist.destroy_process_group()
