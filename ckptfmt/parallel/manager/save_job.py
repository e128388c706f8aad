"""A manager's saves behind the training loop: the save job and the saver thread that runs it.

``CheckpointManager.save`` stages the state (or leaves the copy to the job) and hands a
:class:`SaveJob` to this rank's :class:`Saver`. The saver thread runs one job at a time, on a
duplicate of the manager's communicator, so its collective calls never pair with the training
thread's. For one job, every rank calls, in this order: the staging agreement (a background copy
only; it is the save's roll call) or the save's roll call (with ``when_busy="skip"`` and a
donated state, followed by the start vote); ``save_collective`` on level 1 (level 3 when there
is no level 1), and again on level 3 when level 1 failed for a storage reason on some rank; the
flush when due; the retention's allgather. Every failure is voted on inside those calls, so the
ranks take the same branch.

Saves in flight (``ManagerSettings.saves_in_flight``): each save holds one of that many slots
(:class:`InFlight`) from its call until its job is over; with ``when_busy="skip"`` a save made
while none is free is still taken on every rank (the same calls, the same sequence numbers) but
marked skipped on this rank (:class:`Gate`), and so is a queued save the loop gives up
(``SaveHandle.abandon``) before its copy began. The save's first collective step carries each
rank's answer (``share.StartVote``): a save some rank could not start is skipped on every rank,
nothing written, its handle finished with :class:`SaveSkippedError` (:meth:`Saver.skip`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ckptfmt.container.metadata import ManifestMeta
from ckptfmt.errors import (
    CkptError,
    CollectiveTimeoutError,
    ManagerBrokenError,
    OutOfStepError,
    SaveFailedError,
    SaveSkippedError,
    UsageError,
)
from ckptfmt.errors.base import ranks_text
from ckptfmt.format.options import WriteOptions
from ckptfmt.manifest.limits import display
from ckptfmt.manifest.model import Manifest
from ckptfmt.parallel.collective import share
from ckptfmt.parallel.collective.publish import FaultHook
from ckptfmt.parallel.collective.save import save_collective
from ckptfmt.parallel.collective.save_state import check_leaf
from ckptfmt.parallel.collective.stager import Stager
from ckptfmt.parallel.collective.staging import BufferPool, SaveHandle
from ckptfmt.parallel.levels import room
from ckptfmt.parallel.levels.layout import group_key
from ckptfmt.parallel.manager.outcomes import Calls, Outcomes
from ckptfmt.parallel.manager.retention import Retention, newest_base
from ckptfmt.parallel.manager.telemetry import SaveReport, Skips, data_bytes_of, parity_bytes_of
from ckptfmt.redundancy.config import Policy, Redundancy
from ckptfmt.storage.progress import ProgressCallback, metering
from ckptfmt.storage.slots import Slots
from ckptfmt.storage.steps import step_dir_name
from ckptfmt.storage.store.directory import DirectoryStore
from ckptfmt.transport.comm import Comm, start_background
from ckptfmt.tree.state import Name, Objects, flatten

log = logging.getLogger("ckptfmt")

__all__ = [
    "Gate",
    "InFlight",
    "SaveJob",
    "SaveSettings",
    "Saver",
    "Slot",
    "checked_leaves",
    "may_fall_back",
]


def checked_leaves(state: Mapping[str, Any], objects: Objects = "refuse") -> list[tuple[Name, Any]]:
    """The leaves of ``state``, each checked (:func:`check_leaf`): misuse raises
    ``UsageError`` at the call, before anything is copied. ``objects``: what becomes of an
    object that is not storable (``tree.state.Objects``: refused, or pickled now)."""
    if objects not in ("refuse", "pickle"):
        raise UsageError(f"objects must be 'refuse' or 'pickle', got {objects!r}")
    leaves = flatten(state, objects)  # refuses a state that is not a mapping
    for name, leaf in leaves:
        check_leaf(display(name), leaf)
    return leaves


def may_fall_back(exc: CkptError) -> bool:
    """Whether a failed level-1 save is worth writing to level 3 instead: every failing rank
    met a storage failure (an ``OSError``: a full or failing node-local disk). Misuse, ranks
    out of step, a state that could not be copied, or anything else (a bug's ``ValueError``)
    is reported as the save's failure, never hidden by writing elsewhere."""
    return isinstance(exc, SaveFailedError) and all(
        f.kind == "storage" for f in exc.rank_failures.values()
    )


class Slot:
    """One of the slots for saves in flight, held by one save until its job is over (given
    back once, whoever gives it first: the job, or the call that failed before handing it)."""

    def __init__(self, flights: InFlight) -> None:
        self._flights: InFlight | None = flights
        self._lock = threading.Lock()

    def give(self) -> None:
        with self._lock:
            flights, self._flights = self._flights, None
        if flights is not None:
            flights.give()


class InFlight:
    """One rank's saves in flight: the slots the saves hold (``slots`` at most) and the jobs
    queued or running on the saver thread. The training thread takes slots; the saver thread
    (or a failed call) gives them back. :meth:`wait` waits for every job (``idle``)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.held = 0
        self.queued = 0
        self._cond = threading.Condition()

    def take(self, block: bool) -> Slot | None:
        """A slot for a save: wait for one (``block``), or None at once when none is free."""
        with self._cond:
            if block:
                self._cond.wait_for(lambda: self.held < self.slots)
            elif self.held >= self.slots:
                return None
            self.held += 1
        return Slot(self)

    def room(self, block: bool) -> bool:
        """Whether a slot is free (waiting for one when ``block``), without taking it."""
        with self._cond:
            if block:
                self._cond.wait_for(lambda: self.held < self.slots)
            return self.held < self.slots

    def give(self) -> None:
        with self._cond:
            self.held -= 1
            self._cond.notify_all()

    def queue(self) -> None:
        with self._cond:
            self.queued += 1

    def done(self) -> None:
        with self._cond:
            self.queued -= 1
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no job is queued or running; whether none is."""
        with self._cond:
            return self._cond.wait_for(lambda: self.queued == 0, timeout)

    def is_set(self) -> bool:
        """Whether no job is queued or running (the saver is idle)."""
        return self.queued == 0


class Gate:
    """Whether a save's job may start on this rank, settled once under a lock between the
    training thread giving the save up (:meth:`abandon`) and the saver thread starting it
    (:meth:`start`): whichever comes first wins. ``why``: why this rank cannot start it (no
    slot was free at the call, or it was given up), None when it can."""

    ABANDONED = "given up by the loop before its copy began (SaveHandle.abandon)"

    def __init__(self, why: str | None = None) -> None:
        self.why = why
        self._started = False
        self._lock = threading.Lock()

    def abandon(self, slot: Slot | None = None) -> bool:
        """The training thread: give the save up unless its job has started; whether it is.
        ``slot``, the save's, is given back at once: a save given up holds no staging copy,
        and the next save may take its place in flight."""
        with self._lock:
            if self._started:
                return False
            if self.why is None:
                self.why = self.ABANDONED
        if slot is not None:
            slot.give()
        return True

    def start(self) -> str | None:
        """The saver thread, once every rank's saver is in the save: start it; this rank's
        answer to the start vote (``why``, None when it starts)."""
        with self._lock:
            self._started = True
            return self.why


@dataclass(kw_only=True)
class SaveJob:
    """What one save hands its saver thread."""

    step: int
    seq: int  # the save's collective call number
    report: SaveReport
    handle: SaveHandle
    mode: str  # copy_mode: "now", "background" or "none"
    staged: dict[str, Any]  # the staged state (empty for a background copy: the job makes it)
    taken: list[np.ndarray]  # pool buffers to give back when the job ends
    failure: BaseException | None = None  # this rank's failure before the job (voted on)
    ready: Callable[[], None] | None = None  # called before anything of the state is read
    before_commit: Callable[[], None] | None = None  # called before the manifest vote
    boxes: share.Boxes | None = None  # what this rank writes of the replicated tensors
    leaves: list[tuple[Name, Any]] | None = None  # background copy: staged by the job itself
    slot: Slot | None = None  # the slot this save holds (None: it was skipped at its call)
    gate: Gate = field(default_factory=Gate)  # this rank's start, or why not
    voted: bool = False  # a donated state's job votes on its start after the roll call


@dataclass(frozen=True, kw_only=True)
class SaveSettings:
    """How and where a manager's saves go (the same on every rank but ``node``)."""

    node: str
    local_root: Path | None
    shared_dir: Path | None  # a directory: what a save with no level 1, or its fallback, writes
    policy: Policy
    flush_every: int
    write: WriteOptions
    fault: FaultHook | None
    progress: ProgressCallback | None
    fallback_to_shared: bool
    incremental: bool = False  # each save against the newest committed step of its level
    saves_in_flight: int = 1  # the saves queued or running at once
    slots: Slots | None = None  # level 1's spare step directories, written in place


class Saver:
    """One rank's saver thread and what it runs. ``saves`` is the job's save number (carried
    across restarts by the manifests: a restore raises it)."""

    def __init__(
        self,
        bg: Comm,
        settings: SaveSettings,
        *,
        calls: Calls,
        outcomes: Outcomes,
        retention: Retention,
        stager: Stager,
        pool: BufferPool,
    ) -> None:
        self.bg = bg
        self.settings = settings
        self.calls, self.outcomes, self.retention = calls, outcomes, retention
        self.stager, self.pool = stager, pool
        self.saves = 0
        self._linked: dict[str, Any] | None = None  # the last incremental write's tallies
        self._before_commit: Callable[[], None] | None = None  # the running job's check
        self.idle = InFlight(settings.saves_in_flight)  # idle.wait(): every job is over
        self.skips = Skips()
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._worker = start_background(bg, self._work, f"ckptfmt-saver-{bg.rank}")

    def put(self, job: Callable[[], None]) -> None:
        """Queue ``job`` for the saver thread (the manager waits on :attr:`idle`)."""
        self.idle.queue()
        self._jobs.put(job)

    def stop(self) -> None:
        """End the saver thread once the queued jobs are done."""
        self._jobs.put(None)
        self._worker.join(timeout=60)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception as exc:
                # the communicator itself failed (a peer died or the transport broke): no
                # further collective is safe; recorded before anyone waiting is released
                broken = self.calls.break_on(ManagerBrokenError(f"{type(exc).__name__}: {exc}"))
                self.outcomes.fail(-1, broken)
                log.error("rank %s: background save failed: %s", self.bg.rank, broken)
            finally:
                self.idle.done()

    def break_on(
        self, step: int, exc: Exception, report: SaveReport, handle: SaveHandle | None = None
    ) -> CkptError:
        """The save of ``step`` failed before its staging because the ranks could not agree
        (on the training thread, or a background copy's on the saver thread): no collective
        of this manager can be trusted any more; the failure is kept for the next call and
        returned. ``handle`` (the training thread's: no job will finish it): its save is
        recorded and the handle finished with the failure."""
        broken = self.calls.break_on(exc)
        report.error = str(broken)
        self.outcomes.fail(step, broken)
        log.error("rank %s: save of step %s failed: %s", self.bg.rank, step, broken)
        if handle is not None:
            self.outcomes.record_save(report)
            handle.set_committed(broken)
        return broken

    def run(self, job: SaveJob) -> None:
        """Background, collective on the saver threads' communicator: write level 1 (or level
        3 when there is no level 1), flush when due, apply retention. Every failure of the
        save or the flush (on any rank: any exception) is voted on and kept for the next call;
        a save some rank could not start is skipped on every rank (:meth:`skip`). The staging
        buffers and the save's slot go back and the save's handle is finished at the end."""
        report = job.report
        started = time.perf_counter()
        mark = self.outcomes.mark()
        error: BaseException | None = None
        skipped: SaveSkippedError | None = None
        staged, failure = job.staged, job.failure
        try:
            rolled = False
            if job.voted:  # a donated state that the loop may give up: vote after the roll call
                vote = self._vote(job)
                if vote is None:
                    return
                if vote.skipping:
                    skipped = self.skip(job, vote.skipping)
                    return
                rolled = True
            if failure is None and job.ready is not None and job.gate.why is None:
                try:
                    job.ready()
                except Exception as exc:  # voted on like a failed copy
                    failure = exc
            if job.mode == "background":
                copied = self._copy(job, failure)
                if copied is None:
                    return
                if isinstance(copied, SaveSkippedError):
                    skipped = copied
                    return
                staged, failure = copied
                # a background copy's agreement was this save's roll call on the saver
                # threads' communicator: the ranks are known to be in it
                rolled = True
            self._before_commit = job.before_commit
            self._save(job.step, staged, job.seq, failure, report, rolled)
        except BaseException as exc:  # the communicator broke (see _work)
            error = ManagerBrokenError(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self._before_commit = None
            report.background_s = time.perf_counter() - started
            self.outcomes.record_save(report)
            self.pool.give(job.taken)
            if job.slot is not None:
                job.slot.give()
            job.handle.set_committed(
                error or skipped or self.outcomes.failure_since(mark, job.step)
            )

    def skip(self, job: SaveJob, skipping: Mapping[int, str]) -> SaveSkippedError:
        """The save of ``job`` is skipped on every rank (``skipping``: the ranks that could not
        start it, with why; the same on every rank, from the start vote): recorded in its
        report, counted and logged; the error its handle ends with."""
        ranks = sorted(skipping)
        exc = SaveSkippedError(job.step, ranks, skipping[ranks[0]])
        job.report.skipped = True
        job.report.error = str(exc)
        self.skips.note(job.step, f"{ranks_text(ranks)}: {skipping[ranks[0]]}")
        return exc

    def _vote(self, job: SaveJob) -> share.StartVote | None:
        """Collective on the saver threads' communicator (every rank, first in a donated
        state's job under ``when_busy="skip"``): the save's roll call, then every rank's answer
        to the start vote, asked only once every rank's saver is in the save (so the loop may
        give the save up until then). None when the ranks could not agree (the manager is
        broken; the failure is kept)."""
        vote = share.StartVote(job.gate.start)
        if self.bg.size == 1:
            vote.alone()
            return vote
        try:
            share.agree(self.bg, self.calls.deadline_s, job.step, job.seq, None, vote)
        except Exception as exc:  # the roll call's deadline passed, or the transport
            self.break_on(job.step, exc, job.report)
            return None
        return vote

    def _copy(
        self, job: SaveJob, failure: BaseException | None
    ) -> tuple[dict[str, Any], BaseException | None] | SaveSkippedError | None:
        """A background copy (collective: the staging agreement on the saver threads'
        communicator, with the start vote, then the local copy): the staged state and this
        rank's failure; the skip when some rank could not start the save; None when the ranks
        could not agree (the manager is broken; the state is free again)."""
        vote = share.StartVote(job.gate.start)
        try:  # every rank takes part
            boxes = self.stager.agree(job.step, job.seq, job.leaves, self.bg, vote)
        except Exception as exc:  # the roll call's deadline passed, or the transport
            self.break_on(job.step, exc, job.report)
            job.handle.set_staged()
            return None
        if vote.skipping:
            return self.skip(job, vote.skipping)
        staged = job.staged
        if job.leaves is not None and failure is None:
            try:
                staged, job.report.staged_bytes = self.stager.stage(
                    job.leaves, job.taken, True, boxes
                )
            except Exception as exc:  # voted on like a failed copy
                failure = exc
        job.handle.set_staged()
        return staged, failure

    def _save(
        self,
        step: int,
        staged: dict[str, Any],
        seq: int,
        failure: BaseException | None,
        report: SaveReport,
        rolled: bool,
    ) -> None:
        """Collective on the saver threads' communicator: the roll call (unless ``rolled``),
        the write (with its fallback), the flush when due, retention."""
        s = self.settings
        number = self.saves + 1
        red = s.policy.redundancy_for(number) if s.local_root is not None else None
        if not rolled:
            try:
                self.calls.roll_call("save", step, self.bg, seq)
            except (CollectiveTimeoutError, OutOfStepError) as exc:  # no later one is safe
                self.outcomes.fail(step, exc)
                report.error = str(exc)
                return
        written = self._write_somewhere(staged, step, number, red, seq, failure, report)
        if written is None:
            return
        level, manifest = written
        self.saves = number
        report.level = level
        report.redundancy = red.scheme if red is not None and level == 1 else None
        report.bytes_written[str(level)] = data_bytes_of(manifest, self.bg.rank)
        if self._linked is not None:  # an incremental save: what was written, what linked
            report.bytes_written[str(level)] = int(self._linked.get("written_bytes", 0))
            report.bytes_linked[str(level)] = int(self._linked.get("linked_bytes", 0))
            report.link_refused += int(self._linked.get("unlinkable", 0))
            report.parity_linked = int(self._linked.get("parity_linked_bytes", 0))
        report.parity_bytes = parity_bytes_of(manifest, self.bg.rank) if level == 1 else 0
        if level == 3:
            self.retention.flushed.add(manifest.save_id)
            report.flushed = True
        else:
            self.retention.newest_local = manifest
            due = s.flush_every and number % s.flush_every == 0
            # a flush that failed (a full or unreachable level 3) is owed: the next save
            # flushes its own step whether due or not
            wanted = due or s.policy.flush_for(number) or self.retention.flush_owed
            shared = self.retention.shared  # a shared directory or a bucket
            if shared is not None and wanted:
                flushed = self.retention.flush(manifest, self.bg, seq)
                if self.retention.made_room:  # level 3 was full: its older steps went
                    report.made_room.setdefault("3", []).extend(self.retention.made_room)
                if flushed:
                    report.flushed = True
                    report.bytes_written["3"] = data_bytes_of(manifest, self.bg.rank)
                    linked = self.retention.flush_linked
                    if linked:  # an incremental flush that copied (a flushed one: empty)
                        report.bytes_written["3"] = int(linked.get("written_bytes", 0))
                        report.bytes_linked["3"] = int(linked.get("linked_bytes", 0))
                        report.link_refused += int(linked.get("unlinkable", 0))
                else:
                    report.flush_error = self.retention.flush_error
        self.retention.retain(self.bg, {step})

    def _write_somewhere(
        self,
        staged: dict[str, Any],
        step: int,
        number: int,
        red: Redundancy | None,
        seq: int,
        failure: BaseException | None,
        report: SaveReport,
    ) -> tuple[int, Manifest] | None:
        """Collective: write the step to level 1 (level 3 when there is none), and to level 3
        when level 1 failed for a storage reason (:func:`may_fall_back`). The level and the
        manifest, or None when the save failed (the failure is kept)."""
        s = self.settings
        level = 1 if s.local_root is not None else 3
        root = s.local_root or s.shared_dir
        assert root is not None
        try:
            try:
                return level, self._write(staged, root, step, level, number, red, seq, failure)
            except CkptError as exc:
                if not (room.is_full(exc) and self._make_room(level, staged, red, step, report)):
                    raise
                log.warning(
                    "level %s was full: removed older steps to make room for step %s", level, step
                )
                return level, self._write(staged, root, step, level, number, red, seq, failure)
        except CkptError as exc:
            report.error = str(exc)
            can = level == 1 and s.shared_dir is not None and s.fallback_to_shared
            if not (can and may_fall_back(exc)):
                self.outcomes.fail(step, exc)
                return None
            # level 1 cannot take it (full, failing): the step goes to level 3 directly
            log.warning(
                "level-1 save of step %s failed, writing it to level 3 instead: %s", step, exc
            )
            assert s.shared_dir is not None  # checked above
            try:
                try:
                    manifest = self._write(staged, s.shared_dir, step, 3, number, None, seq, None)
                except CkptError as exc3:
                    if not (room.is_full(exc3) and self._make_room(3, staged, None, step, report)):
                        raise
                    manifest = self._write(staged, s.shared_dir, step, 3, number, None, seq, None)
            except CkptError as exc2:
                self.outcomes.fail(step, exc2)
                report.error = f"{exc}; and on level 3: {exc2}"
                return None
            report.fell_back = True
            self.outcomes.notices.append(
                f"level-1 save of step {step} failed, so it was written to level 3: {exc}"
            )
            return 3, manifest

    def _make_room(
        self,
        level: int,
        staged: Mapping[str, Any],
        red: Redundancy | None,
        step: int,
        report: SaveReport,
    ) -> bool:
        """Collective (one allgather on the saver threads' communicator, every rank, after a
        write to ``level`` failed full on some rank: the vote gave every rank the same error):
        remove the oldest steps of ``level`` but those ``keep`` kept so that the write of
        ``step`` fits (``parallel.levels.room``); whether any was removed (then the write is
        tried once more). The steps removed go into ``report.made_room``."""
        need = _bytes_to_write(staged, red)  # only here: a full level is rare
        s = self.settings
        protect = {step} | self.retention.kept  # the steps kept past retention stay (``keep``)
        if level == 1:
            assert s.local_root is not None
            removed = room.make_room_on_nodes(
                self.bg, s.local_root, s.node, self.retention.node_leader, need, protect
            )
        else:
            assert s.shared_dir is not None
            total = sum(self.bg.allgather_json(need))
            mine = room.make_room_here(s.shared_dir, total, protect) if self.bg.rank == 0 else []
            removed = self.bg.bcast_json(mine)  # make_room_here never raises: no rank is left
        if removed:
            report.made_room.setdefault(str(level), []).extend(removed)
            self.outcomes.notices.append(
                f"level {level} was full: steps {removed} were removed to make room for step {step}"
            )
        return bool(removed)

    def _write(
        self,
        staged: dict[str, Any],
        root: Path,
        step: int,
        level: int,
        number: int,
        red: Redundancy | None,
        seq: int,
        failure: BaseException | None,
    ) -> Manifest:
        """Collective: ``save_collective`` of the staged state as ``root``'s step directory;
        incremental, when the manager is, against the newest committed step there that this
        job saved or restored (``Retention.bases``)."""
        s = self.settings
        known = self.retention.bases[level]
        base = newest_base(root, among=known) if s.incremental else None
        linked: dict[str, Any] = {}
        self._linked = linked if s.incremental else None
        final = root / step_dir_name(step)
        where: Path | DirectoryStore = final
        if level == 1 and s.slots is not None:  # a recycled step directory, if one is spare
            where = DirectoryStore(final, slots=s.slots)
        with metering("save", s.progress) as meter:
            manifest, _ = save_collective(
                self.bg,
                staged,
                where,
                step=step,
                node=s.node,
                group=group_key(s.node, level == 1),
                write=s.write,
                meta=ManifestMeta(levels={str(level): {"save_number": number}}),
                fault=_with_check(s.fault, self._before_commit),
                redundancy=red,
                seq=seq,
                failure=failure,
                base=base,
                report=linked,
                plans=self.stager.plans,  # the staging's plan: the same layout is planned once
            )
            meter.finish()
        known.add(manifest.save_id)
        return manifest


def _with_check(fault: FaultHook | None, check: Callable[[], None] | None) -> FaultHook | None:
    """The save's phase hook with ``check`` run where every file is written and the manifest
    is about to be voted on (the ``"manifest"`` point): its exception fails the save on every
    rank, nothing committed."""
    if check is None:
        return fault

    def hook(point: str) -> None:
        if fault is not None:
            fault(point)
        if point == "manifest":
            check()

    return hook


def _bytes_to_write(staged: Mapping[str, Any], red: Redundancy | None) -> int:
    """About how many bytes this rank writes for ``staged``: its arrays, and the parity the
    redundancy adds (a partner's whole copy, or up to half as much again for XOR and
    Reed-Solomon sets), for deciding how much room a full level needs."""
    nbytes = 0
    todo: list[Any] = [staged]
    while todo:
        value = todo.pop()
        if isinstance(value, Mapping):
            todo.extend(value.values())
        elif isinstance(value, (list, tuple)):
            todo.extend(value)
        else:
            nbytes += int(getattr(value, "nbytes", 0) or 0)
    if red is None:
        return nbytes
    return nbytes * 2 if red.scheme == "partner" else nbytes * 3 // 2
