"""Every exception ckptfmt raises, in one tree under :class:`CkptError`.

Each class carries structured fields (which file, which tensor, expected vs actual) so that callers
and the CLI can act on them without parsing messages. Built-in mix-ins (``ValueError``,
``FileNotFoundError``, ...) are added where a caller might reasonably already catch those.

The CLI maps the families below to exit statuses (see ``spec/FORMAT.md``, "Exit statuses"):

* :class:`DamagedError` and its subclasses -> 1 (damaged: some data fails its checks)
* :class:`UsageError` -> 2 (bad arguments)
* :class:`NotACheckpointError`, :class:`ManifestError`, :class:`FormatVersionError` -> 3
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

__all__ = [
    "AllocationLimitError",
    "ChecksumError",
    "CkptError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "CorruptShardError",
    "DamagedError",
    "DestinationExistsError",
    "DestinationUnwritableError",
    "DtypeMismatchError",
    "FailureKind",
    "ForeignFormatError",
    "FormatVersionError",
    "ImplicitSingleProcessError",
    "failure_kind",
    "InvalidNameError",
    "LimitExceededError",
    "LoadFailedError",
    "ManagerBrokenError",
    "ManifestChecksumError",
    "ManifestError",
    "MetadataMismatchError",
    "MissingFileError",
    "NotACheckpointError",
    "NotRegularFileError",
    "OutOfStepError",
    "PickleRefusedError",
    "RankFailure",
    "SaveFailedError",
    "SizeMismatchError",
    "StateMismatchError",
    "StorageFullError",
    "UnreachableNodesError",
    "UnrecoverableDamageError",
    "UnrecoverableError",
    "UnsupportedDtypeError",
    "UnsupportedValueError",
    "UrlNotSupportedError",
    "UsageError",
]


class CkptError(Exception):
    """Base of every error ckptfmt raises on purpose."""


# --- usage: the caller asked for something that cannot be done -----------------------------------


class UsageError(CkptError, ValueError):
    """The call itself is wrong (bad argument, unsupported value); nothing was written."""


class InvalidNameError(UsageError):
    """A tensor or value name breaks the name rules of the format (``spec/FORMAT.md``, "Names")."""

    def __init__(self, name: object, reason: str) -> None:
        self.name = name
        self.reason = reason
        super().__init__(f"invalid name {name!r}: {reason}")


class UnsupportedValueError(UsageError, TypeError):
    """A state value is neither an array of a supported dtype nor a JSON-able value."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason
        super().__init__(f"cannot save {name!r}: {reason}")


class UnsupportedDtypeError(UsageError, TypeError):
    """An array's dtype is not one the format can hold (e.g. ``longdouble``, ``object``)."""

    def __init__(self, dtype: object, name: str | None = None) -> None:
        self.dtype = dtype
        self.name = name
        where = f" (tensor {name!r})" if name else ""
        super().__init__(f"unsupported dtype {dtype!s}{where}")


class LimitExceededError(UsageError):
    """A hard limit of the format (``spec/FORMAT.md``, "Limits") would be exceeded."""

    def __init__(self, what: str, value: object, limit: object) -> None:
        self.what = what
        self.value = value
        self.limit = limit
        super().__init__(f"{what} is {value}, the limit is {limit}")


class DestinationExistsError(UsageError, FileExistsError):
    """The save target exists: a checkpoint (refused unless overwriting) or a foreign directory."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"refusing to save to {path}: {reason}")


# --- the thing on disk is not (yet) a checkpoint --------------------------------------------------


class NotACheckpointError(CkptError, FileNotFoundError):
    """The path holds no committed checkpoint (missing, torn before commit, or something else)."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path} is not a readable checkpoint: {reason}")


class ManifestError(CkptError, ValueError):
    """The manifest is unreadable or breaks the schema or the format's rules.

    ``pointer`` is a JSON pointer into the manifest where the problem is, when known.
    """

    def __init__(self, reason: str, pointer: str = "", path: str | None = None) -> None:
        self.reason = reason
        self.pointer = pointer
        self.path = path
        where = f" at {pointer}" if pointer else ""
        file = f"{path}: " if path else ""
        super().__init__(f"{file}invalid manifest{where}: {reason}")


class FormatVersionError(ManifestError):
    """The checkpoint was written in a format version this reader does not know."""

    def __init__(self, found: object, supported: Sequence[int]) -> None:
        self.found = found
        self.supported = tuple(supported)
        super().__init__(
            f"format version {found!r} is not supported (this reader: {list(supported)})"
        )


# --- data on disk fails its checks ---------------------------------------------------------------


class DamagedError(CkptError):
    """Some stored data is missing or fails a checksum.

    ``file`` is the path relative to the checkpoint root, ``tensors`` the tensors it affects.
    """

    def __init__(self, file: str, reason: str, tensors: Sequence[str] = ()) -> None:
        self.file = file
        self.reason = reason
        self.tensors = tuple(tensors)
        affected = f" (affects {', '.join(self.tensors)})" if self.tensors else ""
        super().__init__(f"{file}: {reason}{affected}")


class MissingFileError(DamagedError, FileNotFoundError):
    """A file the manifest lists is not there."""

    def __init__(self, file: str, tensors: Sequence[str] = ()) -> None:
        super().__init__(file, "missing", tensors)


class ChecksumError(DamagedError):
    """Bytes read back do not match the checksum written for them."""

    def __init__(
        self, file: str, what: str, expected: int, actual: int, tensors: Sequence[str] = ()
    ) -> None:
        self.what = what
        self.expected = expected
        self.actual = actual
        super().__init__(
            file, f"{what} CRC32C mismatch (expected {expected:08x}, got {actual:08x})", tensors
        )


class SizeMismatchError(DamagedError):
    """A file's size differs from the size the manifest records."""

    def __init__(self, file: str, expected: int, actual: int, tensors: Sequence[str] = ()) -> None:
        self.expected = expected
        self.actual = actual
        super().__init__(file, f"size {actual} bytes, expected {expected}", tensors)


class CorruptShardError(DamagedError):
    """A shard file's internal structure (index, chunk placement) is not what the format allows."""


class MetadataMismatchError(DamagedError):
    """A zarr metadata document disagrees with the manifest."""


class UnrecoverableDamageError(DamagedError):
    """Data is lost beyond what the checkpoint's redundancy can rebuild (or it has none).

    ``lost_ranks`` are the ranks whose data is missing or damaged, ``nodes`` their nodes at save
    time, ``tensors`` the tensors with data written by those ranks (what cannot be restored from
    this copy), ``file`` the checkpoint (a directory, or a ``{node}`` template).
    """

    def __init__(
        self,
        file: str,
        reason: str,
        lost_ranks: Sequence[int] = (),
        nodes: Sequence[str] = (),
        tensors: Sequence[str] = (),
    ) -> None:
        self.lost_ranks = tuple(lost_ranks)
        self.nodes = tuple(nodes)
        where = (
            f" (ranks {', '.join(map(str, self.lost_ranks))} on node(s) {', '.join(self.nodes)})"
            if self.lost_ranks
            else ""
        )
        super().__init__(file, f"{reason}{where}", tensors)


# --- collective operations and redundancy -------------------------------------------------


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
    :class:`CkptError` (``file``, ``tensors``, ``expected``, ...). ``kind`` is the failure's
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


class SaveFailedError(CollectiveError):
    """A collective save (or flush, or rebuild write) failed on some rank; nothing of it was
    committed anywhere. ``failures`` maps rank to that rank's error message."""

    verb = "save"


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
        where = "; ".join(f"{_ranks_text(rs)} in {k!r}" for k, rs in groups.items())
        super().__init__(
            {
                r: RankFailure("OutOfStepError", f"is in {k!r}", "roll-call", kind="collective")
                for r, k in odd.items()
            },
            message=f"the ranks are in different collective calls: {where} (a collective method "
            "called on some ranks only, or with another step)",
        )


def _ranks_text(ranks: Sequence[int], most: int = 8) -> str:
    shown = ", ".join(map(str, ranks[:most]))
    more = f" and {len(ranks) - most} more" if len(ranks) > most else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{more}"


class ManagerBrokenError(CkptError):
    """A ``CheckpointManager``'s communicator failed (a peer died, the transport broke, or the
    ranks fell out of step past a deadline): it cannot make collective calls any more. Earlier
    checkpoints are intact; restart the job to go on saving."""


class ImplicitSingleProcessError(UsageError):
    """No ``comm`` was given but the launcher says the job has several ranks: every rank would
    save as "rank 0 of 1" into the same directories. ``world_size``: what the launcher says."""

    def __init__(self, world_size: int, launcher: str) -> None:
        self.world_size = world_size
        self.launcher = launcher
        super().__init__(
            f"{launcher} started {world_size} ranks but no comm was given: pass "
            "comm=ckptfmt.transport.mpi.MpiComm() (mpiexec/srun) or "
            "comm=ckptfmt_torch.comm.TorchComm() (torchrun), or run one process"
        )


class StateMismatchError(UsageError):
    """The state given to ``restore`` does not match the checkpoint; nothing was written into
    it. ``missing``: names of the state the checkpoint lacks; ``unexpected``: saved names the
    state lacks; ``mismatched``: arrays whose shape or dtype differ (one line each)."""

    def __init__(
        self, missing: Sequence[str], unexpected: Sequence[str], mismatched: Sequence[str]
    ) -> None:
        self.missing = tuple(missing)
        self.unexpected = tuple(unexpected)
        self.mismatched = tuple(mismatched)
        parts = []
        if self.mismatched:
            parts.append("differs: " + "; ".join(self.mismatched[:8]))
        if self.missing:
            parts.append("not in the checkpoint: " + ", ".join(self.missing[:8]))
        if self.unexpected:
            parts.append("not in the state: " + ", ".join(self.unexpected[:8]))
        hint = (
            " (restore(..., strict=False) or include=/exclude= patterns restore part of a state)"
            if self.missing or self.unexpected
            else ""
        )
        super().__init__(
            "the state does not match the checkpoint, nothing was restored into it: "
            + "; ".join(parts)
            + hint
        )


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


class UnrecoverableError(CkptError):
    """More blocks of a redundancy set are lost than its scheme can rebuild.

    ``lost`` are the lost block indices (``0..k-1`` data members, ``k..`` parity), ``tolerates``
    how many losses the scheme survives, ``scheme`` its id.
    """

    def __init__(self, scheme: str, lost: Sequence[int], tolerates: int, k: int) -> None:
        self.scheme = scheme
        self.lost = tuple(sorted(lost))
        self.tolerates = tolerates
        self.k = k
        members = [i for i in self.lost if i < k]
        parity = [i - k for i in self.lost if i >= k]
        super().__init__(
            f"{scheme}: cannot rebuild: {len(self.lost)} block(s) lost (data members {members}, "
            f"parity {parity}), the scheme tolerates {tolerates}"
        )


# --- a new user's misuse, named at the call (issue 16) ------------------------------------------


class DtypeMismatchError(UsageError, TypeError):
    """Saved tensors and the destinations they are loaded into differ in dtype, and the cast
    policy (``cast=``) does not allow converting them; nothing was written into any destination.

    ``mismatched``: name -> (saved dtype, destination dtype); ``cast``: the policy in force
    (``"no"``, ``"safe"``, ``"any"``)."""

    def __init__(self, mismatched: dict[str, tuple[str, str]], cast: str) -> None:
        self.mismatched = dict(mismatched)
        self.cast = cast
        shown = "; ".join(
            f"{n}: saved {s}, destination {d}" for n, (s, d) in list(self.mismatched.items())[:5]
        )
        more = f"; ... {len(self.mismatched) - 5} more" if len(self.mismatched) > 5 else ""
        hint = (
            'pass cast="safe" to convert where no value changes, cast="any" to convert anyway'
            if cast == "no"
            else 'not a safe cast: pass cast="any" to convert anyway (values may change)'
        )
        super().__init__(
            f"dtype mismatch for {len(self.mismatched)} tensor(s): {shown}{more} ({hint})"
        )


class UrlNotSupportedError(UsageError):
    """A URL (``s3://bucket/x``) was given where a file-system path is needed: object storage is
    not supported (yet). ``url``: what was given; ``scheme``: its scheme."""

    def __init__(self, url: str, scheme: str) -> None:
        self.url = url
        self.scheme = scheme
        super().__init__(
            f"{url!r}: {scheme}:// URLs are not supported; ckptfmt reads and writes file-system "
            "paths only (mount the bucket, or save locally and copy)"
        )


class DestinationUnwritableError(UsageError, OSError):
    """The destination directory cannot be made or written: a parent is a file, the file system
    is read-only, permission is denied. ``path``: the path; ``reason``: what the system said."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"cannot write {path!r}: {reason}")


# --- interop: foreign formats in and out (``ckptfmt export`` / ``ckptfmt import``) ----------------


class ForeignFormatError(CkptError, ValueError):
    """An import source is not a valid file of its format (a safetensors file, a Hugging Face
    directory and its index, a ``torch.save`` file, a DCP directory): truncated, a header that
    lies about offsets, overlapping tensors, an index naming missing files, a name that is not a
    valid ckptfmt name. Nothing was written. ``path``: the file; ``reason``; ``tensor``: the
    tensor concerned, when there is one."""

    def __init__(self, path: str, reason: str, tensor: str | None = None) -> None:
        self.path = path
        self.reason = reason
        self.tensor = tensor
        which = f" (tensor {tensor!r})" if tensor is not None else ""
        super().__init__(f"{path}: not a valid import source: {reason}{which}")


class PickleRefusedError(UsageError):
    """Reading ``path`` needs unpickling (DCP's ``.metadata`` is a pickle), which ckptfmt does
    only when asked explicitly (``trust_pickle=True``, ``--trust-pickle``); nothing was read."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"refusing to unpickle {path}: {reason}")


# --- integrity of metadata, full storage, hostile files (issue 19) --------------------------------


class ManifestChecksumError(DamagedError, ManifestError):
    """A manifest whose own CRC32C does not hold, or whose checksum member is damaged or missing
    (format version 2 on, ``spec/FORMAT.md`` §10): the file is damaged (``verify`` exit 1), and
    nothing in it is used. ``file``: the manifest's path; ``reason``: what failed. A
    :class:`ManifestError` too, so code that skips unreadable manifests skips it."""

    def __init__(self, file: str, reason: str) -> None:
        self.file = file
        self.reason = reason
        self.tensors = ()
        self.pointer = ""
        self.path = file
        Exception.__init__(self, f"{file}: damaged manifest: {reason}")


class NotRegularFileError(MissingFileError):
    """Where a checkpoint file belongs there is something else: a FIFO, a device, a socket, a
    directory, or a symbolic link (never followed). It is refused without being read (opening a
    FIFO for reading would block), and counts as a missing file. ``what``: what is there."""

    def __init__(self, file: str, what: str, tensors: Sequence[str] = ()) -> None:
        self.what = what
        DamagedError.__init__(self, file, f"missing: not a regular file ({what})", tensors)


class StorageFullError(CkptError, OSError):
    """A save, flush, rebuild or reshard could not write: the file system is full (``ENOSPC``,
    bytes or inodes) or the quota is exhausted (``EDQUOT``). Also an :class:`OSError` with that
    ``errno``, so ``except OSError`` keeps working. Whatever was staged has been removed.

    ``directory``: where it was writing; ``level``: the storage level (``"1"``, ``"3"``), or a
    description of the target, None when unknown; ``needed``: the bytes the operation writes in
    all (a lower bound when not known exactly), None when unknown; ``free``: the bytes that were
    free there for an unprivileged writer (None when unknown); ``free_inodes`` likewise;
    ``file``: the file being written when it failed."""

    def __init__(
        self,
        directory: str,
        *,
        err: int,
        file: str | None = None,
        level: str | None = None,
        needed: int | None = None,
        free: int | None = None,
        free_inodes: int | None = None,
    ) -> None:
        self.directory = directory
        self.file = file
        self.level = level
        self.needed = needed
        self.free = free
        self.free_inodes = free_inodes
        what = "quota exhausted" if err == _errno_edquot() else "no space left on device"
        where = f" (level {level})" if level is not None and level.isdigit() else ""
        if level is not None and not level.isdigit():
            where = f" ({level})"
        parts = [f"cannot write to {directory}{where}: {what}"]
        if file is not None:
            parts.append(f"while writing {file}")
        if needed is not None:
            parts.append(f"the write needs {needed} bytes")
        if free is not None:
            parts.append(f"{free} bytes free")
        if free_inodes is not None:
            parts.append(f"{free_inodes} inodes free")
        OSError.__init__(self, err, "; ".join(parts))
        self.strerror = "; ".join(parts)

    def __str__(self) -> str:
        return str(self.strerror)

    def with_context(
        self, level: str | None = None, needed: int | None = None, directory: str | None = None
    ) -> StorageFullError:
        """The same error (the free space as measured when it happened) with the level, the
        bytes needed and the directory filled in by the caller that knows them: the save knows
        its whole write and its checkpoint's directory, a file write only its own."""
        return StorageFullError(
            directory if directory is not None else self.directory,
            err=self.errno if self.errno is not None else 28,  # ENOSPC
            file=self.file,
            level=level if level is not None else self.level,
            needed=needed if needed is not None else self.needed,
            free=self.free,
            free_inodes=self.free_inodes,
        )


def _errno_edquot() -> int:
    import errno as _errno

    return getattr(_errno, "EDQUOT", -1)


class AllocationLimitError(CkptError, MemoryError):
    """Reading would allocate more than the reader allows: ``nbytes`` for ``tensor`` (or in all,
    when ``tensor`` is None) against ``limit`` (``ckptfmt.load(max_bytes=...)``; by default the
    machine's physical memory). Checked before anything is allocated, so a manifest or
    ``zarr.json`` that claims a huge tensor over a sparse file cannot exhaust memory."""

    def __init__(self, tensor: str | None, nbytes: int, limit: int) -> None:
        self.tensor = tensor
        self.nbytes = nbytes
        self.limit = limit
        what = f"tensor {tensor!r} needs" if tensor is not None else "the tensors need"
        super().__init__(f"{what} {nbytes} bytes, more than the limit of {limit} bytes")
