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

from collections.abc import Sequence


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


class SaveFailedError(CkptError):
    """A collective save failed on some rank; nothing was committed anywhere.

    ``failures`` maps rank to that rank's error message.
    """

    def __init__(self, failures: dict[int, str], cause: BaseException | None = None) -> None:
        self.failures = failures
        self.cause = cause  # this rank's own error, if it had one
        lines = "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))
        super().__init__(f"save failed on {len(failures)} rank(s): {lines}")


class LoadFailedError(CkptError):
    """A collective load failed on some rank (``failures``: rank -> message)."""

    def __init__(self, failures: dict[int, str], message: str | None = None) -> None:
        self.failures = failures
        if message is None:
            lines = "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))
            message = f"load failed on {len(failures)} rank(s): {lines}"
        super().__init__(message)


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
            f"no current rank sees the files written on node(s) {', '.join(nodes)} "
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


# --- a new user's misuse, named at the call (issue 16) ---------------------------------------------


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
