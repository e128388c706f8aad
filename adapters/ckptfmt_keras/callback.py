"""``BackupAndRestore``: Keras's callback of that name, on ckptfmt's multi-level checkpoints, for
one process or every worker of a data-parallel job.

    model.fit(data.tf_dataset(), epochs=10, callbacks=[
        BackupAndRestore("/shared/ckpt", save_freq=100, local_dir="/local/ckpt/{node}",
                         comm=MpiComm(), dataset=data)])

It takes ``keras.callbacks.BackupAndRestore``'s arguments (``backup_dir``, ``save_freq``,
``double_checkpoint``, ``delete_checkpoint``) and these:

- ``settings``: the levels, redundancy, cadence and retention, a ``ckptfmt.ManagerSettings``
  passed to ``ckptfmt.CheckpointManager``, which does all the saving, as it is; its fields may
  be given as keywords instead (``local_dir="/local/ckpt/{node}", flush_every=10``). Its level 3
  is ``backup_dir`` (a directory, or a bucket's URL with ``storage_options``); with
  ``local_dir`` (level 1, node-local, may contain ``{node}``) each checkpoint is copied to
  ``backup_dir`` every ``flush_every``-th save in the background; without it every save goes to
  ``backup_dir`` directly. Without ``settings``, ``keep_local`` /
  ``keep_shared`` default to 1, or 2 with ``double_checkpoint``.
- ``comm``: the ranks (``ckptfmt.transport.mpi.MpiComm()``; one process when omitted). Every
  worker holds the whole model and passes all of it; ckptfmt writes each tensor once, the
  writing spread over all workers. Every call is collective: all workers run ``fit`` alike.
- ``dataset``: anything with ``set_epoch(epoch)`` (``ResumableDataset``), called at every epoch's
  start.
- ``read``: ``ckptfmt.ReadOptions``, passed to ``CheckpointManager.restore``; its ``rank_map``
  and ``per_rank`` serve a job of another number of workers than the one that saved
  (``spec/reshard.md`` §3). The model and optimizer are replicated and load at any size; each
  worker's metric accumulators are per-rank entries, so such a restore fails with
  ``PerRankError`` unless a map (saved rank -> current rank) carries them over or
  ``per_rank="drop"`` drops them (a ``PerRankWarning`` lists what). Resume such a
  job from a checkpoint saved at an epoch's end: the batches of an epoch depend on the number
  of workers, so a ``step`` within an epoch means other batches at another size.

What it saves: the model's variables, the optimizer's, each worker's metric accumulators (so a
resumed epoch reports what an uninterrupted one would), and the counters ``epoch``, ``step``
(batches done in that epoch), ``global_step`` and ``optimizer_iterations``. Saves are
asynchronous: ``fit`` waits only while the variables are copied out.

How ``fit`` resumes, at ``on_train_begin``: the newest checkpoint every worker can load (level 1
first, then level 3, then older ones) is loaded into the model and optimizer; ``fit`` starts at
its epoch (as Keras's callback does); the ``step`` batches of that epoch already trained are then
taken from the data and passed over without training, so the data must give the same batches in
the same order for an epoch each time (``ResumableDataset``, or arrays with ``shuffle=False``).
They are passed over a whole execution at a time: a ``steps_per_execution`` that does not divide
the saved ``step`` (another than the save's) is refused (``UsageError``) before anything changes.
With ``steps_per_epoch`` fewer than the data's batches (or data of unknown length) Keras carries
its data iterator from one epoch to the next, which a resumed fit, starting the data afresh,
does not: a resume after the first epoch of such a fit goes on with a ``ResumeWarning`` (it
trains on other batches than the interrupted fit would have).
A checkpoint saved after an epoch's last batch resumes at the next epoch's start (the
restored counters say so), so the resumed ``fit`` reports no empty epoch; the last batch passed
over logs the restored metrics, as it logged them when it was trained.
With nothing to restore and several workers, every replica starts from rank 0's weights.
A fit that ended by an exception leaves nothing to the next fit of the model, on whichever
backup: its start epoch (which Keras keeps in the model) is cleared and its passing over undone.

``fenced=True`` (TensorFlow backend): a save takes the variables' values without copying
them (TensorFlow copies a variable on write while a value read from it is held: the values
stay those of the save whatever the training does next) and returns; the manager's thread
copies them, and the next batch's ``on_train_batch_begin`` (the fence) waits for what is not
copied yet and lets the values go. Guaranteed: the checkpoint holds the state of its step,
even where something changes a variable (``assign``, the optimizer) before the fence; such a
change only costs a copy of that variable. ``blocked_s``: per save, the seconds spent in the
save and at the fence. Under JAX and PyTorch (whose train steps donate or update the
variables' buffers in place) ``fenced`` changes nothing: the values are copied before the
save returns. With several workers the replicas' check reads the values before it returns.

On ``on_train_end`` the newest checkpoint is flushed to ``backup_dir`` and, with
``delete_checkpoint`` (Keras's default), every checkpoint is deleted from both levels
(``CheckpointManager.delete_all``): unlike Keras's callback, which removes ``backup_dir`` whole,
files of the user's in ``backup_dir`` or ``local_dir`` stay, and so does a directory holding
them.
"""

from __future__ import annotations

import time
import warnings
import weakref
from pathlib import Path
from typing import Any

import keras
import numpy as np

from ckptfmt.errors import ReplicaWarning, ResumeWarning, StateMismatchError, UsageError
from ckptfmt.parallel import CheckpointManager, ManagerSettings, RestoreReport, SaveHandle
from ckptfmt.plan import ReadOptions
from ckptfmt.storage import parse_location
from ckptfmt.transport import Comm, SingleComm
from ckptfmt.tree import PerRank
from ckptfmt_keras import _compat, backend
from ckptfmt_keras.checkpoint import from_state
from ckptfmt_keras.convert import assign, flat_names, named_variables, nest
from ckptfmt_keras.parallel import (
    agree,
    average_outside_loss_scaling,
    broadcast_variables,
    is_distributed,
)

# Managers of fits that ended by an exception (no on_train_end), by backup directory and rank:
# the next fit on that directory in this process closes the old one before it restores. The rank
# too: ranks that are threads of one process (``ckptfmt.transport.threads``) each close their own.
_OPEN: dict[tuple[str, int], CheckpointManager] = {}

# Models whose ``fit`` start epoch a callback set and (the fit ended by an exception) did not
# clear: Keras keeps it, and would start every later fit of the model there, whatever its backup.
_EPOCH_SET: weakref.WeakSet[Any] = weakref.WeakSet()


class BackupAndRestore(keras.callbacks.Callback):  # type: ignore[misc]  # Keras is untyped
    """Back up the training state while ``fit`` runs and resume it, at the right epoch and step,
    when ``fit`` runs again after a crash. See the module docstring."""

    def __init__(
        self,
        backup_dir: str | Path,
        save_freq: str | int | bool = "epoch",
        double_checkpoint: bool = False,
        delete_checkpoint: bool = True,
        *,
        settings: ManagerSettings | None = None,
        comm: Comm | None = None,
        dataset: Any = None,
        include_optimizer: bool = True,
        include_metrics: bool = True,
        read: ReadOptions | None = None,
        fenced: bool = False,
        **options: Any,
    ) -> None:
        super().__init__()
        if not backup_dir:
            raise UsageError("Empty `backup_dir` argument passed")
        if (
            save_freq != "epoch"
            and save_freq is not False
            and (isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1)
        ):
            raise UsageError(
                f"save_freq is 'epoch', a positive number of batches or False, not {save_freq!r}"
            )
        if dataset is not None and not callable(getattr(dataset, "set_epoch", None)):
            raise UsageError("dataset must have a set_epoch(epoch) method")
        keep = 2 if double_checkpoint else 1
        # a bucket's URL as given (a Path folds its "//" and names a directory ./s3:/...)
        where = parse_location(backup_dir)
        self.backup_dir: Path | str = where.spec if where.is_bucket else Path(backup_dir)
        self.save_freq = save_freq
        self.double_checkpoint = double_checkpoint
        self.delete_checkpoint = delete_checkpoint
        self.comm = comm or SingleComm()
        self.dataset = dataset
        self.include_optimizer = include_optimizer
        self.include_metrics = include_metrics
        self.read = read if read is not None else ReadOptions()
        if settings is None:  # Keras's retention: the newest checkpoint, or two
            settings = ManagerSettings(keep_local=keep, keep_shared=keep)
        self.settings = ManagerSettings.of(settings, **options).decided_by(
            "BackupAndRestore (its backup_dir is level 3)", shared_dir=self.backup_dir
        )
        self.manager: CheckpointManager | None = None
        self.last_restore: RestoreReport | None = None
        self.restored_counters: dict[str, int] | None = None
        self.replica_fixes: list[tuple[int, list[str]]] = []  # (global step, names)
        self._epoch = self._step = self._global = 0
        self._resume: tuple[int, int] | None = None  # (epoch, batches to pass over)
        self._pending_metrics: dict[str, Any] | None = None
        self._pending_rng: Any = None  # the saved torch global random state, until it is due
        self._resume_logs: dict[str, Any] = {}
        self._save_at_epoch_end = False
        self._set_initial_epoch = False
        self.fenced = fenced
        self.blocked_s: list[float] = []
        # fenced: the save in flight and the values it holds (let go at the fence)
        self._in_flight: tuple[SaveHandle, list[Any]] | None = None

    @property
    def global_step(self) -> int:
        """Batches trained so far, over all epochs and restarts (what the next save is named)."""
        return self._global

    @property
    def position(self) -> tuple[int, int]:
        """``(epoch, batches done in it)``, as the next save would record it."""
        return self._epoch, self._step

    # --- fit's hooks -----------------------------------------------------------------------------

    def on_train_begin(self, logs: Any = None) -> None:
        model = self.model
        if not model.built:
            raise UsageError(
                "build the model before fit() (call it on a batch, or give it an Input) so "
                "that its variables exist to be restored"
            )
        # what a fit of this model that ended by an exception left: the epoch it resumed at
        # (Keras would start this fit there too) and the train function passing batches over
        self._restore_train_function()
        if model in _EPOCH_SET:
            _compat.set_initial_epoch(model, None)
            _EPOCH_SET.discard(model)
        self._set_initial_epoch = False
        opt = average_outside_loss_scaling(self._optimizer())  # mixed_float16's wrapper
        if self.comm.size > 1 and opt is not None and is_distributed(opt) and model.jit_compile:
            raise UsageError(
                "the gradient exchange cannot run under XLA: compile with jit_compile=False"
            )
        key = self._key()
        stale = _OPEN.pop(key, None)
        if stale is not None:  # a fit that ended by an exception left it open
            stale.close(flush=False)
        if self.manager is not None and self.manager is not stale:  # this callback's, if left
            self.manager.close(flush=False)  # open (closed already: nothing happens)
        # a fenced save of that fit whose fence never came: its manager is closed (every save
        # in flight waited for), so its copy is over; let its values go, or this fit's first
        # fence would wait on it and add the time to that fit's last ``blocked_s`` entry
        self._in_flight = None
        self.manager = _OPEN[key] = CheckpointManager(settings=self.settings, comm=self.comm)
        self._epoch = self._step = self._global = 0
        self._resume, self._pending_metrics, self._pending_rng = None, None, None
        self._resume_logs, self._save_at_epoch_end = {}, False
        report = self.manager.restore(read=self.read)
        self.last_restore = report
        if not report.restored:
            self.restored_counters = None
            broadcast_variables(model, self.comm)  # replicas start from rank 0's weights
            if opt is not None and opt.built:
                broadcast_variables(opt, self.comm)
            return
        state = report.state or {}
        steps = (self.params or {}).get("steps")
        self._check_executions(report, state, steps)  # before anything is changed
        self._check_carried(report, state, steps)
        try:
            counters = from_state(model, state, optimizer=opt if self.include_optimizer else None)
        except StateMismatchError as exc:
            raise self._not_this_models(exc, report, state) from None
        if steps and counters["step"] >= steps:
            # saved after the epoch's last batch, before its end: resume at the next epoch's
            # start (as the uninterrupted run went on), not in an epoch of batches passed over
            counters = {**counters, "epoch": counters["epoch"] + 1, "step": 0}
        self.restored_counters = counters
        self._pending_rng = _saved_rng(state)
        self._epoch, self._step = counters["epoch"], counters["step"]
        self._global = counters["global_step"]
        if self._epoch:
            _compat.set_initial_epoch(model, self._epoch)
            self._set_initial_epoch = True
            _EPOCH_SET.add(model)
        if self._step:
            self._resume = (self._epoch, self._step)
            self._pass_over(self._step)
            if self.include_metrics and "metrics" in state:
                self._pending_metrics = state["metrics"]

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        if self.dataset is not None:
            self.dataset.set_epoch(epoch)
        self._epoch, self._step = epoch, 0
        if self._resume is not None and self._resume[0] == epoch:
            self._step = self._resume[1]  # passed over by the wrapped train function
            if self._pending_metrics is not None:
                self._restore_metrics(None)  # fit has just reset them
        else:
            self._pending_metrics = None
            if self._pending_rng is not None:
                # saved at an epoch's end: what the data pipeline draws at the next epoch's
                # start, before its first batch, is drawn after this in either run
                backend.set_rng_state(self._pending_rng)
                self._pending_rng = None
        self._resume = None

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._fence()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        steps = (self.params or {}).get("steps")
        # with steps_per_execution, Keras names a last, shorter execution's end as if it were
        # whole (batch 14 of a 12-batch epoch, 5 an execution): the epoch has ``steps`` only
        done = min(batch + 1, steps) if steps else batch + 1
        if done <= self._step:  # a batch passed over while resuming
            return
        before = self._global
        self._global += done - self._step
        self._step = done
        freq = self.save_freq
        if not isinstance(freq, (str, bool)) and self._global // freq > before // freq:
            if steps and done >= steps:
                # the epoch's last batch: saved at the epoch's end, as the next epoch's start,
                # after what fit does between (a data pipeline drawing random numbers for the
                # next epoch), which a run resumed from it then does not repeat
                self._save_at_epoch_end = True
            else:
                self._save()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._epoch, self._step = epoch + 1, 0
        if self.save_freq == "epoch" or self._save_at_epoch_end:
            self._save_at_epoch_end = False
            self._save()

    def on_train_end(self, logs: Any = None) -> None:
        self._fence()
        self._restore_train_function()
        if self._set_initial_epoch:
            _compat.set_initial_epoch(self.model, None)
            self._set_initial_epoch = False
            _EPOCH_SET.discard(self.model)
        if self.manager is None:
            return
        manager, self.manager = self.manager, None
        _OPEN.pop(self._key(), None)
        try:
            if self.delete_checkpoint:
                # the checkpoints only: a level's directory may hold the user's files too
                manager.delete_all()
        finally:  # closed whatever the deletion did: nothing else holds the manager now
            manager.close(flush=not self.delete_checkpoint)

    # --- saving ----------------------------------------------------------------------------------

    def _save(self) -> None:
        """Collective: copy the state out (the only part ``fit`` waits for) and hand it to the
        manager, which writes it in the background."""
        assert self.manager is not None
        entered = time.perf_counter()
        self._fence()
        held: list[Any] = []  # fenced: the values the arrays are views of

        def value(v: Any) -> np.ndarray:
            if self.fenced:
                taken = backend.snapshot(v)
                if taken is not None:
                    held.append(taken[1])
                    return taken[0]
            return backend.to_numpy(v)

        opt = self._optimizer() if self.include_optimizer else None
        model_vars = named_variables(self.model)  # under JAX, self.model syncs the variables
        arrays = {f"model/{n}": value(v) for n, v in model_vars.items()}
        opt_vars = named_variables(opt) if opt is not None else {}
        arrays.update({f"optimizer/{n}": value(v) for n, v in opt_vars.items()})
        differ = agree(arrays, self.comm)
        if differ:
            self._fix_replicas(differ, arrays, model_vars, opt_vars)
        state: dict[str, Any] = nest(arrays)
        if opt is not None and "optimizer" not in state:
            state["optimizer"] = {}
        if self.include_metrics:
            state["metrics"] = nest(
                {
                    name: PerRank(backend.to_numpy(v))
                    for name, v in named_variables(self.model.metrics_variables).items()
                }
            )
        rng = backend.rng_state()
        if rng is not None:  # each worker's own generator
            state["rng"] = {backend.name(): PerRank(rng)}
        state["counters"] = {
            "epoch": self._epoch,
            "step": self._step,
            "global_step": self._global,
            # a variable, or with gradient_accumulation_steps a tensor computed from one
            "optimizer_iterations": int(keras.ops.convert_to_numpy(opt.iterations))
            if opt is not None
            else 0,
        }
        if not held:
            self.manager.save(self._global, state)
            return
        handle = self.manager.save(self._global, state, background_copy=True)
        self._in_flight = (handle, held)
        self.blocked_s.append(time.perf_counter() - entered)

    def _fence(self) -> None:
        """Fenced saves: wait for the copy of the save in flight, then let its values go (the
        variables are updated in place again)."""
        if self._in_flight is None:
            return
        entered = time.perf_counter()
        (handle, _), self._in_flight = self._in_flight, None
        handle.wait_staged()
        if self.blocked_s:
            self.blocked_s[-1] += time.perf_counter() - entered

    def _fix_replicas(
        self,
        differ: list[str],
        arrays: dict[str, np.ndarray],
        model_vars: dict[str, Any],
        opt_vars: dict[str, Any],
    ) -> None:
        """Replicas that drifted apart: every worker takes rank 0's values, so the checkpoint is
        one consistent state and resuming gives what the uninterrupted run has. Expected for
        non-trainable state that each worker updates from its own batches (batch normalization
        statistics, as with Horovod); a warning when trainable or optimizer variables differ,
        which averaged gradients never cause."""
        opt_names = {f"optimizer/{n}" for n in opt_vars}
        for name in differ:
            kind, _, var = name.partition("/")
            backend.assign((model_vars if kind == "model" else opt_vars)[var], arrays[name])
        self.replica_fixes.append((self._global, differ))
        trainable = {f"model/{n}" for n in named_variables(self.model.trainable_variables)}
        if self.comm.rank == 0 and any(n in trainable or n in opt_names for n in differ):
            warnings.warn(
                f"replicas differed in {len(differ)} variable(s) at step {self._global} "
                f"({', '.join(differ[:5])}); rank 0's values taken",
                ReplicaWarning,
                stacklevel=3,
            )

    # --- resuming --------------------------------------------------------------------------------

    def _restore_metrics(self, batch: Any) -> None:
        """At the resumed epoch's start (after ``fit`` reset the metrics): set this worker's
        saved accumulators, and keep what they report for the last batch passed over. Compiled
        metrics create their variables when first used; where ``fit`` has not built them yet
        (TensorFlow), this waits for the first batch passed over (``batch``) and builds them
        from its shapes, as ``fit`` itself does (nothing runs)."""
        model = self.model
        if _compat.metrics_unbuilt(model):
            if batch is None:
                return
            _compat.build_metrics_from(model, batch)
        saved, self._pending_metrics = self._pending_metrics or {}, None
        assign(model.metrics_variables, flat_names(saved), strict=False)
        self._resume_logs = dict(model.get_metrics_result())

    def _pass_over(self, batches: int) -> None:
        """Wrap ``model.train_function`` (built by ``fit`` before ``on_train_begin``) so that the
        first ``batches`` batches are taken from the data without training; then unwrap.

        The wrapper is the same on every backend: the data is the last argument (TensorFlow
        and JAX pass an iterator, from which each call takes ``steps_per_execution`` batches;
        PyTorch passes the batch, already taken), and JAX's stateless train function also takes
        the training state first and returns it second, which a batch passed over returns
        unchanged."""
        model = self.model
        original = getattr(model.train_function, "_ckptfmt_original", model.train_function)
        per_call = int(getattr(model, "steps_per_execution", 1) or 1)
        remaining = [batches]

        def train_function(*args: Any) -> Any:
            batch = _take(args[-1], per_call)
            state = args[0] if len(args) == 2 else None
            if self._pending_metrics is not None:
                self._restore_metrics(batch)
                if state is not None:  # JAX: the metrics' values travel in the state
                    state = (*state[:3], [v.value for v in model.metrics_variables])
            remaining[0] -= per_call
            logs: dict[str, Any] = {}
            if remaining[0] <= 0:
                model.train_function = original
                if self._pending_rng is not None:  # as it was after the batch saved
                    backend.set_rng_state(self._pending_rng)
                    self._pending_rng = None
                # the last batch passed over logs what it logged when it was trained (the
                # metrics are the saved ones); should the epoch end here (its length was
                # unknown at the restore), its end reports them too, as it did then
                logs = self._resume_logs
            return logs if state is None else (logs, state)

        train_function._ckptfmt_original = original  # type: ignore[attr-defined]
        model.train_function = train_function

    def _restore_train_function(self) -> None:
        model = self.model
        original = getattr(model.train_function, "_ckptfmt_original", None)
        if original is not None:
            model.train_function = original

    # --- helpers ---------------------------------------------------------------------------------

    def _optimizer(self) -> Any:
        return getattr(self.model, "optimizer", None)

    def _key(self) -> tuple[str, int]:
        """The backup's key in ``_OPEN``: its URL, or its directory's absolute path; the rank."""
        where = self.backup_dir
        return (where if isinstance(where, str) else str(where.absolute())), self.comm.rank

    def _check_executions(
        self, report: RestoreReport, state: dict[str, Any], steps: int | None
    ) -> None:
        """Refuse a resume mid-epoch at a batch where none of this fit's executions begins
        (another ``steps_per_execution`` than the save's): the batches done are passed over a
        whole execution at a time, so the last one passed over would take batches never
        trained, and the fit would go on without them."""
        counters = dict(state.get("counters") or {})
        step, epoch = int(counters.get("step", 0)), int(counters.get("epoch", 0))
        per_call = int(getattr(self.model, "steps_per_execution", 1) or 1)
        if not step or (steps and step >= steps) or step % per_call == 0:
            return
        raise UsageError(
            f"the backup at {report.path} was saved after batch {step} of epoch {epoch}, where "
            f"no execution of {per_call} batches (this model's steps_per_execution) begins: "
            f"resume it with a steps_per_execution that divides {step} (the save's did)"
        )

    def _check_carried(
        self, report: RestoreReport, state: dict[str, Any], steps: int | None
    ) -> None:
        """Warn of a resume after the first epoch in a ``fit`` that carries its data iterator
        from one epoch to the next (``steps_per_epoch`` fewer than the data's batches, or data
        of unknown length, such as a repeated dataset): the interrupted fit's epoch went on
        where the last one stopped in the data, the resumed one starts the data afresh, so it
        trains on other batches than the interrupted fit would have. It goes on (what Keras's
        own callback does, and the backup is the run's only way forward); passing over the
        batches of the epochs before is not done: what a second pass over the data gives (a
        reshuffle, ``set_epoch``) is the data's own. A resume within the first epoch is exact
        (the data starts afresh in both fits)."""
        counters = dict(state.get("counters") or {})
        step, epoch = int(counters.get("step", 0)), int(counters.get("epoch", 0))
        if steps and step >= steps:  # resumed at the next epoch's start
            epoch, step = epoch + 1, 0
        if not epoch:
            return
        carried = _compat.carried_batches()
        if carried is None:
            return
        per_epoch, batches = carried
        has = "an unknown number of" if batches is None else str(batches)
        if self.comm.rank == 0:
            warnings.warn(
                f"resuming from {report.path}, saved at epoch {epoch}, batch {step} of a fit "
                f"with steps_per_epoch={per_epoch} and data of {has} batches: Keras carries "
                "its data iterator from one epoch to the next there, and a resumed fit starts "
                "the data afresh, so it trains on other batches than the interrupted fit "
                "would have. For a resume that is exact, give fit exactly steps_per_epoch "
                "batches an epoch (dataset.take(steps_per_epoch), with ResumableDataset "
                "choosing each epoch's batches), or leave steps_per_epoch out",
                ResumeWarning,
                stacklevel=3,
            )

    def _dirs(self) -> str:
        """The directories of this callback's backup (level 3, and level 1 if any)."""
        dirs = [str(self.backup_dir)]
        if self.manager is not None and self.manager.local_root is not None:
            dirs.append(str(self.manager.local_root))
        return " and ".join(dirs)

    def _not_this_models(
        self, exc: StateMismatchError, report: RestoreReport, state: dict[str, Any]
    ) -> StateMismatchError:
        """``exc`` (the model does not match the backup found) told as a leftover backup: its
        path and step, what differs, and which directories to remove (a ``fit`` that ends
        deletes its backup, so one is left only by a run that did not end)."""
        counters = dict(state.get("counters") or {})
        at = (
            f" (saved at epoch {counters['epoch']}, batch {counters['step']})"
            if {"epoch", "step"} <= counters.keys()
            else ""
        )
        note = (
            f"This backup{at} is left by a fit that did not end (a fit that ends deletes its "
            f"backup) and is not of this model: remove {self._dirs()} to start afresh, or give "
            "BackupAndRestore another backup_dir"
        )
        return StateMismatchError(
            exc.missing,
            exc.unexpected,
            exc.mismatched,
            into="the model",
            source="the backup",
            note=note,
            path=report.path,
            step=report.step,
        )


def _take(data: Any, count: int) -> Any:
    """Take one call's batches from what ``fit`` passes its train function (an iterator, or
    a list of batches already taken); return the first (shapes to build metrics from)."""
    if isinstance(data, (list, tuple)):
        return data[0]
    first = next(data)
    for _ in range(count - 1):
        try:
            next(data)
        except StopIteration:  # a last, shorter call
            break
    return first


def _saved_rng(state: dict[str, Any]) -> Any:
    """This worker's saved random state of the running backend, if the checkpoint has one."""
    saved = (state.get("rng") or {}).get(backend.name())
    return None if saved is None else np.asarray(saved)
