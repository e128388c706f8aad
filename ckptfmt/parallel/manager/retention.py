"""A manager's levels on disk: flushing level 1 to level 3, retention, deletion, leftovers.

:class:`Retention` knows where each level is for this rank, whether this rank leads its node
(the node's first rank acts on its level-1 directory; rank 0 on level 3), the newest level-1
checkpoint of this job and which saves are on level 3 already. Its collective methods are
called on every rank of the communicator they are given, in the order the manager's
docstrings say; the failures of a flush are kept in the manager's :class:`Outcomes`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ckptfmt.errors import (
    CkptError,
    CollectiveError,
    CollectiveTimeoutError,
    OutOfStepError,
    StorageError,
)
from ckptfmt.manifest.model import Manifest
from ckptfmt.parallel.collective.publish import FaultHook
from ckptfmt.parallel.levels import room
from ckptfmt.parallel.levels.clear import clear_root
from ckptfmt.parallel.levels.layout import Levels, newest_base, retain_steps
from ckptfmt.parallel.levels.pick import level3_of
from ckptfmt.parallel.manager.outcomes import Calls, Outcomes
from ckptfmt.storage import commit
from ckptfmt.storage.slots import Slots
from ckptfmt.storage.steps import list_step_dirs, step_dir_name
from ckptfmt.transport.comm import Comm

log = logging.getLogger("ckptfmt")
_T = TypeVar("_T")

__all__ = ["Retention", "committed", "newest_base"]


def committed(root: Path | None) -> list[tuple[int, Path]]:
    """The committed steps under ``root`` (none when the level is absent), oldest first."""
    if root is None:
        return []
    return [(s, p) for s, p in list_step_dirs(root) if commit.is_committed(p)]


class Retention:
    """Flush and retention for one rank of a manager. ``node_leader`` is set once the ranks
    have told each other their nodes (the manager's start)."""

    def __init__(
        self,
        levels: Levels,
        local_root: Path | None,
        *,
        keep_local: int,
        keep_shared: int,
        fsync: bool,
        fault: FaultHook | None,
        outcomes: Outcomes,
        incremental: bool = False,
        slots: Slots | None = None,
    ) -> None:
        self.levels = levels
        # level 1's spare step directories: retention recycles a step there instead of
        # deleting it, and the next save writes into it in place (``storage/slots.py``)
        self.slots = slots
        self.incremental = incremental
        self.flush_linked: dict[str, Any] | None = None  # the last incremental flush's tallies
        self.local_root = local_root
        self.shared = level3_of(levels)  # a shared directory or a bucket
        self.keep_local, self.keep_shared = keep_local, keep_shared
        self.fsync = fsync
        self.fault = fault
        self.outcomes = outcomes
        self.node_leader = False
        self.newest_local: Manifest | None = None  # this job's newest level-1 checkpoint
        self.flushed: set[str] = set()  # save ids on level 3
        # the saves an incremental save (level 1) or flush (level 3) may take as its base: those
        # this job wrote there, or restored (``CheckpointManager._restore``). A linked (or
        # copied) file is not read again: a step of an earlier job, maybe damaged since, or
        # refused by the restore for damage, would pass its damage on to every step after it
        self.bases: dict[int, set[str]] = {1: set(), 3: set()}
        self.flush_rate = 0.0  # bytes/s of the last flush
        self.flush_owed = False  # the last flush failed: the next save flushes, due or not
        self.flush_error: str | None = None  # why it failed
        self.made_room: list[int] = []  # the level-3 steps the last flush removed for room
        # steps kept on every level besides the newest (CheckpointManager.keep): a new set is
        # assigned, never changed in place, so the saver thread reads one or the other
        self.kept: frozenset[int] = frozenset()

    def retain(self, comm: Comm, protect: set[int]) -> None:
        """Collective (an allgather on ``comm``): the same retention on every node. Each node's
        leader lists its committed level-1 steps; every node keeps the newest ``keep_local``
        steps of all nodes together (and ``protect``), so no node deletes a step another node
        still counts on; rank 0 keeps the newest ``keep_shared`` on level 3 (a failure there
        that is ckptfmt's, a bucket out of reach, is logged: the save it follows is committed).
        With :attr:`slots`, a level-1 step dropped is recycled (``Slots.recycle``), not deleted:
        the newest ``keep_local`` steps (and ``protect``) are never among them. The steps
        :attr:`kept` are protected too."""
        protect = protect | self.kept
        mine = [s for s, _ in committed(self.local_root)] if self.node_leader else []
        seen = comm.allgather_json(mine)
        if self.local_root is not None and self.node_leader:
            everywhere = sorted({s for x in seen for s in x})
            keep = set(everywhere[-self.keep_local :]) if self.keep_local > 0 else set(everywhere)
            retire = self.slots.recycle if self.slots is not None else None
            retain_steps(self.local_root, keep | protect, retire)
        if comm.rank == 0:
            self._retain_shared(protect)

    def _retain_shared(self, protect: set[int]) -> None:
        """Rank 0: keep the newest ``keep_shared`` steps on level 3 (and ``protect``, and
        :attr:`kept`)."""
        if self.shared is None or self.keep_shared <= 0:
            return
        try:
            self.shared.retain(self.keep_shared, protect | self.kept)
        except CkptError as exc:
            log.warning("retention on level 3 (%s) failed: %s", self.shared.where, exc)

    def flush(self, manifest: Manifest, comm: Comm, seq: int | None = None) -> bool:
        """Collective (``SharedLevel.flush`` on ``comm``: ``flush_collective`` to a shared
        directory, ``flush_to_bucket`` to a bucket): copy the level-1 checkpoint of
        ``manifest`` to level 3; when level 3 is full, its oldest steps are removed to make
        room (never its newest, ``parallel.levels.room``) and the flush is tried once more. False
        when it failed: the step is safe on level 1, the failure is told once as a
        :class:`FlushWarning` and the flush is owed (the next save flushes)."""
        assert self.local_root is not None and self.shared is not None
        started = time.perf_counter()
        step = manifest.step or 0
        nbytes = sum(f.size for _, f in manifest.files())
        self.made_room = []
        try:
            try:
                self._flush_once(comm, manifest, seq)
            except CkptError as exc:
                if not (room.is_full(exc) and self._make_room(comm, nbytes, step)):
                    raise
                self._flush_once(comm, manifest, seq)
        except CkptError as exc:
            # the step is safe on level 1: a failed flush is no failed save (FlushWarning)
            self.outcomes.flush_failed(step, exc)
            self.flush_owed, self.flush_error = True, str(exc)
            return False
        self.flush_rate = nbytes / max(time.perf_counter() - started, 1e-6)
        self.flushed.add(manifest.save_id)
        self.bases[3].add(manifest.save_id)
        self.flush_owed, self.flush_error = False, None
        return True

    def _flush_once(self, comm: Comm, manifest: Manifest, seq: int | None) -> None:
        assert self.local_root is not None and self.shared is not None
        local = self.local_root / step_dir_name(manifest.step or 0)
        # incremental: against the newest step on level 3, unchanged files are linked (a
        # directory) or copied inside the store (a bucket), not copied from level 1
        self.flush_linked = {} if self.incremental else None
        self.shared.flush(
            comm,
            manifest,
            local,
            fsync=self.fsync,
            fault=self.fault,
            seq=seq,
            incremental=self.incremental,
            report=self.flush_linked,
            bases=self.bases[3],
        )

    def _make_room(self, comm: Comm, nbytes: int, step: int) -> bool:
        """Collective (a broadcast from rank 0; every rank, after a flush failed full: the vote
        gave every rank the same error): rank 0 removes the oldest level-3 steps so that the
        flush of ``step`` (``nbytes``) fits (``parallel.levels.room``); whether any was removed."""
        assert self.shared is not None
        mine = self.shared.make_room(nbytes, {step} | self.kept) if comm.rank == 0 else []
        removed = comm.bcast_json(mine)
        self.made_room = [int(s) for s in removed]
        if removed:
            log.warning(
                "level 3 (%s) was full: removed steps %s to flush step %s",
                self.shared.where,
                removed,
                step,
            )
            self.outcomes.notices.append(
                f"level 3 was full: steps {removed} were removed to make room for step {step}"
            )
        return bool(removed)

    def flush_newest(
        self, calls: Calls, budget_s: float, comm: Comm | None = None, seq: int | None = None
    ) -> None:
        """Collective (on ``comm``: the main thread's, or the saver thread's at SIGTERM; in
        order: a roll call, an all-true of the estimates, the flush): flush the newest level-1
        checkpoint if level 3 lacks it and the last measured flush rate says it fits in
        ``budget_s``. ``seq`` None counts a new collective call. Failures are kept for the
        next call."""
        on = comm or calls.comm
        m = self.newest_local
        if m is None or self.shared is None or m.save_id in self.flushed:
            return
        nbytes = sum(f.size for _, f in m.files())
        estimate = nbytes / self.flush_rate if self.flush_rate else 0.0
        try:
            calls.roll_call("flush", m.step, on, seq)
        except (CollectiveTimeoutError, OutOfStepError) as exc:
            log.error("not flushing step %s at exit: %s", m.step, exc)
            return
        if not on.all_true(estimate <= budget_s):
            log.warning(
                "not flushing step %s at exit: ~%.0f s needed, budget %.0f s",
                m.step,
                estimate,
                budget_s,
            )
            return
        if seq is None:
            seq = calls.next()
        self.flush(m, on, seq)
        if on.rank == 0:
            self._retain_shared({m.step or 0})
        if on.rank == 0 and m.save_id in self.flushed:
            log.info("flushed step %s to level 3 at exit", m.step)

    def delete(self, comm: Comm, step: int, levels: Sequence[int]) -> None:
        """Collective (one allgather at the end, every rank): remove ``step`` from ``levels``
        (each node's leader its level-1 copy, rank 0 the level-3 one); a failure on any rank
        raises on every rank (:func:`_settled`)."""

        def work() -> None:
            if 1 in levels and self.node_leader and self.local_root is not None:
                path = self.local_root / step_dir_name(step)
                if commit.is_committed(path):
                    commit.remove(path)
            if 3 in levels and comm.rank == 0 and self.shared is not None:
                self.shared.remove(step)

        try:
            _settled(comm, "delete", work)
        finally:
            if 1 in levels and self.newest_local is not None and self.newest_local.step == step:
                self.newest_local = None

    def clear(self, comm: Comm) -> list[str]:
        """Collective (one allgather at the end, every rank): remove every step and record the
        manager wrote, and nothing else (``levels.clear``): each node's leader at its level-1
        root, rank 0 at level 3. Returns the paths this rank left because they are not the
        manager's. A failure on any rank (a step the file system will not rename, a bucket
        that refuses) raises on every rank (:func:`_settled`)."""

        def work() -> list[str]:
            left: list[str] = []
            if self.node_leader and self.local_root is not None:
                left += [str(self.local_root / n) for n in clear_root(self.local_root)]
            if comm.rank == 0 and self.shared is not None:
                where = self.shared.where.rstrip("/")
                left += [f"{where}/{n}" for n in self.shared.clear()]
            return left

        try:
            return _settled(comm, "delete_all", work)
        finally:
            # every rank, leader or not: a rank that still held the deleted step would call a
            # flush's collectives at close that the others never call
            self.newest_local = None

    def clean_leftovers(self, comm: Comm) -> None:
        """Collective (a barrier at the end): remove what crashed saves left (each node's
        leader on level 1, rank 0 on level 3)."""
        if self.node_leader and self.local_root is not None:
            commit.clean_leftovers(self.local_root)
        if comm.rank == 0 and self.shared is not None:
            self.shared.clean_leftovers()
        comm.barrier()

    def steps(self) -> dict[int, dict[str, bool]]:
        """The committed steps this rank sees, with the levels that hold them (local); a step
        on level 3 counts there when it is whole (``SharedLevel.whole``)."""
        out: dict[int, dict[str, bool]] = {}
        level1 = [s for s, _ in committed(self.local_root)]
        shared = self.shared
        level3 = [s for s in shared.committed() if shared.whole(s)] if shared is not None else []
        for key, steps in (("level1", level1), ("level3", level3)):
            for s in steps:
                out.setdefault(s, {"level1": False, "level3": False})[key] = True
        return dict(sorted(out.items()))


def _settled(comm: Comm, operation: str, work: Callable[[], _T]) -> _T:
    """Collective (one allgather, every rank): run ``work``, this rank's part of
    ``operation``, and raise on every rank if it failed on any: where it failed, its own error
    (an ``OSError`` as ckptfmt's :class:`StorageError`), elsewhere a :class:`CollectiveError`
    naming that rank. A rank that raised alone would leave the others waiting for it at their
    next collective."""
    failure: CkptError | None = None
    try:
        result = work()
    except CkptError as exc:
        failure = exc
    except OSError as exc:
        failure = StorageError.of(exc)
    said = comm.allgather_json(None if failure is None else f"{type(failure).__name__}: {failure}")
    failed = {r: m for r, m in enumerate(said) if m is not None}
    if failure is not None:
        raise failure
    if failed:
        raise CollectiveError(failed, operation=operation)
    return result  # work() returned: no rank failed
