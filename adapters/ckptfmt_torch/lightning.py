"""PyTorch Lightning: Lightning's checkpoints written as ckptfmt checkpoints.

    import ckptfmt_torch.lightning

    trainer = L.Trainer(plugins=[ckptfmt_torch.lightning.CheckpointIO()], ...)
    trainer.fit(model, datamodule=dm, ckpt_path="last")  # resumes from the newest checkpoint

Each path Lightning names (``.../epoch=0-step=10.ckpt``, ``last.ckpt``) becomes one committed
ckptfmt checkpoint *directory* of that name: the model's and optimizers' tensors as verified
zarr arrays (written by parallel threads, nothing pickled), the rest of Lightning's dict
(``loops``, ``callbacks``, ``hyper_parameters``, counters) as values, lists and tuples kept.
``ModelCheckpoint`` works unchanged (top-k, ``save_last``, ``every_n_train_steps``, its
deletions); a rewritten ``last.ckpt`` is replaced atomically and a deleted checkpoint disappears
whole. ``AsyncCheckpointIO(ckptfmt_torch.lightning.CheckpointIO())`` writes in a thread. A load
gives Lightning the dict back (CPU tensors, or on ``map_location``), every byte verified.

Who writes, three ways:

- ``CheckpointIO()`` under any strategy: as Lightning's default, the global rank 0 writes the
  whole checkpoint (no collective call: Lightning calls the plugin on rank 0 only); every rank
  loads it on resume.
- ``CheckpointIO(collective=True)`` with ``strategy=ckptfmt_torch.lightning.DDPStrategy()``:
  every rank writes its share of the replicated state (``ckptfmt_torch.save``'s collective save
  over a gloo group of its own) into the same directory, which every rank must see.
- ``CheckpointIO(local_dir="/local/{node}/ckpt", shared_dir="/shared/ckpt", redundancy="xor")``
  with the same strategy: the levels of ``ckptfmt.CheckpointManager`` (node-local copies,
  parity across nodes, flushes to shared storage, retention ``keep_local``/``keep_shared``).
  The manager saves ``global_step`` in the background (the call returns once the state is
  copied); once committed, a small JSON file at Lightning's path names the step, so
  ``ModelCheckpoint``'s bookkeeping and ``ckpt_path="last"`` work as before. A load restores
  that step through the manager (rebuilt from parity if a node's copy is lost) and refuses
  another one.

Lightning's ``DDPStrategy`` calls the plugin on rank 0 only, so the last two refuse to run
under it with more than one process (a ``UsageError`` at the first save, never a hang).
Objects in ``hyper_parameters`` that are neither tensors, containers nor JSON-able are refused
naming their key path before anything is written; ``objects="pickle"`` stores them, and loads
then need ``trust_pickle=True``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ckptfmt.checkpoint import writer_threads
from ckptfmt.errors import (
    CkptError,
    InvalidNameError,
    LoadFailedError,
    NotACheckpointError,
    UsageError,
)
from ckptfmt.format import WriteOptions
from ckptfmt.manifest import check_component
from ckptfmt.parallel import CheckpointManager
from ckptfmt.plan import ReadOptions
from ckptfmt.storage import is_committed, remove_committed
from ckptfmt.transport import Comm, SingleComm
from ckptfmt.tree import Objects
from ckptfmt_torch.checkpoint import load, save
from ckptfmt_torch.comm import TorchComm
from ckptfmt_torch.convert import materialize, to_state

try:  # the standalone package first; the unified ``lightning`` package as well
    from pytorch_lightning.plugins.io import CheckpointIO as _CheckpointIO
    from pytorch_lightning.strategies import DDPStrategy as _DDPStrategy
except ImportError:  # pragma: no cover - only ``lightning`` installed
    try:
        from lightning.pytorch.plugins.io import CheckpointIO as _CheckpointIO  # type: ignore[no-redef]
        from lightning.pytorch.strategies import DDPStrategy as _DDPStrategy  # type: ignore[no-redef]
    except ImportError as exc:
        raise ImportError(
            "ckptfmt_torch.lightning needs PyTorch Lightning: pip install 'ckptfmt[lightning]'"
        ) from exc

__all__ = ["CheckpointIO", "DDPStrategy"]

POINTER_FORMAT = "ckptfmt-lightning-step"
# a mapping whose keys are not all names (ModelCheckpoint's best_k_models is keyed by file
# paths) is stored as {ITEMS: [(key, value), ...]} and given back as the mapping
ITEMS = "%items"
Location = torch.device | str | Mapping[str, Any] | Callable[..., Any]


class CheckpointIO(_CheckpointIO):
    """Lightning's ``CheckpointIO`` plugin writing ckptfmt checkpoints (see the module).

    ``write``: how the files are written (:class:`ckptfmt.WriteOptions`; its ``overwrite`` is
    always on: ``ModelCheckpoint`` rewrites ``last.ckpt``); ``fsync=False`` matches
    ``torch.save``, which does not make its file durable. ``trainer.save_checkpoint(path,
    storage_options=WriteOptions(...))`` overrides it for one save. ``read``: the loads'
    :class:`ckptfmt.ReadOptions`. ``objects``/``trust_pickle``: as for ``ckptfmt_torch.save``
    and ``load``. ``collective``: every rank writes its share (needs
    ``ckptfmt_torch.lightning.DDPStrategy`` under DDP). ``local_dir``, ``shared_dir``,
    ``redundancy``, ``flush_every``, ``keep_local``, ``keep_shared``: save through a
    ``ckptfmt.CheckpointManager`` with these settings (collective too).
    """

    def __init__(
        self,
        *,
        write: WriteOptions | None = None,
        read: ReadOptions | None = None,
        objects: Objects = "refuse",
        trust_pickle: bool = False,
        collective: bool = False,
        local_dir: str | os.PathLike[str] | None = None,
        shared_dir: str | os.PathLike[str] | None = None,
        redundancy: Any = None,
        flush_every: int | None = None,
        keep_local: int = 2,
        keep_shared: int = 3,
    ) -> None:
        super().__init__()
        write = write if write is not None else WriteOptions(threads=writer_threads())
        if not isinstance(write, WriteOptions):
            raise UsageError(f"write must be a ckptfmt.WriteOptions, got {type(write).__name__}")
        if objects not in ("refuse", "pickle"):
            raise UsageError(f"objects must be 'refuse' or 'pickle', got {objects!r}")
        self.write = dataclasses.replace(write, overwrite=True)
        self.read = read if read is not None else ReadOptions(threads=writer_threads())
        self.objects: Objects = objects
        self.trust_pickle = trust_pickle
        self.levels: dict[str, Any] | None = None
        if local_dir is not None or shared_dir is not None:
            self.levels = {
                "local_dir": local_dir,
                "shared_dir": shared_dir,
                "redundancy": redundancy,
                "flush_every": flush_every,
                "keep_local": keep_local,
                "keep_shared": keep_shared,
            }
        elif redundancy is not None:
            raise UsageError("redundancy protects node-local copies: give a local_dir")
        self.collective = collective or self.levels is not None
        self._comm: Comm | None = None
        self._manager: CheckpointManager | None = None
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}  # manager mode: path -> step, until its pointer is in
        self._last: tuple[int, Any] | None = None  # manager mode: (step, handle) of the last save

    # --- what DDPStrategy calls on every rank -----------------------------------------------------

    def connect(self, comm: Comm) -> None:
        """Every rank, in the same order (``DDPStrategy.setup_environment`` does it): the
        communicator of the collective saves; the manager, when levels are asked for, is made
        here (collective)."""
        self.close()
        self._comm = comm
        if self.levels is not None:
            self._manager = self._new_manager(comm)

    def close(self) -> None:
        """Every rank: wait for the manager's save in flight, flush, and let it go."""
        if self._manager is not None:
            manager, self._manager = self._manager, None
            manager.close()
        self._last = None

    def teardown(self) -> None:
        self.close()

    # --- Lightning's three calls ------------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Save Lightning's ``checkpoint`` dict as the checkpoint directory ``path`` (rank 0
        alone, or every rank when collective; see the module). Nothing is written when the dict
        holds an object ``objects`` refuses (:class:`~ckptfmt.errors.UnsupportedValueError`
        naming its key path)."""
        write = self.write
        if storage_options is not None:
            if not isinstance(storage_options, WriteOptions):
                raise UsageError(
                    "storage_options of ckptfmt_torch.lightning.CheckpointIO is a "
                    f"ckptfmt.WriteOptions, got {type(storage_options).__name__}"
                )
            write = dataclasses.replace(storage_options, overwrite=True)
        step = checkpoint.get("global_step")
        step = step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None
        checkpoint = _keyed(checkpoint)
        if self.levels is not None:
            self._save_to_manager(checkpoint, os.fspath(path), step)
            return
        comm = self._collective_comm() if self.collective else SingleComm()
        save(checkpoint, path, step=step, write=write, comm=comm, objects=self.objects)

    def load_checkpoint(
        self, path: Any, map_location: Location | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Every rank that resumes: Lightning's dict from the checkpoint at ``path``, every
        byte verified (:class:`~ckptfmt.errors.DamagedError` naming a damaged file; nothing is
        returned then). Tensors are CPU tensors, or moved to ``map_location`` (a device, a
        mapping ``{"cpu": device}``, or a function called as ``torch.load`` calls it, with each
        tensor for its storage and ``"cpu"``). ``weights_only`` is moot: nothing is unpickled
        unless ``trust_pickle``."""
        del weights_only
        target = Path(os.fspath(path))
        if target.is_file():
            out = self._load_from_manager(target)
        elif not target.exists():
            raise NotACheckpointError(str(target), "no checkpoint is there")
        else:
            out = {}
            try:
                load(out, target, read=self.read, comm=SingleComm(), trust_pickle=self.trust_pickle)
            except LoadFailedError as exc:  # one process: its own error, not the vote's
                raise (exc.cause if isinstance(exc.cause, CkptError) else exc) from None
        got: dict[str, Any] = _unkeyed(out)
        return _placed(got, map_location) if map_location is not None else got

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint at ``path`` (rank 0): out of sight first (renamed to a dot
        name), then deleted, so no reader sees half of it. A manager's pointer file is removed;
        its step stays for the manager's retention. A missing path is no error."""
        target = Path(os.fspath(path))
        with self._lock:
            if str(target) in self._pending:  # its save is not committed yet: no pointer then
                self._pending[str(target)] = -1
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif is_committed(target):
            remove_committed(target)
        elif target.exists():
            raise UsageError(f"{target} is not a ckptfmt checkpoint; it is left as it is")

    # --- collective and manager modes -------------------------------------------------------------

    def _collective_comm(self) -> Comm:
        if self._comm is not None:
            return self._comm
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise UsageError(
                "CheckpointIO(collective=True) or with levels has every rank write: Lightning's "
                "strategies call the plugin on rank 0 only, so pass "
                "strategy=ckptfmt_torch.lightning.DDPStrategy() to the Trainer"
            )
        self._comm = SingleComm()
        return self._comm

    def _new_manager(self, comm: Comm) -> CheckpointManager:
        assert self.levels is not None
        return CheckpointManager(
            **self.levels, comm=comm, write=dataclasses.replace(self.write, overwrite=False)
        )

    def _manager_now(self) -> CheckpointManager:
        if self._manager is None:
            self._manager = self._new_manager(self._collective_comm())
        return self._manager

    def _save_to_manager(self, checkpoint: dict[str, Any], path: str, step: int | None) -> None:
        if step is None:
            raise UsageError("the checkpoint dict has no global_step: the manager saves steps")
        manager = self._manager_now()
        if self._last is not None and self._last[0] == step:
            handle = self._last[1]  # this step is saved already (top-k and last.ckpt at once)
        else:
            state = to_state(checkpoint, objects=self.objects)
            handle = manager.save(step, state, objects=self.objects)
            self._last = (step, handle)
        if manager.comm.rank != 0:
            return
        with self._lock:
            self._pending[path] = step
        handle.committed.add_done_callback(lambda fut: self._point(path, step, fut))

    def _point(self, path: str, step: int, fut: Any) -> None:
        """Rank 0, once the manager's save of ``step`` is over: the pointer file at ``path``
        (written to a temporary name and renamed), unless the save failed (the manager tells
        that at its next call) or ``path`` was removed meanwhile."""
        with self._lock:
            if self._pending.get(path) != step:
                return
            del self._pending[path]
        if fut.exception() is not None:
            return
        tmp = Path(path).with_name(f".{Path(path).name}.tmp-{os.urandom(8).hex()}")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"format": POINTER_FORMAT, "version": 1, "step": step}))
        os.replace(tmp, path)

    def _load_from_manager(self, target: Path) -> dict[str, Any]:
        try:
            doc = json.loads(target.read_text())
            step = doc["step"] if doc.get("format") == POINTER_FORMAT else None
        except (ValueError, KeyError, AttributeError, UnicodeDecodeError):
            step = None
        if not isinstance(step, int):
            raise NotACheckpointError(
                str(target), "a file, not a ckptfmt checkpoint directory or a manager's pointer"
            )
        if self.levels is None:
            raise UsageError(
                f"{target} names step {step} of a CheckpointManager: load it with the "
                "CheckpointIO(local_dir=..., shared_dir=...) that saved it"
            )
        report = self._manager_now().restore(None, read=self.read, trust_pickle=self.trust_pickle)
        if report.step != step or report.state is None:
            raise CkptError(
                f"{target} names step {step}; the newest step the manager can restore is "
                f"{report.step} (tried: {'; '.join(report.tried) or 'nothing else'})"
            )
        out: dict[str, Any] = materialize(report.state)
        return out


class DDPStrategy(_DDPStrategy):
    """Lightning's ``DDPStrategy`` (same arguments) that lets every rank take part in the saves
    of a collective ``ckptfmt_torch.lightning.CheckpointIO`` (``collective=True`` or levels):
    Lightning's own calls the plugin on rank 0 only. With any other plugin it is Lightning's."""

    def setup_environment(self) -> None:
        super().setup_environment()
        io = _ours(self.checkpoint_io)
        if io is not None and io.collective:
            # a group of its own: the saves may run in a thread beside DDP's all-reduces
            io.connect(TorchComm(dist.new_group(backend="gloo")))

    def teardown(self) -> None:
        io = _ours(self.checkpoint_io)
        super().teardown()
        if io is not None:  # AsyncCheckpointIO's teardown does not pass it on
            io.close()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        io = _ours(self.checkpoint_io)
        if io is None or not io.collective:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)


def _ours(io: Any) -> CheckpointIO | None:
    """The ckptfmt plugin inside Lightning's wrappers (``AsyncCheckpointIO``), if that is it."""
    for _ in range(8):
        if isinstance(io, CheckpointIO):
            return io
        io = getattr(io, "checkpoint_io", None)
    return None


def _keyed(obj: Any) -> Any:
    """``obj`` with every mapping whose keys are not all valid names (nor ints: an optimizer's
    parameter indices) as ``{ITEMS: [(key, value), ...]}``; the tensors are the same."""
    if isinstance(obj, Mapping):
        out = {k: _keyed(v) for k, v in obj.items()}
        return out if all(_is_name(k) for k in obj) else {ITEMS: [(k, v) for k, v in out.items()]}
    if isinstance(obj, (list, tuple)):
        items = [_keyed(v) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    return obj


def _is_name(key: Any) -> bool:
    if isinstance(key, int) and not isinstance(key, bool):
        return True
    try:
        check_component(key)
    except InvalidNameError:
        return False
    return bool(key != ITEMS)


def _unkeyed(obj: Any) -> Any:
    """What :func:`_keyed` made of ``obj``, undone (pairs load as lists or tuples)."""
    if isinstance(obj, dict):
        if list(obj) == [ITEMS] and isinstance(obj[ITEMS], (list, tuple)):
            return {k: _unkeyed(v) for k, v in obj[ITEMS]}
        return {k: _unkeyed(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_unkeyed(v) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    return obj


def _placed(obj: Any, where: Location) -> Any:
    """``obj`` with its tensors moved as ``torch.load``'s ``map_location`` would move them."""
    if isinstance(obj, torch.Tensor):
        if callable(where) and not isinstance(where, (str, torch.device)):
            return where(obj, "cpu")
        if isinstance(where, Mapping):
            return obj.to(where["cpu"]) if "cpu" in where else obj
        return obj.to(where)
    if isinstance(obj, dict):
        return {k: _placed(v, where) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_placed(v, where) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    return obj
