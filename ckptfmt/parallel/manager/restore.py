"""A manager's restore: the newest copy every rank can load, rebuilt from redundancy if need be.

Every rank of the communicator calls :func:`restore_newest` with the same request, after the
manager's roll call and the removal of leftovers. In order: an allgather of what each rank sees
(:class:`~ckptfmt.parallel.manager.restore_order.View`); then, for each candidate of the restore
order (:func:`~ckptfmt.parallel.manager.restore_order.candidates`) not refused outright,
``load_collective``; where a level-1 load fails for damage, or where the views already show a node
without the step (no load is tried to find that out), ``rebuild_in_memory`` and
``load_collective`` from the members' buffers it holds (``Rebuilt.files``: the survivors' data
read and checked once, the lost ranks' rebuilt). The rebuilt files are written afterwards by
``write_rebuilt_collective``, which the caller's ``RestoreSite.defer`` runs (the manager's saver
thread); until that commits, the step stays rebuildable from the same redundancy. The first
candidate that loads is the result; the loads' and rebuilds' votes make every rank take the same
branch. When none loads after copies were tried, one more allgather says whether a failed load
had read into the caller's arrays (``into=True``), which then raises on every rank. A failure
that is not damage (an allocation failure, a bug, a transport error on some rank) is raised on
every rank alike instead of trying older steps.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ckptfmt.errors import (
    CkptError,
    CollectiveError,
    LoadFailedError,
    SaveFailedError,
    StorageError,
    UnreachableNodesError,
    UnrecoverableDamageError,
    level_name,
)
from ckptfmt.manifest.limits import display
from ckptfmt.manifest.model import Manifest
from ckptfmt.parallel.collective.load import Into, load_collective
from ckptfmt.parallel.collective.publish import FaultHook
from ckptfmt.parallel.collective.rebuild import (
    Rebuilt,
    rebuild_in_memory,
    write_rebuilt_collective,
)
from ckptfmt.parallel.levels.layout import group_key
from ckptfmt.parallel.levels.shared import SharedLevel
from ckptfmt.parallel.manager.outcomes import CheckpointWarning
from ckptfmt.parallel.manager.restore_order import Candidate, StepRoot, View, candidates
from ckptfmt.parallel.manager.retention import committed
from ckptfmt.plan.options import ReadOptions
from ckptfmt.storage.files import Files
from ckptfmt.storage.progress import ProgressCallback, metering
from ckptfmt.transport.comm import Comm
from ckptfmt.tree.apply import ApplyReport, apply_loaded, landing_targets
from ckptfmt.tree.casting import Cast
from ckptfmt.tree.state import Shard, flatten

log = logging.getLogger("ckptfmt")

__all__ = ["RestoreReport", "RestoreRequest", "RestoreSite", "restore_newest", "save_number"]


@dataclass
class RestoreReport:
    """What ``restore`` chose and why; ``state`` is the loaded tree (None when nothing was
    restored: the caller's state is then untouched)."""

    step: int | None = None
    level: int | None = None
    path: str | None = None
    tried: list[str] = field(default_factory=list)  # reasons the newer candidates were refused
    rebuilt: list[str] = field(default_factory=list)  # what was rebuilt from redundancy
    unrecoverable: list[dict[str, Any]] = field(default_factory=list)  # ranks/tensors lost
    rebuild_seconds: float = 0.0
    # the rebuilt files, written after the restore returned: "" (none), "pending", "written",
    # or "failed: <why>" (the step then stays rebuildable; the next restore rebuilds it again)
    rewrite: str = ""
    rewrite_error: CkptError | None = None  # why the rebuilt files were not written
    applied: ApplyReport | None = None  # what was written into the caller's state
    # steps whose failed load had begun reading into the caller's arrays (``into=True``)
    landed: list[int] = field(default_factory=list)
    state: dict[str, Any] | None = None  # the loaded tree

    @property
    def restored(self) -> bool:
        """Whether a step was restored."""
        return self.step is not None


@dataclass(frozen=True, kw_only=True)
class RestoreRequest:
    """What the caller asked of ``restore`` (see ``CheckpointManager.restore``)."""

    state: Mapping[str, Any] | None = None
    read: ReadOptions = ReadOptions()
    strict: bool = True
    include: Sequence[str] | None = None
    exclude: Sequence[str] = ()
    apply: bool = True
    cast: Cast = "no"
    into: bool = False
    trust_pickle: bool = False
    step: int | None = None  # this step and no other (None: the newest)


@dataclass(frozen=True, kw_only=True)
class RestoreSite:
    """Where this rank restores from: its communicator and node, the levels' roots, the call's
    sequence number, and how rebuilt files are written and progress told."""

    comm: Comm
    node: str
    roots: Mapping[int, Path | None]  # {1: this node's level-1 directory}
    seq: int
    fsync: bool
    progress: ProgressCallback | None
    shared: SharedLevel | None = None  # level 3: a shared directory or a bucket
    # runs a job, collective on a communicator of the same ranks, after the restore returned
    # (the manager's saver thread); None: the job runs at once, on ``comm``
    defer: Callable[[Callable[[Comm], None]], None] | None = None
    fault: FaultHook | None = None  # a test's fault hook, for the rebuilt files' write


def save_number(manifest: Manifest) -> int:
    """The job's save number a manifest records (``levels[..]["save_number"]``; 0 if none): a
    restored job counts its saves on from there (the flush cadence follows it)."""
    for level in manifest.levels.values():
        n = level.get("save_number") if isinstance(level, Mapping) else None
        if isinstance(n, int) and not isinstance(n, bool):
            return n
    return 0


def raise_unless_damage(exc: CollectiveError, *, storage: bool = False) -> None:
    """A load (or, ``storage``, a rebuild, whose writes may also meet a full or failing disk)
    that failed for another reason than damage (an allocation failure, a bug, ranks out of
    step, a transport error on some rank) is not a reason to try older steps: it is raised, on
    every rank alike (they all hold the same vote)."""
    if isinstance(exc, UnreachableNodesError):
        return
    allowed = ("damage", "storage") if storage else ("damage",)
    if any(f.kind not in allowed for f in exc.rank_failures.values()):
        raise exc


def restore_newest(site: RestoreSite, req: RestoreRequest) -> tuple[RestoreReport, Manifest | None]:
    """Collective (see the module's docstring for the order of the calls): load the newest
    copy every rank can load into ``req.state``; the report and the manifest of what was
    restored (None: nothing usable). Raises :class:`UnrecoverableDamageError` on every rank
    when nothing is usable but a failed load had already read into the caller's arrays
    (``req.into``): one ``allgather`` tells every rank (:func:`_raise_if_landed`)."""
    wants = _wants(req.state)
    targets = _landing(req) if req.into else None
    views, listed = _views(site, every=req.step is not None)
    roots: dict[int, StepRoot | None] = {1: site.roots.get(1), 3: site.shared}
    order = _only(candidates(views, roots), req.step)
    newest = order[0].step if order else None
    report = RestoreReport()
    if req.step is not None and not order:
        report.tried.append(f"step {req.step}: no committed copy on any level")
    i = 0
    while i < len(order):
        c = order[i]
        i += 1
        if c.refused:
            report.tried.append(f"step {c.step} level {c.level}: {c.refused}")
            continue
        lacking = sorted({v["node"] for v in views if c.step not in v["l1"]})
        got = _load_or_rebuild(site, c, wants, req, targets, report, lacking)
        if got is None:
            if c.level == 3 and not listed:  # the pointer's step failed: older ones are listed
                for v, l3 in zip(views, _list_shared(site), strict=True):
                    v["l3"] = l3
                listed = True
                after = (-c.step, c.level)
                later = [x for x in candidates(views, roots) if (-x.step, x.level) > after]
                order[i:] = _only(later, req.step)
            continue
        loaded, manifest = got
        where = site.shared.describe(c.path) if c.level == 3 and site.shared else str(c.path)
        report.step, report.level, report.path = c.step, c.level, where
        if req.apply:
            report.applied = apply_loaded(
                req.state,
                loaded,
                strict=req.strict,
                include=req.include,
                exclude=req.exclude,
                cast=req.cast,
            )
        report.state = loaded
        _log(site.comm, report, newest)
        return report, manifest
    _raise_if_landed(site, report, order)
    _log(site.comm, report, newest)
    return report, None


def _raise_if_landed(site: RestoreSite, report: RestoreReport, order: list[Candidate]) -> None:
    """Collective (one ``allgather``, every rank, when copies were tried and none restored):
    raise :class:`UnrecoverableDamageError` on every rank when a load that failed had already
    read into some rank's arrays (``into=True``: the CRCs are checked as the data comes in).
    Restoring nothing says the state is as it was, and a caller would train from it; it holds
    part of a damaged step instead."""
    if not report.tried:  # nothing was tried (no checkpoint): the same on every rank
        return
    landed = sorted({s for got in site.comm.allgather_json(report.landed) for s in got})
    if not landed:
        return
    where = next((c.path for c in order if c.step == landed[-1]), "")
    steps = ", ".join(map(str, landed))
    raise UnrecoverableDamageError(
        str(where),
        f"restore(into=True) read part of step {steps} into the state's arrays before finding "
        "it damaged, and no copy could be restored: the state holds neither a checkpoint nor "
        "what it held before; initialise it again (or restore without into=True, which "
        f"writes nothing unless the whole step loads). Refused: {'; '.join(report.tried)}",
    )


def _only(order: list[Candidate], step: int | None) -> list[Candidate]:
    """The candidates of ``step`` (all of them when None)."""
    return order if step is None else [c for c in order if c.step == step]


def _views(site: RestoreSite, every: bool = False) -> tuple[list[View], bool]:
    """Collective (one allgather): what every rank sees, and whether level 3 was listed in
    full. Each rank lists its level-1 directory; a shared directory is listed by every rank
    (each its own mount), a bucket by rank 0 alone for every rank: the step of the latest
    pointer (one GET, one of its commit), or, without a usable pointer or with ``every`` (a
    restore of one step, which need not be the newest), a LIST. A bucket that cannot be read
    raises the same error on every rank: no rank starts fresh for a checkpoint it could not
    see."""
    shared = site.shared
    l3: list[int] = []
    listed = True
    failure = None
    if shared is not None and (not shared.one_looks or site.comm.rank == 0):
        try:
            newest = None if every else shared.newest()
            listed = newest is None
            l3 = shared.committed() if newest is None else newest
        except CkptError as exc:
            failure = str(exc)
    seen = site.comm.allgather_json(
        {
            "node": site.node,
            "l1": [s for s, _ in committed(site.roots.get(1))],
            "l3": l3,
            "listed": listed,
            "failure": failure,
        }
    )
    one = shared is not None and shared.one_looks
    _raise_unreadable(site, [g["failure"] for g in (seen[:1] if one else seen)])
    views: list[View] = [
        {"node": g["node"], "l1": g["l1"], "l3": seen[0]["l3"] if one else g["l3"]} for g in seen
    ]
    return views, bool(seen[0]["listed"]) if one else True


def _list_shared(site: RestoreSite) -> list[list[int]]:
    """Collective (a broadcast from rank 0): every committed step of a bucket, for every rank
    (rank 0 LISTs; the pointer's step did not load)."""
    assert site.shared is not None
    got: dict[str, Any] = {}
    if site.comm.rank == 0:
        try:
            got["steps"] = site.shared.committed()
        except CkptError as exc:
            got["failure"] = str(exc)
    got = site.comm.bcast_json(got)
    _raise_unreadable(site, [got.get("failure")])
    return [list(got["steps"])] * site.comm.size


def _raise_unreadable(site: RestoreSite, failures: list[str | None]) -> None:
    """Raise, on every rank alike, the first failure to read level 3 (the same list on
    every rank)."""
    for f in failures:
        if f is not None:
            where = site.shared.where if site.shared is not None else "level 3"
            raise StorageError(where, f"cannot look for checkpoints: {f}", level=level_name(3))


def _load_or_rebuild(
    site: RestoreSite,
    c: Candidate,
    wants: dict[str, Any],
    req: RestoreRequest,
    targets: Into | None,
    report: RestoreReport,
    lacking: list[str],
) -> tuple[dict[str, Any], Manifest] | None:
    """Collective: load candidate ``c``; on level 1, lost or damaged on some node, rebuild
    what parity covers and load from the rebuild. None (the reason in ``report``) when it
    cannot be. ``lacking``: the nodes whose level-1 directory lacks the step (the same on every
    rank, from the views): a load would only find out that they lost it, so the rebuild comes
    first (a load then follows when the rebuild cannot be made: the ranks without the step may
    be new to a job of another size)."""
    if c.level == 1 and lacking:
        mark = (len(report.tried), len(report.unrecoverable))
        got = _rebuild_and_load(site, c, wants, req, targets, report, None, lacking)
        if got is not False:
            return got
        try:  # e.g. ranks new to a job of another size, which the load serves over the Comm
            loaded = _load(site, c, wants, req.read, targets, req.trust_pickle, report=report)
        except LoadFailedError as exc:
            raise_unless_damage(exc)
            return None  # why the rebuild could not be made is in the report
        del report.tried[mark[0] :], report.unrecoverable[mark[1] :]
        return loaded
    try:
        return _load(site, c, wants, req.read, targets, req.trust_pickle, report=report)
    except LoadFailedError as exc:
        raise_unless_damage(exc)
        if c.level == 3:
            report.tried.append(f"step {c.step} level {c.level}: {exc}")
            return None
        got = _rebuild_and_load(site, c, wants, req, targets, report, str(exc))
        return None if got is False else got


def _rebuild_and_load(
    site: RestoreSite,
    c: Candidate,
    wants: dict[str, Any],
    req: RestoreRequest,
    targets: Into | None,
    report: RestoreReport,
    why: str | None,
    lacking: Sequence[str] = (),
) -> tuple[dict[str, Any], Manifest] | Literal[False] | None:
    """Collective: rebuild the level-1 step of ``c`` in memory and load it from there (every
    rank's member data: its own read, or what the rebuild made of the others'); the rebuilt
    files are written afterwards (:func:`_write_later`). None (the reason in ``report``): the
    step cannot be restored; False: it cannot be rebuilt (the reason in ``report``). ``why``:
    the load's failure; None when no load was tried because the nodes ``lacking`` have no copy
    (the reason then says, as the load would have, whose files no rank sees)."""
    try:
        rebuilt = rebuild_in_memory(
            site.comm, c.path, group_key(site.node, True), site.fsync, site.seq
        )
    except (UnrecoverableDamageError, SaveFailedError) as exc:
        if isinstance(exc, SaveFailedError):
            raise_unless_damage(exc, storage=True)
        if why is None:
            why = f"no committed copy on node(s) {', '.join(lacking)}"
        report.tried.append(f"step {c.step} level 1: {why}; cannot rebuild: {exc}")
        if isinstance(exc, UnrecoverableDamageError):
            report.unrecoverable.append(
                {
                    "step": c.step,
                    "ranks": list(exc.lost_ranks),
                    "nodes": list(exc.nodes),
                    "tensors": list(exc.tensors),
                }
            )
        return False
    result = rebuilt.report
    if why is None:
        gone = [r for r, ok in enumerate(rebuilt.intact_dirs) if not ok]
        why = str(UnreachableNodesError(result.recreated_nodes, gone))
    if result.repaired:
        report.rebuilt.append(f"step {c.step} level 1: {why}; {result.describe()}")
        report.rebuild_seconds += result.seconds
    try:
        if not rebuilt.written:  # nothing of the data lost (metadata at most): from the files
            got = _load(site, c, wants, req.read, targets, req.trust_pickle, report=report)
        else:
            # every rank's member checked before anything is read (``MemberFiles.verify``),
            # and every rank reads its own member only (from memory, never a neighbour's
            # files from disk, which could fail once data has landed): the load lands it in
            # the caller's arrays even without ``into``, nothing of theirs written unless it
            # all loads
            memory = rebuilt.files(site.comm.rank)
            got = _load(
                site,
                c,
                wants,
                req.read,
                targets if targets is not None else _landing(req),
                req.trust_pickle,
                memory,
                range(site.comm.size),
                memory.verify,
            )
    except LoadFailedError as exc2:
        raise_unless_damage(exc2)
        report.tried.append(f"step {c.step} level {c.level}: {exc2}")
        return None
    if rebuilt.written:
        _write_later(site, rebuilt, report)
    return got


def _write_later(site: RestoreSite, rebuilt: Rebuilt, report: RestoreReport) -> None:
    """Have the rebuilt files written (``write_rebuilt_collective``) on the manager's saver
    thread, after the restore returned (every rank queues it, in the same order as its other
    background jobs); without one (``site.defer`` None), now. A write that fails leaves the
    step as rebuildable as it was (a later restore rebuilds it again): it is logged and kept in
    ``report.rewrite``, never raised."""
    step = rebuilt.manifest.step
    report.rewrite = "pending"

    def write(comm: Comm) -> None:
        try:
            write_rebuilt_collective(comm, rebuilt, site.fsync, site.seq, site.fault or _no_hook)
        except CkptError as exc:
            report.rewrite, report.rewrite_error = f"failed: {exc}", exc
            if comm.rank == 0:
                log.warning(
                    "restore: the rebuilt files of step %s were not written (%s); the step "
                    "stays rebuildable from its redundancy",
                    step,
                    exc,
                )
            return
        report.rewrite = "written"

    if site.defer is None:
        write(site.comm)
    else:
        site.defer(write)


def _landing(req: RestoreRequest) -> Callable[[dict[str, Any]], dict[str, np.ndarray]] | None:
    """What a load may read straight into (``load_collective``'s ``into``): the arrays of the
    caller's state that applying it would copy a saved array of their dtype into, once the
    load says what it returns; none when the state would be refused (``landing_targets``).
    None: nothing is applied."""
    state = req.state
    if state is None or not req.apply:
        return None

    def targets(skeleton: dict[str, Any]) -> dict[str, np.ndarray]:
        return landing_targets(
            state,
            skeleton,
            strict=req.strict,
            include=req.include,
            exclude=req.exclude,
            cast=req.cast,
        )

    return targets


def _no_hook(_point: str) -> None:
    pass


def _load(
    site: RestoreSite,
    c: Candidate,
    wants: dict[str, Any],
    read: ReadOptions,
    into: Into | None,
    trust_pickle: bool,
    memory: Files | None = None,
    own_only: Sequence[int] = (),
    check_first: Callable[[], None] | None = None,
    report: RestoreReport | None = None,
) -> tuple[dict[str, Any], Manifest]:
    """Collective: ``load_collective`` of ``c``; ``memory``: a level-1 step rebuilt in memory
    (``Rebuilt.files``), read instead of the directory, ``own_only`` the ranks whose data only
    they hold. A load that fails after it was given arrays of the caller's to read into (and
    checks as it reads: no ``check_first``) is listed in ``report.landed``."""
    # some ranks without a copy may be new to the job (another size, another node): the load
    # finds out whether every saved node's files are visible to some rank
    source = memory
    path = c.path
    if c.level == 3 and site.shared is not None:
        path, source = site.shared.open_step(site.comm, c.path, c.step)
    landing: list[bool] = []  # whether the load was given arrays of the caller's to fill

    def tracked(skeleton: dict[str, Any]) -> Mapping[str, np.ndarray]:
        got = into(skeleton) if callable(into) else (into or {})
        landing.append(bool(got))
        return got

    # a load that lands as it checks (no ``check_first``) is tracked
    track = into is not None and check_first is None and report is not None
    try:
        with metering("load", site.progress) as meter:
            loaded = load_collective(
                site.comm,
                path,
                wants,
                seq=site.seq,
                expect_step=c.step,
                node=site.node if c.level == 1 else None,
                host=site.node,  # its ranks share their reads of replicated state on either level
                read=read,
                into=tracked if track else into,
                trust_pickle=trust_pickle,
                source=source,
                own_only=own_only,
                check_first=check_first,
            )
            meter.finish()
    except LoadFailedError:
        if any(landing) and report is not None:
            report.landed.append(c.step)
        raise
    return loaded


def _wants(
    state: Mapping[str, Any] | None,
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]] | None]:
    """The boxes this rank wants: its ``Shard`` leaves' regions ('/'-joined names)."""
    if state is None:
        return {}
    return {
        display(name): (leaf.offset, leaf.data.shape)
        for name, leaf in flatten(state)
        if isinstance(leaf, Shard)
    }


def _log(comm: Comm, report: RestoreReport, newest: int | None) -> None:
    """Warn when a newer checkpoint could not be used; rank 0 logs what was refused, rebuilt
    and restored."""
    older = newest is not None and (report.step is None or report.step < newest)
    if report.tried and older:  # a newer checkpoint could not be used: say so loudly
        chosen = "nothing" if report.step is None else f"step {report.step}"
        warnings.warn(
            f"restore fell back to {chosen}: refused {'; '.join(report.tried)}",
            CheckpointWarning,
            stacklevel=4,
        )
    if comm.rank != 0:
        return
    for reason in report.tried:
        log.warning("restore: refused %s", reason)
    for line in report.rebuilt:
        log.warning("restore: %s", line)
    if report.step is None:
        log.info("restore: no usable checkpoint; starting fresh")
    else:
        (log.warning if report.tried else log.info)(
            "restored step %s from level %s (%s)", report.step, report.level, report.path
        )
