"""The commit protocol (``spec/PROTOCOL.md`` §1): a checkpoint appears whole or not at all.

1. ``prepare``: refuse a destination that is a committed checkpoint (unless overwriting) or a
   non-empty directory that is not one; create the staging directory ``.<name>.tmp-<save_id>``
   beside the destination.
2. The caller writes every data and metadata file into the staging directory, fsyncing each.
3. ``finalize``: write the manifest last and fsync it, fsync every directory of the tree, rename
   the staging directory to the destination, fsync the parent. When overwriting, the old
   checkpoint is first renamed to ``.<name>.old-<save_id>`` and removed after the new one is in.

A crash before the last rename leaves only a staging directory, which no reader takes for a
checkpoint (it has a dot name and, until the very end, no manifest); ``clean_leftovers`` removes it.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from ckptfmt.errors import DestinationExistsError
from ckptfmt.manifest.codec import MANIFEST_NAME
from ckptfmt.storage.files import fsync_dir, write_gather

LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old|del)-[0-9a-f]{32}$")


def is_committed(path: Path) -> bool:
    """Whether ``path`` is a committed checkpoint directory (it holds a manifest)."""
    return (path / MANIFEST_NAME).is_file()


def staging_dir(final: Path, save_id: str) -> Path:
    return final.parent / f".{final.name}.tmp-{save_id}"


def prepare(final: Path, save_id: str, overwrite: bool) -> Path:
    """Check the destination and create the staging directory; return it."""
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


def publish(staging: Path, final: Path, save_id: str, fsync: bool = True) -> Path | None:
    """Phase 2: rename the staged tree into place (an existing copy is moved aside to
    ``.name.old-<save_id>``, not deleted, so :func:`unpublish` can put it back). Returns the
    moved-aside copy, for :func:`discard` once every node has published."""
    old: Path | None = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{save_id}"
        os.rename(final, old)
    os.rename(staging, final)
    if fsync:
        fsync_dir(final.parent)
    return old


def unpublish(staging: Path, final: Path, old: Path | None, fsync: bool = True) -> None:
    """Roll a published step back (another node failed to publish it): out of sight first,
    then the previous copy back in place, then removed."""
    if final.exists() and (final / MANIFEST_NAME).is_file():
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
    ``.name.del-*`` dot-name first (``clean_leftovers`` finishes an interrupted removal)."""
    doomed = path.parent / f".{path.name}.del-{os.urandom(16).hex()}"
    os.rename(path, doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def abort(staging: Path) -> None:
    """Remove a staging directory after a failed save."""
    shutil.rmtree(staging, ignore_errors=True)


def clean_leftovers(parent: Path) -> list[Path]:
    """Remove what crashed saves left in ``parent``; return what was removed.

    A ``.name.tmp-*`` directory is a save that never committed. A ``.name.old-*`` directory is a
    replaced checkpoint: removed if ``name`` is committed, else renamed back (the crash came between
    the two renames of an overwrite). A ``.name.del-*`` directory is a checkpoint that retention
    was deleting: removed.
    """
    removed: list[Path] = []
    if not parent.is_dir():
        return removed
    for child in sorted(parent.iterdir()):
        m = LEFTOVER.match(child.name)
        if not m or not child.is_dir():
            continue
        final = parent / m["name"]
        if m["kind"] == "old" and not final.exists() and is_committed(child):
            os.rename(child, final)
            fsync_dir(parent)
            continue
        shutil.rmtree(child, ignore_errors=True)
        removed.append(child)
    return removed
