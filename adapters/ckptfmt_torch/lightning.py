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
whole. ``AsyncCheckpointIO(ckptfmt_torch.lightning.CheckpointIO())`` writes in a thread and keeps
what it keeps around ``TorchCheckpointIO``: a deletion asked for while that checkpoint's write is
still queued skips the write, one asked for while it is being written happens once it is
written. A load gives Lightning the dict it saved (an ``OrderedDict`` with its ``_metadata``
where it was one; CPU tensors, or on ``map_location``), every byte verified; a damaged
checkpoint is named with the newest other checkpoint beside it, and nothing of it is loaded.

Loading outside a Trainer, as ``MyModel.load_from_checkpoint`` does:
``ckptfmt_torch.lightning.load_from_checkpoint(MyModel, path, map_location=..., strict=...,
**hparams)``. Importing this module also lets Lightning's own ``load_from_checkpoint`` and
``TorchCheckpointIO`` read a ckptfmt checkpoint directory (see :func:`load_from_checkpoint`).
``DataPosition`` (``ckptfmt_torch.lightning_data``) carries the data loader's position, so a run
stopped mid-epoch resumes on the next batch.

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
  that step through the manager, from level 1 (rebuilt from parity if a node's copy is lost)
  or level 3, while its retention keeps it, and no other (a newer step committed when the
  run was killed, before its pointer, is not taken for it). Under ``AsyncCheckpointIO`` its
  thread's save ends once the step is committed, so the last checkpoint is in when ``fit``
  returns.

Lightning's ``DDPStrategy`` calls the plugin on rank 0 only, so the last two refuse to run
under it with more than one process (a ``UsageError`` at the first save, never a hang).
Objects in ``hyper_parameters`` that are neither tensors, containers nor JSON-able are refused
naming their key path before anything is written; ``objects="pickle"`` stores them, and loads
then need ``trust_pickle=True``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from ckptfmt.checkpoint import open_checkpoint, writer_threads
from ckptfmt.errors import (
    CkptError,
    DamagedError,
    LoadFailedError,
    NotACheckpointError,
    UnreadableError,
    UsageError,
)
from ckptfmt.format import WriteOptions, checked_write
from ckptfmt.parallel import CheckpointManager, ManagerSettings
from ckptfmt.plan import ReadOptions
from ckptfmt.storage import Store, is_committed, parse_location, remove_committed
from ckptfmt.transport import Comm, SingleComm
from ckptfmt.tree import Objects
from ckptfmt_torch import _compat
from ckptfmt_torch.checkpoint import load, save
from ckptfmt_torch.comm import TorchComm
from ckptfmt_torch.convert import materialize, to_state
from ckptfmt_torch.fence import FencedSaver
from ckptfmt_torch.lightning_data import DataPosition
from ckptfmt_torch.lightning_dict import (
    CONTAINERS,
    Location,
    containers_json,
    keyed,
    placed,
    restored,
    unkeyed,
)

try:  # the standalone package first; the unified ``lightning`` package as well
    # the two modules whose file loader (pl_load) is wrapped, see load_from_checkpoint
    import lightning_fabric.plugins.io.torch_io  # noqa: F401
    import pytorch_lightning.core.saving  # noqa: F401
    from pytorch_lightning import LightningDataModule as _LightningDataModule
    from pytorch_lightning import LightningModule as _LightningModule
    from pytorch_lightning.plugins.io import CheckpointIO as _CheckpointIO
    from pytorch_lightning.strategies import DDPStrategy as _DDPStrategy
except ImportError:  # pragma: no cover - only ``lightning`` installed
    try:
        import lightning.fabric.plugins.io.torch_io
        import lightning.pytorch.core.saving  # noqa: F401
        from lightning.pytorch import LightningDataModule as _LightningDataModule  # type: ignore[no-redef]
        from lightning.pytorch import LightningModule as _LightningModule  # type: ignore[no-redef]
        from lightning.pytorch.plugins.io import CheckpointIO as _CheckpointIO  # type: ignore[no-redef]
        from lightning.pytorch.strategies import DDPStrategy as _DDPStrategy  # type: ignore[no-redef]
    except ImportError as exc:
        raise ImportError(
            "ckptfmt_torch.lightning needs PyTorch Lightning: pip install 'ckptfmt[lightning]'"
        ) from exc

__all__ = ["CheckpointIO", "DDPStrategy", "DataPosition", "load_from_checkpoint"]

POINTER_FORMAT = "ckptfmt-lightning-step"
# tombstones kept at most: deletions asked for while their write was still queued
MAX_TOMBSTONES = 256
M = TypeVar("M")


class CheckpointIO(_CheckpointIO):
    """Lightning's ``CheckpointIO`` plugin writing ckptfmt checkpoints (see the module).

    ``write``: how the files are written (:class:`ckptfmt.WriteOptions`; its ``overwrite`` is
    always on: ``ModelCheckpoint`` rewrites ``last.ckpt``); ``fsync=False`` matches
    ``torch.save``, which does not make its file durable. ``trainer.save_checkpoint(path,
    storage_options=WriteOptions(...))`` overrides it for one save. ``read``: the loads'
    :class:`ckptfmt.ReadOptions`. ``objects``/``trust_pickle``: as for ``ckptfmt_torch.save``
    and ``load``. ``collective``: every rank writes its share (needs
    ``ckptfmt_torch.lightning.DDPStrategy`` under DDP). ``settings``
    (:class:`ckptfmt.ManagerSettings`; or its fields as keywords: ``local_dir=...,
    shared_dir=..., redundancy="xor"``): save through a ``ckptfmt.CheckpointManager`` with
    these settings, passed to it as they are (collective too); its files are written as
    ``settings.write`` says (the keyword spelling takes ``write`` for it).

    ``fenced=True`` (with ``settings``): the save returns once the small part of the state is
    copied; the parameters and the optimizers' state are copied on the manager's thread while
    the next forward and backward run, and the next optimizer step (after its closure, where
    Lightning runs the forward and backward) waits for what is not copied yet
    (:class:`ckptfmt_torch.FencedSaver` over every optimizer that steps). A parameter or
    optimizer tensor changed in place outside the optimizer before that step fails the save,
    nothing committed, and raises :class:`~ckptfmt.errors.StateChangedError` at the step. Not
    under ``AsyncCheckpointIO`` (the save already returns at once).
    """

    def __init__(
        self,
        *,
        write: WriteOptions | None = None,
        read: ReadOptions | None = None,
        objects: Objects = "refuse",
        trust_pickle: bool = False,
        collective: bool = False,
        settings: ManagerSettings | None = None,
        fenced: bool = False,
        **options: Any,
    ) -> None:
        super().__init__()
        given_write = write is not None
        write = (
            checked_write(write) if write is not None else WriteOptions(threads=writer_threads())
        )
        if objects not in ("refuse", "pickle"):
            raise UsageError(f"objects must be 'refuse' or 'pickle', got {objects!r}")
        self.write = dataclasses.replace(write, overwrite=True)
        self.read = read if read is not None else ReadOptions(threads=writer_threads())
        self.objects: Objects = objects
        self.trust_pickle = trust_pickle
        self.settings: ManagerSettings | None = None  # the manager's, when saves go through one
        if settings is not None or options:
            if settings is None:  # the keyword spelling: files written as `write` says
                options.setdefault("write", dataclasses.replace(self.write, overwrite=False))
            elif given_write:
                raise UsageError(
                    "CheckpointIO(settings=...) writes through the manager: give its "
                    "WriteOptions as settings.write, not as write="
                )
            self.settings = ManagerSettings.of(settings, **options)
            self.settings.need_a_level()
        self.collective = collective or self.settings is not None
        if fenced and self.settings is None:
            raise UsageError(
                "CheckpointIO(fenced=True) fences the saves of a CheckpointManager: give its "
                "settings (settings=... or local_dir=..., shared_dir=...)"
            )
        self.fenced = fenced
        self._saver: FencedSaver | None = None  # fenced: the manager's, made with it
        self._comm: Comm | None = None
        self._manager: CheckpointManager | None = None
        self._lock = threading.Lock()
        # the bookkeeping that lets AsyncCheckpointIO delete what it is told to (keys: absolute
        # paths): the saves running now, the deletions to do once they end, and the deletions
        # asked for while nothing was there yet (a write still queued), with the asking thread
        self._writing: dict[str, int] = {}
        self._doomed: set[str] = set()
        self._tombstones: OrderedDict[str, int] = OrderedDict()
        # manager mode: path -> the steps saved to it whose pointer is not in yet
        self._pending: dict[str, set[int]] = {}
        self._last: tuple[int, Any] | None = None  # manager mode: (step, handle) of the last save

    # --- what DDPStrategy calls on every rank -----------------------------------------------------

    def connect(self, comm: Comm) -> None:
        """Every rank, in the same order (``DDPStrategy.setup_environment`` does it): the
        communicator of the collective saves; the manager, when levels are asked for, is made
        here (collective)."""
        self.close()
        self._comm = comm
        if self.settings is not None:
            self._manager = self._new_manager(comm)

    def close(self) -> None:
        """Every rank: wait for the manager's save in flight, flush, and let it go."""
        if self._saver is not None:
            saver, self._saver = self._saver, None
            saver.close()  # the fence off the optimizers; a save in flight waited for
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
        naming its key path).

        Under ``AsyncCheckpointIO`` this runs in its thread, in the order the saves were asked
        for; a deletion of ``path`` asked for (on the caller's thread) since this save was
        queued skips it, or, for a collective save that every rank must join, removes it once
        written."""
        write = self.write
        if storage_options is not None:
            if not isinstance(storage_options, WriteOptions):
                raise UsageError(
                    "storage_options of ckptfmt_torch.lightning.CheckpointIO is a "
                    f"ckptfmt.WriteOptions, got {type(storage_options).__name__}"
                )
            write = dataclasses.replace(storage_options, overwrite=True)
        if self.settings is not None and _bucket(path) is not None:
            raise UsageError(
                f"{path}: with a CheckpointManager the checkpoints Lightning names are pointer "
                "files on a file system (give ModelCheckpoint a directory); the manager's levels "
                "hold the data, and its shared_dir may be a bucket"
            )
        step = checkpoint.get("global_step")
        step = step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None
        tree = keyed(checkpoint)
        containers = containers_json(checkpoint)
        if containers is not None:
            tree[CONTAINERS] = containers
        key = _key(path)
        with self._lock:
            asker = self._tombstones.pop(key, None)
            # removed since it was queued: a save from another thread than the one that asked
            # (a save asked for after the deletion, on the same thread, is written)
            removed = asker is not None and asker != threading.get_ident()
            if removed and not self.collective:
                return
            self._writing[key] = self._writing.get(key, 0) + 1
        try:
            if self.settings is not None:
                self._save_to_manager(tree, key, step, point=not removed)
            else:
                comm = self._collective_comm() if self.collective else SingleComm()
                save(tree, path, step=step, write=write, comm=comm, objects=self.objects)
        finally:
            with self._lock:
                self._writing[key] -= 1
                if not self._writing[key]:
                    del self._writing[key]
                doomed = key not in self._writing and (key in self._doomed or removed)
                if doomed:
                    self._doomed.discard(key)
                    if self.settings is None:
                        self._remove_now(key)

    def load_checkpoint(
        self, path: Any, map_location: Location | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Every rank that resumes: Lightning's dict from the checkpoint at ``path``, every
        byte verified, ``OrderedDict`` and ``_metadata`` as saved. A damaged or unreadable
        checkpoint raises its :class:`~ckptfmt.errors.DamagedError` (or ``UnreadableError``)
        naming the checkpoint, the file in it, and the newest other checkpoint beside it to
        resume from instead; nothing is returned then. Tensors are CPU tensors, or moved to
        ``map_location`` (a device, a mapping ``{"cpu": device}``, or a function called as
        ``torch.load`` calls it, with each tensor for its storage and ``"cpu"``; ``None`` back
        keeps it). ``weights_only`` is moot: nothing is unpickled unless ``trust_pickle``."""
        del weights_only
        if _bucket(path) is not None:  # a bucket's URL: read there (its damage named as is)
            out = self._load_tree(str(path), None)
        else:
            target = Path(os.fspath(path))
            if target.is_file():
                out = self._load_from_manager(target)
            elif not target.exists():
                raise NotACheckpointError(str(target), "no checkpoint is there")
            elif not is_committed(target):
                reason = "no manifest in it (never committed, torn before commit, or not ckptfmt's)"
                raise _named(NotACheckpointError(str(target), reason), target)
            else:
                out = self._load_tree(target, target)
        containers = out.pop(CONTAINERS, None)
        got: dict[str, Any] = unkeyed(out)
        if map_location is not None:
            got = placed(got, map_location)
        back: dict[str, Any] = restored(got, containers)
        return back

    def _load_tree(self, source: str | Path, target: Path | None) -> dict[str, Any]:
        """The tree of the committed checkpoint at ``source``, in this process; damage raises
        its error, named with the checkpoint to resume from instead beside ``target`` (a
        directory; None for a bucket's URL)."""
        out: dict[str, Any] = {}
        try:
            load(out, source, read=self.read, comm=SingleComm(), trust_pickle=self.trust_pickle)
        except LoadFailedError as exc:  # one process: its own error, not the vote's
            cause = exc.cause if isinstance(exc.cause, CkptError) else exc
            if isinstance(cause, (DamagedError, UnreadableError)) and target is not None:
                raise _named(cause, target) from None
            raise cause from None
        except (DamagedError, UnreadableError) as exc:
            if target is None:
                raise
            raise _named(exc, target) from None
        return out

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint at ``path`` (rank 0): out of sight first (renamed to a dot
        name), then deleted, so no reader sees half of it. A manager's pointer file is removed;
        its step stays for the manager's retention. A missing path is no error.

        Under ``AsyncCheckpointIO`` (the saves in its thread, this on the caller's), a
        checkpoint being written is removed once written, and one not there yet (its write
        still queued) is remembered, so that write is skipped."""
        key = _key(path)
        with self._lock:
            # manager: saves not committed yet, whose pointers are then not written
            pending = self._pending.pop(key, None) is not None
            if key in self._writing:
                self._doomed.add(key)
                return
            if not _there(key):
                if pending:
                    return
                self._tombstones[key] = threading.get_ident()
                self._tombstones.move_to_end(key)
                while len(self._tombstones) > MAX_TOMBSTONES:
                    self._tombstones.popitem(last=False)
                return
            self._remove_now(key)

    def _remove_now(self, key: str) -> None:
        bucket = _bucket(key)
        if bucket is not None:  # its commit object first: no reader sees half of it
            if bucket.is_committed():
                bucket.delete()
            return
        target = Path(key)
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
        assert self.settings is not None
        return CheckpointManager(settings=self.settings, comm=comm)

    def _manager_now(self) -> CheckpointManager:
        if self._manager is None:
            self._manager = self._new_manager(self._collective_comm())
        return self._manager

    def _save_to_manager(
        self, checkpoint: dict[str, Any], path: str, step: int | None, *, point: bool = True
    ) -> None:
        if step is None:
            raise UsageError("the checkpoint dict has no global_step: the manager saves steps")
        manager = self._manager_now()
        if self._last is not None and self._last[0] == step:
            handle = self._last[1]  # this step is saved already (top-k and last.ckpt at once)
        elif self.fenced:
            if self._saver is None or self._saver.manager is not manager:
                self._saver = FencedSaver(manager, None)  # every optimizer that steps
            handle = self._saver.save(step, checkpoint, objects=self.objects)
            self._last = (step, handle)
        else:
            state = to_state(checkpoint, objects=self.objects)
            handle = manager.save(step, state, objects=self.objects)
            self._last = (step, handle)
        if manager.comm.rank == 0 and point:
            with self._lock:
                self._pending.setdefault(path, set()).add(step)
            handle.committed.add_done_callback(lambda fut: self._point(path, step, fut))
        if threading.current_thread() is not threading.main_thread():
            # AsyncCheckpointIO's thread (the save already runs behind the training): its end,
            # which fit waits for, is the commit's, so the pointer is in when fit returns (its
            # teardown does not reach this plugin); a failure is the manager's to tell
            futures.wait([handle.committed])

    def _point(self, path: str, step: int, fut: Any) -> None:
        """Rank 0, once the manager's save of ``step`` is over: the pointer file at ``path``
        (written to a temporary name and renamed), unless the save failed (the manager tells
        that at its next call) or ``path`` was removed meanwhile. A save of a newer step to
        the same path still in flight does not hold it back: until that one is committed,
        this step is the newest whole one (the manager's saves end in order)."""
        with self._lock:
            steps = self._pending.get(path)
            if steps is None or step not in steps:
                return
            steps.discard(step)
            if not steps:
                del self._pending[path]
            if fut.exception() is not None:
                return
            # under the lock: a removal of ``path`` asked for now waits for it
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
        if self.settings is None:
            raise UsageError(
                f"{target} names step {step} of a CheckpointManager: load it with the "
                "CheckpointIO(settings=...) that saved it (outside a Trainer: "
                "ckptfmt_torch.lightning.load_from_checkpoint(MyModel, path, "
                "checkpoint_io=CheckpointIO(settings=...)))"
            )
        report = self._manager_now().restore(
            None, read=self.read, trust_pickle=self.trust_pickle, step=step
        )
        if report.step != step or report.state is None:
            raise CkptError(
                f"{target} names step {step}, which the manager cannot restore (tried: "
                f"{'; '.join(report.tried) or 'nothing'}); its newest steps are "
                f"{sorted(self._manager_now().steps())[-3:]}"
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


def _key(path: Any) -> str:
    """The one spelling of a checkpoint path the bookkeeping uses (Lightning names a path the
    same way for its save and its deletion, but relative or absolute as it was given); a
    bucket's URL as it is (made absolute, it would name a local ``s3:/`` directory)."""
    if _bucket(path) is not None:
        return str(path)
    return str(os.path.abspath(os.fspath(path)))


def _bucket(path: Any) -> Store | None:
    """The store of ``path`` when it is a bucket's URL (a remote ``dirpath`` of
    ``ModelCheckpoint``, ``trainer.save_checkpoint(url)``), else None. Makes no request."""
    if not isinstance(path, str):
        return None
    where = parse_location(path)
    return where.store() if where.is_bucket else None


def _there(key: str) -> bool:
    """Whether something is at the checkpoint path ``key``: a committed checkpoint in a
    bucket, a file, a link or a directory."""
    bucket = _bucket(key)
    if bucket is not None:
        return bucket.is_committed()
    target = Path(key)
    return target.exists() or target.is_symlink()


# --- damage: which checkpoint, and which other to resume from ----------------------------------


def _named(exc: CkptError, target: Path) -> CkptError:
    """``exc`` (its class and fields kept, so ``except ChecksumError`` still catches it) with a
    message that names the checkpoint ``target`` and the newest other checkpoint beside it."""
    text = str(exc)
    if str(target) not in text:
        text = f"{target}: {text}"
    text += "; nothing of it was loaded"
    other = _newest_beside(target)
    if other is None:
        text += f"; there is no other checkpoint in {target.parent}"
    else:
        path, step = other
        text += (
            f"; an older checkpoint is beside it: {path} (step {step}): check it with "
            f"`ckptfmt verify {path}` and resume from it with "
            f"trainer.fit(model, ckpt_path={str(path)!r})"
        )
    named = type(exc).__new__(type(exc))  # not copy.copy: it would call __init__ with args
    named.__dict__.update(exc.__dict__)
    named.args = (text,)
    return named


def _newest_beside(target: Path) -> tuple[Path, int | None] | None:
    """The committed ckptfmt checkpoint in ``target``'s directory, other than ``target``, with
    the highest step (the newest file of those of one step); ``None`` when there is none."""
    best: tuple[tuple[int, float], Path, int | None] | None = None
    try:
        siblings = list(target.parent.iterdir())
    except OSError:
        return None
    for path in siblings:
        if path.name.startswith(".") or path.name == target.name or not path.is_dir():
            continue
        try:
            if not is_committed(path):
                continue
            step = open_checkpoint(path).manifest.step
            rank = (step if step is not None else -1, path.stat().st_mtime)
        except (CkptError, OSError):
            continue
        if best is None or rank > best[0]:
            best = (rank, path, step)
    return None if best is None else (best[1], best[2])


# --- loading as Lightning's load_from_checkpoint does ------------------------------------------

# the plugin a load_from_checkpoint call asked for, seen by the hooked pl_load inside it
_LOAD_WITH: contextvars.ContextVar[CheckpointIO | None] = contextvars.ContextVar(
    "ckptfmt_lightning_load_with", default=None
)


def load_from_checkpoint(
    cls: type[M],
    path: str | os.PathLike[str],
    /,
    *,
    map_location: Location | None = None,
    hparams_file: str | os.PathLike[str] | None = None,
    strict: bool | None = None,
    checkpoint_io: CheckpointIO | None = None,
    **hparams: Any,
) -> M:
    """``cls.load_from_checkpoint(path, ...)`` for a ckptfmt checkpoint: the ``LightningModule``
    (or ``LightningDataModule``) ``cls`` built from the hyper-parameters saved with
    ``save_hyperparameters`` (``hparams`` override them, ``hparams_file`` replaces them), its
    weights loaded (``strict`` as Lightning's), on ``map_location`` (the CPU by default: the
    checkpoint does not record the device it was saved from). It is Lightning's own
    ``load_from_checkpoint``, reading the checkpoint through ``checkpoint_io`` (default
    ``CheckpointIO()``; the one with ``local_dir``/``shared_dir`` for a manager's pointer), so
    every argument means what it means there; a ``torch.save`` file loads as Lightning loads it.

    Importing ``ckptfmt_torch.lightning`` also makes ``MyModel.load_from_checkpoint(path)`` and
    Lightning's ``TorchCheckpointIO`` (a Trainer without the plugin: ``trainer.validate(model,
    ckpt_path=path)``) read a ckptfmt checkpoint directory: their file loader (``pl_load``) is
    wrapped so that a local directory or a manager's pointer file goes through ckptfmt, and
    anything else to Lightning's."""
    if not (isinstance(cls, type) and issubclass(cls, (_LightningModule, _LightningDataModule))):
        raise UsageError(
            "load_from_checkpoint builds a LightningModule or LightningDataModule class, "
            f"got {cls!r}"
        )
    _install_load_hook()
    kwargs: dict[str, Any] = {"map_location": map_location, "hparams_file": hparams_file}
    if issubclass(cls, _LightningModule):
        kwargs["strict"] = strict
    elif strict is not None:
        raise UsageError("strict is an argument of a LightningModule's load, not a data module's")
    token = _LOAD_WITH.set(checkpoint_io)
    try:
        model: M = cls.load_from_checkpoint(os.fspath(path), **kwargs, **hparams)
    finally:
        _LOAD_WITH.reset(token)
    return model


def _on_disk(path: Any) -> Path | None:
    """``path`` if it names a local directory (a checkpoint of ours, or nothing Lightning's
    loader can read) or a manager's pointer file; ``None`` for anything else."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    text = os.fspath(path)
    if not isinstance(text, str) or "://" in text or text.startswith("http"):
        return None
    target = Path(text)
    if target.is_dir():
        return target
    if target.is_file():
        try:
            with target.open("rb") as f:
                head = f.read(96)
        except OSError:
            return None
        if head.lstrip().startswith(b"{") and POINTER_FORMAT.encode() in head:
            return target
    return None


def _hooked(original: Callable[..., Any]) -> Callable[..., Any]:
    def pl_load(
        path_or_url: Any, map_location: Location | None = None, weights_only: bool | None = None
    ) -> Any:
        target = _on_disk(path_or_url)
        if target is None:
            return original(path_or_url, map_location=map_location, weights_only=weights_only)
        io = _LOAD_WITH.get() or CheckpointIO()
        return io.load_checkpoint(target, map_location=map_location)

    pl_load.ckptfmt_wraps = original  # type: ignore[attr-defined]
    return pl_load


def _install_load_hook() -> None:
    """Wrap ``pl_load`` where Lightning's ``load_from_checkpoint`` and ``TorchCheckpointIO``
    call it (once; the modules of the ``lightning`` package as well, when imported). A
    Lightning whose loader moved raises ``FrameworkCompatError`` here, at the import of this
    module, rather than leaving its loaders silently blind to ckptfmt directories."""
    _compat.wrap_lightning_loader(_hooked)


_install_load_hook()
