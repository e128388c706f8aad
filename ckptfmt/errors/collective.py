"""The collective family: an operation of several ranks failed on some of them, or the ranks
could not agree at all; every rank of the operation raises the same error (the CLI, which runs
one process, exits 3 should one reach it).

:class:`RankFailure` is what every rank learns of one rank's failure from the vote, with its
kind (:data:`FailureKind`) so that ranks act on a failure by its type.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from ckptfmt.errors.base import CkptError, ranks_text
from ckptfmt.errors.damage import DamagedError, ManifestError, NotACheckpointError
from ckptfmt.errors.usage import UsageError

FailureKind = Literal["usage", "damage", "collective", "storage", "state", "other"]
"""What a failure means to the ranks that learn of it from a vote: ``"usage"`` (a
:class:`UsageError`: misuse), ``"damage"`` (the data read is damaged or absent: another copy or
an older step may do), ``"collective"`` (the ranks fell out of step or timed out),
``"storage"`` (an ``OSError``: a full or failing disk), ``"state"`` (the caller's state could
not be copied or made ready, whatever the exception: nothing reached storage), ``"other"``
(anything else: a bug, an allocation failure)."""


@dataclass(frozen=True)
class RankFailure:
    """What failed on one rank in a collective phase, as every rank learns it from the vote.

    ``type`` is the exception's class name (``"ValueError"``, ``"MemoryError"``,
    ``"ChecksumError"``, ...), ``message`` its text, ``phase`` the phase of the collective
    operation it happened in (``"stage"``, ``"plan"``, ``"write"``, ``"encode"``, ``"commit"``,
    ``"flush"``, ``"load"``, ``"rebuild"``, ...), ``fields`` the JSON-able structured fields of a
    :class:`CkptError` (``path``, ``tensors``, ``expected``, ...). ``kind`` is the failure's
    family (:data:`FailureKind`), decided by ``isinstance`` on the rank where it happened, so
    that every rank can act on a failure by its type (retry elsewhere, fall back, raise)
    without the exception object."""

    type: str
    message: str
    phase: str = ""
    fields: Mapping[str, Any] = field(default_factory=dict)
    kind: FailureKind = "other"

    def __str__(self) -> str:
        return f"{self.type}: {self.message}" if self.type else self.message

    def to_json(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "message": self.message,
            "phase": self.phase,
            "fields": dict(self.fields),
            "kind": self.kind,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> RankFailure:
        return cls(
            str(doc.get("type", "")),
            str(doc.get("message", "")),
            str(doc.get("phase", "")),
            dict(doc.get("fields") or {}),
            _kind(doc.get("kind")),
        )

    @classmethod
    def of(
        cls, exc: BaseException, phase: str = "", kind: FailureKind | None = None
    ) -> RankFailure:
        """The failure record of ``exc``: its type, message, JSON-able public fields and kind
        (``kind``, when given, overrides :func:`failure_kind`)."""
        fields: dict[str, Any] = {}
        for key, value in vars(exc).items():
            if key.startswith("_") or key in ("args", "cause", "rank_failures", "failures"):
                continue
            if isinstance(value, (str, int, float, bool)) or value is None:
                fields[key] = value
            elif isinstance(value, (tuple, list)) and all(
                isinstance(v, (str, int, float, bool)) for v in value
            ):
                fields[key] = list(value)
        return cls(type(exc).__name__, str(exc), phase, fields, kind or failure_kind(exc))


def failure_kind(exc: BaseException) -> FailureKind:
    """The :data:`FailureKind` of ``exc``, by its class. The order matters: some damage and
    usage errors are also ``OSError`` (``MissingFileError``, ``DestinationUnwritableError``)."""
    if isinstance(exc, UsageError):
        return "usage"
    if isinstance(exc, DamagedError | ManifestError | NotACheckpointError | UnreachableNodesError):
        return "damage"
    if isinstance(exc, CollectiveError | ManagerBrokenError):
        return "collective"
    if isinstance(exc, OSError):
        return "storage"
    return "other"


def _kind(value: object) -> FailureKind:
    kinds: tuple[str, ...] = get_args(FailureKind)
    return value if isinstance(value, str) and value in kinds else "other"  # type: ignore[return-value]


class CollectiveError(CkptError):
    """A collective operation failed on some rank(s); every rank of the operation raises it.

    ``rank_failures`` maps each failing rank to its :class:`RankFailure` (type, message, phase,
    structured fields); ``failures`` maps rank to ``"Type: message"`` (the short form);
    ``operation`` and ``step`` say which collective operation it was; ``cause`` is this rank's
    own exception, if it had one."""

    verb = "operation"

    def __init__(
        self,
        failures: Mapping[int, str | RankFailure],
        cause: BaseException | None = None,
        *,
        operation: str = "",
        step: int | None = None,
        message: str | None = None,
    ) -> None:
        self.rank_failures = {
            int(r): f if isinstance(f, RankFailure) else RankFailure("", str(f))
            for r, f in failures.items()
        }
        self.failures = {r: str(f) for r, f in self.rank_failures.items()}
        self.cause = cause
        self.operation = operation
        self.step = step
        if message is None:
            lines = "; ".join(
                f"rank {r}: {f}" + (f" (in {f.phase})" if f.phase else "")
                for r, f in sorted(self.rank_failures.items())
            )
            of_step = f" of step {step}" if step is not None else ""
            message = f"{self.verb}{of_step} failed on {len(self.failures)} rank(s): {lines}"
        super().__init__(message)

    @property
    def failed_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self.rank_failures))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (``torch.distributed.checkpoint`` sends a failed save's error from its
        coordinator to every rank) with its fields, without ``cause``: this rank's own
        exception, which need not pickle and is not the receiver's."""
        fields = {k: v for k, v in self.__dict__.items() if k != "cause"}
        return (_unpickle_collective, (type(self), str(self), fields))


def _unpickle_collective(
    cls: type[CollectiveError], message: str, fields: dict[str, Any]
) -> CollectiveError:
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    exc.__dict__.update(fields, cause=None)
    return exc


class SaveFailedError(CollectiveError):
    """A collective save (or flush, or rebuild write) failed on some rank; nothing of it was
    committed anywhere. ``failures`` maps rank to that rank's error message."""

    verb = "save"


class SaveSkippedError(CollectiveError):
    """A ``CheckpointManager`` save that was taken but not made, on every rank: some rank could
    not start it (``ManagerSettings.when_busy="skip"``: every slot for a save in flight was
    taken, or the loop gave the save up with ``SaveHandle.abandon`` before its copy began).
    Nothing of it was written; earlier checkpoints are untouched and the next save goes on as
    usual. Not a failure: counted in the manager's ``saves_skipped``, never in
    ``failed_saves``. ``step``: the save's step; ``ranks``: the ranks that could not start it;
    ``reason``: why, as the first of them said."""

    verb = "save"

    def __init__(self, step: int, ranks: Sequence[int], reason: str) -> None:
        self.ranks = tuple(ranks)
        self.reason = reason
        super().__init__(
            {},
            operation="save",
            step=step,
            message=f"save of step {step} skipped on every rank: {ranks_text(self.ranks)} "
            f"could not start it ({reason}); nothing was written, earlier checkpoints stand "
            "(raise ManagerSettings.saves_in_flight, or save less often, to skip fewer)",
        )


class LoadFailedError(CollectiveError):
    """A collective load failed on some rank (``failures``: rank -> message)."""

    verb = "load"


class CollectiveTimeoutError(CollectiveError):
    """Some ranks did not arrive at a collective step within the deadline (``missing``: those
    ranks, when known; ``deadline_s``: the deadline). The ranks are out of step (one called a
    collective the others did not, or it hangs or died): the communicator cannot be trusted any
    more."""

    verb = "collective"

    def __init__(
        self,
        missing: Sequence[int],
        deadline_s: float,
        *,
        operation: str = "",
        step: int | None = None,
        phase: str = "",
    ) -> None:
        self.missing = tuple(missing)
        self.deadline_s = deadline_s
        self.phase = phase
        who = (
            f"rank(s) {', '.join(map(str, self.missing))} did not arrive"
            if self.missing
            else "the coordinating rank did not answer"
        )
        what = f"{operation or 'collective'}" + (f" of step {step}" if step is not None else "")
        where = f" (phase {phase})" if phase else ""
        super().__init__(
            {
                r: RankFailure("CollectiveTimeoutError", "did not arrive", phase, kind="collective")
                for r in missing
            },
            operation=operation,
            step=step,
            message=f"{what}{where}: {who} within {deadline_s:g} s",
        )


class OutOfStepError(CollectiveError):
    """The ranks met in a roll call from different collective calls (``keys``: rank -> the
    call it is in, e.g. ``"save step=6 call=3"``): one rank saves step 6 while the others save
    step 5, or restores while they save. Every rank of the roll call raises it, naming the ranks
    that are not in rank 0's call; the calls' later messages are never paired up."""

    verb = "collective"

    def __init__(self, keys: Mapping[int, str]) -> None:
        self.keys = {int(r): str(k) for r, k in keys.items()}
        first = self.keys.get(0, "")
        odd = {r: k for r, k in self.keys.items() if k != first}
        groups: dict[str, list[int]] = {}
        for r, k in sorted(self.keys.items()):
            groups.setdefault(k, []).append(r)
        where = "; ".join(f"{ranks_text(rs)} in {k!r}" for k, rs in groups.items())
        super().__init__(
            {
                r: RankFailure("OutOfStepError", f"is in {k!r}", "roll-call", kind="collective")
                for r, k in odd.items()
            },
            message=f"the ranks are in different collective calls: {where} (a collective method "
            "called on some ranks only, or with another step)",
        )


class ManagerBrokenError(CollectiveError):
    """A ``CheckpointManager``'s communicator failed (a peer died, the transport broke, or the
    ranks fell out of step past a deadline): it cannot make collective calls any more. Earlier
    checkpoints are intact; restart the job to go on saving. ``cause``: the failure that broke
    it, when known."""

    verb = "collective"

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__({}, cause, message=message)


class UnreachableNodesError(LoadFailedError):
    """Files the current ranks need were written on saved nodes whose directory no current rank
    sees (a level-1 copy of a node that is gone or not part of the job). ``nodes``: those nodes;
    ``writers``: their saved ranks. Another copy (level 3) may still load."""

    def __init__(self, nodes: Sequence[str], writers: Sequence[int]) -> None:
        self.nodes = tuple(nodes)
        self.writers = tuple(writers)
        shown = ", ".join(map(str, writers[:16])) + (" …" if len(writers) > 16 else "")
        super().__init__(
            {},
            message=f"no current rank sees the files written on node(s) {', '.join(nodes)} "
            f"(saved ranks {shown})",
        )
