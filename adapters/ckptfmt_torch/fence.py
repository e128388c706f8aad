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
observation), so their copy runs on the saver thread while the next forward and backward run,
and the step waits only for what is not copied yet. Everything else is what the forward pass
may change (module buffers: BatchNorm's running statistics; counters; RNG states), and is small:
it is copied before ``save`` returns (on a CUDA device, on the current stream, ahead of the
kernels queued after it).

What ``save`` does on the loop's thread is kept short: which tensors the optimizers cover is
worked out at the first save and kept while the state's tensors stay where they are (the same
memory, shape, strides and dtype under the same names, the optimizers' parameters the same):
a save then walks the state once, notes each covered tensor's version counter and copies the
rest. Everything else (the ranks' agreement, the copy, the files) is the saver thread's. CPU
state goes to ``CheckpointManager.save(background_copy=True)``, which copies it into the
manager's reused buffers (each rank only its share of what every rank holds the same); state on
a CUDA device goes through :func:`ckptfmt_torch.staging.save_async` (pinned buffers, a side
stream).

What is guaranteed, and what is detected:

- The checkpoint of step ``s`` holds the state as it was when ``save(s, ...)`` was called, if
  nothing changes a parameter or an optimizer tensor in place before the optimizer's next step.
- A change made through the tensor (an in-place op on it or on a view of it: PyTorch's version
  counter) before the step is detected: before the commit (the save fails on every rank and
  nothing is committed) and at the fence, which raises :class:`StateChangedError` there,
  naming the tensors. A change seen only at the fence vetoes the commit if the save has not
  committed yet; where it has, the error says that step ``s``'s checkpoint may mix states.
- Not detected: a write through ``tensor.data`` or through another tensor sharing the memory
  under another version counter (e.g. from ``numpy()`` or DLPack), or by another thread.
  Make such changes after the optimizer's step, or save with the copy made before ``save``
  returns (``CheckpointManager.save`` without ``background_copy``).

Host memory: one staging copy per save in flight, reused from save to save (the manager's
buffers, or the stager's for CUDA state), plus a reused copy of the small part copied before
``save`` returns. Several optimizers: pass them all; the first step of any of them is the fence.
``optimizers=None``: every ``torch.optim`` optimizer of the process is a fence (a global step
pre-hook), and the tensors copied behind the loop are those of the optimizers seen stepping so
far (before any step, everything is copied before ``save`` returns); the integrations
(``ckptfmt_torch.lightning.CheckpointIO(fenced=True)``) use it where they do not hold the
optimizers themselves.

A manager with ``when_busy="skip"`` (``ckptfmt.ManagerSettings``): the fence never waits for a
copy that has not begun (its save is queued behind one still writing); it gives that save up
(``SaveHandle.abandon``), and the save is skipped on every rank, counted in the manager's
``saves_skipped`` and logged. It still waits for a copy that has begun: every rank's saver had
reached the save, and the copy is as long as the state's bytes.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ckptfmt import CheckpointManager, PerRank, Shard
from ckptfmt.errors import StateChangedError, UsageError
from ckptfmt.parallel import SaveHandle
from ckptfmt.tree import Objects
from ckptfmt_torch.convert import (
    _join,
    _key,
    _leaf,
    dtensor_box,
    is_dtensor,
    is_stateful,
    tensor_to_numpy,
)
from ckptfmt_torch.staging import TorchStager, save_async

__all__ = ["FencedSaver"]


class _Watch:
    """The tensors one save copies behind the caller's back, with their version counters as
    they were at ``save``; which of them changed since, and the fence's verdict."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.tensors: list[tuple[str, torch.Tensor, int]] = []
        # set at the fence (under ``lock``): the names changed before it, [] for none
        self.verdict: list[str] | None = None
        self.lock = threading.Lock()

    def changed(self) -> list[str]:
        return [name for name, t, v in self.tensors if t._version != v]

    def before_commit(self) -> None:
        """The saver thread, the copy done, before the commit vote: a change the fence saw, or
        (the fence not passed yet, so the optimizer has not run) any change seen now, fails
        the save on every rank."""
        with self.lock:
            changed = self.verdict if self.verdict is not None else self.changed()
        if changed:
            raise StateChangedError(self.step, changed)


class _Known:
    """What the plan of a tensor kept from the last saves says: the memory it was (to tell
    the same tensor, or a new view of the same memory, from another), whether the
    optimizers cover it, and its numpy view (for one copied behind the loop)."""

    __slots__ = ("array", "background", "dtype", "era", "ptr", "shape", "stride", "tensor")

    def __init__(self, t: torch.Tensor, background: bool, era: int) -> None:
        self.tensor = t  # held: its memory cannot be reused by another tensor meanwhile
        self.ptr, self.shape, self.stride, self.dtype = t.data_ptr(), t.shape, t.stride(), t.dtype
        self.background, self.era = background, era
        self.array: np.ndarray | None = None

    def fits(self, t: torch.Tensor, era: int) -> bool:
        if self.era != era:
            return False
        # the same tensor object too: ``p.data = ...`` gives a parameter new memory in place
        return (
            t.data_ptr() == self.ptr
            and t.dtype == self.dtype
            and t.shape == self.shape
            and t.stride() == self.stride
        )


class FencedSaver:
    """``save`` for a training loop with an optimizer: the copy overlaps the next forward and
    backward pass and ``optimizer.step()`` waits for it (see the module's docstring).

    ``manager``: the :class:`ckptfmt.CheckpointManager` to save with; ``optimizers``: one
    optimizer or several (every parameter of theirs and every tensor of their state is copied
    in the background; all else before ``save`` returns), or None for every optimizer of the
    process. ``stager``: host buffers reused from save to save (a new one by default).
    ``blocked_s``: per save, the seconds the loop spent in ``save`` plus waiting at the
    fence."""

    def __init__(
        self,
        manager: CheckpointManager,
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
        *,
        stager: TorchStager | None = None,
    ) -> None:
        self.manager = manager
        self.stager = stager if stager is not None else TorchStager()
        self.blocked_s: list[float] = []
        self._handle: SaveHandle | None = None
        self._watch: _Watch | None = None
        self._hooks: list[Any]
        # the optimizers seen stepping (optimizers=None), held weakly
        self._seen: weakref.WeakSet[torch.optim.Optimizer] | None = None
        if optimizers is None:
            self.optimizers: list[torch.optim.Optimizer] = []
            self._seen = weakref.WeakSet()
            self._hooks = [register_optimizer_step_pre_hook(self._fence_any)]
        else:
            if isinstance(optimizers, torch.optim.Optimizer):
                opts = [optimizers]
            else:
                opts = list(optimizers) if isinstance(optimizers, Sequence) else []
            if not opts or not all(isinstance(o, torch.optim.Optimizer) for o in opts):
                raise UsageError("FencedSaver needs the optimizer(s) whose step is the fence")
            self.optimizers = opts
            self._hooks = [o.register_step_pre_hook(self._fence) for o in opts]
        # the plan kept from save to save: per name, what its tensor was (see _Known); the
        # optimizers' signature and their memory it was made with; ``era`` counts the plans
        self._known: dict[str, _Known] = {}
        self._signature: tuple[Any, ...] | None = None
        self._covered: set[int] = set()
        self._era = 0

    # --- the loop's calls ---------------------------------------------------------------------

    def save(
        self, step: int, state_dict: Mapping[str, Any], *, objects: Objects = "refuse"
    ) -> SaveHandle:
        """Collective, as ``CheckpointManager.save``: checkpoint ``state_dict`` (tensors,
        statefuls such as :class:`ckptfmt_torch.TrainingState`, values) as ``step``. Returns the
        save's handle once everything but the parameters and the optimizer state is copied;
        those are copied on the saver thread until the next ``optimizer.step()``.
        ``objects``: as for ``CheckpointManager.save``."""
        if not self._hooks:
            raise UsageError("this FencedSaver is closed")
        entered = time.perf_counter()
        self._pass_fence()  # a save before any step since the last one: its copy must be done
        self._check_plan()
        watch = _Watch(step)
        if self._on_device():
            handle = self._save_staged(step, state_dict, watch)
        else:
            handle = self._save_host(step, state_dict, watch, objects)
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

    # --- one save -----------------------------------------------------------------------------

    def _save_host(
        self, step: int, state_dict: Mapping[str, Any], watch: _Watch, objects: Objects
    ) -> SaveHandle:
        """State in host memory: the covered tensors' own memory (numpy views) handed to the
        manager's background copy, the rest copied now into the stager's buffers."""
        taken: list[torch.Tensor] = []
        if not isinstance(state_dict, Mapping):
            raise UsageError("a state dict is a mapping of names to tensors, values or statefuls")
        try:
            with torch.no_grad():
                state = self._walk(state_dict, "", watch, taken, objects)
            handle = self.manager.save(
                step,
                state,
                background_copy=True,
                before_commit=watch.before_commit,
                objects=objects,
            )
        except BaseException:
            self.stager.release(taken)
            raise
        handle.committed.add_done_callback(lambda _: self.stager.release(taken))
        return handle

    def _walk(
        self, obj: Any, path: str, watch: _Watch, taken: list[torch.Tensor], objects: Objects
    ) -> Any:
        """``to_state`` of ``obj`` with each tensor planned (see :meth:`_array`)."""
        if is_dtensor(obj):
            (offset, local_shape), global_shape = dtensor_box(obj, path)
            local = self._array(obj.to_local(), path, watch, taken)
            return local if local_shape == global_shape else Shard(local, offset, global_shape)
        if isinstance(obj, torch.Tensor):
            return self._array(obj, path, watch, taken)
        if isinstance(obj, PerRank) and isinstance(obj.value, torch.Tensor):
            return PerRank(self._array(obj.value, path, watch, taken))
        if is_stateful(obj):
            return self._walk(obj.state_dict(), path, watch, taken, objects)
        if isinstance(obj, Mapping):
            out = {}
            for k, v in obj.items():
                key = _key(k, path)
                out[key] = self._walk(v, _join(path, key), watch, taken, objects)
            return out
        if isinstance(obj, (list, tuple)):
            items = [
                self._walk(x, _join(path, str(i)), watch, taken, objects) for i, x in enumerate(obj)
            ]
            return tuple(items) if isinstance(obj, tuple) else items
        return _leaf(obj, path, objects)

    def _array(
        self, t: torch.Tensor, name: str, watch: _Watch, taken: list[torch.Tensor]
    ) -> np.ndarray:
        """The numpy leaf of tensor ``t``: its own memory when the optimizers cover it (its
        version counter noted: the saver thread copies it), else a copy made now."""
        known = self._known.get(name)
        if known is None or not known.fits(t, self._era):
            if known is not None:  # the state moved: plan again, once for this save
                self._replan()
            covered = t.device.type == "cpu" and _storage_key(t) in self._covered
            known = self._known[name] = _Known(t, covered, self._era)
        if known.background:
            if known.array is None:
                known.array = tensor_to_numpy(t, name)
            watch.tensors.append((name, t, t._version))
            return known.array
        if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized or t.is_meta:
            return tensor_to_numpy(t, name)  # a copy to the host already, or the refusal
        t = t.detach().resolve_conj().resolve_neg()
        buf = self.stager.take(tuple(t.shape), t.dtype, False)
        taken.append(buf)
        buf.copy_(t)
        return tensor_to_numpy(buf, name)

    def _save_staged(self, step: int, state_dict: Mapping[str, Any], watch: _Watch) -> SaveHandle:
        """State on a CUDA device: ``save_async`` (pinned buffers, side-stream copies), the
        covered tensors' copies left to run behind the loop."""

        def copy_now(t: torch.Tensor, name: str) -> bool:
            known = self._known.get(name)
            if known is None or not known.fits(t, self._era):
                covered = _storage_key(t) in self._covered
                known = self._known[name] = _Known(t, covered, self._era)
            if known.background:
                watch.tensors.append((name, t, t._version))
                return False
            return True

        def copied() -> None:  # the saver thread, the copy done, before the fence lets go
            changed = watch.changed()
            if changed:
                raise StateChangedError(step, changed)

        return save_async(
            self.manager,
            step,
            state_dict,
            self.stager,
            background_copy=True,
            copy_now=copy_now,
            copied=copied,
            before_commit=watch.before_commit,
        )

    # --- the plan -----------------------------------------------------------------------------

    def _opts(self) -> list[torch.optim.Optimizer]:
        return list(self._seen) if self._seen is not None else self.optimizers

    def _check_plan(self) -> None:
        """Plan again when the optimizers changed: others seen, parameters added or removed,
        state made (the first step) or replaced (``load_state_dict``)."""
        signature = tuple(
            (id(o), id(o.state), len(o.state), tuple(len(g["params"]) for g in o.param_groups))
            for o in self._opts()
        )
        if signature != self._signature:
            self._signature = signature
            self._replan()

    def _replan(self) -> None:
        self._era += 1
        self._known.clear()
        self._covered = self._covered_storages()

    def _on_device(self) -> bool:
        return any(
            p.device.type == "cuda"
            for o in self._opts()
            for g in o.param_groups
            for p in g["params"][:1]
        )

    def _covered_storages(self) -> set[int]:
        """The memory of every parameter of the optimizers and every tensor of their state:
        what only ``optimizer.step()`` changes."""
        keys: set[int] = set()
        for opt in self._opts():
            for group in opt.param_groups:
                keys.update(_storage_key(p) for p in group["params"])
            for per_param in opt.state.values():
                keys.update(_storage_key(t) for t in _tensors(per_param))
        keys.discard(0)  # empty tensors: nothing to copy, and they all share address 0
        keys.discard(-1)
        return keys

    # --- the fence ----------------------------------------------------------------------------

    def _fence_any(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        """The global step pre-hook (``optimizers=None``): every optimizer's step."""
        if self._seen is not None:
            self._seen.add(optimizer)
        return self._fence(optimizer, args, kwargs)

    def _fence(self, _optimizer: Any, args: Any, kwargs: Any) -> Any:
        """The optimizers' step pre-hook. A step given a closure (Lightning's: the forward
        and backward run inside ``optimizer.step``) gets the closure back wrapped: the fence
        is passed once it returns, before the update, so that the copy still overlaps the
        forward and backward (every ``torch.optim`` optimizer calls its closure before it
        updates anything)."""
        if self._handle is None:
            return None
        closure = kwargs.get("closure")
        # ``args`` holds the optimizer first (torch passes the step's own arguments)
        positional = closure is None and len(args) > 1 and callable(args[1])
        if positional:
            closure = args[1]
        if closure is None:
            self._timed_fence()
            return None

        def fenced(*a: Any, **k: Any) -> Any:
            out = closure(*a, **k)
            self._timed_fence()
            return out

        if positional:
            return (args[0], fenced, *args[2:]), kwargs
        return args, {**kwargs, "closure": fenced}

    def _timed_fence(self) -> None:
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
        with watch.lock:  # the saver thread's commit check reads it
            changed = watch.verdict = watch.changed()
        if not changed:
            return
        handle.wait()  # committed before the verdict, or failed (by it or by the copy's check)
        committed = handle.committed.exception() is None
        raise StateChangedError(watch.step, changed, committed=committed)


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
