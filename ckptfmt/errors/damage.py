"""The damage families: what is on disk fails its checks, or is not a checkpoint at all.

* :class:`DamagedError`: some stored data is missing or fails a checksum (the CLI exits 1);
  another copy, the redundancy, or an older step may still do.
* :class:`UnreadableError`: the thing given is not a readable checkpoint or import source: no
  manifest, an invalid one, an unsupported format version, a file that is not of its format, a
  tensor larger than the reader may allocate (the CLI exits 3).

``path`` is always the file or directory the error is about (for data inside a checkpoint, the
path relative to its root), ``tensors`` the tensors it affects. A :class:`DamagedError` about a
file inside a checkpoint also names the checkpoint, ``checkpoint`` (its directory or URL), in
its field and its message: ``/ckpt/step-100: model/w/c/0/0: chunk 0 CRC32C mismatch``, the same
for a directory and a bucket (the reader that met the damage fills it in,
:meth:`DamagedError.in_checkpoint`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Self

from ckptfmt.errors.base import CkptError


class DamagedError(CkptError):
    """Some stored data is missing or fails a checksum.

    ``path``: the file, relative to the checkpoint root (empty where the damage is not one
    file's); ``reason``: what is wrong; ``tensors``: the tensors it affects; ``checkpoint``:
    the checkpoint's root (its directory or URL) that ``path`` is relative to, None until the
    reader that met the damage names it (then the message starts with it)."""

    checkpoint: str | None = None

    def __init__(self, path: str, reason: str, tensors: Sequence[str] = ()) -> None:
        self.path = path
        self.checkpoint = None
        self.reason = reason
        self.tensors = tuple(tensors)
        affected = f" (affects {', '.join(self.tensors)})" if self.tensors else ""
        where = f"{path}: " if path else ""
        # by name, not super(): in ManifestChecksumError the next class would be ManifestError
        CkptError.__init__(self, f"{where}{reason}{affected}")

    def in_checkpoint(self, root: str | os.PathLike[str]) -> Self:
        """This error, naming ``root`` as the checkpoint its ``path`` is in: ``checkpoint`` set
        and the message prefixed with it (``/ckpt/step-100: model/w/c/0/0: ...``). Only the
        first call counts (the innermost reader knows the root best), and an error whose
        ``path`` already names where it is (absolute, or a URL) is left as it is."""
        where = os.fspath(root)
        if self.checkpoint is None and where and not _names_a_place(self.path):
            self.checkpoint = where
            CkptError.__init__(self, f"{where}: {self}")
        return self

    @property
    def location(self) -> str:
        """Where the damaged file is, whole: ``checkpoint/path`` (a path or a URL), or ``path``
        alone while the checkpoint is not named."""
        if self.checkpoint is None:
            return self.path
        return f"{self.checkpoint.rstrip('/')}/{self.path}" if self.path else self.checkpoint


def _names_a_place(path: str) -> bool:
    """Whether ``path`` names where it is by itself (an absolute path, a URL)."""
    return os.path.isabs(path) or "://" in path


class MissingFileError(DamagedError, FileNotFoundError):
    """A file the manifest lists is not there."""

    def __init__(self, path: str, tensors: Sequence[str] = (), reason: str = "missing") -> None:
        super().__init__(path, reason, tensors)


class NotRegularFileError(MissingFileError):
    """Where a checkpoint file belongs there is something else: a FIFO, a device, a socket, a
    directory, or a symbolic link (never followed). It is refused without being read (opening a
    FIFO for reading would block), and counts as a missing file. ``what``: what is there."""

    def __init__(self, path: str, what: str, tensors: Sequence[str] = ()) -> None:
        self.what = what
        super().__init__(path, tensors, f"missing: not a regular file ({what})")


class ChecksumError(DamagedError):
    """Bytes read back do not match the checksum written for them (``what``: which bytes)."""

    def __init__(
        self, path: str, what: str, expected: int, actual: int, tensors: Sequence[str] = ()
    ) -> None:
        self.what = what
        self.expected = expected
        self.actual = actual
        super().__init__(
            path, f"{what} CRC32C mismatch (expected {expected:08x}, got {actual:08x})", tensors
        )


class SizeMismatchError(DamagedError):
    """A file's size differs from the size the manifest records."""

    def __init__(self, path: str, expected: int, actual: int, tensors: Sequence[str] = ()) -> None:
        self.expected = expected
        self.actual = actual
        super().__init__(path, f"size {actual} bytes, expected {expected}", tensors)


class CorruptShardError(DamagedError):
    """A shard file's internal structure (index, chunk placement) is not what the format allows."""


class MetadataMismatchError(DamagedError):
    """A zarr metadata document disagrees with the manifest."""


class UnrecoverableDamageError(DamagedError):
    """Data is lost beyond what the checkpoint's redundancy can rebuild (or it has none).

    ``lost_ranks`` are the ranks whose data is missing or damaged, ``nodes`` their nodes at save
    time, ``tensors`` the tensors with data written by those ranks (what cannot be restored from
    this copy), ``path`` the checkpoint (a directory, or a ``{node}`` template).
    """

    def __init__(
        self,
        path: str,
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
        super().__init__(path, f"{reason}{where}", tensors)


class UnrecoverableError(DamagedError):
    """More blocks of one redundancy set are lost than its scheme can rebuild: the scheme's own
    verdict, before anyone knows which files and tensors that means (the rebuild turns it into
    an :class:`UnrecoverableDamageError` naming them).

    ``lost`` are the lost block indices (``0..k-1`` data members, ``k..`` parity), ``tolerates``
    how many losses the scheme survives, ``scheme`` its id, ``k`` its number of data members.
    """

    def __init__(self, scheme: str, lost: Sequence[int], tolerates: int, k: int) -> None:
        self.scheme = scheme
        self.lost = tuple(sorted(lost))
        self.tolerates = tolerates
        self.k = k
        members = [i for i in self.lost if i < k]
        parity = [i - k for i in self.lost if i >= k]
        super().__init__(
            "",
            f"{scheme}: cannot rebuild: {len(self.lost)} block(s) lost (data members {members}, "
            f"parity {parity}), the scheme tolerates {tolerates}",
        )


class DamagedCheckpointError(DamagedError):
    """A checkpoint a training run was to resume from is damaged or unreadable; nothing of it
    was loaded, and the run does not start from it. ``path``: that checkpoint; ``cause``: what
    was found (naming the file in it); ``older``: the newest older complete checkpoint beside
    it, None when there is none; ``hint``: how to resume from ``older`` (the call, as the
    framework spells it), or what else to do."""

    def __init__(self, path: str, cause: BaseException, older: str | None, hint: str = "") -> None:
        self.cause = cause
        self.older = older
        self.hint = hint
        found = f"{type(cause).__name__}: {cause}"
        there = (
            f"an older checkpoint exists: {older}"
            if older is not None
            else "no older complete checkpoint exists beside it"
        )
        advice = f"; {hint}" if hint else ""
        super().__init__(
            path,
            f"cannot resume from this checkpoint, it is damaged ({found}); {there}{advice}",
            getattr(cause, "tensors", ()),
        )


class UnreadableError(CkptError):
    """The thing given is not a readable checkpoint (or import source): nothing of it is used."""


class NotACheckpointError(UnreadableError, FileNotFoundError):
    """The path holds no committed checkpoint (missing, torn before commit, or something else).
    ``hint``: where the checkpoint meant probably is, when the path is a near miss (a Hugging
    Face ``checkpoint-N/`` whose ckptfmt data is in ``ckptfmt/``, a root of step directories),
    else empty."""

    def __init__(self, path: str, reason: str, hint: str = "") -> None:
        self.path = path
        self.reason = reason
        self.hint = hint
        more = f"; {hint}" if hint else ""
        super().__init__(f"{path} is not a readable checkpoint: {reason}{more}")


class ManifestError(UnreadableError, ValueError):
    """The manifest is unreadable or breaks the schema or the format's rules.

    ``pointer`` is a JSON pointer into the manifest where the problem is, when known; ``path``
    the manifest's file, when known.
    """

    def __init__(self, reason: str, pointer: str = "", path: str | None = None) -> None:
        self.reason = reason
        self.pointer = pointer
        self.path = path
        where = f" at {pointer}" if pointer else ""
        which = f"{path}: " if path else ""
        # by name, not super(): in ManifestChecksumError the next class would be another root
        CkptError.__init__(self, f"{which}invalid manifest{where}: {reason}")


class FormatVersionError(ManifestError):
    """The checkpoint was written in a format version this reader does not know: ``actual``
    (what the manifest says) is not one of ``supported``."""

    def __init__(self, actual: object, supported: Sequence[int]) -> None:
        self.actual = actual
        self.supported = tuple(supported)
        super().__init__(
            f"format version {actual!r} is not supported (this reader: {list(supported)})"
        )


class ManifestChecksumError(DamagedError, ManifestError):
    """A manifest whose own CRC32C does not hold, or whose checksum member is damaged or missing
    (format version 2 on, ``spec/FORMAT.md`` §10): the file is damaged (``verify`` exit 1), and
    nothing in it is used. ``path``: the manifest's path; ``reason``: what failed. A
    :class:`ManifestError` too, so code that skips unreadable manifests skips it."""

    path: str  # always known here, unlike a ManifestError's

    def __init__(self, path: str, reason: str) -> None:
        ManifestError.__init__(self, reason, path=path)
        DamagedError.__init__(self, path, f"damaged manifest: {reason}")
        self.reason = reason  # what failed, without the prefix the message gives it


class ForeignFormatError(UnreadableError, ValueError):
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


class AllocationLimitError(UnreadableError, MemoryError):
    """Reading would allocate more than the reader allows: ``actual`` bytes for ``tensor`` (or
    in all, when ``tensor`` is None) against ``limit`` (``ckptfmt.load(max_bytes=...)``; by
    default the machine's physical memory). Checked before anything is allocated, so a manifest
    or ``zarr.json`` that claims a huge tensor over a sparse file cannot exhaust memory."""

    def __init__(self, tensor: str | None, actual: int, limit: int) -> None:
        self.tensor = tensor
        self.actual = actual
        self.limit = limit
        what = f"tensor {tensor!r} needs" if tensor is not None else "the tensors need"
        super().__init__(f"{what} {actual} bytes, more than the limit of {limit} bytes")
