"""Staging PyTorch state for asynchronous saves: device memory into reusable host buffers.

    from ckptfmt_torch.staging import TorchStager, save_async

    stager = TorchStager()                                # keep one for the whole run
    for step in ...:
        loss.backward()
        if handle is not None:
            handle.wait_staged()                          # before the tensors change
        optimizer.step()
        if step % every == 0:
            handle = save_async(mgr, step, {"train": ts}, stager)
    handle.result()                                       # the step, once committed

:class:`TorchStager` copies every tensor of a state dict into a host buffer it keeps for the
next save (same shape and dtype: the same memory, no allocation). CUDA tensors are copied into
page-locked (pinned) buffers with non-blocking copies on a side stream that first waits on an
event recorded on the tensor's current stream, so the copy never reads a tensor before the
kernels queued before ``save_async`` (the optimizer step that writes it) have run; the stage
handle completes when the copies have. CPU tensors take the same path without a stream (copied
at once, or on the saver thread with ``background_copy=True``). bfloat16 and float8 are copied
as their bits (``convert.tensor_to_numpy``'s integer views): bit-exact.

:func:`save_async` hands the staged host state to ``CheckpointManager.save`` as donated
(``donate=True``: no second copy) and returns a
:class:`ckptfmt.parallel.collective.staging.SaveHandle` whose ``staged`` says when the caller's
tensors may change and ``committed`` when the checkpoint is committed; the host buffers go back to
the stager when the save is over.

``ckptfmt_torch.restore`` loads it back into the tensors in place, wherever they live, and puts
the tensors only the checkpoint has on the device its ``map_location`` names.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ckptfmt import CheckpointManager, PerRank, Shard
from ckptfmt.errors import UsageError
from ckptfmt.parallel import SaveHandle
from ckptfmt_torch.convert import (
    dtensor_box,
    is_dtensor,
    is_stateful,
    tensor_to_numpy,
    to_state,
)

_Key = tuple[tuple[int, ...], torch.dtype, bool]


def can_pin() -> bool:
    """Whether page-locked host memory can be had (a CUDA device is present)."""
    return torch.cuda.is_available()


class StageEvent:
    """Completion of one staging: the device copies (CUDA events) and the CPU copies left for
    later (``background_copy``). :meth:`wait` finishes both; :meth:`done` asks without waiting
    (a deferred CPU copy is done only once :meth:`wait` has run it)."""

    def __init__(self) -> None:
        self.events: list[Any] = []  # torch.cuda.Event, one per device
        self.deferred: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host buffer, source)
        self._lock = threading.Lock()
        self._waited = False

    def done(self) -> bool:
        if self.deferred and not self._waited:
            return False
        return all(e.query() for e in self.events)

    def wait(self) -> None:
        with self._lock:
            if self._waited:
                return
            with torch.no_grad():
                for buf, src in self.deferred:
                    buf.copy_(src)
            for e in self.events:
                e.synchronize()
            self._waited = True


class TorchStager:
    """Reusable host staging buffers for PyTorch state (pinned when a CUDA device is present,
    or as ``pin_memory`` says), and the copies into them.

    A stager serves one save at a time: its buffers are handed out by :meth:`stage` and come
    back with :meth:`release` (``save_async`` does both); a save made while the previous one
    still holds the buffers gets new ones.
    """

    def __init__(self, pin_memory: bool | None = None) -> None:
        pin = can_pin() if pin_memory is None else pin_memory
        if pin and not can_pin():
            raise UsageError("pin_memory=True needs a CUDA device (page-locked memory)")
        self.pin_memory = pin
        self._free: dict[_Key, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._streams: dict[int, Any] = {}  # device index -> side stream
        self._holding: list[tuple[SaveHandle, SaveHandle]] = []  # (manager's, ours) not over
        self.made = 0
        self.reused = 0

    # --- buffers ---------------------------------------------------------------------------------

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
        key = (tuple(int(n) for n in shape), dtype, pin)
        with self._lock:
            free = self._free.get(key)
            if free:
                self.reused += 1
                return free.pop()
            self.made += 1
        buf = torch.empty(key[0], dtype=dtype, pin_memory=pin)
        if buf.numel():
            buf.view(-1).view(torch.uint8).zero_()  # pre-touch: the pages exist from now on
        return buf

    def release(self, buffers: list[torch.Tensor]) -> None:
        """Give buffers back for the next save (nothing may read them any more)."""
        with self._lock:
            for buf in buffers:
                pinned = bool(buf.is_pinned()) if self.pin_memory else False
                key = (tuple(int(n) for n in buf.shape), buf.dtype, pinned)
                self._free.setdefault(key, []).append(buf)

    def hold(self, inner: SaveHandle, outer: SaveHandle) -> None:
        """``save_async``: the save of ``outer`` (the manager's ``inner``) holds buffers."""
        with self._lock:
            self._holding = [(i, o) for i, o in self._holding if not o.done()]
            self._holding.append((inner, outer))

    def settle(self) -> None:
        """Wait for the saves whose manager save is over to give their buffers back (they do
        from the saver thread, a moment after the manager's slot is free again)."""
        with self._lock:
            holding = list(self._holding)
        for inner, outer in holding:
            if inner.done():
                outer.wait()

    def _stream(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
        return self._streams[index]

    # --- staging ---------------------------------------------------------------------------------

    def stage(
        self,
        state_dict: Mapping[str, Any],
        *,
        background_copy: bool = False,
        copy_now: Callable[[torch.Tensor, str], bool] | None = None,
    ) -> tuple[dict[str, Any], StageEvent, list[torch.Tensor]]:
        """Copy every tensor of ``state_dict`` (statefuls by their ``state_dict()``, DTensors
        by their local shard) into host buffers. Returns the host state (numpy views of the
        buffers, ``Shard`` leaves for DTensor shards, other values as they are: a valid input
        of ``to_state``), the event that says when the copies are done, and the buffers to
        :meth:`release` when the save no longer needs them.

        CUDA copies are queued on a side stream after an event recorded on each device's
        current stream; ``background_copy`` leaves CPU tensors' copies to ``StageEvent.wait``
        (run by the saver thread in ``save_async``). ``copy_now(tensor, name)`` is asked of
        every tensor: those it picks are tensors the loop changes before it reaches the fence
        (module buffers in the forward pass): a CPU one is copied before this returns, a CUDA
        one on the device's current stream (ahead of the kernels queued after this call)."""
        event = StageEvent()
        taken: list[torch.Tensor] = []
        waits: dict[int, Any] = {}  # device -> event recorded on its current stream
        current: dict[int, torch.device] = {}  # devices with copies on their current stream

        def copy(t: torch.Tensor, name: str) -> torch.Tensor:
            if t.layout != torch.strided or t.is_quantized or t.is_meta:
                tensor_to_numpy(t, name)  # raises the adapter's error for it
            t = t.detach()
            if t.is_conj() or t.is_neg():
                t = t.resolve_conj().resolve_neg()
            on_device = t.device.type == "cuda"
            now = copy_now is not None and copy_now(t, name)
            buf = self.take(tuple(t.shape), t.dtype, self.pin_memory and on_device)
            taken.append(buf)
            if on_device and now:  # on the current stream: before the kernels queued after
                buf.copy_(t, non_blocking=self.pin_memory)
                current[t.device.index if t.device.index is not None else 0] = t.device
            elif on_device:
                index = t.device.index if t.device.index is not None else 0
                side = self._stream(t.device)
                if index not in waits:
                    ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    ready.record(torch.cuda.current_stream(t.device))
                    side.wait_event(ready)
                    waits[index] = side
                with torch.cuda.stream(side):
                    buf.copy_(t, non_blocking=self.pin_memory)
                t.record_stream(side)  # the allocator keeps t's memory until the copy ran
            elif t.device.type == "cpu":
                if background_copy and not now:
                    event.deferred.append((buf, t))
                else:
                    buf.copy_(t)
            else:
                buf.copy_(t)  # another device type: a synchronous copy
            return buf

        def walk(obj: Any, path: str) -> Any:
            if is_dtensor(obj):
                (offset, local_shape), global_shape = dtensor_box(obj, path)
                local = tensor_to_numpy(copy(obj.to_local(), path), path)
                return local if local_shape == global_shape else Shard(local, offset, global_shape)
            if isinstance(obj, torch.Tensor):
                return tensor_to_numpy(copy(obj, path), path)
            if isinstance(obj, PerRank):
                inner = obj.value
                if isinstance(inner, torch.Tensor):
                    return PerRank(tensor_to_numpy(copy(inner, path), path))
                return obj
            if is_stateful(obj):
                return walk(obj.state_dict(), path)
            if isinstance(obj, Mapping):
                return {k: walk(v, f"{path}/{k}" if path else str(k)) for k, v in obj.items()}
            return obj

        with torch.no_grad():
            host = walk(state_dict, "")
        for side in waits.values():
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(side)
            event.events.append(done)
        for device in current.values():
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(torch.cuda.current_stream(device))
            event.events.append(done)
        if not isinstance(host, dict):
            raise UsageError("a state dict is a mapping of names to tensors, values or statefuls")
        return host, event, taken


def save_async(
    manager: CheckpointManager,
    step: int,
    state_dict: Mapping[str, Any],
    stager: TorchStager | None = None,
    *,
    background_copy: bool = False,
    copy_now: Callable[[torch.Tensor, str], bool] | None = None,
    copied: Callable[[], None] | None = None,
    before_commit: Callable[[], None] | None = None,
) -> SaveHandle:
    """Collective, as ``manager.save``: stage ``state_dict`` (device tensors copied into the
    stager's pinned buffers without blocking the host) and save it. Returns a handle:
    ``staged`` is done once the caller's tensors may change again (the device copies are done;
    with ``background_copy`` the CPU copies too, which the saver thread makes), ``committed``
    once the checkpoint is committed (the step) or failed (the save's error).

    ``copy_now`` (see :meth:`TorchStager.stage`) picks CPU tensors copied before this returns
    even with ``background_copy``; ``copied`` runs on the saver thread once every copy is done
    and ``before_commit`` before the commit vote (``CheckpointManager.save``): an exception in
    either fails the save, nothing committed (:class:`ckptfmt_torch.fence.FencedSaver` checks
    there that no tensor changed while it was copied).

    Waits first, as ``save`` does, while the manager has ``saves_in_flight`` saves queued or
    running (``when_busy="wait"``), so that the stager's buffers of a save that is over are
    free again and reused: host memory stays within one staging copy per save in flight. With
    ``when_busy="skip"`` and no room, nothing is staged and the save is taken as skipped on
    every rank (``manager.save(..., skip=True)``). The handle's ``abandon`` gives up a save
    whose background copy has not begun (``SaveHandle.abandon``)."""
    stager = stager if stager is not None else TorchStager()
    if not manager.wait_for_room():
        return manager.save(step, {}, donate=True, skip=True)
    stager.settle()
    host, event, taken = stager.stage(
        state_dict, background_copy=background_copy, copy_now=copy_now
    )
    handle = SaveHandle(step)
    if event.done():
        handle.set_staged()

    def ready() -> None:  # on the saver thread, before the writer reads the buffers
        event.wait()
        try:
            if copied is not None:  # before staged: the loop may change the state after that
                copied()
        finally:
            handle.set_staged()

    try:
        inner = manager.save(
            step, to_state(host), donate=True, ready=ready, before_commit=before_commit
        )
    except BaseException:
        event.wait()  # the copies may still be running into the buffers
        stager.release(taken)
        raise

    def finished(f: Any) -> None:
        if inner.skipped():  # never waited for: device copies may still be running into them
            for e in event.events:
                e.synchronize()
        stager.release(taken)
        handle.set_committed(f.exception())

    stager.hold(inner, handle)
    handle.can_abandon(inner.abandon)
    inner.committed.add_done_callback(finished)
    return handle
