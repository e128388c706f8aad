"""Spare step directories of a level-1 root, rewritten in place by later saves
(``spec/PROTOCOL.md`` §1, "Recycled step directories").

A new file costs its pages' allocation and zeroing (on tmpfs, and on most file systems their
blocks); a write into a file that already has them runs about twice as fast here. So a manager's
level 1 does not delete a step that retention drops: :meth:`Slots.recycle` renames it into
``<root>/.slots/`` (one rename: from then on no step name leads to it) and removes its manifest;
the next save's committer takes it (:meth:`Slots.take`: renamed to the save's staging name) and
every writer overwrites the files it finds there in place (``storage.files.write_gather`` with
``in_place``), creating the others. What the new step does not write is removed before its
manifest is written (:func:`sweep`). The commit is the usual one: manifest last, rename.

Why a torn rewrite is never taken for a good step: a slot is written only under a staging name
(a dot-name without a manifest until every file is written and fsynced), and its manifest was
removed, after the rename out of the step names, before the slot could be taken. A crash in the
middle leaves a staging directory, which no reader opens and ``clean_leftovers`` removes. A slot
is only ever a step that retention dropped, never the newest committed one: with ``keep_local=K``
the K newest steps stay committed, untouched, while the next one is written.

A file with more than one link (an incremental save's hard link, shared with another step) is
never written through: it is unlinked and created anew (``files.write_gather``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ckptfmt.manifest.codec import MANIFEST_NAME
from ckptfmt.manifest.model import Manifest
from ckptfmt.storage import commit
from ckptfmt.storage.files import fsync_dir

SLOTS_DIR = ".slots"
"""Where a level-1 root keeps its spare step directories; no reader looks there."""


class Slots:
    """The spare step directories of one level-1 root (``root/.slots``), at most ``spare`` of
    them. Used by the node's first rank only (it applies retention and commits the node's
    saves). ``fsync``: make each rename durable before the next step (the saves' setting)."""

    def __init__(self, root: Path, spare: int = 1, fsync: bool = True) -> None:
        self.root = Path(root).absolute()
        self.dir = self.root / SLOTS_DIR
        self.spare = spare
        self.fsync = fsync

    def __repr__(self) -> str:
        return f"Slots({str(self.root)!r}, spare={self.spare})"

    def held(self) -> list[Path]:
        """The spare slots, oldest name first."""
        try:
            return sorted(p for p in self.dir.iterdir() if p.is_dir())
        except FileNotFoundError:
            return []

    def recycle(self, step_dir: Path) -> None:
        """Retire the committed step at ``step_dir``: out of the step names in one rename (into
        ``.slots/``, made durable), then its manifest removed, so that it can never be read as
        a step again. Removed instead, as ``commit.remove`` does, when ``spare`` slots are
        there already."""
        if len(self.held()) >= self.spare:
            commit.remove(step_dir)
            return
        self.dir.mkdir(exist_ok=True)
        slot = self.dir / os.urandom(16).hex()
        os.rename(step_dir, slot)
        if self.fsync:
            fsync_dir(self.root)
        (slot / MANIFEST_NAME).unlink(missing_ok=True)
        if self.fsync:
            fsync_dir(slot)

    def take(self, staging: Path) -> bool:
        """Rename a spare slot to ``staging`` (a save's staging directory, which must not
        exist); whether there was one. Its manifest, should a crash have left it there, is
        removed first."""
        for slot in self.held():
            (slot / MANIFEST_NAME).unlink(missing_ok=True)
            try:
                os.rename(slot, staging)
            except FileNotFoundError:
                continue
            if self.fsync:
                fsync_dir(staging.parent)
            return True
        return False

    def clear(self) -> None:
        """Remove every spare slot (a full level needs their room)."""
        shutil.rmtree(self.dir, ignore_errors=True)


def kept_paths(manifest: Manifest) -> tuple[set[str], set[str]]:
    """What a step of ``manifest`` holds: its files (data, and the parity files its level-1
    redundancy record names), and the nodes (groups and arrays, '/'-joined; ``""``: the root)
    whose ``zarr.json`` it has."""
    files = {f.path for _, f in manifest.files()}
    record = manifest.levels.get("1", {}).get("redundancy") if manifest.levels else None
    for s in (record or {}).get("sets", []):
        for p in s.get("parity", []):
            if isinstance(p, dict) and "path" in p:
                files.add(str(p["path"]))
    nodes = {""}
    for e in manifest.entries:
        nodes |= {"/".join(e.name[:k]) for k in range(1, len(e.name) + 1)}
    return files, nodes


def sweep(staging: Path, manifest: Manifest) -> int:
    """Remove from a staging directory made from a slot every file the step of ``manifest``
    does not hold (a tensor of the old step that this one lacks, a shard file that moved), and
    the directories left empty; return how many files were removed. The committer, once every
    writer is done and before the manifest is written."""
    files, nodes = kept_paths(manifest)
    removed = 0
    top = os.fspath(staging)
    kept_below: dict[str, int] = {}  # directory -> entries left in it (bottom-up: children first)
    for dirpath, dirs, names in os.walk(top, topdown=False):
        rel_dir = dirpath[len(top) + 1 :].replace(os.sep, "/")
        left = sum(1 for d in dirs if kept_below.get(os.path.join(dirpath, d), 1))
        for name in names:
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if rel in files or (name == "zarr.json" and rel_dir in nodes):
                left += 1
                continue
            os.unlink(os.path.join(dirpath, name))
            removed += 1
        if rel_dir and not left:
            os.rmdir(dirpath)
        kept_below[dirpath] = left
    return removed
