"""Hugging Face ``Trainer`` with ckptfmt checkpoints: one line to enable.

    from ckptfmt_torch.hf import Trainer          # in place of: from transformers import Trainer

    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=True)

A trainer that is already a subclass takes the mixin: ``class MyTrainer(CheckpointMixin,
SFTTrainer)``. Options (``ckptfmt=CheckpointOptions(...)``): saves through
``ckptfmt.CheckpointManager`` with its ``settings`` (``ckptfmt.ManagerSettings``: background
saves, levels, redundancy) and HF-loadable weights beside the data (``hf_weights``).

HF's own logic stays where it is right (when to save, ``trainer_state.json``, the data position:
on resume HF skips the batches ``global_step`` says were trained; best-model bookkeeping);
only the storage of the big state changes. Each ``output_dir/checkpoint-N/`` holds:

- ``ckptfmt/``: a ckptfmt checkpoint of the model, the optimizer, the LR scheduler, the gradient
  scaler and every rank's random generators (``PerRank``), written by every rank in parallel
  (the core's collective save) and committed atomically; nothing in it is ever unpickled.
  With the manager it is a link to the manager's level-3 step (``<shared_dir>/step-...``).
- ``config.json`` (and ``generation_config.json``), the tokenizer files when the trainer has
  one, ``training_args.json`` (the arguments as JSON; HF's pickled ``training_args.bin`` is not
  written), ``model.safetensors`` with ``hf_weights=True`` (else ``ckptfmt export`` makes it).
- ``trainer_state.json``, written last, once the data is committed: a directory without it is
  a torn save. ``resume_from_checkpoint=True`` takes the newest complete one, and
  ``save_total_limit`` counts and removes complete ones only, never the one being written.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ckptfmt.errors import (
    CkptError,
    DamagedCheckpointError,
    DamagedError,
    LoadFailedError,
    PerRankError,
    UnreadableError,
    UsageError,
)
from ckptfmt.format import WriteOptions, checked_write
from ckptfmt.parallel import CheckpointManager, ManagerSettings, load_collective
from ckptfmt.plan import ReadOptions
from ckptfmt.storage import step_dir_name
from ckptfmt_torch import _compat, hf_data
from ckptfmt_torch.checkpoint import default_comm, save
from ckptfmt_torch.convert import from_state, to_state
from ckptfmt_torch.fence import FencedSaver
from ckptfmt_torch.training import rng_state, set_rng_state

log = logging.getLogger(__name__)
_T = TypeVar("_T")

DATA_DIR = "ckptfmt"
"""The ckptfmt checkpoint inside ``checkpoint-N/`` (a directory, or a link to a level-3 step)."""
MANAGED_NAME = "ckptfmt-step.json"
"""Beside a manager's step: which step of which levels the checkpoint directory stands for."""
STATE_NAME = "trainer_state.json"
ARGS_NAME = "training_args.json"
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")

if TYPE_CHECKING:
    _Base = transformers.Trainer
else:
    _Base = object


@dataclasses.dataclass(frozen=True, init=False)
class CheckpointOptions:
    """How the trainer writes its checkpoints.

    ``settings`` (:class:`ckptfmt.ManagerSettings`): save through a ``CheckpointManager`` with
    these settings, passed to it as they are: its levels (level 1 on node-local disks,
    ``local_dir``, protected across nodes by ``redundancy``, flushed to level 3 every
    ``flush_every``-th save), and ``async_save`` (``save`` returns once the state is copied
    into host buffers; the files are written and committed behind the training, and
    ``trainer_state.json`` follows the commit). Level 3 defaults to ``<output_dir>/ckptfmt``;
    the trainer sets ``keep_shared`` (from ``save_total_limit``) and ``on_error="raise"``
    itself, and keeps the step of the best checkpoint (``CheckpointManager.keep``) as long as
    the rotation keeps its directory. The settings' fields may be given as keywords instead
    (``CheckpointOptions(async_save=True)``, ``local_dir=...``); saves spelled so are
    synchronous unless ``async_save=True``. Without either, every rank writes its share of each
    checkpoint and the save returns once it is committed.

    ``hf_weights``: also write ``model.safetensors`` (rank 0, blocking) for
    ``from_pretrained``. ``write``: chunk and shard sizes, threads, fsync (of a save without a
    manager; the keyword spelling passes it to the manager too).

    ``fenced=True`` (with ``async_save``): the save returns once the small part of the state
    (scheduler, RNG, counters) is copied; the parameters and the optimizer's state are copied
    on the manager's thread while the next steps' forward and backward run, and the optimizer's
    next ``step`` waits for what is not copied yet (:class:`ckptfmt_torch.FencedSaver` on the
    trainer's optimizer). A parameter or optimizer tensor changed in place outside the
    optimizer before that step fails the save, nothing committed, and raises
    :class:`~ckptfmt.errors.StateChangedError` at the step.
    """

    settings: ManagerSettings | None = None
    hf_weights: bool = False
    write: WriteOptions | None = None
    fenced: bool = False

    def __init__(
        self,
        *,
        settings: ManagerSettings | None = None,
        hf_weights: bool = False,
        write: WriteOptions | None = None,
        fenced: bool = False,
        **options: Any,
    ) -> None:
        # async_save=False alone is the default spelled out: no manager
        if options and options != {"async_save": False}:
            if settings is None:  # the keyword spelling: synchronous, written as `write` says
                options.setdefault("async_save", False)
                if write is not None:
                    options.setdefault("write", write)
            settings = ManagerSettings.of(settings, **options)
        elif settings is not None:
            settings = ManagerSettings.of(settings)
        object.__setattr__(self, "settings", settings)
        object.__setattr__(self, "hf_weights", hf_weights)
        object.__setattr__(self, "write", None if write is None else checked_write(write))
        if fenced and (settings is None or not settings.async_save):
            raise UsageError(
                "CheckpointOptions(fenced=True) overlaps the copy of background saves: give "
                "async_save=True (or settings with it)"
            )
        object.__setattr__(self, "fenced", fenced)

    @property
    def managed(self) -> bool:
        """Whether saves go through a ``CheckpointManager``."""
        return self.settings is not None


def checkpoint_step(path: str | os.PathLike[str]) -> int | None:
    """The N of a ``checkpoint-N`` directory name, else None."""
    m = _CHECKPOINT.match(Path(path).name)
    return int(m[1]) if m else None


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether ``checkpoint-N/`` is a whole checkpoint: its ``trainer_state.json`` (written
    last) is there, and its ckptfmt data, when it has a ``ckptfmt/`` entry, is committed."""
    p = Path(path)
    if not (p / STATE_NAME).is_file():
        return False
    data = p / DATA_DIR
    return not (data.exists() or data.is_symlink()) or (data / "ckptfmt.json").is_file()


def last_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The newest complete ``checkpoint-N`` under ``output_dir`` (``get_last_checkpoint``
    that skips torn saves), or None."""
    root = Path(output_dir)
    found = [(s, p) for p in _children(root) if (s := checkpoint_step(p)) is not None]
    complete = [(s, p) for s, p in found if is_complete(p)]
    return str(max(complete)[1]) if complete else None


def damaged_checkpoint(checkpoint: Path, cause: BaseException) -> DamagedCheckpointError:
    """The error a resume from ``checkpoint`` (``checkpoint-N/``) raises when its data is
    damaged (``cause``, naming the file): it names the checkpoint, the newest older complete
    one beside it and the call that resumes from that one. Resuming from another step is the
    user's choice (the steps since are trained again), so it is never taken silently."""
    step = checkpoint_step(checkpoint)
    older = [
        (s, p)
        for p in _children(checkpoint.parent)
        if (s := checkpoint_step(p)) is not None and step is not None and s < step
        if is_complete(p)
    ]
    if older:
        found = str(max(older)[1])
        hint = f"resume from it with trainer.train(resume_from_checkpoint={found!r})"
        return DamagedCheckpointError(str(checkpoint), cause, found, hint)
    data = checkpoint / DATA_DIR
    hint = f"`ckptfmt verify {data}` lists every damaged file"
    return DamagedCheckpointError(str(checkpoint), cause, None, hint)


def on_no_level(checkpoint: Path, step: int | None, held: set[int]) -> UsageError:
    """The error a resume from ``checkpoint`` (``checkpoint-N/``) raises when its step was on
    the manager's level 1 only and no level given holds it now (another ``local_dir``, or the
    node's disk lost): it names the newest older complete checkpoint that would restore (its
    data committed beside it or on level 3, a step the manager holds, ``held``, or HF's own
    files) and the call that resumes from it. Never taken silently, not even for
    ``resume_from_checkpoint=True``: the steps since would be trained again, and the newer
    checkpoint overwritten, when giving the right ``local_dir`` may restore it."""
    why = (
        f"{checkpoint}: its ckptfmt step {step} was saved on the manager's level 1 only, and no "
        "level given holds it (ckptfmt=CheckpointOptions(local_dir=...) must name the "
        "node-local directory that does, as when it was saved)"
    )
    older = [
        (s, p)
        for p in _children(checkpoint.parent)
        if (s := checkpoint_step(p)) is not None and step is not None and s < step
        if is_complete(p) and _restorable(p, s, held)
    ]
    if not older:
        return UsageError(f"{why}; no older checkpoint beside it restores either")
    found = str(max(older)[1])
    return UsageError(
        f"{why}; the newest older checkpoint that restores is {found} (step {max(older)[0]}): "
        f"resume from it with trainer.train(resume_from_checkpoint={found!r}) (the steps "
        "since are trained again)"
    )


def _restorable(path: Path, step: int, held: set[int]) -> bool:
    """Whether the complete ``checkpoint-N`` at ``path`` has its state: its ckptfmt data
    (committed: :func:`is_complete`), a step the manager holds, or HF's own files."""
    return (path / DATA_DIR).is_dir() or step in held or not (path / MANAGED_NAME).is_file()


def _children(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with each tied tensor once (``lm_head.weight``, the embedding's
    own memory, is left out as HF's ``save_pretrained`` leaves it): views of the module's
    tensors, so that loading into them loads the model, tied names included."""
    seen: set[tuple[Any, ...]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if t.numel():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride())
            if key in seen:
                continue
            seen.add(key)
        out[name] = t
    return out


class CheckpointMixin(_Base):
    """Put before a ``transformers.Trainer`` subclass: ``class T(CheckpointMixin, SFTTrainer)``.
    Takes the trainer's arguments plus ``ckptfmt=CheckpointOptions(...)`` (keyword)."""

    # the epochs' data positions, set when training starts (``_init_training_state``)
    _ckptfmt_epochs: hf_data.Epochs | None = None
    # the checkpoint ``train`` resumes from, while it runs
    _ckptfmt_resuming: str | None = None

    def __init__(self, *args: Any, ckptfmt: CheckpointOptions | None = None, **kwargs: Any):
        _compat.check_trainer()  # the private hooks below are HF's still, or a loud error
        super().__init__(*args, **kwargs)
        if ckptfmt is not None and not isinstance(ckptfmt, CheckpointOptions):
            raise UsageError(f"ckptfmt= takes a CheckpointOptions, got {type(ckptfmt).__name__}")
        self.ckptfmt = ckptfmt or CheckpointOptions()
        if self.ckptfmt.managed:  # a setting the trainer decides itself is refused now
            self._ckptfmt_settings(str(self.args.output_dir))
        self._ckptfmt_manager: CheckpointManager | None = None
        self._ckptfmt_loaded: tuple[str, dict[str, Any]] | None = None
        self._ckptfmt_pending: Future[int] | None = None
        self._ckptfmt_saver: FencedSaver | None = None  # fenced: on the trainer's optimizer

    # --- training ----------------------------------------------------------------------------

    def train(  # type: ignore[override]
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> transformers.trainer_utils.TrainOutput:
        """``Trainer.train``; ``resume_from_checkpoint=True`` takes the newest *complete*
        checkpoint (HF's ``get_last_checkpoint`` would take a torn one)."""
        if resume_from_checkpoint is True:
            found = last_checkpoint(str(self.args.output_dir))
            if found is None:
                raise UsageError(f"no complete checkpoint in output_dir {self.args.output_dir}")
            resume_from_checkpoint = found
        resuming = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
        self._ckptfmt_resuming = resuming
        try:
            out = super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)
        except BaseException:
            self._ckptfmt_loaded = None
            self._ckptfmt_resuming = None
            try:
                self.wait_for_checkpoint()
            except CkptError as exc:  # the save in flight failed too: logged, the training's
                log.warning("while training failed, %s", exc)  # own error is the one raised
            raise
        self._ckptfmt_loaded = None
        self._ckptfmt_resuming = None
        self.wait_for_checkpoint()
        return out

    @property
    def checkpoint_manager(self) -> CheckpointManager | None:
        """The ``CheckpointManager`` of managed saves, once made (None before, and without)."""
        return self._ckptfmt_manager

    def _ckptfmt_settings(self, run_dir: str | os.PathLike[str]) -> ManagerSettings:
        """The manager's settings: the options' as they are, level 3 by default in
        ``run_dir/ckptfmt``, and what the trainer decides itself: ``keep_shared`` from
        ``save_total_limit`` (a step of every checkpoint-N kept stays on level 3) and
        ``on_error="raise"`` (a save's failure is the training's)."""
        settings = self.ckptfmt.settings
        if settings is None:
            raise UsageError("the trainer's CheckpointOptions name no manager settings")
        if settings.shared_dir is None:
            settings = dataclasses.replace(settings, shared_dir=Path(run_dir) / DATA_DIR)
        limit = self.args.save_total_limit
        return settings.decided_by(
            "the Trainer (from its save_total_limit; its saves raise their failures)",
            keep_shared=limit + 1 if limit else 0,  # the one in flight comes on top
            on_error="raise",
        )

    def wait_for_checkpoint(self) -> None:
        """Wait for the save in flight (async saves) and finish its directory. ``train`` calls
        it before it returns."""
        if self._ckptfmt_saver is not None:
            saver, self._ckptfmt_saver = self._ckptfmt_saver, None
            saver.close()  # the fence off the optimizer; the save in flight committed
        if self._ckptfmt_manager is not None:
            self._ckptfmt_manager.wait()

    # --- saving ------------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """HF's ``_save_checkpoint`` with the big state in ckptfmt; same order of callbacks and
        best-model bookkeeping; ``trainer_state.json`` and the rotation after the commit."""
        step = self.state.global_step
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = _compat.trainer_output_dir(self, trial)
        out = Path(run_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        sd = self._ckptfmt_state_dict()
        fenced = self.ckptfmt.managed and self.ckptfmt.fenced
        # an unsupported object is refused here (the fenced saver's walk: in its save), before
        # anything is written
        state = to_state(sd) if not fenced else sd
        if self.state.best_global_step:
            best = Path(run_dir) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}"
            # HF checks after its model is saved: the checkpoint being saved now counts
            if best == out or best.exists():
                self.state.best_model_checkpoint = str(best)
        trainer_state = self._trainer_state_json()
        if self.args.should_save:  # the step saved again (after a resume): torn until rewritten
            (out / STATE_NAME).unlink(missing_ok=True)
        if not self.ckptfmt.managed:
            out.mkdir(parents=True, exist_ok=True)
            write = self.ckptfmt.write or WriteOptions()
            save(state, out / DATA_DIR, step=step, write=dataclasses.replace(write, overwrite=True))
            self._write_hf_files(out)
            self._finish(out, trainer_state, None)
        else:
            mgr = self._manager(run_dir)
            # the best checkpoint, kept by the rotation, keeps its step (keep_shared counts the
            # newest steps only)
            best_dir = self.state.best_model_checkpoint
            best_step = None if best_dir is None else checkpoint_step(best_dir)
            mgr.keep([] if best_step is None else [best_step])
            handle = self._ckptfmt_fenced(mgr).save(step, sd) if fenced else mgr.save(step, state)
            made = False  # whether this save made the directory (a failed save removes it)
            if self.args.should_save:
                made = not out.exists()
                out.mkdir(parents=True, exist_ok=True)
                self._write_hf_files(out)
            handle.committed.add_done_callback(
                lambda f: self._finish(out, trainer_state, f, made=made)
            )
            if not mgr.async_save:
                mgr.wait()
        if self.args.push_to_hub:
            _compat.trainer_push(self, str(out))

    def _ckptfmt_fenced(self, mgr: CheckpointManager) -> FencedSaver:
        """The fenced saver on the trainer's optimizer (made again if the trainer made
        another)."""
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        saver = self._ckptfmt_saver
        if saver is None or saver.manager is not mgr or saver.optimizers != [optimizer]:
            if saver is not None:
                saver.close()
            saver = self._ckptfmt_saver = FencedSaver(mgr, optimizer)
        return saver

    def _ckptfmt_state_dict(self) -> dict[str, Any]:
        """What the checkpoint holds, as a PyTorch state dict (views, nothing copied)."""
        sd: dict[str, Any] = {"model": weights(self.accelerator.unwrap_model(self.model))}
        if not self.args.save_only_model:
            sd["optimizer"] = getattr(self.optimizer, "optimizer", self.optimizer)
            if self.lr_scheduler is not None:
                sd["scheduler"] = self.lr_scheduler
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                sd["scaler"] = scaler
            sd["rng"] = rng_state()
        sd["trainer"] = {"global_step": self.state.global_step}
        epochs = self._ckptfmt_epochs
        length = hf_data.length(self.train_dataset)
        if epochs is not None and length is not None:
            sd["trainer"]["data"] = epochs.position(
                self.state.global_step,
                length,
                self._ckptfmt_per_step(),
                self.args.world_size,
            )
        return sd

    def _ckptfmt_per_step(self) -> int:
        """Samples of the epoch's order one optimizer step takes, over all ranks."""
        args = self.args
        return int(args.train_batch_size * args.gradient_accumulation_steps * args.world_size)

    def _trainer_state_json(self) -> str:
        """``trainer_state.json`` as HF writes it, with the stateful callbacks' state now."""
        exportable = _compat.exportable_state()
        states: Any = self.state.stateful_callbacks  # a dict by name (typed as a list in HF)
        for cb in [*self.callback_handler.callbacks, self.control]:
            if isinstance(cb, exportable):
                name = type(cb).__name__
                if isinstance(states[name], list):
                    states[name].append(cb.state())
                else:
                    states[name] = cb.state()
        return json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n"

    def _write_hf_files(self, out: Path) -> None:
        """Rank 0: what HF's tools read beside the data (not yet ``trainer_state.json``)."""
        if not self.args.should_save:
            return
        model = self.accelerator.unwrap_model(self.model)
        if self.ckptfmt.hf_weights and hasattr(model, "save_pretrained"):
            model.save_pretrained(str(out))
        else:
            config = getattr(model, "config", None)
            if config is not None:
                config.save_pretrained(str(out))
            gen = getattr(model, "generation_config", None)
            if gen is not None and getattr(model, "can_generate", lambda: False)():
                gen.save_pretrained(str(out))
        if self.processing_class is not None and hasattr(self.processing_class, "save_pretrained"):
            self.processing_class.save_pretrained(str(out))
        args: Any = self.args
        (out / ARGS_NAME).write_text(args.to_json_string(), encoding="utf-8")

    def _finish(
        self, out: Path, trainer_state: str, committed: Future[int] | None, made: bool = False
    ) -> None:
        """Rank 0, once the data is committed (at once for a blocking save, on the saver
        thread after an async one): the link to the manager's step, ``trainer_state.json``
        last, then the rotation. A failed save removes the directory when it made it
        (``made``): it holds only HF's files of this save (``model.safetensors`` with
        ``hf_weights``) and no trainer state, so nothing resumes from it and the rotation,
        which counts complete checkpoints only, would never remove it. A directory that was
        there before (the step saved again after a resume) is left, torn."""
        if not self.args.should_save:
            return
        if committed is not None:
            if committed.exception() is not None:
                log.warning("checkpoint %s was not committed: %s", out, committed.exception())
                if made:
                    shutil.rmtree(out, ignore_errors=True)
                return
            self._link_step(out, committed.result())
        tmp = out / f".{STATE_NAME}.tmp"
        tmp.write_text(trainer_state, encoding="utf-8")
        os.replace(tmp, out / STATE_NAME)
        self._rotate(out.parent)

    def _link_step(self, out: Path, step: int) -> None:
        mgr = self._ckptfmt_manager
        if mgr is None:  # pragma: no cover - a managed save made it
            return
        out.mkdir(parents=True, exist_ok=True)
        shared = mgr.levels.shared_dir
        record = {"step": step, "local_dir": mgr.settings.local_dir, "shared_dir": str(shared)}
        (out / MANAGED_NAME).write_text(json.dumps(record) + "\n", encoding="utf-8")
        link = out / DATA_DIR
        if link.is_symlink() or link.exists():
            (shutil.rmtree if link.is_dir() and not link.is_symlink() else os.unlink)(link)
        target = None if shared is None else Path(shared) / step_dir_name(step)
        if target is not None and (target / "ckptfmt.json").is_file():
            link.symlink_to(os.path.relpath(target, out), target_is_directory=True)

    def _rotate(self, run_dir: Path) -> None:
        """``save_total_limit`` over complete checkpoints only (never the one in flight),
        keeping the newest and the best, as HF's ``rotate_checkpoints`` does."""
        limit = self.args.save_total_limit
        if limit is None or limit <= 0:
            return
        steps = [(checkpoint_step(p), p) for p in _children(run_dir) if is_complete(p)]
        found = sorted((s, p) for s, p in steps if s is not None)
        protected = {found[-1][1]} if found else set()
        if self.state.best_model_checkpoint is not None:
            protected.add(Path(self.state.best_model_checkpoint))
        extra = len(found) - max(limit, len(protected))
        for _, path in found:
            if extra <= 0:
                break
            if path not in protected:
                log.info("deleting older checkpoint %s (save_total_limit=%s)", path, limit)
                shutil.rmtree(path, ignore_errors=True)
                extra -= 1

    def _manager(self, run_dir: str | os.PathLike[str]) -> CheckpointManager:
        """Collective the first time (every rank): the manager of the options' levels."""
        if self._ckptfmt_manager is None:
            self._ckptfmt_manager = CheckpointManager(
                settings=self._ckptfmt_settings(run_dir), comm=default_comm()
            )
        return self._ckptfmt_manager

    # --- resuming ----------------------------------------------------------------------------
    # _save_checkpoint above and the _load_* below override private Trainer methods by name:
    # each is an entry of _compat.TRAINER_OVERRIDES, checked when the trainer is made.

    def set_initial_training_values(
        self, args: Any, dataloader: Any
    ) -> tuple[int, int, int, int, int, int | None, int]:
        """HF's (epochs, steps per epoch, examples, samples, total batch, batches per epoch,
        max steps). Resumed at another number of ranks, this run's epochs begin at other
        optimizer steps (``hf_data.Epochs.origin``): with ``max_steps`` the run gets the epochs
        it needs to reach it (HF counts them from step 0, too few when the run that saved took
        more samples a step); with ``num_train_epochs`` its last step is where its last epoch
        ends, so that the run, the LR schedule and ``max_steps`` end together. Collective
        (every rank): the checkpoint is read here, once (``_ckptfmt_read`` keeps it). A public
        method of ``Trainer`` (its documented hook for these numbers), so not one of the
        private names ``_compat`` checks."""
        epochs, per_epoch, examples, samples, total, batches, max_steps = (
            super().set_initial_training_values(args, dataloader)
        )
        path = self._ckptfmt_resuming
        found = None if path is None else self._ckptfmt_resume(path, None, per_epoch)
        if found is not None:
            origin = found[3].origin
            if args.max_steps > 0:
                epochs = max(epochs, -(-(max_steps - origin) // per_epoch))
            else:
                max_steps += origin
        return epochs, per_epoch, examples, samples, total, batches, max_steps

    def _init_training_state(
        self,
        max_steps: int,
        num_update_steps_per_epoch: int,
        num_train_epochs: int,
        resume_from_checkpoint: str | None,
        trial: Any,
    ) -> tuple[int, int]:
        """HF's (epochs trained, batches of the epoch to skip), from the checkpoint's global
        data position when it has one (``hf_data``): the same numbers as HF's at the world
        size that saved; at another, the skip in this size's batches, or a
        ``DataPositionError``."""
        epochs, skip = super()._init_training_state(  # type: ignore[misc]
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        self._ckptfmt_epochs = hf_data.Epochs(num_update_steps_per_epoch)
        found = (
            None
            if resume_from_checkpoint is None
            else self._ckptfmt_resume(
                resume_from_checkpoint, self.state.global_step, num_update_steps_per_epoch
            )
        )
        if found is None:
            return epochs, skip  # HF's own files, or saved before positions were global
        saved, epoch, done, self._ckptfmt_epochs = found
        ga, per_step = self.args.gradient_accumulation_steps, self._ckptfmt_per_step()
        if self.args.ignore_data_skip:
            return epoch, 0
        if saved.get("world_size") != self.args.world_size and self.args.process_index == 0:
            log.warning(
                "ckptfmt: resumed at sample %d of epoch %d (the epoch's global order), saved by "
                "%s rank(s), continued by %d: %s -> %d samples per optimizer step; skipping %d "
                "step(s) of this run's loader, the step counter goes on from %d",
                int(saved["samples"]),
                epoch,
                saved.get("world_size"),
                self.args.world_size,
                saved.get("per_step"),
                per_step,
                done,
                self.state.global_step,
            )
        return epoch, done * ga

    def _ckptfmt_resume(
        self, checkpoint: str, global_step: int | None, steps_per_epoch: int
    ) -> tuple[dict[str, Any], int, int, hf_data.Epochs] | None:
        """Collective (every rank, through ``_ckptfmt_read``): the checkpoint's saved data
        position and, in this run's units, the epoch to resume in, its optimizer steps done
        and the run's :class:`hf_data.Epochs`; None for a checkpoint without a position (HF's
        own files, earlier versions) or a training set without a length. ``global_step``:
        the checkpoint's (read from its ``trainer_state.json`` when None). Raises
        ``DataPositionError`` for a position this run cannot continue."""
        tree = self._ckptfmt_read(checkpoint)
        saved = None if tree is None else dict(tree.get("trainer", {})).get("data")
        length = hf_data.length(self.train_dataset)
        if saved is None or length is None:
            return None
        if global_step is None:
            state = json.loads((Path(checkpoint) / STATE_NAME).read_text(encoding="utf-8"))
            global_step = int(state["global_step"])
        per_step = self._ckptfmt_per_step()
        epoch, done, epochs = hf_data.resume(saved, global_step, steps_per_epoch, length, per_step)
        return dict(saved), epoch, done, epochs

    def _ckptfmt_read(self, checkpoint: str) -> dict[str, Any] | None:
        """Collective (every rank): the ckptfmt state of ``checkpoint`` (read once per resume,
        verified), or None for a checkpoint without ckptfmt data (HF's own files)."""
        if self._ckptfmt_loaded is not None and self._ckptfmt_loaded[0] == checkpoint:
            return self._ckptfmt_loaded[1]
        ck = Path(checkpoint)
        step = checkpoint_step(ck)
        data, managed = ck / DATA_DIR, (ck / MANAGED_NAME).is_file()
        if not managed and not data.is_dir():
            return None
        tree: dict[str, Any] | None = None
        if managed and self.ckptfmt.managed:  # the manager's levels first: level 1, rebuilt
            mgr = self._manager(str(self.args.output_dir))
            # this step, not the newest: a newer one may be committed without its directory
            # (a run killed while flushing it)
            report = _per_rank_dropped(lambda read: mgr.restore(read=read, step=step))
            if report.step == step and report.state is not None:
                tree = dict(report.state)
                if self.args.process_index == 0:
                    log.info(
                        "ckptfmt: %s restored from level %s (%s)", ck, report.level, report.path
                    )
        if tree is None:
            if not data.is_dir():
                held = self._ckptfmt_manager.steps() if self._ckptfmt_manager is not None else {}
                raise on_no_level(ck, step, set(held))
            try:
                tree, manifest = _per_rank_dropped(
                    lambda read: load_collective(default_comm(), data, {}, read=read)
                )
            except LoadFailedError as exc:  # every rank: the rank that met the damage names it
                if not any(f.kind == "damage" for f in exc.rank_failures.values()):
                    raise
                own = exc.cause if isinstance(exc.cause, DamagedError | UnreadableError) else None
                raise damaged_checkpoint(ck, own or exc) from exc
            except (DamagedError, UnreadableError) as exc:
                raise damaged_checkpoint(ck, exc) from exc
            if step is not None and manifest.step != step:
                raise UsageError(f"{data} holds step {manifest.step}, not {step}")
        self._ckptfmt_loaded = (checkpoint, tree)
        return tree

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        tree = self._ckptfmt_read(resume_from_checkpoint)
        if tree is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        target = self.accelerator.unwrap_model(model if model is not None else self.model)
        from_state({"model": weights(target)}, {"model": tree["model"]})

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        tree = None if checkpoint is None else self._ckptfmt_read(checkpoint)
        if tree is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        target: dict[str, Any] = {}
        if "optimizer" in tree:
            target["optimizer"] = getattr(self.optimizer, "optimizer", self.optimizer)
        if "scheduler" in tree and self.lr_scheduler is not None:
            target["scheduler"] = self.lr_scheduler
        from_state(target, {k: tree[k] for k in target})

    def _load_scaler(self, checkpoint: str | None) -> None:
        tree = None if checkpoint is None else self._ckptfmt_read(checkpoint)
        if tree is None:
            super()._load_scaler(checkpoint)
            return
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and "scaler" in tree:
            from_state({"scaler": scaler}, {"scaler": tree["scaler"]})

    def _load_rng_state(self, checkpoint: str | None) -> None:
        tree = None if checkpoint is None else self._ckptfmt_read(checkpoint)
        if tree is None:
            super()._load_rng_state(checkpoint)
            return
        if "rng" in tree:
            set_rng_state(tree["rng"])

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        tree = None if best is None else self._ckptfmt_read(best)
        if tree is None:
            super()._load_best_model()
            return
        model = self.accelerator.unwrap_model(self.model)
        from_state({"model": weights(model)}, {"model": tree["model"]})


def _per_rank_dropped(load: Callable[[ReadOptions], _T]) -> _T:
    """Collective (every rank, through ``load``): ``load(ReadOptions())``; at another number of
    ranks than the save's, the per-rank entries (each rank's random generators) cannot be
    carried over: every rank gets the same :class:`PerRankError` from the read plan, warns
    (naming the entries and both sizes) and loads again without them, each rank keeping the new
    run's seeding. Everything else (model, optimizer, schedule, data position) is replicated and
    loads at any size."""
    try:
        return load(ReadOptions())
    except PerRankError as exc:
        log.warning("ckptfmt: %s; resuming without them (each rank keeps its own seeding)", exc)
        return load(ReadOptions(per_rank="drop"))


class Trainer(CheckpointMixin, transformers.Trainer):
    """``transformers.Trainer`` with ckptfmt checkpoints (see the module's docstring); the same
    arguments, plus ``ckptfmt=CheckpointOptions(...)``."""
