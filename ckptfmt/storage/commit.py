"""The commit protocol (``spec/PROTOCOL.md`` §1): a checkpoint appears whole or not at all, and a
checkpoint path names a whole checkpoint at every instant, also while it is overwritten.

1. ``prepare``: refuse a destination that is a committed checkpoint (unless overwriting) or a
   non-empty directory that is not one; create the staging directory ``.<name>.tmp-<save_id>``
   beside the destination.
2. The caller writes every data and metadata file into the staging directory, fsyncing each.
3. ``finalize``: write the manifest last and fsync it, fsync every directory of the tree, rename
   the staging directory to the destination, fsync the parent. When overwriting, the staging
   directory and the old checkpoint are swapped in one ``renameat2(RENAME_EXCHANGE)`` (Linux:
   :func:`exchange`), so the destination goes from the old checkpoint to the new one in one
   step; the old one, now at the staging name, is renamed to ``.<name>.old-<save_id>`` and
   removed once the new one stands. Where the file system cannot exchange, the old checkpoint
   is renamed aside to ``.<name>.old-<save_id>`` first and the new one renamed in: a crash
   between the two leaves no directory at the name, and :func:`recover` (run by the next save
   to it and by ``clean_leftovers``) renames the old one back.

A crash before the last rename leaves only a staging directory, which no reader takes for a
checkpoint (it has a dot name and, until the very end, no manifest); ``clean_leftovers`` removes it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

from ckptfmt.errors import DestinationExistsError, NotDurableError
from ckptfmt.manifest.codec import MANIFEST_NAME
from ckptfmt.storage.files import fsync_dir, write_gather

LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old|del)-[0-9a-f]{32}$")

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_NO_EXCHANGE = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})


@cache
def _renameat2() -> Callable[[int, bytes, int, bytes, int], int] | None:
    """glibc's ``renameat2`` (2.28 and later), None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def exchange(a: Path, b: Path) -> bool:
    """Swap the directories ``a`` and ``b`` (both exist, same file system) in one atomic step
    (Linux ``renameat2(RENAME_EXCHANGE)``): a reader of either path sees one of the two trees,
    never none. False, with nothing changed, where the kernel, C library or file system cannot
    (the caller then renames in two steps); any other failure raises ``OSError``."""
    fn = _renameat2()
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def is_committed(path: Path) -> bool:
    """Whether ``path`` is a committed checkpoint directory (it holds a manifest)."""
    return (path / MANIFEST_NAME).is_file()


def staging_dir(final: Path, save_id: str) -> Path:
    return final.parent / f".{final.name}.tmp-{save_id}"


def prepare(
    final: Path, save_id: str, overwrite: bool, take: Callable[[Path], bool] | None = None
) -> Path:
    """Check the destination and create the staging directory; return it. An overwrite that a
    crash cut between its two renames is undone first (:func:`recover`): the checkpoint it was
    replacing is the one there; then what crashed saves to ``final`` left beside it is removed
    (:func:`clean_leftovers` of this name: a save killed before its rename would otherwise leave
    a whole checkpoint's bytes behind at every crash). ``take``: puts a recycled step directory
    at the staging path (``storage.slots.Slots.take``) and says whether it did; else the
    directory is made empty."""
    recover(final)
    clean_leftovers(final.parent, final.name)
    if final.exists() or final.is_symlink():
        if not final.is_dir() or final.is_symlink():
            raise DestinationExistsError(str(final), "it exists and is not a directory")
        if is_committed(final):
            if not overwrite:
                raise DestinationExistsError(
                    str(final),
                    "a checkpoint is already there "
                    "(pass write=WriteOptions(overwrite=True) to replace it)",
                )
        elif any(final.iterdir()):
            raise DestinationExistsError(
                str(final), "it is a non-empty directory that is not a checkpoint"
            )
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(final, save_id)
    if take is None or not take(staging):
        staging.mkdir()
    return staging


def fsync_tree(root: Path) -> None:
    """fsync every directory below and including ``root`` (files were fsynced when written)."""
    for dirpath, _dirs, _files in os.walk(root, topdown=False):
        fsync_dir(Path(dirpath))


def finalize(staging: Path, final: Path, manifest: bytes, save_id: str, fsync: bool = True) -> None:
    """Write the manifest last, make the tree durable, and rename it into place atomically.

    ``fsync=False`` (for benchmarks and throw-away runs) skips every fsync but keeps the order
    and the renames: atomic for readers, not durable across a power loss."""
    stage_manifest(staging, manifest, fsync)
    discard(publish(staging, final, save_id, fsync))


def stage_manifest(staging: Path, manifest: bytes, fsync: bool = True) -> None:
    """Phase 1 of a commit across nodes: write the manifest into the staging directory and make
    the tree durable. Nothing is visible to readers yet (the staging name is a dot-name)."""
    write_gather(staging / MANIFEST_NAME, [manifest], fsync)
    if fsync:
        fsync_tree(staging)


def publish(
    staging: Path,
    final: Path,
    save_id: str,
    fsync: bool = True,
    hook: Callable[[str], None] | None = None,
) -> Path | None:
    """Phase 2: put the staged tree in place. An existing copy is swapped out in one step
    (:func:`exchange`; where that cannot be done, renamed aside first, then the new one in) and
    kept at ``.name.old-<save_id>``, not deleted, so :func:`unpublish` can put it back. Returns
    the moved-aside copy, for :func:`discard` once every node has published. When the parent
    cannot be fsynced after the rename, :class:`NotDurableError` (its ``replaced``: the copy
    moved aside): the step is published all the same, and nothing is put back. ``hook`` (tests'
    crash points) is called with ``"swapped"`` after the exchange (the old tree at the staging
    name) and ``"aside"`` between the two renames where there was no exchange. A second rename
    that fails puts the old tree back in place before raising: a failed publish published
    nothing (the draft stays staged, for ``abort``)."""
    old: Path | None = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{save_id}"
        if exchange(staging, final):
            if hook:
                hook("swapped")
            try:
                os.rename(staging, old)  # the old tree, now at the staging name
            except OSError:  # nothing published: the old tree back in place, the new staged
                exchange(staging, final)
                raise
        else:
            os.rename(final, old)
            if hook:
                hook("aside")
            try:
                os.rename(staging, final)
            except OSError:  # nothing published: the old tree back in place
                os.rename(old, final)
                raise
    else:
        os.rename(staging, final)
    if fsync:
        try:
            fsync_dir(final.parent)
        except OSError as exc:  # renamed: committed for every reader, not known to be on disk
            why = (exc.strerror or str(exc)).lower()
            raise NotDurableError(str(final), why, err=exc.errno, replaced=old) from exc
    return old


def unpublish(staging: Path, final: Path, old: Path | None, fsync: bool = True) -> None:
    """Roll a published step back (another node failed to publish it): the previous copy
    swapped back in one step where there is one (else out of sight first, then the previous
    copy back in place), then the rolled-back one removed."""
    new_there = final.exists() and (final / MANIFEST_NAME).is_file()
    if new_there and old is not None and old.exists() and exchange(old, final):
        os.rename(old, staging)
    else:
        if new_there:
            os.rename(final, staging)
        if old is not None and old.exists():
            os.rename(old, final)
    if fsync:
        fsync_dir(final.parent)
    shutil.rmtree(staging, ignore_errors=True)


def discard(old: Path | None) -> None:
    """Remove a copy that :func:`publish` moved aside, once the commit stands everywhere."""
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove(path: Path) -> None:
    """Delete a committed checkpoint so that no reader ever sees half of it: rename it to a
    ``.name.del-*`` dot-name first. Removals a crash cut short beside it (other ``.*.del-*``
    directories: no reader takes them, and no later removal of their name comes) are finished
    too, as ``clean_leftovers`` does."""
    doomed = path.parent / f".{path.name}.del-{os.urandom(16).hex()}"
    os.rename(path, doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed, ignore_errors=True)
    for child in path.parent.iterdir():
        m = LEFTOVER.match(child.name)
        if m and m["kind"] == "del" and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)


def abort(staging: Path) -> None:
    """Remove a staging directory after a failed save."""
    shutil.rmtree(staging, ignore_errors=True)


def recover(final: Path) -> Path | None:
    """Undo an overwrite of ``final`` that a crash cut between its two renames (where the file
    system could not exchange): ``final`` is missing and a committed ``.<name>.old-*`` beside it
    holds the checkpoint it was replacing, which is renamed back (the newest, if several).
    Returns the restored directory's former path, None when there was nothing to undo."""
    if final.exists() or final.is_symlink() or not final.parent.is_dir():
        return None
    aside = [
        c
        for c in final.parent.iterdir()
        if (m := LEFTOVER.match(c.name)) and m["kind"] == "old" and m["name"] == final.name
    ]
    aside = [c for c in aside if c.is_dir() and is_committed(c)]
    if not aside:
        return None
    back = max(aside, key=lambda c: (c / MANIFEST_NAME).stat().st_mtime_ns)
    os.rename(back, final)
    fsync_dir(final.parent)
    return back


def clean_leftovers(parent: Path, name: str | None = None) -> list[Path]:
    """Remove what crashed saves left in ``parent`` (of the checkpoint ``name`` only, when
    given); return what was removed.

    A ``.name.tmp-*`` directory is a save that never committed (or, after an exchange, the
    checkpoint it replaced). A ``.name.old-*`` directory is a replaced checkpoint: removed if
    ``name`` is committed, else renamed back (:func:`recover`: the crash came between the two
    renames of an overwrite). A ``.name.del-*`` directory is a checkpoint that retention was
    deleting: removed.
    """
    removed: list[Path] = []
    if not parent.is_dir():
        return removed
    for child in sorted(parent.iterdir()):
        m = LEFTOVER.match(child.name)
        if not m or not child.is_dir() or (name is not None and m["name"] != name):
            continue
        if m["kind"] == "old" and recover(parent / m["name"]) == child:
            continue
        shutil.rmtree(child, ignore_errors=True)
        removed.append(child)
    return removed
