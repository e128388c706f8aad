"""``ckptfmt_torch.FencedSaver``: the copy of parameters and optimizer state overlaps the next
forward and backward pass, ``optimizer.step()`` waits for it, and a state changed in place
before that step is refused, never committed as a mix of two states."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import ckptfmt_torch
import pytest
import torch
from kit.managers import node_manager

from ckptfmt import CheckpointWarning
from ckptfmt.errors import StateChangedError, UsageError
from ckptfmt.storage.steps import step_dir_name

pytestmark = pytest.mark.torch


def model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
    )
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)  # BatchNorm updates its buffers here
    loss.backward()
    opt.step()  # the fence
    opt.zero_grad()


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, (p, st) in enumerate(opt.state.items()):
        del p
        out.update({f"optim/{i}/{k}": v.clone() for k, v in st.items()})
    return out


def restored(path: Path) -> dict[str, torch.Tensor]:
    model, opt = model_and_optimizer(seed=99)  # other values everywhere
    train_step(model, opt, 12345)  # the optimizer's state exists, as after any step
    ckptfmt_torch.load({"model": model, "optim": opt}, path)
    return snapshot(model, opt)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_each_checkpoint_holds_the_state_of_its_save_call(tmp_path: Path) -> None:
    model, opt = model_and_optimizer()
    mgr = node_manager(tmp_path, shared=None, keep_local=10)
    saver = ckptfmt_torch.FencedSaver(mgr, opt)
    expected: dict[int, dict[str, torch.Tensor]] = {}
    for step in range(6):
        train_step(model, opt, step)  # waits for the previous save's copy at opt.step()
        expected[step] = snapshot(model, opt)
        saver.save(step, {"model": model, "optim": opt})
    train_step(model, opt, 6)  # the last copy overlaps a step too
    saver.close()
    mgr.close()
    assert len(saver.blocked_s) == 6
    for step, want in expected.items():
        # BatchNorm's running statistics changed in every forward pass after a save: they
        # were copied before save() returned (a background copy would have been refused)
        assert_same(restored(tmp_path / "l1" / "n0" / step_dir_name(step)), want)


def slow_commit(point: str) -> None:
    if point == "written":
        time.sleep(0.5)  # the fence is reached long before the commit vote


def test_an_in_place_change_before_the_step_is_refused_and_never_committed(
    tmp_path: Path,
) -> None:
    model, opt = model_and_optimizer()
    train_step(model, opt, 0)
    mgr = node_manager(tmp_path, shared=None, keep_local=10, fault=slow_commit, on_error="warn")
    saver = ckptfmt_torch.FencedSaver(mgr, opt)
    saver.save(1, {"model": model, "optim": opt})
    saver.wait()
    before = snapshot(model, opt)
    handle = saver.save(2, {"model": model, "optim": opt})
    with torch.no_grad():
        model[0].weight.mul_(0.5)  # not the optimizer: the fence does not cover this
    with pytest.raises(StateChangedError, match=r"step 2 .*0\.weight") as caught:
        train_step(model, opt, 1)
    assert caught.value.step == 2 and "model/0.weight" in caught.value.names
    assert not caught.value.committed and "was not committed" in str(caught.value)
    assert isinstance(handle.committed.exception(30), Exception)
    with pytest.warns(CheckpointWarning):
        saver.close()
    mgr.close()
    assert sorted(p.name for p in (tmp_path / "l1" / "n0").glob("step-*")) == [step_dir_name(1)]
    assert_same(restored(tmp_path / "l1" / "n0" / step_dir_name(1)), before)


def test_a_closed_saver_removes_its_fence_and_refuses_saves(tmp_path: Path) -> None:
    model, opt = model_and_optimizer()
    mgr = node_manager(tmp_path, shared=None)
    with ckptfmt_torch.FencedSaver(mgr, opt) as saver:
        saver.save(0, {"model": model, "optim": opt})
    assert not opt._optimizer_step_pre_hooks
    with pytest.raises(UsageError, match="closed"):
        saver.save(1, {"model": model, "optim": opt})
    mgr.close()


def test_a_fence_needs_an_optimizer(tmp_path: Path) -> None:
    mgr = node_manager(tmp_path, shared=None)
    bad: Any = torch.nn.Linear(2, 2)
    with pytest.raises(UsageError, match="optimizer"):
        ckptfmt_torch.FencedSaver(mgr, bad)
    mgr.close()


def test_a_change_seen_only_after_the_commit_says_to_delete_that_checkpoint(
    tmp_path: Path,
) -> None:
    model, opt = model_and_optimizer()
    train_step(model, opt, 0)
    mgr = node_manager(tmp_path, shared=None, keep_local=10)
    saver = ckptfmt_torch.FencedSaver(mgr, opt)
    handle = saver.save(1, {"model": model, "optim": opt})
    assert handle.result(30) == 1  # committed before the loop reaches the fence
    with torch.no_grad():
        model[3].bias.zero_()
    with pytest.raises(StateChangedError, match=r"CheckpointManager.delete\(1\)") as e:
        train_step(model, opt, 1)
    assert e.value.committed and e.value.names == ("model/3.bias",)
    saver.close()
    mgr.close()


@pytest.mark.parametrize("in_flight", [1, 2])
def test_with_skip_the_fence_never_waits_for_a_copy_not_begun(
    tmp_path: Path, in_flight: int
) -> None:
    """A save at every step while each write lasts 0.5 s, ``when_busy="skip"``: a save that
    finds no slot is skipped at its call, and with two in flight one queued behind a write is
    given up at the fence (its copy has not begun) instead of waited for; the loop is never
    kept long. Every save is committed or skipped (counted, on its handle), and every
    committed step kept restores to the state of its ``save`` call, bit for bit."""
    model, opt = model_and_optimizer()
    mgr = node_manager(
        tmp_path,
        shared=None,
        keep_local=20,
        fault=slow_commit,
        saves_in_flight=in_flight,
        when_busy="skip",
    )
    saver = ckptfmt_torch.FencedSaver(mgr, opt)
    expected: dict[int, dict[str, torch.Tensor]] = {}
    handles = []
    for step in range(10):
        train_step(model, opt, step)  # the fence: gives up a save whose copy has not begun
        expected[step] = snapshot(model, opt)
        handles.append(saver.save(step, {"model": model, "optim": opt}))
        time.sleep(0.05)
    train_step(model, opt, 10)
    saver.close()
    mgr.close()
    skipped = [h.step for h in handles if h.skipped()]
    committed = [h.step for h in handles if h.committed.exception() is None]
    assert len(skipped) + len(committed) == 10 and skipped and committed[0] == 0
    assert mgr.saves_skipped == len(skipped) and mgr.failed_saves == []
    reasons = " ".join(r.error or "" for r in mgr.save_reports if r.skipped)
    if in_flight == 2:
        assert "SaveHandle.abandon" in reasons, reasons  # given up at the fence
    assert max(saver.blocked_s) < 0.25, saver.blocked_s
    for step in committed:
        assert_same(restored(tmp_path / "l1" / "n0" / step_dir_name(step)), expected[step])


def test_the_plan_follows_the_state_when_its_memory_moves(tmp_path: Path) -> None:
    """The plan kept from save to save (which tensors the optimizer covers) is made again when
    the state moves: a parameter given new memory (``p.data = ...``), the optimizer's state
    replaced by ``load_state_dict``. Every checkpoint still holds its save call's state, and a
    change outside the optimizer to the moved tensors is still refused."""
    model, opt = model_and_optimizer()
    mgr = node_manager(tmp_path, shared=None, keep_local=10, fault=slow_commit, on_error="warn")
    saver = ckptfmt_torch.FencedSaver(mgr, opt)
    expected: dict[int, dict[str, torch.Tensor]] = {}
    for step in range(6):
        train_step(model, opt, step)
        if step == 2:
            with torch.no_grad():
                model[0].weight.data = model[0].weight.data.clone() + 1  # new memory
        if step == 4:
            opt.load_state_dict(opt.state_dict() | {})  # new state tensors (copies)
        expected[step] = snapshot(model, opt)
        saver.save(step, {"model": model, "optim": opt})
    with torch.no_grad():
        model[0].weight.add_(1.0)  # the moved parameter, outside the optimizer
    with pytest.raises(StateChangedError, match=r"0\.weight"):
        train_step(model, opt, 6)
    with pytest.warns(CheckpointWarning):
        saver.close()
    mgr.close()
    for step in range(5):
        assert_same(restored(tmp_path / "l1" / "n0" / step_dir_name(step)), expected[step])
    assert not (tmp_path / "l1" / "n0" / step_dir_name(5)).exists()


def test_a_parameter_saved_itself_and_given_new_memory_is_saved_from_its_new_memory(
    tmp_path: Path,
) -> None:
    """A state dict holding the parameters themselves (not ``model.state_dict()``'s fresh
    detached tensors): ``p.data = ...`` (EMA weights swapped in, say) gives the same object new
    memory. The plan is made again for it, so the checkpoint holds the new values, not the old
    memory's (which a plan kept by the tensor's identity went on saving)."""
    model, opt = model_and_optimizer()
    mgr = node_manager(tmp_path, shared=None, keep_local=10)
    saver = ckptfmt_torch.FencedSaver(mgr, opt)
    params = dict(model.named_parameters())
    expected: dict[int, dict[str, torch.Tensor]] = {}
    for step in range(4):
        train_step(model, opt, step)
        if step == 2:
            with torch.no_grad():
                for p in params.values():
                    p.data = torch.full_like(p, 7.0) + p  # new memory, other values
        expected[step] = {k: p.detach().clone() for k, p in params.items()}
        saver.save(step, {"params": params})
    train_step(model, opt, 4)
    saver.close()
    mgr.close()
    for step, want in expected.items():
        other, _ = model_and_optimizer(seed=99)
        got = dict(other.named_parameters())
        ckptfmt_torch.load({"params": got}, tmp_path / "l1" / "n0" / step_dir_name(step))
        for k in want:
            assert torch.equal(got[k].detach(), want[k]), (step, k)


def test_without_optimizers_every_optimizer_is_a_fence(tmp_path: Path) -> None:
    """``optimizers=None``: the optimizers are learnt from their steps (a global step pre-hook);
    a save before any step copies everything before it returns."""
    model, opt = model_and_optimizer()
    mgr = node_manager(tmp_path, shared=None, keep_local=10)
    saver = ckptfmt_torch.FencedSaver(mgr, None)
    expected: dict[int, dict[str, torch.Tensor]] = {}
    expected[0] = snapshot(model, opt)
    saver.save(0, {"model": model, "optim": opt})  # no optimizer known: all copied now
    for step in range(1, 5):
        train_step(model, opt, step)
        expected[step] = snapshot(model, opt)
        saver.save(step, {"model": model, "optim": opt})
    with torch.no_grad():
        model[3].bias.zero_()
    with pytest.raises(StateChangedError, match=r"3\.bias"):
        train_step(model, opt, 5)
    with pytest.warns(CheckpointWarning):
        saver.close()
    train_step(model, opt, 6)  # the global hook is gone
    mgr.close()
    assert (tmp_path / "l1" / "n0" / step_dir_name(0)).is_dir()  # no optimizer state yet
    for step in range(1, 4):
        assert_same(restored(tmp_path / "l1" / "n0" / step_dir_name(step)), expected[step])


def test_a_step_with_a_closure_is_fenced_after_the_closure(tmp_path: Path) -> None:
    """``optimizer.step(closure)`` (Lightning's way: forward and backward inside the step): the
    fence is passed when the closure returns, before the update, so the copy overlaps the
    forward and backward; the checkpoints hold their save call's state, and a change the
    closure makes to a parameter outside the optimizer is still refused."""
    model, opt = model_and_optimizer()
    mgr = node_manager(tmp_path, shared=None, keep_local=10, fault=slow_commit, on_error="warn")
    saver = ckptfmt_torch.FencedSaver(mgr, opt)
    order: list[str] = []
    original = saver._pass_fence

    def noting(give_up: bool = True) -> None:
        order.append("fence")
        original(give_up)

    saver._pass_fence = noting  # type: ignore[method-assign]  # notes when it runs, no more

    def closure_of(seed: int, mutate: bool = False) -> Any:
        def closure() -> torch.Tensor:
            order.append("closure")
            opt.zero_grad()
            g = torch.Generator().manual_seed(seed)
            x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if mutate:
                with torch.no_grad():
                    model[3].weight.mul_(2.0)
            return loss

        return closure

    expected: dict[int, dict[str, torch.Tensor]] = {}
    for step in range(4):
        opt.step(closure_of(step))
        expected[step] = snapshot(model, opt)
        order.clear()
        saver.save(step, {"model": model, "optim": opt})
    opt.step(closure=closure_of(4))
    assert order == ["fence", "closure", "fence"]  # save's own check, then after the closure
    saver.save(5, {"model": model, "optim": opt})
    with pytest.raises(StateChangedError, match=r"3\.weight"):
        opt.step(closure_of(6, mutate=True))
    with pytest.warns(CheckpointWarning):
        saver.close()
    mgr.close()
    for step in range(4):
        assert_same(restored(tmp_path / "l1" / "n0" / step_dir_name(step)), expected[step])
    assert not (tmp_path / "l1" / "n0" / step_dir_name(5)).exists()
