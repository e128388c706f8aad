"""Checks on the paths a user passes, before anything touches the file system.

:func:`refuse_url` is called by every entry point that takes a checkpoint path (``ckptfmt.save``,
``load``, ``open``, ``verify``, ``latest``, the CLI, ``CheckpointManager``): a URL such as
``s3://bucket/x`` would otherwise become the relative directory ``./s3:/bucket/x``, and a job
would "save" into its working directory. :func:`check_destination` finds, before anything is
staged, a destination that cannot be written (a parent that is a file, a read-only file system).
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from ckptfmt.errors import DestinationUnwritableError, UrlNotSupportedError
from ckptfmt.manifest.codec import MANIFEST_NAME
from ckptfmt.storage.objects.url import SUPPORTED

# an RFC 3986 scheme, then "://" (or ":/": what ``pathlib.Path("s3://b/x")`` leaves of it); a
# one-letter scheme would be a Windows drive, which this POSIX-only package never sees anyway
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):/")


def refuse_url(path: str | os.PathLike[str] | None) -> None:
    """Raise :class:`UrlNotSupportedError` when ``path`` is a URL (``s3://``, ``gs://``,
    ``file://``, ...) where a directory on a file system is needed. Paths (and ``None``) pass."""
    if path is None:
        return
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    m = _URL.match(text)
    if m:
        scheme = m.group(1).lower()
        needs = "a directory on a file system is needed" if scheme in SUPPORTED else None
        raise UrlNotSupportedError(text, scheme, needs)


def check_destination(path: str | os.PathLike[str]) -> None:
    """Raise :class:`DestinationUnwritableError` when a checkpoint cannot be made at ``path``:
    an existing parent is a file, or the nearest existing parent is on a
    read-only file system or not writable. Checked before anything is staged, so the user gets
    one clear error instead of a ``FileExistsError``/``OSError`` from deep in the commit."""
    refuse_url(path)
    target = Path(os.fspath(path)).absolute()  # itself a file: DestinationExistsError, later
    problem = unwritable(target.parent)
    if problem is not None:
        raise DestinationUnwritableError(str(path), problem[0], err=problem[1])


def unwritable(directory: Path) -> tuple[str, int] | None:
    """Why no file can be written in ``directory`` (made first if missing), with the ``errno``
    that says it, or None when nothing stands in the way: ``directory`` or its nearest existing
    ancestor is a file, on a read-only file system, or not writable. Looks only, makes nothing."""
    probe = directory.absolute()
    while not probe.exists() and not probe.is_symlink() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, so no directory can be made under it", errno.ENOTDIR
    try:
        read_only = bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
    except OSError:  # pragma: no cover - statvfs of an existing directory fails only oddly
        read_only = False
    if read_only:
        return f"{probe} is on a read-only file system", errno.EROFS
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"no permission to write in {probe}", errno.EACCES
    return None


def missing_parents(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The directories above each of ``paths`` (its parent, that one's parent, ...) that do not
    exist yet, deepest first: what writing ``paths`` will create, for :func:`removing_made`."""
    missing: set[Path] = set()
    for p in paths:
        d = Path(os.path.abspath(p)).parent
        while not (d.exists() or d.is_symlink()) and d.parent != d:
            missing.add(d)
            d = d.parent
    return sorted(missing, key=lambda d: (-len(d.parts), str(d)))


@contextmanager
def removing_made(paths: Iterable[str | os.PathLike[str]]) -> Iterator[None]:
    """Run the block; if it raises, remove the directories above ``paths`` that it created (they
    were missing when it began, :func:`missing_parents`) and that are empty again, so a failed
    export, import or reshard leaves no empty directory behind it. A directory that existed
    before, or that holds anything now (another writer's), is never removed."""
    made = missing_parents(paths)
    try:
        yield
    except BaseException:
        for d in made:  # deepest first: a parent is empty once its made children are gone
            with suppress(OSError):
                os.rmdir(d)
        raise


def refuse_inside_checkpoint(path: str | os.PathLike[str]) -> None:
    """Raise :class:`DestinationUnwritableError` when ``path`` lies inside a committed
    checkpoint directory (one of its parents holds a manifest): the offline tools never write
    there, since whatever they put inside a checkpoint is deleted with it when it is replaced
    (an overwrite swaps the whole tree) or removed by retention."""
    target = Path(os.path.abspath(path))
    for parent in target.parents:
        if (parent / MANIFEST_NAME).is_file():
            raise DestinationUnwritableError(
                str(path),
                f"it is inside the checkpoint {parent}, whose replacement or removal would "
                "delete it; choose a directory outside the checkpoint",
            )
