"""``CheckpointManager``: multi-level, asynchronous checkpoints for a training loop.

    mgr = CheckpointManager(local_dir="/local/ckpt", shared_dir="/shared/ckpt", comm=MpiComm(),
                            flush_every=10)
    step = mgr.restore(state)            # collective: newest usable step, or None
    for step in ...:
        mgr.save(step, state)            # returns once the state is copied into host buffers
    mgr.close()                          # waits; flushes the newest checkpoint to level 3

Every rank of ``comm`` makes the same calls in the same order (they are collective). Saving goes
on in one background thread per rank that talks to the other ranks on a duplicated communicator;
the next ``save`` waits for the previous one. A failed save (a full disk, a dead directory) is
voted on by all ranks, leaves earlier checkpoints untouched, and is reported at the next call: as
a :class:`CheckpointWarning` by default (training goes on), or raised with ``on_error="raise"``.
Anything else escaping the background thread aborts the whole job (``comm.start_background``).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import queue
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ckptfmt.container.metadata import ManifestMeta
from ckptfmt.engine.encode import member_sets
from ckptfmt.errors import (
    CkptError,
    CollectiveError,
    CollectiveTimeoutError,
    DamagedError,
    ManagerBrokenError,
    ManifestError,
    NotACheckpointError,
    OutOfStepError,
    UnreachableNodesError,
    UnrecoverableDamageError,
    UsageError,
)
from ckptfmt.format.options import WriteOptions
from ckptfmt.manifest.limits import display
from ckptfmt.manifest.model import Manifest
from ckptfmt.parallel import share
from ckptfmt.parallel.launch import launcher_world_size, refuse_implicit_single, refuse_url
from ckptfmt.parallel.levels import (
    Levels,
    flush_collective,
    resolve_node,
    retain,
    retain_steps,
)
from ckptfmt.parallel.load import LoadFailedError, load_collective
from ckptfmt.parallel.options import ExitPolicy, OnError, check_on_error, legacy_options
from ckptfmt.parallel.protocol import FaultHook, SaveFailedError, check_leaf, save_collective
from ckptfmt.parallel.rebuild import rebuild_collective
from ckptfmt.parallel.sigterm import SigtermWatch
from ckptfmt.parallel.staging import BufferPool, SaveHandle, copy_mode, default_pool
from ckptfmt.parallel.telemetry import SaveReport, data_bytes_of, parity_bytes_of
from ckptfmt.plan.options import PerRankMode, ReadOptions
from ckptfmt.plan.per_rank import RankMap
from ckptfmt.redundancy.config import Policy, Redundancy
from ckptfmt.storage import commit
from ckptfmt.storage.progress import ProgressCallback, metering
from ckptfmt.storage.steps import list_step_dirs, parse_step, step_dir_name
from ckptfmt.transport.comm import Comm, SingleComm, start_background
from ckptfmt.tree.apply import ApplyReport, apply_loaded
from ckptfmt.tree.casting import check_policy
from ckptfmt.tree.state import Name, Shard, arrays_of, flatten

log = logging.getLogger("ckptfmt")

RedundancySpec = None | str | Redundancy | Policy | Mapping[str, Any] | list[dict[str, Any]] | Path


def _damage_kinds() -> frozenset[str]:
    """The names of the errors that mean "this copy is damaged or absent" (another copy or an
    older step may do), as a vote reports them."""
    roots = (DamagedError, ManifestError, NotACheckpointError, UnreachableNodesError)
    names = {c.__name__ for root in roots for c in _subclasses(root)}
    return frozenset(names | {"MisplacedCopyError", "OutOfStepError", ""})


def _raise_unless_damage(exc: CollectiveError, storage: bool = False) -> None:
    """A load (or, ``storage``, a rebuild, whose writes may also meet a full or failing disk)
    that failed for another reason than damage (an allocation failure, a bug, a transport error
    on some rank) is not a reason to try older steps: it is raised, on every rank alike (they
    all hold the same vote)."""
    if isinstance(exc, UnreachableNodesError):
        return
    kinds = _damage_kinds()
    if storage:
        kinds |= {c.__name__ for c in _subclasses(OSError)}
    if any(f.type not in kinds for f in exc.rank_failures.values()):
        raise exc


def _may_fall_back(exc: CkptError) -> bool:
    """Whether a failed level-1 save is worth writing to level 3 instead: a storage failure
    on some rank (a full or failing node-local disk), not misuse or ranks out of step."""
    if not isinstance(exc, SaveFailedError):
        return False
    usage = {c.__name__ for c in _subclasses(UsageError)} | {"OutOfStepError"}
    # a rank whose copy of the state failed has nothing to write anywhere
    before_data = {"copy", "declare", "plan"}
    return all(
        f.type not in usage and f.phase not in before_data for f in exc.rank_failures.values()
    )


def _subclasses(cls: type) -> set[type]:
    out: set[type] = {cls}
    todo: list[type] = [cls]
    while todo:
        sub: type
        for sub in todo.pop().__subclasses__():
            if sub not in out:
                out.add(sub)
                todo.append(sub)
    return out


def _save_number(manifest: Manifest) -> int:
    """The job's save number a manifest records (``levels[..]["save_number"]``; 0 if none)."""
    for level in manifest.levels.values():
        n = level.get("save_number") if isinstance(level, Mapping) else None
        if isinstance(n, int) and not isinstance(n, bool):
            return n
    return 0


@dataclass
class _SaveJob:
    """What one save hands its background job."""

    step: int
    staged: dict[str, Any]
    seq: int
    failure: BaseException | None
    report: SaveReport
    handle: SaveHandle
    taken: list[np.ndarray]  # pool buffers to give back when the job ends
    mode: str  # copy_mode: "now", "background" or "none"
    ready: Callable[[], None] | None
    boxes: share.Boxes | None  # what this rank writes of the replicated tensors (staged only)
    leaves: list[tuple[Name, Any]] | None = None  # background copy: staged by the job itself


class CheckpointWarning(UserWarning):
    """A background save failed; training goes on with the previous checkpoints intact."""


@dataclass
class RestoreReport:
    """What ``restore`` chose and why."""

    step: int | None = None
    level: int | None = None
    path: str | None = None
    tried: list[str] = field(default_factory=list)  # reasons the newer candidates were refused
    rebuilt: list[str] = field(default_factory=list)  # what was rebuilt from redundancy
    unrecoverable: list[dict[str, Any]] = field(default_factory=list)  # ranks/tensors lost
    rebuild_seconds: float = 0.0
    applied: ApplyReport | None = None  # what was written into the caller's state


class CheckpointManager:
    """Multi-level checkpoints: level 1 on each node's ``local_dir``, flushed every
    ``flush_every``-th save to ``shared_dir`` (level 3). Either level may be omitted.

    ``redundancy`` protects level 1 across nodes: a scheme id (``"partner"``, ``"xor"``,
    ``"rs"``) or :class:`Redundancy` for every save, or a :class:`Policy` / list of descriptors
    (``[{"every": 1, "redundancy": "xor"}, {"every": 10, "redundancy": "rs", "m": 2},
    {"every": 100, "flush": True}]``) or a JSON file of one. ``restore`` rebuilds lost or damaged
    level-1 data from it before falling back to level 3. ``flush_every`` defaults to every save,
    or, when the policy has ``flush`` descriptors, to what they say.

    ``local_dir`` may contain ``{node}``; the node is ``node``, else the ``CKPTFMT_NODE``
    environment variable, else the host name. Constructing the manager is collective.

    ``fallback_to_shared``: a level-1 save that fails for a storage reason on some rank (a full
    or failing node-local disk) is written to level 3 instead, when there is one; the next call
    warns, and ``last_save.fell_back`` says so. ``on_save``: called with each save's
    :class:`SaveReport` (blocked and background time, bytes per level, parity, level reached),
    from the saver thread.

    ``deadline_s``: how long a collective call (save, restore, delete, prune, the exit flush)
    waits for every rank to arrive (``MpiComm`` and ``TorchComm``; a transport without
    deadlines uses its own timeout). A rank left alone in a call the others never make
    (``save`` called on one rank only) is told, naming the ranks that did not arrive and the
    step, instead of waiting forever; ranks that meet from different calls (one saves step 6,
    the others step 5) are all told (:class:`~ckptfmt.errors.OutOfStepError`). The manager then
    refuses further collective calls (:class:`ManagerBrokenError`): its ranks are out of step.

    ``write`` (:class:`~ckptfmt.WriteOptions`: chunk and shard sizes, writer threads, fsync; the
    same object ``save_collective`` and ``ckptfmt reshard`` take) says how the files are written;
    its ``overwrite`` is the manager's own (a step saved again after a restart replaces the
    old one). ``at_exit`` (:class:`~ckptfmt.ExitPolicy`): the flush at ``close`` / interpreter
    exit and on SIGTERM. ``on_error``: ``"warn"`` (a failed background save is a
    :class:`CheckpointWarning` at the next call; training goes on) or ``"raise"``. The former
    keywords ``fsync``, ``chunk_bytes``, ``shard_bytes``, ``threads``, ``exit_flush``,
    ``exit_flush_budget_s`` and ``handle_sigterm`` still work, with a ``DeprecationWarning``.

    ``progress``: called with :class:`~ckptfmt.Progress` events of each save (``op="save"``,
    from the saver thread: this rank's data and parity files; the last once it is committed)
    and of each load a restore makes (``op="load"``: this rank's reads and what it receives;
    a restore that falls back to another step or level starts a new series).
    """

    def __init__(
        self,
        local_dir: str | Path | None = None,
        shared_dir: str | Path | None = None,
        *,
        comm: Comm | None = None,
        node: str | None = None,
        flush_every: int | None = None,
        redundancy: RedundancySpec = None,
        keep_local: int = 2,
        keep_shared: int = 3,
        async_save: bool = True,
        on_error: OnError = "warn",
        fallback_to_shared: bool = True,
        deadline_s: float = 300.0,
        write: WriteOptions = WriteOptions(),
        at_exit: ExitPolicy = ExitPolicy(),
        on_save: Callable[[SaveReport], None] | None = None,
        progress: ProgressCallback | None = None,
        pool: BufferPool | None = None,
        fault: FaultHook | None = None,
        **deprecated: Any,
    ) -> None:
        if local_dir is None and shared_dir is None:
            raise UsageError("give a local_dir (level 1), a shared_dir (level 3), or both")
        self.on_error = check_on_error(on_error)
        write, at_exit = legacy_options(deprecated, write, at_exit)
        if not isinstance(write, WriteOptions) or not isinstance(at_exit, ExitPolicy):
            raise UsageError("write is a ckptfmt.WriteOptions and at_exit a ckptfmt.ExitPolicy")
        self.policy = Policy.of(redundancy)
        if flush_every is None:  # every save, unless the policy's descriptors say when
            flush_every = 0 if any(d.flush for d in self.policy.descriptors) else 1
        elif isinstance(flush_every, bool) or not isinstance(flush_every, int) or flush_every < 1:
            raise UsageError("flush_every must be an int >= 1")
        if comm is None:
            refuse_implicit_single(launcher_world_size())
        for d in (local_dir, shared_dir):
            if d is not None:
                refuse_url(str(d))
        self.comm = comm or SingleComm()
        self.node = resolve_node(node)
        self.levels = Levels(
            None if local_dir is None else str(local_dir),
            None if shared_dir is None else Path(shared_dir).absolute(),
        )
        self.local_root = self.levels.local_root(self.node)
        self.flush_every = flush_every
        self.keep_local, self.keep_shared = keep_local, keep_shared
        self.async_save = async_save
        self.at_exit = at_exit
        # a step saved again (a job restarted from an older step) replaces the old directory
        self.write = dataclasses.replace(write, overwrite=True)
        self.fault = fault
        if not deadline_s > 0:
            raise UsageError(f"deadline_s must be > 0, got {deadline_s!r}")
        self.deadline_s = float(deadline_s)
        self.on_save = on_save
        self.progress = progress
        self.fallback_to_shared = fallback_to_shared
        self._pool = pool if pool is not None else default_pool()  # staging buffers, reused
        self._init_records()
        self._start()

    def _init_records(self) -> None:
        """Local: what the manager reports (saves, restores, failures) and counts (the job's
        save number, the collective calls), empty at the start."""
        self._notices: list[str] = []  # said at the next call: not failures (a fallback)
        self.last_save: SaveReport | None = None  # the newest save whose outcome is known
        self.save_reports: list[SaveReport] = []  # the newest 100, oldest first
        self.restored_state: dict[str, Any] | None = None
        self.last_restore: RestoreReport | None = None
        self.failed_saves: list[tuple[int, CkptError]] = []
        self._pending: list[tuple[int, CkptError]] = []
        self._saves = 0  # the job's save number (carried across restarts by the manifests)
        self._calls = 0  # collective calls made (save, restore, close): the votes' sequence
        self._broken: CkptError | None = None  # the communicator failed: no collective is safe
        self._newest_local: Manifest | None = None
        self._flushed: set[str] = set()  # save ids on level 3
        self._flush_rate = 0.0  # bytes/s of the last flush
        self._own_boxes: tuple[str, share.Boxes] | None = None  # the last share: digest, boxes
        self._closed = False

    def _start(self) -> None:
        """Collective (an allgather of the node names, then ``dup`` of the communicator): every
        rank learns the nodes (a redundancy the nodes cannot carry raises on every rank), rank
        0 records them under level 3, and the saver thread and the SIGTERM watch start."""
        nodes = self.comm.allgather_json(self.node)
        self._node_leader = nodes.index(self.node) == self.comm.rank
        if self.local_root is not None:
            for red in self.policy.all_redundancies():
                member_sets(red, nodes)  # the same verdict on every rank: raises for all
        elif self.policy.all_redundancies():
            raise UsageError("redundancy protects level 1: give a local_dir")
        if self.comm.rank == 0:
            self.levels.record(nodes)
        self._bg = self.comm.dup()
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._worker = start_background(self._bg, self._work, f"ckptfmt-saver-{self.comm.rank}")
        self._sigterm: SigtermWatch | None = None
        if self.at_exit.sigterm and threading.current_thread() is threading.main_thread():
            self._sigterm = SigtermWatch(self._flush_at_sigterm)
            self._sigterm.install()
        atexit.register(self._at_exit)

    # --- the training-loop API -------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        donate: bool = False,
        background_copy: bool = False,
        ready: Callable[[], None] | None = None,
    ) -> SaveHandle:
        """Collective: checkpoint ``state`` as ``step``. Returns once the state is copied into
        host buffers (asynchronous mode); writing, committing and flushing go on behind.

        Returns a :class:`~ckptfmt.parallel.staging.SaveHandle`: ``staged`` says when ``state``
        may be mutated again, ``committed`` when the checkpoint is committed (or why it failed).
        ``background_copy=True`` makes the staging copy on the saver thread instead, after the
        ranks' agreement on what each copies, which is the saver threads' too (``save`` makes
        no collective call and returns at once; wait on ``staged`` before mutating: a save
        that failed, on any rank, is told at the next call); ``donate=True`` makes none (the
        writer reads ``state`` itself: ``staged`` is done when the save is). ``ready``, when
        given, is called on the saver thread before anything of ``state`` is read (e.g. to wait
        for device-to-host copies). See ``ckptfmt.parallel.staging``."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise UsageError(f"step must be a non-negative int, got {step!r}")
        self._check_open()
        entered = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - entered
        if waited > 0.01:
            log.info("save of step %s waited %.2f s for the previous save", step, waited)
        mode = copy_mode(donate, background_copy)
        self._calls += 1
        seq = self._calls
        telemetry = SaveReport(step, waited_s=waited)
        staged: dict[str, Any] = {}
        taken: list[np.ndarray] = []  # pool buffers this save holds until its job ends
        handle = SaveHandle(step)
        failure: BaseException | None = None
        usage: UsageError | None = None
        leaves: list[tuple[Name, Any]] | None = None
        try:
            leaves = self._check_state(state)  # misuse raised here, whatever on_error says
        except UsageError as exc:
            failure = usage = exc
        if mode == "background":  # the agreement and the copy are the saver thread's
            job = _SaveJob(step, {}, seq, failure, telemetry, handle, taken, mode, ready, None)
            job.leaves = leaves
            return self._hand_over(job, usage, entered)
        try:  # every rank takes part, a rank whose state was refused too
            boxes = self._share(step, seq, leaves)
        except Exception as exc:  # the roll call's deadline passed, or the transport failed
            return self._unshared(step, exc, handle, telemetry)
        if leaves is not None:
            try:
                staged, telemetry.staged_bytes = self._stage(leaves, taken, mode == "now", boxes)
            except Exception as exc:  # e.g. MemoryError while copying: voted on like any failure
                failure = exc
        if mode == "now" or failure is not None:
            handle.set_staged()
        # a rank that failed to stage still takes part in the save's first vote, which fails
        # the step on every rank (no rank pairs this save with its next one)
        job = _SaveJob(step, staged, seq, failure, telemetry, handle, taken, mode, ready, boxes)
        return self._hand_over(job, usage, entered)

    def _hand_over(self, job: _SaveJob, usage: UsageError | None, entered: float) -> SaveHandle:
        """Give ``job`` to the saver thread; raise ``usage`` (this rank's state was refused)
        once the job, which the other ranks' saves pair with, is done; without ``async_save``
        or after a failure, wait for it and report."""
        job.report.blocked_s = time.perf_counter() - entered
        self._idle.clear()
        self._jobs.put(lambda: self._save_job(job))
        if usage is not None:
            self._idle.wait()
            self._pending = [(s, e) for s, e in self._pending if s != job.step]
            raise usage
        if not self.async_save or job.failure is not None:
            self._idle.wait()
            self._report()
        return job.handle

    def wait(self) -> None:
        """Wait for the save in flight; report a failed one (see ``on_error``)."""
        self._idle.wait()
        self._report()

    def latest(self) -> int | None:
        """The newest step committed on this rank's level-1 directory or on level 3 (a local
        view, not collective; ``restore`` decides collectively)."""
        steps = [s for s, p in self._committed(self.local_root)]
        steps += [s for s, p in self._committed(self.levels.shared_dir)]
        return max(steps) if steps else None

    def steps(self) -> dict[int, dict[str, bool]]:
        """The committed steps this rank sees, with the levels that hold them:
        ``{step: {"level1": bool, "level3": bool}}`` (level 1: this rank's node's directory).
        A local view, not collective."""
        out: dict[int, dict[str, bool]] = {}
        for key, root in (("level1", self.local_root), ("level3", self.levels.shared_dir)):
            for s, _ in self._committed(root):
                out.setdefault(s, {"level1": False, "level3": False})[key] = True
        return dict(sorted(out.items()))

    def delete(self, step: int | str, levels: Sequence[int] = (1, 3)) -> None:
        """Collective: remove ``step`` (a number or a step directory name such as
        ``"step-100"``) from the given levels, on every node (each node's first rank removes
        its level-1 copy, rank 0 the level-3 one); waits for the save in flight first."""
        number = parse_step(step)
        bad = [lv for lv in levels if lv not in (1, 3)]
        if bad:
            raise UsageError(f"levels are 1 and 3, got {bad}")
        self._check_open()
        self.wait()
        self._calls += 1
        self._roll_call("delete", number)
        if 1 in levels and self._node_leader and self.local_root is not None:
            path = self.local_root / step_dir_name(number)
            if commit.is_committed(path):
                commit.remove(path)
        if 3 in levels and self.comm.rank == 0 and self.levels.shared_dir is not None:
            path = self.levels.shared_dir / step_dir_name(number)
            if commit.is_committed(path):
                commit.remove(path)
        if 1 in levels and self._newest_local is not None and self._newest_local.step == number:
            self._newest_local = None
        self.comm.barrier()

    def prune(self, keep_local: int | None = None, keep_shared: int | None = None) -> None:
        """Collective: apply retention now: keep the newest ``keep_local`` level-1 steps (of all
        nodes together) and ``keep_shared`` level-3 steps (default: the manager's settings)."""
        self._check_open()
        self.wait()
        self._calls += 1
        self._roll_call("prune", None)
        saved = self.keep_local, self.keep_shared
        if keep_local is not None:
            self.keep_local = keep_local
        if keep_shared is not None:
            self.keep_shared = keep_shared
        try:
            self._retain(self.comm, set())
        finally:
            self.keep_local, self.keep_shared = saved

    def restore(
        self,
        state: Mapping[str, Any] | None = None,
        *,
        rank_map: RankMap = None,
        per_rank: PerRankMode = "error",
        strict: bool = True,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] = (),
        apply: bool = True,
        cast: str | None = None,
        into: bool = False,
    ) -> int | None:
        """Collective: load the newest step that every rank can load, and return it (None when
        there is none). Level 1 is tried first (every rank's data present or rebuildable from
        the save's redundancy, every checksum good), then level 3, then older steps. ``state``,
        when given, is updated in place (arrays copied into, other values replaced; ``Shard``
        leaves say which region this rank wants); the loaded state is also kept as
        ``restored_state``. Leftovers of crashed saves are removed first.

        The job may have another number of ranks than the save (``spec/reshard.md``): each rank
        gets its ``Shard`` boxes or whole tensors; per-rank entries follow ``rank_map`` (saved
        rank -> current rank) or raise :class:`PerRankError` listing what cannot be carried
        over, unless ``per_rank="drop"`` (a warning lists it instead).

        ``state`` must match the checkpoint: a name of the state the checkpoint lacks, a saved
        name the state lacks, or an array of another shape or dtype raises
        :class:`StateMismatchError` on that rank before anything is written into ``state``.
        ``strict=False`` allows names on either side only; ``include``/``exclude`` (``fnmatch``
        patterns on '/'-joined names) restore part of a state. ``last_restore.applied`` says
        what was loaded, missing, unexpected and excluded. ``apply=False``: ``state`` only says
        which boxes to load (its ``Shard`` leaves); nothing is written into it (an adapter that
        checks and converts ``restored_state`` itself).

        ``cast``: an array of ``state`` whose dtype differs from the saved one is refused
        (:class:`DtypeMismatchError` naming every such array and both dtypes, nothing written),
        unless ``cast="safe"`` (no value changes: ``bfloat16`` into ``float32``) or ``"any"``
        (``float32`` into ``float16`` rounds) allows converting it; the policy of the torch and
        Keras adapters (``ckptfmt.tree.casting``). Conversions made are listed in
        ``last_restore.applied.casts`` and warned of (``CastWarning``).

        ``into=True``: read straight into the arrays of ``state`` that can take their tensor as
        it is (C-contiguous, writeable, the saved shape and dtype), so each is written once on
        the way in instead of loaded and then copied; the others are loaded and copied as
        without it. The price: a restore that fails part-way, or falls back to an older step,
        may already have written into them (the checks before writing still run, but after the
        read).

        A transport failure on the way (a peer died: gloo's "Connection closed by peer") raises
        :class:`ManagerBrokenError` and the manager refuses collective calls from then on, as
        after a background save that met one."""
        self._check_open()
        check_policy(cast)  # a usage error before anything collective
        self.wait()
        try:
            return self._restore(
                state, rank_map, per_rank, strict, include, exclude, apply, cast, into
            )
        except CkptError:
            raise
        except RuntimeError as exc:  # the communicator itself (torch's DistError, MPI.Exception)
            broken = ManagerBrokenError(f"restore: {type(exc).__name__}: {exc}")
            self._broken = broken
            raise broken from exc

    def _restore(
        self,
        state: Mapping[str, Any] | None,
        rank_map: RankMap,
        per_rank: PerRankMode,
        strict: bool,
        include: Sequence[str] | None,
        exclude: Sequence[str],
        apply: bool,
        cast: str | None = None,
        into: bool = False,
    ) -> int | None:
        self._calls += 1
        self._roll_call("restore", None)
        self._clean_leftovers()
        wants = self._wants(state)
        targets = arrays_of(state) if into and apply and state is not None else None
        local = [s for s, _ in self._committed(self.local_root)]
        shared = [s for s, _ in self._committed(self.levels.shared_dir)]
        seen = self.comm.allgather_json({"node": self.node, "l1": local, "l3": shared})
        candidates = sorted({s for x in seen for s in x["l1"] + x["l3"]}, reverse=True)
        report = RestoreReport()
        for step in candidates:
            for level, root in ((1, self.local_root), (3, self.levels.shared_dir)):
                if root is None:
                    continue
                key = "l1" if level == 1 else "l3"
                lacking = [r for r, x in enumerate(seen) if step not in x[key]]
                if level == 3 and len(lacking) == len(seen):
                    continue  # never flushed: not a candidate on this level
                path = root / step_dir_name(step)
                if lacking and (level == 3 or len(lacking) == len(seen)):
                    nodes = sorted({seen[r]["node"] for r in lacking})
                    report.tried.append(
                        f"step {step} level {level}: no committed copy on node(s) "
                        f"{', '.join(nodes)} (ranks {', '.join(map(str, lacking))})"
                    )
                    continue
                # some ranks without a copy may be new to the job (another size, another node):
                # the load finds out whether every saved node's files are visible to some rank
                try:
                    loaded, manifest = self._load(
                        path, wants, level, step, rank_map, per_rank, targets
                    )
                except LoadFailedError as exc:
                    _raise_unless_damage(exc)
                    if level == 3:
                        report.tried.append(f"step {step} level {level}: {exc}")
                        continue
                    # lost or damaged on some node: rebuild what parity covers, load again
                    if not self._rebuild(path, step, str(exc), report):
                        continue
                    try:
                        loaded, manifest = self._load(
                            path, wants, level, step, rank_map, per_rank, targets
                        )
                    except LoadFailedError as exc2:
                        _raise_unless_damage(exc2)
                        report.tried.append(f"step {step} level {level}: {exc2}")
                        continue
                report.step, report.level, report.path = step, level, str(path)
                if apply:
                    report.applied = apply_loaded(
                        state, loaded, strict=strict, include=include, exclude=exclude, cast=cast
                    )
                self._saves = max(self._saves, _save_number(manifest))
                self.restored_state = loaded
                if level == 1:
                    # a save by another number of ranks is not this job's to flush: its files
                    # belong to ranks that are not here (flush copies what each rank wrote)
                    same = manifest.world_size == self.comm.size
                    self._newest_local = manifest if same else None
                else:
                    self._flushed.add(manifest.save_id)
                self.last_restore = report
                self._log_restore(report, candidates[0])
                return int(step)
        self.last_restore = report
        self._log_restore(report, candidates[0] if candidates else None)
        return None

    def _load(
        self,
        path: Path,
        wants: dict[str, Any],
        level: int,
        step: int,
        rank_map: RankMap,
        per_rank: PerRankMode,
        into: dict[str, np.ndarray] | None = None,
    ) -> tuple[dict[str, Any], Manifest]:
        with metering("load", self.progress) as meter:
            loaded = load_collective(
                self.comm,
                path,
                wants,
                seq=self._calls,
                expect_step=step,
                node=self.node if level == 1 else None,
                read=ReadOptions(rank_map, per_rank),
                into=into,
            )
            meter.finish()
        return loaded

    def _rebuild(self, path: Path, step: int, why: str, report: RestoreReport) -> bool:
        """Collective: rebuild this level-1 step from its redundancy; False (with the reasons
        in ``report``) when it cannot be."""
        try:
            result, _ = rebuild_collective(
                self.comm, path, self._group_key(True), self.write.fsync, self._calls
            )
        except (UnrecoverableDamageError, SaveFailedError) as exc:
            if isinstance(exc, SaveFailedError):
                _raise_unless_damage(exc, storage=True)
            report.tried.append(f"step {step} level 1: {why}; cannot rebuild: {exc}")
            if isinstance(exc, UnrecoverableDamageError):
                report.unrecoverable.append(
                    {
                        "step": step,
                        "ranks": list(exc.lost_ranks),
                        "nodes": list(exc.nodes),
                        "tensors": list(exc.tensors),
                    }
                )
            return False
        if result.repaired:
            report.rebuilt.append(f"step {step} level 1: {why}; {result.describe()}")
            report.rebuild_seconds += result.seconds
        return True

    def close(self, flush: bool | None = None) -> None:
        """Wait for the save in flight and, unless told not to, flush the newest level-1
        checkpoint to level 3 if it is not there yet (collective)."""
        if self._closed:
            return
        self.wait()
        if self._broken is not None:  # no collective is safe any more: nothing to flush with
            flush = False
        if self.at_exit.flush if flush is None else flush:
            self._flush_newest(self.at_exit.budget_s)
            self._report()
        self._closed = True
        self._jobs.put(None)
        self._worker.join(timeout=60)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- staging (the only part the training loop waits for) -------------------------------------

    def _check_state(self, state: Mapping[str, Any]) -> list[tuple[Name, Any]]:
        """The leaves of ``state``, each checked (:func:`check_leaf`): misuse raises
        ``UsageError`` at the call, before anything is copied."""
        leaves = flatten(state)  # refuses a state that is not a mapping
        for name, leaf in leaves:
            check_leaf(display(name), leaf)
        return leaves

    def _roll_call(
        self, what: str, step: int | None, comm: Comm | None = None, seq: int | None = None
    ) -> None:
        """Collective (every rank of ``comm``, default the caller's communicator, at the start
        of each collective call): every rank is in the same call (``what``, ``step``, the call
        number) within the deadline, or every rank still there raises what the roll call
        raises, and this manager makes no collective call any more (its ranks are out of
        step)."""
        try:
            (comm or self.comm).roll_call(
                self.deadline_s, what, step, self._calls if seq is None else seq
            )
        except (CollectiveTimeoutError, OutOfStepError) as exc:
            self._broken = exc
            raise

    def _share(
        self,
        step: int,
        seq: int,
        leaves: list[tuple[Name, Any]] | None,
        comm: Comm | None = None,
    ) -> share.Boxes | None:
        """Collective (every rank, before its staging copy: from ``save`` on ``comm`` None, the
        caller's communicator, or from the saver thread on its own for a background copy;
        ``leaves`` None where the state was refused): the regions of the replicated tensors
        this rank writes, when every rank holds the same ones (``ckptfmt.parallel.share``),
        else None (stage everything). One process: None. Raises what the roll call raises. The
        regions of the last agreed digest are kept: a training loop saves the same tensors."""
        if self.comm.size == 1:
            return None
        holdings = share.replicated(leaves) if leaves is not None else []
        mine = share.digest(holdings, self.write, self.comm.size) if leaves is not None else None
        if not share.agree(comm or self.comm, self.deadline_s, step, seq, mine):
            return None
        assert mine is not None  # agree is True only where this rank has a digest
        if self._own_boxes is None or self._own_boxes[0] != mine:
            boxes = share.own_boxes(holdings, self.write, self.comm.size, self.comm.rank)
            self._own_boxes = (mine, boxes)
        return self._own_boxes[1]

    def _stage(
        self,
        leaves: list[tuple[Name, Any]],
        taken: list[np.ndarray],
        copy_now: bool,
        boxes: share.Boxes | None,
    ) -> tuple[dict[str, Any], int]:
        """The staging copy into the pool's buffers (``share.stage``)."""
        return share.stage(self._pool, leaves, taken, copy_now, boxes)

    def _unshared(
        self, step: int, exc: Exception, handle: SaveHandle, report: SaveReport
    ) -> SaveHandle:
        """The ranks could not agree before staging (some rank did not come within the
        deadline, or the transport failed): no collective of this manager can be trusted any
        more. The save fails on this rank at once (no background job), reported as a
        background save's failure would be (``on_error``)."""
        broken = self._break_on(step, exc, report)
        self._record_save(report)
        handle.set_committed(broken)
        self._report()
        return handle

    def _break_on(self, step: int, exc: Exception, report: SaveReport) -> CkptError:
        """The save of ``step`` failed before its staging because the ranks could not agree
        (the main thread's :meth:`_unshared`, or a background copy's on the saver thread): no
        collective of this manager can be trusted any more; the failure is kept for the next
        call and returned."""
        broken: CkptError = (
            exc
            if isinstance(exc, CkptError)
            else ManagerBrokenError(f"{type(exc).__name__}: {exc}")
        )
        self._broken = broken
        report.error = str(broken)
        self._pending.append((step, broken))
        log.error("rank %s: save of step %s failed: %s", self.comm.rank, step, broken)
        return broken

    # --- the background thread -------------------------------------------------------------------

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
                broken = ManagerBrokenError(f"{type(exc).__name__}: {exc}")
                self._broken = broken
                self._pending.append((-1, broken))
                log.error("rank %s: background save failed: %s", self._bg.rank, broken)
            finally:
                self._idle.set()

    def _save_job(self, job: _SaveJob) -> None:
        """Background, collective on the duplicated communicator: write level 1 (or level 3 when
        there is no level 1), flush when due, apply retention. Every failure of the save or
        the flush (on any rank: any exception) is voted on and recorded for the next call.
        The staging buffers go back to the pool and the save's handle is finished at the end."""
        report = job.report
        started = time.perf_counter()
        pending = len(self._pending)
        error: BaseException | None = None
        staged, failure = job.staged, job.failure
        try:
            if failure is None and job.ready is not None:
                try:
                    job.ready()
                except Exception as exc:  # voted on like a failed copy
                    failure = exc
            if job.mode == "background":
                try:  # every rank takes part, on the saver threads' communicator
                    boxes = self._share(job.step, job.seq, job.leaves, self._bg)
                except Exception as exc:  # the roll call's deadline passed, or the transport
                    self._break_on(job.step, exc, report)
                    job.handle.set_staged()  # the state is free again at once
                    return
                if job.leaves is not None and failure is None:
                    try:
                        staged, report.staged_bytes = self._stage(
                            job.leaves, job.taken, True, boxes
                        )
                    except Exception as exc:  # voted on like a failed copy
                        failure = exc
                job.handle.set_staged()
            # a background copy's agreement was this save's roll call on the saver threads'
            # communicator: the ranks are known to be in it
            rolled = job.mode == "background"
            self._save_steps(job.step, staged, job.seq, failure, report, rolled)
        except BaseException as exc:  # the communicator broke (see _work)
            error = ManagerBrokenError(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            report.background_s = time.perf_counter() - started
            self._record_save(report)
            self._pool.give(job.taken)
            mine = [e for s, e in self._pending[pending:] if s in (job.step, -1)]
            job.handle.set_committed(error or (mine[0] if mine else None))

    def _save_steps(
        self,
        step: int,
        staged: dict[str, Any],
        seq: int,
        failure: BaseException | None,
        report: SaveReport,
        rolled: bool = False,
    ) -> None:
        target_root = self.local_root or self.levels.shared_dir
        assert target_root is not None
        number = self._saves + 1
        red = self.policy.redundancy_for(number) if self.local_root is not None else None
        try:
            if not rolled:
                self._roll_call("save", step, self._bg, seq)
        except (CollectiveTimeoutError, OutOfStepError) as exc:  # no later collective is safe
            self._pending.append((step, exc))
            report.error = str(exc)
            return
        level = 1 if self.local_root is not None else 3
        try:
            manifest = self._write(staged, target_root, step, level, number, red, seq, failure)
        except CkptError as exc:
            report.error = str(exc)
            can = level == 1 and self.levels.shared_dir is not None and self.fallback_to_shared
            if not (can and _may_fall_back(exc)):
                self._pending.append((step, exc))
                return
            # level 1 cannot take it (full, failing): the step goes to level 3 directly
            log.warning(
                "level-1 save of step %s failed, writing it to level 3 instead: %s",
                step,
                exc,
            )
            shared = self.levels.shared_dir
            assert shared is not None  # checked above
            try:
                manifest = self._write(staged, shared, step, 3, number, None, seq, None)
            except CkptError as exc2:
                self._pending.append((step, exc2))
                report.error = f"{exc}; and on level 3: {exc2}"
                return
            level, report.fell_back = 3, True
            self._notices.append(
                f"level-1 save of step {step} failed, so it was written to level 3: {exc}"
            )
        self._saves = number
        report.level = level
        report.redundancy = red.scheme if red is not None and level == 1 else None
        report.bytes_written[str(level)] = data_bytes_of(manifest, self._bg.rank)
        report.parity_bytes = parity_bytes_of(manifest, self._bg.rank) if level == 1 else 0
        if level == 3:
            self._flushed.add(manifest.save_id)
            report.flushed = True
        else:
            self._newest_local = manifest
            due = self.flush_every and number % self.flush_every == 0
            wanted = due or self.policy.flush_for(number)
            if (
                self.levels.shared_dir is not None
                and wanted
                and self._flush(manifest, self._bg, seq)
            ):
                report.flushed = True
                report.bytes_written["3"] = report.bytes_written["1"]
        self._retain(self._bg, {step})

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
        with metering("save", self.progress) as meter:
            manifest = self._write_collective(staged, root, step, level, number, red, seq, failure)
            meter.finish()
        return manifest

    def _write_collective(
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
        manifest, _ = save_collective(
            self._bg,
            staged,
            root / step_dir_name(step),
            step=step,
            node=self.node,
            group=self._group_key(level == 1),
            write=self.write,
            meta=ManifestMeta(levels={str(level): {"save_number": number}}),
            fault=self.fault,
            redundancy=red,
            seq=seq,
            failure=failure,
        )
        return manifest

    def _record_save(self, report: SaveReport) -> None:
        """Keep ``report`` and hand it to ``on_save`` (from the saver thread; a failing
        callback is logged, never raised into the save)."""
        self.last_save = report
        self.save_reports = [*self.save_reports[-99:], report]
        if self.on_save is not None:
            try:
                self.on_save(report)
            except Exception as exc:
                log.warning("on_save callback failed: %s", exc)

    def _retain(self, comm: Comm, protect: set[int]) -> None:
        """Collective: the same retention on every node. Each node's leader lists its committed
        level-1 steps; every node keeps the newest ``keep_local`` steps of all nodes together
        (and ``protect``), so no node deletes a step another node still counts on."""
        mine = [s for s, _ in self._committed(self.local_root)] if self._node_leader else []
        seen = comm.allgather_json(mine)
        if self.local_root is not None and self._node_leader:
            everywhere = sorted({s for x in seen for s in x})
            keep = set(everywhere[-self.keep_local :]) if self.keep_local > 0 else set(everywhere)
            retain_steps(self.local_root, keep | protect)
        if comm.rank == 0:
            retain(self.levels.shared_dir, self.keep_shared, protect)

    def _flush(self, manifest: Manifest, comm: Comm, seq: int | None = None) -> bool:
        assert self.local_root is not None and self.levels.shared_dir is not None
        started = time.perf_counter()
        try:
            flush_collective(
                comm,
                manifest,
                self.local_root / step_dir_name(manifest.step or 0),
                self.levels.shared_dir,
                fsync=self.write.fsync,
                fault=self.fault,
                seq=seq,
            )
        except CkptError as exc:
            self._pending.append((manifest.step or 0, exc))
            return False
        nbytes = sum(f.size for _, f in manifest.files())
        self._flush_rate = nbytes / max(time.perf_counter() - started, 1e-6)
        self._flushed.add(manifest.save_id)
        return True

    def _flush_newest(
        self, budget_s: float, comm: Comm | None = None, seq: int | None = None
    ) -> None:
        """Collective (on ``comm``: the main thread's, or the saver thread's at SIGTERM): flush
        the newest level-1 checkpoint if level 3 lacks it and the last measured flush rate says
        it fits in ``budget_s``. Failures are kept for the next call (``_pending``)."""
        on = comm or self.comm
        m = self._newest_local
        if m is None or self.levels.shared_dir is None or m.save_id in self._flushed:
            return
        nbytes = sum(f.size for _, f in m.files())
        estimate = nbytes / self._flush_rate if self._flush_rate else 0.0
        try:
            self._roll_call("flush", m.step, on, seq)
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
            self._calls += 1
            seq = self._calls
        self._flush(m, on, seq)
        if on.rank == 0:
            retain(self.levels.shared_dir, self.keep_shared, {m.step or 0})
        if on.rank == 0 and m.save_id in self._flushed:
            log.info("flushed step %s to level 3 at exit", m.step)

    # --- helpers ---------------------------------------------------------------------------------

    def _report(self) -> None:
        notices, self._notices = self._notices, []
        for notice in notices:
            warnings.warn(notice, CheckpointWarning, stacklevel=3)
        pending, self._pending = self._pending, []
        for step, exc in pending:
            self.failed_saves.append((step, exc))
            if self.on_error == "raise":
                raise exc
            warnings.warn(
                f"checkpoint of step {step} failed: {exc}", CheckpointWarning, stacklevel=3
            )

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError("this CheckpointManager is closed")
        if self._broken is not None:
            raise ManagerBrokenError(
                f"this CheckpointManager cannot make collective calls any more: {self._broken}"
            ) from self._broken

    def _group_key(self, node_local: bool) -> str:
        """Which ranks see the same directory: a node's ranks on level 1, everyone on level 3."""
        return f"node:{self.node}" if node_local else "shared"

    @staticmethod
    def _committed(root: Path | None) -> list[tuple[int, Path]]:
        if root is None:
            return []
        return [(s, p) for s, p in list_step_dirs(root) if commit.is_committed(p)]

    def _clean_leftovers(self) -> None:
        if self._node_leader and self.local_root is not None:
            commit.clean_leftovers(self.local_root)
        if self.comm.rank == 0 and self.levels.shared_dir is not None:
            commit.clean_leftovers(self.levels.shared_dir)
        self.comm.barrier()

    @staticmethod
    def _wants(
        state: Mapping[str, Any] | None,
    ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]] | None]:
        if state is None:
            return {}
        return {
            display(name): (leaf.offset, leaf.data.shape)
            for name, leaf in flatten(state)
            if isinstance(leaf, Shard)
        }

    def _log_restore(self, report: RestoreReport, newest: int | None = None) -> None:
        older = newest is not None and (report.step is None or report.step < newest)
        if report.tried and older:  # a newer checkpoint could not be used: say so loudly
            chosen = "nothing" if report.step is None else f"step {report.step}"
            warnings.warn(
                f"restore fell back to {chosen}: refused {'; '.join(report.tried)}",
                CheckpointWarning,
                stacklevel=3,
            )
        if self.comm.rank != 0:
            return
        for reason in report.tried:
            log.warning("restore: refused %s", reason)
        for line in report.rebuilt:
            log.warning("restore: %s", line)
        if report.step is None:
            log.info("restore: no usable checkpoint; starting fresh")
        else:
            (log.warning if report.tried else log.info)(
                "restored step %s from level %s (%s)",
                report.step,
                report.level,
                report.path,
            )

    def _flush_at_sigterm(self) -> None:
        """The scheduler's warning (any thread): flush the newest checkpoint within the budget.
        The flush runs on the saver thread, after the save in flight, on its communicator (the
        main thread may be anywhere, in the middle of its own collectives); every rank gets the
        signal and queues the same flush."""
        if self._closed or self._broken is not None:
            return
        done = threading.Event()

        def job() -> None:
            try:
                self._flush_newest(self.at_exit.budget_s, self._bg, seq=-1)
            finally:
                done.set()

        self._idle.clear()
        self._jobs.put(job)
        done.wait()
        self._idle.wait()
        self._report_quietly()

    def _report_quietly(self) -> None:
        for step, exc in self._pending:
            log.warning("at SIGTERM: step %s: %s", step, exc)

    def _at_exit(self) -> None:
        try:
            self.close()
        except CkptError as exc:
            log.warning("at exit: %s", exc)
