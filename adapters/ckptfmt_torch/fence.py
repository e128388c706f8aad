"""Saves whose copy overlaps the next forward and backward pass, fenced at the optimizer's step.

    saver = ckptfmt_torch.FencedSaver(mgr, optimizer)   # once; hooks optimizer.step
    for step in range(steps):
        loss = model(batch).sum()
        loss.backward()
        optimizer.step()          # the fence: waits (if at all) for the last save's copy
        optimizer.zero_grad()
        if step % every == 0:
            saver.save(step, {"train": ts})             # returns at once
    saver.close()                 # the last save committed, the hook removed

Parameters and optimizer state change only in ``optimizer.step()`` (DataStates-LLM's
observation), so their copy into the stager's host buffers runs on the saver thread while the
next forward and backward run, and the step waits only for what is not copied yet: ``save``
blocks for the walk of the state and the copy of everything else. Everything else is what the
forward pass may change (module buffers: BatchNorm's running statistics; counters; RNG states),
and is small: it is copied before ``save`` returns (on a CUDA device, on the current stream,
ahead of the kernels queued after it).

What is guaranteed, and what is detected:

- The checkpoint of step ``s`` holds the state as it was when ``save(s, ...)`` was called, if
  nothing changes a parameter or an optimizer tensor in place before the optimizer's next step.
- A change made through the tensor (an in-place op on it or on a view of it: PyTorch's version
  counter) before the step is detected: once the copy is done (the save fails on every rank and
  nothing is committed) and again at the fence, which raises :class:`StateChangedError`
  there, naming the tensors. A change seen only at the fence vetoes the commit if the save has
  not committed yet; where it has, the error says that step ``s``'s checkpoint may mix states.
- Not detected: a write through ``tensor.data`` or through another tensor sharing the memory
  under another version counter (e.g. from ``numpy()`` or DLPack), or by another thread.
  Make such changes after the optimizer's step, or save with the copy made before ``save``
  returns (``CheckpointManager.save`` without ``background_copy``).

Host memory: one staging copy per save in flight, reused from save to save (the stager's
buffers). Several optimizers: pass them all; the first step of any of them is the fence.

A manager with ``when_busy="skip"`` (``ckptfmt.ManagerSettings``): the fence never waits for a
copy that has not begun (its save is queued behind one still writing); it gives that save up
(``SaveHandle.abandon``), and the save is skipped on every rank, counted in the manager's
``saves_skipped`` and logged. It still waits for a copy that has begun: every rank's saver had
reached the save, and the copy is as long as the state's bytes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ckptfmt import CheckpointManager
from ckptfmt.errors import StateChangedError, UsageError
from ckptfmt.parallel import SaveHandle
from ckptfmt_torch.staging import TorchStager, save_async

__all__ = ["FencedSaver"]


class _Watch:
    """The tensors one save copies behind the caller's back, with their version counters as
    they were at ``save``; which of them changed since."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.tensors: list[tuple[str, torch.Tensor, int]] = []
        self.veto: list[str] | None = None  # set at the fence: the commit must not happen
        self.lock = threading.Lock()

    def changed(self) -> list[str]:
        return [name for name, t, v in self.tensors if t._version != v]


class FencedSaver:
    """``save`` for a training loop with an optimizer: the copy overlaps the next forward and
    backward pass and ``optimizer.step()`` waits for it (see the module's docstring).

    ``manager``: the :class:`ckptfmt.CheckpointManager` to save with; ``optimizers``: one
    optimizer or several (every parameter of theirs and every tensor of their state is copied
    in the background; all else before ``save`` returns). ``stager``: host buffers reused from
    save to save (a new one by default). ``blocked_s``: per save, the seconds the loop spent in
    ``save`` plus waiting at the fence."""

    def __init__(
        self,
        manager: CheckpointManager,
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        *,
        stager: TorchStager | None = None,
    ) -> None:
        if isinstance(optimizers, torch.optim.Optimizer):
            opts = [optimizers]
        else:
            opts = list(optimizers) if isinstance(optimizers, Sequence) else []
        if not opts or not all(isinstance(o, torch.optim.Optimizer) for o in opts):
            raise UsageError("FencedSaver needs the optimizer(s) whose step is the fence")
        self.manager = manager
        self.optimizers = opts
        self.stager = stager if stager is not None else TorchStager()
        self.blocked_s: list[float] = []
        self._handle: SaveHandle | None = None
        self._watch: _Watch | None = None
        self._hooks = [o.register_step_pre_hook(self._fence) for o in opts]

    # --- the loop's calls ---------------------------------------------------------------------

    def save(self, step: int, state_dict: Mapping[str, Any]) -> SaveHandle:
        """Collective, as ``CheckpointManager.save``: checkpoint ``state_dict`` (tensors,
        statefuls such as :class:`ckptfmt_torch.TrainingState`, values) as ``step``. Returns the
        save's handle once everything but the parameters and the optimizer state is copied;
        those are copied on the saver thread until the next ``optimizer.step()``."""
        if not self._hooks:
            raise UsageError("this FencedSaver is closed")
        entered = time.perf_counter()
        self._pass_fence()  # a save before any step since the last one: its copy must be done
        background = self._background_storages()
        watch = _Watch(step)

        def copy_now(t: torch.Tensor, name: str) -> bool:
            if _storage_key(t) in background:
                watch.tensors.append((name, t, t._version))
                return False
            return True

        def copied() -> None:  # the saver thread, the copy done, before the fence lets go
            changed = watch.changed()
            if changed:
                raise StateChangedError(step, changed)

        def before_commit() -> None:  # the saver thread, before the commit vote
            with watch.lock:
                if watch.veto:
                    raise StateChangedError(step, watch.veto)

        handle = save_async(
            self.manager,
            step,
            state_dict,
            self.stager,
            background_copy=True,
            copy_now=copy_now,
            copied=copied,
            before_commit=before_commit,
        )
        self._handle, self._watch = handle, watch
        self.blocked_s.append(time.perf_counter() - entered)
        return handle

    def wait(self) -> None:
        """Wait for the save in flight to be committed (the fence first); report a failure as
        the manager does (``on_error``)."""
        self._pass_fence(give_up=False)
        self.manager.wait()

    def close(self) -> None:
        """Wait for the save in flight and remove the fence from the optimizers. The manager
        stays open (close it yourself)."""
        try:
            self.wait()
        finally:
            for h in self._hooks:
                h.remove()
            self._hooks = []

    def __enter__(self) -> FencedSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the fence ----------------------------------------------------------------------------

    def _fence(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """The optimizers' step pre-hook."""
        entered = time.perf_counter()
        pending = self._handle is not None
        try:
            self._pass_fence()
        finally:
            if pending and self.blocked_s:
                self.blocked_s[-1] += time.perf_counter() - entered

    def _pass_fence(self, give_up: bool = True) -> None:
        """Wait for the copy of the save in flight (or, ``give_up`` under ``when_busy="skip"``,
        give the save up when its copy has not begun), then check that nothing it copied in the
        background changed before now; the state is the loop's again."""
        handle, watch = self._handle, self._watch
        if handle is None or watch is None:
            return
        self._handle = self._watch = None
        if give_up and self.manager.settings.when_busy == "skip" and handle.abandon():
            return  # nothing of the state was read, nor will be: the save is skipped
        handle.wait_staged()
        changed = watch.changed()
        if not changed:
            return
        with watch.lock:  # the saver thread's commit check reads it
            watch.veto = changed
        handle.wait()  # committed before the veto, or failed (by it or by the copy's check)
        committed = handle.committed.exception() is None
        raise StateChangedError(watch.step, changed, committed=committed)

    def _background_storages(self) -> set[int]:
        """The memory of every parameter of the optimizers and every tensor of their state:
        what only ``optimizer.step()`` changes."""
        keys: set[int] = set()
        for opt in self.optimizers:
            for group in opt.param_groups:
                keys.update(_storage_key(p) for p in group["params"])
            for per_param in opt.state.values():
                keys.update(_storage_key(t) for t in _tensors(per_param))
        keys.discard(0)  # empty tensors: nothing to copy, and they all share address 0
        keys.discard(-1)
        return keys


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _tensors(v)


def _storage_key(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") and callable(t.to_local) else t
    try:
        return int(local.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # no storage (meta, sparse): copied now
        return -1
