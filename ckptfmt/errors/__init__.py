"""Every exception and warning ckptfmt raises or gives, in one tree under :class:`CkptError` and
:class:`CkptWarning`.

Each error belongs to one family (:data:`FAMILIES`), which says what went wrong and what may
still be done; the CLI's exit status follows from it (``spec/CLI.md``, "Exit statuses"):

* usage (:class:`UsageError`, ``usage.py``): the call is wrong, nothing was done -> 2;
* damage (:class:`DamagedError`, ``damage.py``): stored data is missing or fails its checks -> 1;
* unreadable (:class:`UnreadableError`, ``damage.py``): not a readable checkpoint (no manifest,
  an invalid one, an unsupported format version, a foreign file not of its format) -> 3;
* collective (:class:`CollectiveError`, ``collective.py``): a collective operation failed on
  some ranks, or the ranks fell out of step -> 3;
* storage (:class:`StorageError`, ``storage.py``): the file system refused a path ckptfmt was
  given (not a directory, read-only, permission denied, full), or an object store a request
  after its retries (:class:`ObjectStoreError`); also an ``OSError`` -> 3.

A class in two families takes the first in its bases (``ManifestChecksumError`` is damage,
``DestinationUnwritableError`` usage). Fields name one idea each, the same in every class:
``path`` (the file or directory the error is about), ``level``, ``rank``/``ranks``, ``step``,
``expected``/``actual``, ``tensors``, ``reason``. Built-in mix-ins (``ValueError``,
``FileNotFoundError``, ``OSError``, ...) are kept where a caller may already catch those.
"""

from __future__ import annotations

from ckptfmt.errors.base import (
    CastWarning,
    CheckpointWarning,
    CkptError,
    CkptWarning,
    FlushWarning,
    PerRankWarning,
    ReplicaWarning,
    ResumeWarning,
)
from ckptfmt.errors.collective import (
    CollectiveError,
    CollectiveTimeoutError,
    FailureKind,
    LoadFailedError,
    ManagerBrokenError,
    OutOfStepError,
    RankFailure,
    SaveFailedError,
    SaveSkippedError,
    UnreachableNodesError,
    failure_kind,
)
from ckptfmt.errors.damage import (
    AllocationLimitError,
    ChecksumError,
    CorruptShardError,
    DamagedCheckpointError,
    DamagedError,
    ForeignFormatError,
    FormatVersionError,
    ManifestChecksumError,
    ManifestError,
    MetadataMismatchError,
    MissingFileError,
    NotACheckpointError,
    NotRegularFileError,
    SizeMismatchError,
    UnreadableError,
    UnrecoverableDamageError,
    UnrecoverableError,
)
from ckptfmt.errors.storage import (
    BucketNotFoundError,
    CredentialsError,
    DestinationUnwritableError,
    HttpNotAllowedError,
    NotDurableError,
    ObjectStoreError,
    ObjectStoreSetupError,
    StorageError,
    StorageFullError,
    level_name,
)
from ckptfmt.errors.usage import (
    CloudNotInstalledError,
    DataPositionError,
    DestinationExistsError,
    DtypeMismatchError,
    FrameworkCompatError,
    ImplicitSingleProcessError,
    InvalidNameError,
    LimitExceededError,
    PerRankError,
    PickleRefusedError,
    StateChangedError,
    StateMismatchError,
    UnsupportedDtypeError,
    UnsupportedValueError,
    UrlNotSupportedError,
    UsageError,
)

FAMILIES: tuple[type[CkptError], ...] = (
    UsageError,
    DamagedError,
    UnreadableError,
    CollectiveError,
    StorageError,
)
"""The family roots. Every error of the tree derives from at least one; the first of them in
its method resolution order is its family."""


def family_of(exc: BaseException | type[BaseException]) -> type[CkptError] | None:
    """The family root of an error (or error class) of the tree; None for any other."""
    cls = exc if isinstance(exc, type) else type(exc)
    return next((c for c in cls.__mro__ if c in FAMILIES), None)


__all__ = [
    "FAMILIES",
    "AllocationLimitError",
    "BucketNotFoundError",
    "CastWarning",
    "CheckpointWarning",
    "FlushWarning",
    "ChecksumError",
    "CkptError",
    "CkptWarning",
    "CloudNotInstalledError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "CredentialsError",
    "CorruptShardError",
    "DamagedCheckpointError",
    "DataPositionError",
    "DamagedError",
    "DestinationExistsError",
    "DestinationUnwritableError",
    "DtypeMismatchError",
    "FailureKind",
    "ForeignFormatError",
    "FormatVersionError",
    "FrameworkCompatError",
    "HttpNotAllowedError",
    "ImplicitSingleProcessError",
    "InvalidNameError",
    "LimitExceededError",
    "LoadFailedError",
    "ManagerBrokenError",
    "ManifestChecksumError",
    "ManifestError",
    "MetadataMismatchError",
    "MissingFileError",
    "NotACheckpointError",
    "NotDurableError",
    "NotRegularFileError",
    "ObjectStoreError",
    "ObjectStoreSetupError",
    "OutOfStepError",
    "PerRankError",
    "PerRankWarning",
    "PickleRefusedError",
    "RankFailure",
    "ReplicaWarning",
    "ResumeWarning",
    "SaveFailedError",
    "SaveSkippedError",
    "SizeMismatchError",
    "StateChangedError",
    "StateMismatchError",
    "StorageError",
    "StorageFullError",
    "UnreachableNodesError",
    "UnreadableError",
    "UnrecoverableDamageError",
    "UnrecoverableError",
    "UnsupportedDtypeError",
    "UnsupportedValueError",
    "UrlNotSupportedError",
    "UsageError",
    "failure_kind",
    "family_of",
    "level_name",
]
