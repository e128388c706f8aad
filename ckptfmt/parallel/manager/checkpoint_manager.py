"""``CheckpointManager``: multi-level, asynchronous checkpoints for a training loop.

    settings = ManagerSettings(local_dir="/local/ckpt", shared_dir="/shared/ckpt", flush_every=10)
    mgr = CheckpointManager(settings=settings, comm=MpiComm())  # or the same fields as keywords
    report = mgr.restore(state)          # collective: the newest usable step (report.step)
    for step in ...:
        mgr.save(step, state)            # returns once the state is copied into host buffers
    mgr.close()                          # waits; flushes the newest checkpoint to level 3

Every rank of ``comm`` makes the same calls in the same order (they are collective). Saving goes
on in one background thread per rank that talks to the other ranks on a duplicated communicator;
up to ``saves_in_flight`` saves are queued or running at once, and a ``save`` made while all of
them are waits for one to be over (``when_busy="wait"``) or is skipped on every rank
(``"skip"``: counted in ``saves_skipped`` and logged, never silently). A failed save (a full
disk, a dead directory) is voted on by all ranks, leaves earlier checkpoints untouched, and is
reported at the next call: as a :class:`CheckpointWarning` by default (training goes on), or
raised with ``on_error="raise"``. Anything else escaping the background thread aborts the whole
job (``comm.start_background``).

The manager is a facade over one module per job: the staging agreement and copy
(``parallel.collective.stager``), the save job and its saver thread (``parallel.manager.save_job``),
the restore (``parallel.manager.restore``, its order a pure function in
``parallel.manager.restore_order``), flush and retention (``parallel.manager.retention``), the end
of the job (``parallel.manager.exit``), and what it reports (``parallel.manager.outcomes``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ckptfmt.engine.encode import member_sets
from ckptfmt.errors import (
    CkptError,
    FlushWarning,
    ManagerBrokenError,
    SaveSkippedError,
    UsageError,
)
from ckptfmt.parallel.collective.launch import launcher_world_size, refuse_implicit_single
from ckptfmt.parallel.collective.publish import FaultHook
from ckptfmt.parallel.collective.share import StartVote
from ckptfmt.parallel.collective.stager import Stager
from ckptfmt.parallel.collective.staging import BufferPool, SaveHandle, copy_mode, default_pool
from ckptfmt.parallel.levels.layout import Levels, agree_nodes, resolve_node
from ckptfmt.parallel.levels.pick import shared_level
from ckptfmt.parallel.levels.shared import DirLevel
from ckptfmt.parallel.manager.exit import ExitHooks
from ckptfmt.parallel.manager.options import ManagerSettings, OnError
from ckptfmt.parallel.manager.outcomes import Calls, CheckpointWarning, Outcomes
from ckptfmt.parallel.manager.restore import (
    RestoreReport,
    RestoreRequest,
    RestoreSite,
    restore_newest,
    save_number,
)
from ckptfmt.parallel.manager.retention import Retention, committed
from ckptfmt.parallel.manager.save_job import (
    Gate,
    SaveJob,
    Saver,
    SaveSettings,
    Slot,
    checked_leaves,
)
from ckptfmt.parallel.manager.telemetry import SaveReport
from ckptfmt.plan.options import ReadOptions
from ckptfmt.storage.slots import Slots
from ckptfmt.storage.steps import StepRef, parse_step
from ckptfmt.transport.comm import Comm, SingleComm
from ckptfmt.tree.casting import Cast, check_policy
from ckptfmt.tree.state import Name, Objects

__all__ = ["CheckpointManager", "CheckpointWarning", "FlushWarning", "RestoreReport"]

log = logging.getLogger("ckptfmt")


class CheckpointManager:
    """Multi-level checkpoints: level 1 on each node's ``local_dir``, flushed every
    ``flush_every``-th save to ``shared_dir`` (level 3). Either level may be omitted. The
    settings below are the fields of one :class:`~ckptfmt.ManagerSettings` (``settings=``),
    checked when it is made; keywords of the same names build one (:meth:`ManagerSettings.of`).

    ``redundancy`` protects level 1 across nodes: a scheme id (``"partner"``, ``"xor"``,
    ``"rs"``) or :class:`Redundancy` for every save, or a :class:`Policy` / list of descriptors
    (``[{"every": 1, "redundancy": "xor"}, {"every": 10, "redundancy": "rs", "m": 2},
    {"every": 100, "flush": True}]``) or a JSON file of one. ``restore`` rebuilds lost or damaged
    level-1 data from it before falling back to level 3. ``flush_every`` defaults to every save,
    or, when the policy has ``flush`` descriptors, to what they say.

    ``local_dir`` may contain ``{node}``; the node is ``node``, else the ``CKPTFMT_NODE``
    environment variable, else the host name. Constructing the manager is collective.

    ``shared_dir`` may be an object-store URL (``"s3://bucket/run"``; ``gs://``, ``az://``
    through the same library; needs ``pip install 'ckptfmt[cloud]'``): the flush then uploads
    each rank's committed level-1 files straight to the bucket and commits each step with a
    commit object (``spec/FORMAT.md``, "Checkpoints in object storage"); ``restore`` falls
    back to the bucket as to a shared directory, reading only the objects each rank needs. A
    bucket needs a ``local_dir`` (it takes flushes, not saves: no ``fallback_to_shared``).
    ``storage_options`` (keys as obstore and fsspec spell them: ``endpoint_url``, ``region``,
    ``aws_access_key_id``, ``allow_http``, the retry settings of
    :class:`~ckptfmt.storage.objects.Retries`) override the standard ``AWS_*`` environment.
    Rank 0 makes one LIST of the bucket at the start: a bucket that does not exist, refused
    credentials or an endpoint out of reach raise the same :class:`StorageError` on every rank.

    ``fallback_to_shared``: a level-1 save that fails for a storage reason on every failing
    rank (an ``OSError``: a full or failing node-local disk) is written to level 3 instead,
    when there is one; the next call warns, and ``last_save.fell_back`` says so. Any other
    failure (misuse, a bug) is the save's failure, reported as such. ``on_save``: called with
    each save's :class:`SaveReport` (blocked and background time, bytes per level, parity, level
    reached), from the saver thread.

    ``deadline_s``: how long a collective call (save, restore, delete, prune, the exit flush)
    waits for every rank to arrive (``MpiComm`` and ``TorchComm``; a transport without
    deadlines uses its own timeout). A rank left alone in a call the others never make
    (``save`` called on one rank only) is told, naming the ranks that did not arrive and the
    step, instead of waiting forever; ranks that meet from different calls (one saves step 6,
    the others step 5) are all told (:class:`~ckptfmt.errors.OutOfStepError`). The manager then
    refuses further collective calls (:class:`ManagerBrokenError`): its ranks are out of step.

    A level that fills up does not stop the saves (``docs/levels.md``, "When a level fills
    up"): a full level's oldest steps are removed to make room (never its newest), a save that
    fits on no level is told by its step, and a failed flush to level 3 is a
    :class:`FlushWarning` (``failed_flushes``), never a failed save: the step is on level 1
    and the next save flushes again. A failure told by a later ``save`` is told after that
    save's own checkpoint was taken.

    ``write`` (:class:`~ckptfmt.WriteOptions`: chunk and shard sizes, writer threads, fsync; the
    same object ``save_collective`` and ``ckptfmt reshard`` take) says how the files are written;
    its ``overwrite`` is the manager's own (a step saved again after a restart replaces the
    old one). ``at_exit`` (:class:`~ckptfmt.ExitPolicy`): the flush at ``close`` / interpreter
    exit and on SIGTERM; with several managers in one process, SIGTERM flushes every open one,
    one after another in the order they were made, and a closed one not at all
    (``parallel.manager.exit``). ``on_error``: ``"warn"`` (a failed background save is a
    :class:`CheckpointWarning` at the next call; training goes on) or ``"raise"``.

    ``progress``: called with :class:`~ckptfmt.Progress` events of each save (``op="save"``,
    from the saver thread: this rank's data and parity files; the last once it is committed)
    and of each load a restore makes (``op="load"``: this rank's reads and what it receives;
    a restore that falls back to another step or level starts a new series). ``fault``: a
    test's hook, called at the named points of each save and flush (``FaultHook``).

    ``recycle_level1`` (default True): a level-1 step that retention drops is not deleted but
    kept as a spare slot (``<local_dir>/.slots/``, out of the step names in one rename, its
    manifest removed), and the next save overwrites its files in place, which skips the new
    files' page allocation (``storage/slots.py``, ``spec/PROTOCOL.md`` §1). The slot is never
    one of the ``keep_local`` newest steps, and is written only under the save's staging name,
    so a save killed part-way leaves the kept steps whole and no torn step behind. It costs one
    more step's room on level 1 at rest; False deletes instead. Never with ``incremental``.

    ``incremental``: each save records content hashes and is made against the newest
    committed step of its level (``spec/FORMAT.md`` §17), and each flush against the newest
    step on level 3: a shard file whose content is unchanged is hard-linked on a file system,
    or copied inside the store on a bucket, instead of written or uploaded again. Only a step
    this job saved, flushed or restored is a base (a linked file is not read again: a step left
    by an earlier job, or one the restore refused, may hold damage); after a restore, the first
    save writes everything on the level the restore did not read (level 3 after a restore from
    level 1, level 1 after one from level 3). Every step stays a complete checkpoint of its
    own, which retention may delete in any order; a save's :class:`SaveReport` counts those
    bytes as ``bytes_linked`` by level.
    """

    def __init__(
        self,
        local_dir: str | Path | None = None,
        shared_dir: str | Path | None = None,
        *,
        settings: ManagerSettings | None = None,
        comm: Comm | None = None,
        pool: BufferPool | None = None,
        fault: FaultHook | None = None,
        **options: Any,
    ) -> None:
        """``settings`` (:class:`~ckptfmt.ManagerSettings`) says everything above; ``local_dir``,
        ``shared_dir`` and ``options`` (any of its fields by name: ``flush_every=10``) are the
        keyword spelling of it, and replace the fields of ``settings`` they name
        (:meth:`ManagerSettings.of`). ``comm``: the ranks (one process when omitted); ``pool``:
        the host buffers to stage into (default: the process's pool)."""
        if local_dir is not None:
            options["local_dir"] = local_dir
        if shared_dir is not None:
            options["shared_dir"] = shared_dir
        self.settings = s = ManagerSettings.of(settings, **options)
        s.need_a_level()
        if comm is None:
            refuse_implicit_single(launcher_world_size())
        shared = shared_level(s.shared_dir, s.storage_options, local_dir=s.local_dir)
        self.comm = comm or SingleComm()
        self.node = resolve_node(s.node)
        self.levels = Levels(
            None if s.local_dir is None else str(s.local_dir),
            shared.root if isinstance(shared, DirLevel) else None,
            bucket=None if isinstance(shared, DirLevel) else shared,
        )
        self.local_root = self.levels.local_root(self.node)
        self.on_error: OnError = s.on_error
        self.policy = s.policy
        self.flush_every = s.flush_period
        self.keep_local, self.keep_shared = s.keep_local, s.keep_shared
        self.async_save = s.async_save
        self.at_exit = s.at_exit
        # a step saved again (a job restarted from an older step) replaces the old directory
        self.write = dataclasses.replace(
            s.write, overwrite=True, content_hash=s.write.content_hash or s.incremental
        )
        self.incremental = s.incremental
        self.fault = fault
        self.deadline_s = float(s.deadline_s)
        self.on_save = s.on_save
        self.progress = s.progress
        self.fallback_to_shared = s.fallback_to_shared
        self._init_parts(pool if pool is not None else default_pool())
        self._start()

    def _init_parts(self, pool: BufferPool) -> None:
        """Local: the parts that keep the manager's records (what it reports, its collective
        calls, its levels' state) and its staging, empty at the start."""
        self.last_restore: RestoreReport | None = None
        # the threads in a save() call now (their counts), and whether close() has begun:
        # close waits for saves other threads are in the middle of, and refuses new ones
        self._entry = threading.Condition()
        self._saving: dict[int, int] = {}
        self._closing = False
        self._outcomes = Outcomes(self.on_error, self.on_save)
        self._calls = Calls(self.comm, self.deadline_s)
        recycle = self.settings.recycle_level1 and not self.incremental
        self._slots = (
            Slots(self.local_root, fsync=self.write.fsync)
            if recycle and self.local_root is not None
            else None
        )
        self._retention = Retention(
            self.levels,
            self.local_root,
            keep_local=self.keep_local,
            keep_shared=self.keep_shared,
            fsync=self.write.fsync,
            fault=self.fault,
            outcomes=self._outcomes,
            incremental=self.incremental,
            slots=self._slots,
        )
        self._stager = Stager(self.comm, self.deadline_s, self.write, pool)

    def _start(self) -> None:
        """Collective (one allgather of the node names and of what stands in the way of each
        rank's level roots, then ``dup`` of the communicator): every rank learns the nodes and
        raises the same error when a level root cannot be written or a redundancy the nodes
        cannot carry is asked for; rank 0 records the nodes under level 3, and the saver thread
        and the exit hooks start."""
        nodes = agree_nodes(self.comm, self.levels, self.node)
        self._retention.node_leader = nodes.index(self.node) == self.comm.rank
        if self.local_root is not None:
            for red in self.policy.all_redundancies():
                member_sets(red, nodes)  # the same verdict on every rank: raises for all
        if self.comm.rank == 0:
            self.levels.record(nodes)
        settings = SaveSettings(
            node=self.node,
            local_root=self.local_root,
            shared_dir=self.levels.shared_dir,
            policy=self.policy,
            flush_every=self.flush_every,
            write=self.write,
            fault=self.fault,
            progress=self.progress,
            fallback_to_shared=self.fallback_to_shared,
            incremental=self.incremental,
            saves_in_flight=self.settings.saves_in_flight,
            slots=self._slots,
        )
        self._saver = Saver(
            self.comm.dup(),
            settings,
            calls=self._calls,
            outcomes=self._outcomes,
            retention=self._retention,
            stager=self._stager,
            pool=self._stager.pool,
        )
        self._exit = ExitHooks(
            self.at_exit,
            self.close,
            saver=self._saver,
            retention=self._retention,
            calls=self._calls,
            outcomes=self._outcomes,
        )
        self._exit.install()

    @property
    def last_save(self) -> SaveReport | None:
        """The newest save whose outcome is known."""
        return self._outcomes.last_save

    @property
    def save_reports(self) -> list[SaveReport]:
        """The newest 100 saves' reports, oldest first."""
        return self._outcomes.save_reports

    @property
    def failed_saves(self) -> list[tuple[int, CkptError]]:
        """The failed saves told so far, ``(step, error)``, oldest first: steps that were
        committed on no level."""
        return self._outcomes.failed_saves

    @property
    def failed_flushes(self) -> list[tuple[int, CkptError]]:
        """The steps whose flush to level 3 failed, ``(step, error)``, each once, oldest first:
        they were committed on level 1 (:class:`FlushWarning`); a later flush may have put
        them, or a newer step, on level 3 since (``steps()`` says where each step is)."""
        return self._outcomes.failed_flushes

    @property
    def saves_skipped(self) -> int:
        """How many saves were skipped so far (``when_busy="skip"``: taken but not made, on
        every rank; each also logged, and its handle and report say so)."""
        return self._saver.skips.count

    @property
    def skipped_steps(self) -> list[int]:
        """The steps of the newest 100 skipped saves, oldest first."""
        return list(self._saver.skips.steps)

    # --- the training-loop API -------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        donate: bool = False,
        background_copy: bool = False,
        ready: Callable[[], None] | None = None,
        before_commit: Callable[[], None] | None = None,
        objects: Objects = "refuse",
        skip: bool = False,
    ) -> SaveHandle:
        """Collective: checkpoint ``state`` as ``step``. Returns once the state is copied into
        host buffers (asynchronous mode); writing, committing and flushing go on behind.

        Returns a :class:`~ckptfmt.parallel.collective.staging.SaveHandle`: ``staged`` says when
        ``state`` may be mutated again, ``committed`` when the checkpoint is committed (or why it
        failed). ``background_copy=True`` makes the staging copy on the saver thread instead, after
        the ranks' agreement on what each copies, which is the saver threads' too (``save`` makes
        no collective call and returns at once; wait on ``staged`` before mutating: a save
        that failed, on any rank, is told at the next call); ``donate=True`` makes none (the
        writer reads ``state`` itself: ``staged`` is done when the save is). ``ready``, when
        given, is called on the saver thread before anything of ``state`` is read (e.g. to wait
        for device-to-host copies); ``before_commit``, on the saver thread once every file is
        written and before the ranks' vote on the manifest: an exception there fails the save on
        every rank, nothing committed (e.g. a check that ``state`` did not change while it was
        copied). See ``ckptfmt.parallel.collective.staging``. ``objects``: an
        object that is neither an array, bytes, a list, tuple or mapping nor JSON-able is refused
        (``"refuse"``: :class:`UnsupportedValueError` naming it) or pickled at the call
        (``"pickle"``; ``restore`` unpickles it only with ``trust_pickle=True``).

        Saves in flight: the call waits while ``saves_in_flight`` saves are queued or running
        (``when_busy="wait"``), or with ``"skip"`` takes the save without making it when none
        of them is over: the save is skipped on every rank, decided in its first collective
        step (the staging agreement; for a background copy on the saver thread, where a save
        given up with ``SaveHandle.abandon`` before its copy began is skipped too). A skipped
        save's handle ends with :class:`~ckptfmt.errors.SaveSkippedError`; it is counted in
        :attr:`saves_skipped` and logged, not reported as a failure. ``skip=True``: this rank
        cannot make this save (an adapter with no room for its own staging): it is skipped,
        on every rank (``state`` is not read).

        On this thread, every rank but with ``background_copy``: the staging agreement
        (``Stager.agree``); the rest is the saver thread's
        (``ckptfmt.parallel.manager.save_job``)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise UsageError(f"step must be a non-negative int, got {step!r}")
        self._calls.check_open()
        self._enter_save()  # a close() from another thread now waits for this save's hand-over
        try:
            return self._save(
                step, state, donate, background_copy, (ready, before_commit), objects, skip
            )
        finally:
            self._leave_save()

    def _enter_save(self) -> None:
        """Local: count this thread in a ``save`` call, unless ``close`` has begun (then
        :class:`UsageError`: a save taken behind the close's flush would be neither flushed
        nor told)."""
        with self._entry:
            if self._closing:
                raise UsageError("this CheckpointManager is closed (close() has begun)")
            self._saving[threading.get_ident()] = self._saving.get(threading.get_ident(), 0) + 1

    def _leave_save(self) -> None:
        with self._entry:
            me = threading.get_ident()
            self._saving[me] -= 1
            if not self._saving[me]:
                del self._saving[me]
            self._entry.notify_all()

    def _save(
        self,
        step: int,
        state: Mapping[str, Any],
        donate: bool,
        background_copy: bool,
        hooks: tuple[Callable[[], None] | None, Callable[[], None] | None],
        objects: Objects,
        skip: bool,
    ) -> SaveHandle:
        """:meth:`save` once its arguments are checked and the call is counted."""
        mode = copy_mode(donate, background_copy)
        entered = time.perf_counter()
        flights = self._saver.idle
        slot = None if skip else flights.take(block=self.settings.when_busy == "wait")
        why = (
            "the caller could not stage it"
            if skip
            else None
            if slot is not None
            else f"{flights.slots} save(s) in flight, none over (saves_in_flight={flights.slots})"
        )
        # an earlier save's failure is told after this save is taken, never instead of it
        earlier = self._outcomes.take()
        waited = time.perf_counter() - entered
        if waited > 0.01:
            log.info("save of step %s waited %.2f s for a save in flight", step, waited)
        try:
            handle = self._take(step, state, mode, entered, waited, hooks, objects, (slot, why))
        except BaseException:
            if slot is not None:
                slot.give()  # a no-op once its job has given it back
            self._outcomes.give_back(earlier)  # told at the next call
            raise
        self._outcomes.tell(earlier, then=_what_became_of(handle))
        return handle

    def _take(
        self,
        step: int,
        state: Mapping[str, Any],
        mode: str,
        entered: float,
        waited: float,
        hooks: tuple[Callable[[], None] | None, Callable[[], None] | None],
        objects: Objects,
        start: tuple[Slot | None, str | None],
    ) -> SaveHandle:
        """:meth:`save` once it holds a slot, or knows that it cannot (``start``: the slot, or
        why this rank cannot start the save): stage ``state`` and hand the job to the saver
        thread; its failures are kept, not told (the caller tells them)."""
        slot, why = start
        seq = self._calls.next()
        job = SaveJob(
            step=step,
            seq=seq,
            report=SaveReport(step, waited_s=waited),
            handle=SaveHandle(step),
            mode=mode,
            staged={},
            taken=[],  # pool buffers this save holds until its job ends
            ready=hooks[0],
            before_commit=hooks[1],
            slot=slot,
        )
        skipping = self.settings.when_busy == "skip"
        usage: UsageError | None = None
        leaves: list[tuple[Name, Any]] | None = None
        try:
            leaves = checked_leaves(state, objects)  # misuse raised here, whatever on_error says
        except UsageError as exc:
            job.failure = usage = exc
        if mode == "background":  # the agreement and the copy are the saver thread's
            job.leaves = leaves
            job.gate = Gate(why)  # voted on in the agreement
            if why is not None:
                job.handle.set_staged()  # nothing of the state will be read
            elif skipping:
                job.handle.can_abandon(functools.partial(job.gate.abandon, slot))
            return self._hand_over(job, usage, entered)
        vote = StartVote(lambda: why)
        try:  # every rank takes part, a rank whose state was refused too
            job.boxes = self._stager.agree(step, seq, leaves, None, vote)
        except Exception as exc:  # the roll call's deadline passed, or the transport failed
            # no collective of this manager can be trusted any more: the save fails here at
            # once (no background job), told as a background save's failure would be
            if slot is not None:
                slot.give()
            self._saver.break_on(job.step, exc, job.report, job.handle)
            return job.handle
        if vote.skipping:  # some rank cannot start it: no rank copies, no job
            skipped = self._saver.skip(job, vote.skipping)
            job.report.blocked_s = time.perf_counter() - entered
            self._outcomes.record_save(job.report)
            if slot is not None:
                slot.give()
            job.handle.set_committed(skipped)
            if usage is not None:
                raise usage
            return job.handle
        if mode == "none" and skipping:  # the loop may give it up until its job starts
            job.voted = True
            job.handle.can_abandon(functools.partial(job.gate.abandon, slot))
        if leaves is not None:
            try:
                job.staged, job.report.staged_bytes = self._stager.stage(
                    leaves, job.taken, mode == "now", job.boxes
                )
            except Exception as exc:  # e.g. MemoryError while copying: voted on like any failure
                job.failure = exc
        if mode == "now" or job.failure is not None:
            job.handle.set_staged()
        # a rank that failed to stage still takes part in the save's first vote, which fails
        # the step on every rank (no rank pairs this save with its next one)
        return self._hand_over(job, usage, entered)

    def _hand_over(self, job: SaveJob, usage: UsageError | None, entered: float) -> SaveHandle:
        """Give ``job`` to the saver thread; raise ``usage`` (this rank's state was refused)
        once the job, which the other ranks' saves pair with, is done; without ``async_save``
        or after a failure, wait for it (the caller reports)."""
        job.report.blocked_s = time.perf_counter() - entered
        self._saver.put(lambda: self._saver.run(job))
        if usage is not None:
            self._saver.idle.wait()
            self._outcomes.forget(job.step)
            raise usage
        if not self.async_save or job.failure is not None:
            self._saver.idle.wait()
        return job.handle

    def wait(self) -> None:
        """Wait for every save in flight; report a failed one (see ``on_error``)."""
        self._saver.idle.wait()
        self._outcomes.tell()

    def wait_for_room(self) -> bool:
        """Local: whether a save made now would start (fewer than ``saves_in_flight`` saves
        queued or running): with ``when_busy="wait"`` after waiting until it would (True), with
        ``"skip"`` at once (False: it would be skipped). For an adapter that stages into
        buffers of its own before :meth:`save` (``ckptfmt_torch.save_async``): it stages only
        for a save that starts, and passes ``skip=True`` otherwise."""
        return self._saver.idle.room(block=self.settings.when_busy == "wait")

    def latest(self) -> StepRef | None:
        """The newest step committed on this rank's level-1 directory or on level 3, with its
        directory (the level-1 copy when this rank sees one; a step only in a bucket has its
        URL, a ``str``, there). A local view, not collective (on a bucket: a LIST and a HEAD
        per step, then the commit and a HEAD of each of its objects, newest first, until a
        step is whole: a step whose objects are not all there is not offered); ``restore``
        decides collectively."""
        found: dict[int, Any] = {}
        shared = self._retention.shared
        if shared is not None:
            for s in shared.committed():
                where = shared.step(s)  # a directory, or a bucket prefix named by its URL
                found[s] = where if isinstance(where, Path) else shared.describe(where)
        local = dict(committed(self.local_root))
        found.update(local)  # level 1 wins for a step on both
        for step in sorted(found, reverse=True):
            if step in local or shared is None or shared.whole(step):
                return StepRef(step, found[step])
        return None

    def steps(self) -> dict[int, dict[str, bool]]:
        """The committed steps this rank sees, with the levels that hold them:
        ``{step: {"level1": bool, "level3": bool}}`` (level 1: this rank's node's directory;
        level 3: a step in a bucket whose objects are all there, see :meth:`latest`). A local
        view, not collective."""
        return self._retention.steps()

    def delete(self, step: int | str, levels: Sequence[int] = (1, 3)) -> None:
        """Collective (a roll call, then an allgather): remove ``step`` (a number or a step
        directory name such as ``"step-100"``) from the given levels, on every node (each
        node's first rank removes its level-1 copy, rank 0 the level-3 one); waits for the
        save in flight first. A removal that fails on one rank raises on every rank (there
        its own error, elsewhere a ``CollectiveError`` naming it)."""
        number = parse_step(step)
        bad = [lv for lv in levels if lv not in (1, 3)]
        if bad:
            raise UsageError(f"levels are 1 and 3, got {bad}")
        self._calls.check_open()
        self.wait()
        self._calls.next()
        self._calls.roll_call("delete", number)
        self._retention.delete(self.comm, number, levels)

    def delete_all(self) -> list[str]:
        """Collective (a roll call, then an allgather): remove every checkpoint from both levels,
        on every node, after the save in flight: the step directories (each out of sight in
        one rename first) or a bucket's step prefixes, what crashed saves left, level 1's
        spare directories and the levels record; a level's directory too when that empties
        it. Nothing else at a level's root is touched (a ``local_dir`` may share a disk with a
        dataset): returns the paths this rank left there, logged too. A removal that fails
        raises on every rank (its own error where it failed, :class:`CollectiveError` naming it
        elsewhere)."""
        self._calls.check_open()
        self.wait()
        self._calls.next()
        self._calls.roll_call("delete_all", None)
        left = self._retention.clear(self.comm)
        if left:
            log.info("kept what is not a checkpoint's: %s", ", ".join(left))
        return left

    def keep(self, steps: Iterable[int]) -> None:
        """Keep ``steps`` (in place of those given before) on every level from the next
        retention on, besides the newest ``keep_local`` and ``keep_shared``: a step that
        something outside the manager still names, such as a trainer's best checkpoint, which
        counting the newest steps would remove; a full level makes room from the other steps
        only. Every rank gives the same steps (each node's first rank applies them to its level
        1); not collective, nothing is waited for."""
        self._retention.kept = frozenset(parse_step(s) for s in steps)

    def prune(self, keep_local: int | None = None, keep_shared: int | None = None) -> None:
        """Collective (a roll call, then the retention's allgather): apply retention now: keep
        the newest ``keep_local`` level-1 steps (of all nodes together) and ``keep_shared``
        level-3 steps (default: the manager's settings)."""
        self._calls.check_open()
        self.wait()
        self._calls.next()
        self._calls.roll_call("prune", None)
        r = self._retention
        saved = r.keep_local, r.keep_shared
        if keep_local is not None:
            r.keep_local = keep_local
        if keep_shared is not None:
            r.keep_shared = keep_shared
        try:
            r.retain(self.comm, set())
        finally:
            r.keep_local, r.keep_shared = saved

    def restore(
        self,
        state: Mapping[str, Any] | None = None,
        *,
        read: ReadOptions | None = None,
        strict: bool = True,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] = (),
        apply: bool = True,
        cast: Cast = "no",
        into: bool = False,
        trust_pickle: bool = False,
        step: int | str | None = None,
    ) -> RestoreReport:
        """Collective: load the newest step that every rank can load (``step``: that step, a
        number or a step directory name, and no other; ``report.step`` is None when no copy
        of it loads, ``report.tried`` says why). Returns a
        :class:`RestoreReport`: ``report.step`` (None when there is none; ``report.restored``
        says whether there was), the level and path, what was refused and rebuilt, and
        ``report.state``, the loaded tree. Level 1 is tried first (every rank's data present or
        rebuildable from the save's redundancy, every checksum good), then level 3, then older
        steps (``ckptfmt.parallel.manager.restore_order``). Level-1 data rebuilt from redundancy
        is loaded from the rebuild's memory; its files are written back on the saver thread
        after ``restore`` returned (the next ``save``, ``restore``, ``wait`` or ``close`` waits
        for that; ``report.rewrite`` says how it went, and a failed write leaves the step
        rebuildable, for the next restore). ``state``, when given, is updated in
        place (arrays copied into, other values replaced; ``Shard`` leaves say which region this
        rank wants). Leftovers of crashed saves are removed first. In order, every rank: the
        wait for the save in flight, a roll call, the leftovers' barrier, then
        ``ckptfmt.parallel.manager.restore``'s calls.

        ``read`` (:class:`~ckptfmt.ReadOptions`): the job may have another number of ranks
        than the save (``spec/reshard.md``): each rank gets its ``Shard`` boxes or whole
        tensors; per-rank entries follow ``read.rank_map`` (saved rank -> current rank) or
        raise :class:`PerRankError` listing what cannot be carried over, unless
        ``read.per_rank="drop"`` (a warning lists it instead).

        ``state`` must match the checkpoint: a name of the state the checkpoint lacks, a saved
        name the state lacks, or an array of another shape or dtype raises
        :class:`StateMismatchError` on that rank before anything is written into ``state``.
        ``strict=False`` allows names on either side only; ``include``/``exclude`` (``fnmatch``
        patterns on '/'-joined names) restore part of a state. ``report.applied`` says what
        was loaded, missing, unexpected and excluded. ``apply=False``: ``state`` only says
        which boxes to load (its ``Shard`` leaves); nothing is written into it (an adapter that
        checks and converts ``report.state`` itself).

        ``cast`` (``ckptfmt.tree.casting``, as in the adapters): with ``"no"`` an array of
        ``state`` of another dtype than the saved one is refused (:class:`DtypeMismatchError`
        naming each, nothing written); ``"safe"`` converts where no value changes (``bfloat16``
        into ``float32``), ``"any"`` also where values round. Conversions made are listed in
        ``report.applied.casts`` and warned of (``CastWarning``).

        ``into=True``: read straight into the arrays of ``state`` that can take their tensor as
        it is (C-contiguous, writeable, the saved shape and dtype): each is written once instead
        of loaded and copied. Only arrays the restore would write anyway are read into (never
        an excluded one, nothing of a state it refuses). The price: a restore whose read finds
        damage part-way, or that falls back to an older step, may already have written into
        them (the CRCs are checked as the data comes in, not before); one that then finds no
        copy to restore raises :class:`UnrecoverableDamageError` on every rank naming the step,
        instead of reporting nothing restored (the arrays hold part of a damaged step). Without
        it, a step rebuilt from redundancy is read straight into the arrays too, all or nothing
        all the same: every byte of it is checked in memory before any of it lands.

        ``trust_pickle=True`` unpickles the objects a save stored with ``objects="pickle"``
        (only for checkpoints from a source you trust); without it such a checkpoint raises
        :class:`PickleRefusedError` naming the entry, and nothing is unpickled.

        A transport failure on the way (a peer died: gloo's "Connection closed by peer") raises
        :class:`ManagerBrokenError` and the manager refuses collective calls from then on, as
        after a background save that met one. ``last_restore`` keeps the last report."""
        self._calls.check_open()
        request = RestoreRequest(
            state=state,
            read=read if read is not None else ReadOptions(),
            strict=strict,
            include=include,
            exclude=exclude,
            apply=apply,
            cast=check_policy(cast),  # a usage error before anything collective
            into=into,
            trust_pickle=trust_pickle,
            step=None if step is None else parse_step(step),
        )
        self.wait()
        try:
            return self._restore(request)
        except CkptError:
            raise
        except RuntimeError as exc:  # the communicator itself (torch's DistError, MPI.Exception)
            broken = ManagerBrokenError(f"restore: {type(exc).__name__}: {exc}")
            self._calls.broken = broken
            raise broken from exc

    def _restore(self, request: RestoreRequest) -> RestoreReport:
        seq = self._calls.next()
        self._calls.roll_call("restore", None)
        self._retention.clean_leftovers(self.comm)
        site = RestoreSite(
            comm=self.comm,
            node=self.node,
            roots={1: self.local_root},
            shared=self._retention.shared,
            seq=seq,
            fsync=self.write.fsync,
            progress=self.progress,
            defer=self._defer,
            fault=self.fault,
        )
        report, manifest = restore_newest(site, request)
        if manifest is not None and report.level is not None:
            self._saver.saves = max(self._saver.saves, save_number(manifest))
            # the restored save is a base only on the level it was read from (every chunk
            # checked): its copy on the other level was not read by this job, and a flipped bit
            # there since an earlier job wrote it would be linked into every step after (a
            # level-1 restore's first flush writes everything; from level 3, the level-1 copy
            # was refused or missing anyway, level 1 being tried first)
            self._retention.bases[report.level].add(manifest.save_id)
            if report.level == 1:
                # a save by another number of ranks is not this job's to flush: its files
                # belong to ranks that are not here (flush copies what each rank wrote)
                same = manifest.world_size == self.comm.size
                self._retention.newest_local = manifest if same else None
            else:
                self._retention.flushed.add(manifest.save_id)
        self.last_restore = report
        return report

    def _defer(self, job: Callable[[Comm], None]) -> None:
        """Run ``job`` on the saver thread, on its communicator, after what is queued there (a
        restore's write of the files it rebuilt: every rank queues it, in the same order as its
        saves; the next save, restore or ``close`` waits for it)."""
        self._saver.put(lambda: job(self._saver.bg))

    def close(self, flush: bool | None = None) -> None:
        """Wait for every save in flight (a ``save`` another thread is in the middle of, an
        ``AsyncCheckpointIO`` worker's say, is taken first; one begun after this, on any thread,
        raises :class:`UsageError`) and, unless told not to, flush the newest level-1
        checkpoint to level 3 if it is not there yet (collective: ``Retention.flush_newest``
        on the saver thread and its communicator, where a SIGTERM's flush also runs: the two
        never run beside each other, ``ExitHooks.flush_at_close``). The manager is closed
        whatever happens; a failed save not told yet is told after (warned, or raised with
        ``on_error="raise"``), and a failed flush is a :class:`FlushWarning`. The spare
        level-1 slot (``.slots/``, a dropped step kept for the next save to overwrite) is
        removed by the node's first rank: no save comes after, and it holds a whole step's
        room. Then the manager leaves the process's exit registry (``parallel.manager.exit``):
        SIGTERM and interpreter exit no longer touch it, and when it was the last open
        manager, SIGTERM is handled again as it was before the first one."""
        if self._calls.closed:
            return
        with self._entry:  # a save another thread is in is handed over first (then flushed)
            self._closing = True
            me = threading.get_ident()
            self._entry.wait_for(lambda: not any(t != me for t in self._saving))
        self._saver.idle.wait()
        # the last save's failure is told once the manager is closed, never instead of closing
        failed = self._outcomes.take()
        try:
            if self._calls.broken is not None:  # no collective is safe any more: no flush
                flush = False
            if self.at_exit.flush if flush is None else flush:
                self._exit.flush_at_close()  # on the saver thread, as SIGTERM's flush
        finally:
            self._exit.uninstall()
            self._calls.closed = True
            self._saver.stop()
            if self._slots is not None and self._retention.node_leader:
                self._slots.clear()  # a spare slot serves the next save only: give its room back
            self._outcomes.tell(failed)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _what_became_of(handle: SaveHandle) -> str:
    """How the save of ``handle`` stands, as a failure of an earlier save told at its call
    says it (the loop must know that this call's own checkpoint was taken)."""
    if not handle.done():
        return f"the save of step {handle.step} was taken and goes on in the background"
    if handle.committed.exception() is None:
        return f"the save of step {handle.step} was committed"
    if isinstance(handle.committed.exception(), SaveSkippedError):
        return f"the save of step {handle.step} was skipped (saves_skipped)"
    return f"the save of step {handle.step} failed as well"
