"""The storage family: the file system refused an operation on a path ckptfmt was given (not a
directory, permission denied, read-only, full). Every class is also an ``OSError`` carrying the
system's ``errno``, so ``except OSError`` keeps working; the message names the path and, where
there is one, the storage level. The CLI exits 3 (nothing usable was read or written).
"""

from __future__ import annotations

import errno as _errno
from pathlib import Path

from ckptfmt.errors.base import CkptError
from ckptfmt.errors.usage import UsageError

LEVEL_NAMES = {"1": "level 1 (local_dir)", "3": "level 3 (shared_dir)"}


def level_name(level: int | str | None) -> str | None:
    """How a message names storage level ``level`` (``1`` -> ``"level 1 (local_dir)"``, after
    the manager's argument that places it); a description passes through, None stays None."""
    if level is None:
        return None
    return LEVEL_NAMES.get(str(level), str(level))


class StorageError(CkptError, OSError):
    """The file system refused an operation on ``path`` (a file or directory ckptfmt was told to
    use, or one under it). ``level``: the storage level it belongs to (``"level 3
    (shared_dir)"``), or a description of the target, None when there is none; ``reason``: what
    failed, in words; ``errno``: the system's error number, when there was one."""

    def __init__(
        self, path: str, reason: str, *, level: str | None = None, err: int | None = None
    ) -> None:
        self.path = path
        self.reason = reason
        self.level = level
        where = f"{level} at {path}" if level else path
        message = f"{where}: {reason}"
        # by name: the OSError mix-in keeps errno; in DestinationUnwritableError the class after
        # this one in the MRO is ValueError, which would drop it
        if err is None:
            OSError.__init__(self, message)
        else:
            OSError.__init__(self, err, message)
        self.strerror = message

    def __str__(self) -> str:
        return str(self.strerror)

    @classmethod
    def of(cls, exc: OSError, path: str | None = None, level: str | None = None) -> StorageError:
        """``exc``, a system error met on ``path`` (by default the path it names), as a
        :class:`StorageError` of ``level`` with the same ``errno``; an error of the tree passes
        through with the level filled in when it lacked one."""
        if isinstance(exc, StorageError):
            if exc.level is None and level is not None:
                return StorageError(exc.path, exc.reason, level=level, err=exc.errno)
            return exc
        named = os_path(exc)
        where = path if path is not None else (named or "?")
        reason = (exc.strerror or str(exc)).lower()
        if named and named != where:
            reason += f" ({named})"
        blocker = _file_in_the_way(named or where)
        if blocker is not None and isinstance(exc, NotADirectoryError | FileExistsError):
            reason += f": {blocker} is a file, so no directory can be made there"
        return StorageError(where, reason, level=level, err=exc.errno)


class NotDurableError(StorageError):
    """A commit's last rename was done, so ``path`` holds the new data, but the directory it
    was renamed in could not be synced to disk (``fsync`` failed, e.g. ``EIO``): the new data
    is what every reader sees now, and may not be what the disk holds after a power loss.
    Nothing is rolled back (that would need the same failing device, and a multi-node commit
    would be left mixed). ``replaced``: where the copy it replaced was moved aside (a
    directory, or None), kept so that a caller can decide what to keep of it."""

    def __init__(
        self,
        path: str,
        cause: str,
        *,
        level: str | None = None,
        err: int | None = None,
        replaced: object = None,
    ) -> None:
        self.cause = cause
        self.replaced = replaced
        super().__init__(
            path,
            f"committed, but its directory could not be synced to disk ({cause}): the new data "
            "is in place and may not survive a power loss; check the device",
            level=level,
            err=err,
        )


def _file_in_the_way(path: str) -> str | None:
    """The nearest existing ancestor of ``path`` (or ``path`` itself) when it is not a
    directory: what stops a directory from being made at ``path``."""
    for p in (Path(path), *Path(path).parents):
        if p.is_symlink() or p.exists():
            return None if p.is_dir() else str(p)
    return None


def os_path(exc: OSError) -> str | None:
    """The path an ``OSError`` names, as text (None when it names none)."""
    name = exc.filename
    if name is None:
        return None
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


class StorageFullError(StorageError):
    """A save, flush, rebuild or reshard could not write: the file system is full (``ENOSPC``,
    bytes or inodes) or the quota is exhausted (``EDQUOT``). Whatever was staged has been
    removed.

    ``path``: the directory it was writing to; ``level``: the storage level (``"level 1
    (local_dir)"``), or a description of the target, None when unknown; ``writing``: the file
    being written when it failed; ``needed``: the bytes the operation writes in all (a lower
    bound when not known exactly), None when unknown; ``free``: the bytes that were free there
    for an unprivileged writer (None when unknown); ``free_inodes`` likewise."""

    def __init__(
        self,
        path: str,
        *,
        err: int,
        writing: str | None = None,
        level: str | None = None,
        needed: int | None = None,
        free: int | None = None,
        free_inodes: int | None = None,
    ) -> None:
        self.writing = writing
        self.needed = needed
        self.free = free
        self.free_inodes = free_inodes
        quota = err == getattr(_errno, "EDQUOT", -1)
        what = "quota exhausted" if quota else "no space left on device"
        parts = [f"cannot write: {what}"]
        if writing is not None:
            parts.append(f"while writing {writing}")
        if needed is not None:
            parts.append(f"the write needs {needed} bytes")
        if free is not None:
            parts.append(f"{free} bytes free")
        if free_inodes is not None:
            parts.append(f"{free_inodes} inodes free")
        super().__init__(path, "; ".join(parts), level=level, err=err)

    def with_context(
        self, level: str | None = None, needed: int | None = None, path: str | None = None
    ) -> StorageFullError:
        """The same error (the free space as measured when it happened) with the level, the
        bytes needed and the directory filled in by the caller that knows them: the save knows
        its whole write and its checkpoint's directory, a file write only its own."""
        return StorageFullError(
            path if path is not None else self.path,
            err=self.errno if self.errno is not None else _errno.ENOSPC,
            writing=self.writing,
            level=level if level is not None else self.level,
            needed=needed if needed is not None else self.needed,
            free=self.free,
            free_inodes=self.free_inodes,
        )


class DestinationUnwritableError(UsageError, StorageError):
    """The destination directory cannot be made or written: a parent is a file, the file system
    is read-only, permission is denied. Found before anything is staged, so it is also a usage
    error (the CLI exits 2: the path given is wrong). ``path``: the path; ``reason``: what the
    system said."""

    def __init__(
        self, path: str, reason: str, *, level: str | None = None, err: int | None = None
    ) -> None:
        super().__init__(path, f"cannot write: {reason}", level=level, err=err)


class ObjectStoreError(StorageError):
    """An object store refused a request, or did not answer, after its retries (backoff on 5xx,
    ``SlowDown``, dropped connections and timeouts, within a bounded time).

    ``path``: the URL of the key (``s3://bucket/run/ckpt/ckptfmt-commit.json``); ``op``: the
    request (``"GET"``, ``"PUT"``, ``"HEAD"``, ``"LIST"``, ``"DELETE"``); ``status``: the HTTP
    status of the last answer, None when there was none (connection refused, timed out);
    ``reason``: what the store said, in short. A conditional put whose condition failed has
    status 412."""

    def __init__(
        self, path: str, op: str, status: int | None, reason: str, *, level: str | None = None
    ) -> None:
        self.op = op
        self.status = status
        answer = f"HTTP {status}" if status is not None else "no answer"
        super().__init__(path, f"{op} failed ({answer}): {reason}", level=level)
        self.reason = reason


class ObjectStoreSetupError(ObjectStoreError):
    """The object store cannot be used as it is set up: the bucket, the endpoint or the
    credentials are not what the store takes. Found before the first request where the settings
    alone show it, else from the store's first answer. The message ends with what to set.

    ``path``: the URL of the key the request was for (the bucket's URL when no request was
    made); ``bucket``: the bucket's URL (``s3://bucket``); ``endpoint``: the endpoint the
    client used, None for the store's default; ``fix``: what to set or do, naming the
    environment variable and the ``storage_options`` key; ``op``, ``status`` as
    :class:`ObjectStoreError` (``op`` ``"SETUP"`` and ``status`` None when no request was
    made)."""

    def __init__(
        self,
        path: str,
        op: str,
        status: int | None,
        reason: str,
        *,
        bucket: str,
        endpoint: str | None,
        fix: str,
    ) -> None:
        self.bucket = bucket
        self.endpoint = endpoint
        self.fix = fix
        at = f" (endpoint {endpoint})" if endpoint else ""
        super().__init__(path, op, status, f"{reason}{at}: {fix}")
        self._tell(None)

    def _tell(self, level: str | None) -> None:
        """The message: as :class:`ObjectStoreError`'s after a request; without one (``op``
        ``"SETUP"``), the path and what is wrong, no request named."""
        if self.op == "SETUP":
            StorageError.__init__(self, self.path, self.reason, level=level)
        else:
            ObjectStoreError.__init__(
                self, self.path, self.op, self.status, self.reason, level=level
            )

    def at_level(self, level: str) -> ObjectStoreSetupError:
        """The same error, said of the storage level ``level`` (``"level 3 (shared_dir)"``):
        a manager names which of its arguments to fix."""
        told = type(self).__new__(type(self))
        told.__dict__.update(self.__dict__)
        told._tell(level)
        return told


class BucketNotFoundError(ObjectStoreSetupError):
    """The bucket of the URL does not exist at the endpoint (S3 ``NoSuchBucket``): ckptfmt
    never creates a bucket."""


class CredentialsError(ObjectStoreSetupError):
    """No credentials are set up for the store, or the store refuses the ones given (S3
    ``InvalidAccessKeyId``, ``SignatureDoesNotMatch``, ``AccessDenied``). ``code``: the
    store's error code, or ``"missing"`` when none were found."""

    def __init__(
        self,
        path: str,
        op: str,
        status: int | None,
        reason: str,
        *,
        bucket: str,
        endpoint: str | None,
        fix: str,
        code: str,
    ) -> None:
        self.code = code
        super().__init__(path, op, status, reason, bucket=bucket, endpoint=endpoint, fix=fix)


class HttpNotAllowedError(ObjectStoreSetupError):
    """The endpoint is a plain ``http://`` URL and the client is not allowed plain HTTP (it
    refuses to send the request: obstore's ``HTTP error: builder error``)."""
