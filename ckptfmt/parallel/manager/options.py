"""The settings of a :class:`~ckptfmt.parallel.manager.checkpoint_manager.CheckpointManager`: one
frozen object, :class:`ManagerSettings` (the levels, the redundancy, the cadence, the retention,
the error handling), with its two parts that other calls take too: how its files are written
(:class:`~ckptfmt.format.options.WriteOptions`, the object the one-process save and ``ckptfmt
reshard`` take) and what it does when the job ends (:class:`ExitPolicy`).

Every setting is checked here, once, when the object is made (a :class:`UsageError` naming the
setting); the manager and the integrations (Keras's ``BackupAndRestore``, Lightning's
``CheckpointIO``, the Hugging Face ``CheckpointOptions``) take the object as it is and pass it on
unchanged, so a new manager setting is one field here. Their keyword spellings
(``CheckpointManager(local_dir=..., flush_every=...)``) all go through :meth:`ManagerSettings.of`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, cast, get_args

from ckptfmt.errors import UsageError
from ckptfmt.format.options import WriteOptions, checked_write
from ckptfmt.parallel.levels.layout import valid_node
from ckptfmt.parallel.manager.telemetry import SaveReport
from ckptfmt.redundancy.config import Policy, Redundancy
from ckptfmt.storage.progress import ProgressCallback
from ckptfmt.storage.store.location import parse_location

__all__ = ["ExitPolicy", "ManagerSettings", "OnError", "RedundancySpec", "WhenBusy"]

OnError = Literal["warn", "raise"]
WhenBusy = Literal["wait", "skip"]
RedundancySpec = None | str | Redundancy | Policy | Mapping[str, Any] | list[dict[str, Any]] | Path


@dataclass(frozen=True)
class ExitPolicy:
    """What a manager does when the job ends (the same on every rank).

    ``flush``: at ``close()`` and at interpreter exit, flush the newest level-1 step to level 3
    when level 3 lacks it and the last measured flush rate says it fits in ``budget_s``
    seconds; ``sigterm``: at SIGTERM, do the same flush from the saver thread, whatever the
    main thread is doing (SCR's and torch-elastic's preemption signal), then let the signal
    take its course (the handler that was there before, or the end of the process). One
    handler serves every open manager of the process (``parallel.manager.exit``): each flushes its
    newest step, oldest manager first; a closed manager is no longer in it."""

    flush: bool = True
    budget_s: float = 120.0
    sigterm: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.budget_s, bool) or not isinstance(self.budget_s, (int, float)):
            raise UsageError(f"budget_s must be a number of seconds, got {self.budget_s!r}")
        if self.budget_s < 0:
            raise UsageError(f"budget_s must be >= 0, got {self.budget_s!r}")
        for name in ("flush", "sigterm"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"ExitPolicy: {name} must be True or False")


@dataclass(frozen=True)
class ManagerSettings:
    """Everything a :class:`~ckptfmt.CheckpointManager` is told, the same on every rank; checked
    when made (a :class:`UsageError` naming the setting), then taken as it is.

    Levels: ``local_dir`` (level 1, node-local; may contain ``{node}``, the node being ``node``,
    else ``CKPTFMT_NODE``, else the host name) and ``shared_dir`` (level 3: a directory, or an
    object-store URL with ``storage_options``, see ``docs/object-storage.md``); a manager needs
    one of them at least. ``fallback_to_shared``: a level-1 save that fails for a storage reason
    goes to level 3 instead.

    Redundancy and cadence: ``redundancy`` protects level 1 across nodes (a scheme id
    ``"partner"``/``"xor"``/``"rs"``, a :class:`~ckptfmt.redundancy.config.Redundancy`, a mapping,
    a list of descriptors, or a JSON file of one; kept as the
    :class:`~ckptfmt.redundancy.config.Policy` it names, so a file is read once, here; it needs a
    ``local_dir``). ``flush_every``: every how many saves a step is copied to level 3 (None:
    every save, or what the policy's ``flush`` descriptors say: :attr:`flush_period`).
    ``async_save``: ``save`` returns once the state is copied; ``incremental``: data files equal
    to the previous step's are hard-linked, not written.

    ``recycle_level1``: a level-1 step that retention drops is kept as a spare slot (renamed
    into ``<local_dir>/.slots/``, its manifest removed) and the next save overwrites its files
    in place instead of creating new ones (about twice as fast on tmpfs; ``docs/levels.md``,
    "Recycled step directories"); it costs one more step's room at rest. Not with
    ``incremental`` (whose saves link files rather than write them). False: dropped steps are
    deleted and every save writes new files.

    Retention: the newest ``keep_local`` steps on level 1 and ``keep_shared`` on level 3 stay
    (0: all). Errors and time: ``on_error`` (``"warn"`` or ``"raise"``: how a failed
    background save is told), ``deadline_s`` (how long a collective call waits for every rank).
    Parts: ``write`` (:class:`~ckptfmt.WriteOptions`) and ``at_exit`` (:class:`ExitPolicy`).
    Reports: ``on_save`` (each save's :class:`SaveReport`, from the saver thread) and
    ``progress`` (:class:`~ckptfmt.Progress` events of saves and restores).

    Saves in flight: ``saves_in_flight`` saves (each with its staging copy in host memory) may
    be queued or running behind the loop at once; ``when_busy`` says what a ``save`` made while
    all of them are does: ``"wait"`` until one is over, or ``"skip"``: the save is taken on every
    rank but not made (its handle raises :class:`~ckptfmt.errors.SaveSkippedError`, the manager
    counts it in ``saves_skipped`` and logs it), so that the loop never waits for a slow level.

    ``CheckpointManager``'s docstring says what each does in full."""

    local_dir: str | os.PathLike[str] | None = None
    shared_dir: str | os.PathLike[str] | None = None
    storage_options: Mapping[str, Any] | None = None
    node: str | None = None
    redundancy: RedundancySpec = None
    flush_every: int | None = None
    keep_local: int = 2
    keep_shared: int = 3
    async_save: bool = True
    incremental: bool = False
    recycle_level1: bool = True
    fallback_to_shared: bool = True
    on_error: OnError = "warn"
    saves_in_flight: int = 1
    when_busy: WhenBusy = "wait"
    deadline_s: float = 300.0
    write: WriteOptions = WriteOptions()
    at_exit: ExitPolicy = ExitPolicy()
    on_save: Callable[[SaveReport], None] | None = None
    progress: ProgressCallback | None = None

    def __post_init__(self) -> None:
        # kept in one spelling each, so that two settings that say the same compare equal
        for name in ("local_dir", "shared_dir"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, (str, os.PathLike)):
                    raise UsageError(f"{name} must be a path or None, got {value!r}")
                if "\0" in os.fsdecode(value):  # else the OS's bare ValueError, deep in a save
                    raise UsageError(f"{name}={value!r}: a path cannot hold a NUL character")
                object.__setattr__(self, name, os.fspath(value))
        if self.local_dir is not None:
            parse_location(self.local_dir).on_disk()  # level 1 is a node's own disk
        given = self.storage_options
        if given is not None:
            if not isinstance(given, Mapping):
                raise UsageError(f"storage_options must be a mapping, got {given!r}")
            object.__setattr__(self, "storage_options", MappingProxyType(dict(given)))
        if self.node is not None and not valid_node(self.node):
            raise UsageError(
                f"node={self.node!r}: a node's name is a non-empty str that fills {{node}} with "
                "one directory (no '/', no NUL, not '.' or '..'), or None"
            )
        object.__setattr__(self, "redundancy", Policy.of(self.redundancy))
        if self.local_dir is None and self.policy.all_redundancies():
            raise UsageError("redundancy protects level 1 (node-local copies): give a local_dir")
        every = self.flush_every
        if every is not None and not (_is_int(every) and every >= 1):
            raise UsageError(f"flush_every must be an int >= 1 or None, got {every!r}")
        for name in ("keep_local", "keep_shared"):
            value = getattr(self, name)
            if not (_is_int(value) and value >= 0):
                raise UsageError(f"{name} must be an int >= 0 (0 keeps every step), got {value!r}")
        for name in ("async_save", "incremental", "recycle_level1", "fallback_to_shared"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"{name} must be True or False")
        if self.on_error not in get_args(OnError):
            raise UsageError(f"on_error is 'warn' or 'raise', got {self.on_error!r}")
        n = self.saves_in_flight
        if not (_is_int(n) and n >= 1):
            raise UsageError(f"saves_in_flight must be an int >= 1, got {n!r}")
        if self.when_busy not in get_args(WhenBusy):
            raise UsageError(f"when_busy is 'wait' or 'skip', got {self.when_busy!r}")
        d = self.deadline_s
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not d > 0:
            raise UsageError(f"deadline_s must be a number of seconds > 0, got {d!r}")
        checked_write(self.write)
        if not isinstance(self.at_exit, ExitPolicy):
            raise UsageError(f"at_exit must be a ckptfmt.ExitPolicy, got {self.at_exit!r}")
        for name in ("on_save", "progress"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise UsageError(f"{name} must be callable or None, got {value!r}")

    @classmethod
    def of(cls, settings: ManagerSettings | None = None, **changes: Any) -> ManagerSettings:
        """``settings`` (the defaults when None) with ``changes`` (fields by name) in place of
        its values: the one way from the keyword spelling to the object, for the manager and
        every integration. ``settings`` itself when nothing changes; an unknown name is a
        ``TypeError`` naming it, a bad value the field's :class:`UsageError`."""
        if settings is None:
            return cls(**changes)
        if not isinstance(settings, cls):
            raise UsageError(f"settings must be a ckptfmt.ManagerSettings, got {settings!r}")
        return dataclasses.replace(settings, **changes) if changes else settings

    @property
    def policy(self) -> Policy:
        """The redundancy policy (``redundancy`` as it is kept)."""
        return cast(Policy, self.redundancy)  # made a Policy by __post_init__

    @property
    def flush_period(self) -> int:
        """Every how many saves a step is flushed to level 3: ``flush_every``, else 1, or 0
        (only where a ``flush`` descriptor of the policy says) when the policy has any."""
        if self.flush_every is not None:
            return self.flush_every
        return 0 if any(d.flush for d in self.policy.descriptors) else 1

    def need_a_level(self) -> None:
        """Raise the :class:`UsageError` of settings with neither level (an integration that
        fills in a level of its own asks only once it has)."""
        if self.local_dir is None and self.shared_dir is None:
            raise UsageError("give a local_dir (level 1), a shared_dir (level 3), or both")

    def decided_by(self, owner: str, **values: Any) -> ManagerSettings:
        """These settings with the fields that ``owner`` (an integration) decides itself set to
        ``values`` (Keras's ``backup_dir`` is level 3; Hugging Face's ``save_total_limit``
        sets ``keep_shared``). A field given another value than its default and than the
        owner's is refused, naming both, rather than silently replaced."""
        decided = dataclasses.replace(self, **values)
        default = _defaults()
        for name in values:
            mine = getattr(self, name)
            if mine != getattr(default, name) and mine != getattr(decided, name):
                raise UsageError(
                    f"ManagerSettings.{name}={mine!r}: {owner} sets it itself (to "
                    f"{getattr(decided, name)!r}); leave it out of the settings"
                )
        return decided


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@functools.cache
def _defaults() -> ManagerSettings:
    return ManagerSettings()
