"""Removing every checkpoint a manager wrote at a level's root, and nothing else.

A level's root is a directory of the user's choosing (``local_dir`` on a node's scratch disk,
``shared_dir``), which may hold other files: the end of a Keras ``fit`` with
``delete_checkpoint`` must not take a dataset beside the checkpoints with it. What a manager
writes at a root is known by name (``spec/PROTOCOL.md``): the committed step directories
``step-<n>``, the dot-named leftovers of crashed saves (``.<name>.tmp|old|del-<id>``), the spare
step directories of level 1 (``.slots``) and the levels record (``ckptfmt-levels.json``, written
through ``.ckptfmt-levels.json.tmp-<pid>``). Those are removed, each step out of sight in one
rename first; anything else is left, and the root itself is removed only when nothing is left
in it.
"""

from __future__ import annotations

import contextlib
import re
import shutil
from pathlib import Path

from ckptfmt.parallel.levels.layout import LEVELS_FILE
from ckptfmt.storage import commit
from ckptfmt.storage.slots import SLOTS_DIR
from ckptfmt.storage.steps import STEP_NAME

__all__ = ["clear_root"]

_RECORD_TMP = re.compile(rf"^\.{re.escape(LEVELS_FILE)}\.tmp-[0-9]+$")


def clear_root(root: Path) -> list[str]:
    """Remove the manager's entries at ``root`` (see the module docstring) and ``root`` itself
    when that empties it; return the names of the entries left, sorted. A step directory
    without a manifest is not known to be the manager's and stays; a symlink is never
    followed."""
    if not root.is_dir():
        return []
    left: list[str] = []
    for child in sorted(root.iterdir()):
        name = child.name
        is_dir = child.is_dir() and not child.is_symlink()
        if is_dir and STEP_NAME.match(name) and commit.is_committed(child):
            commit.remove(child)
        elif is_dir and (commit.LEFTOVER.match(name) or name == SLOTS_DIR):
            shutil.rmtree(child, ignore_errors=True)
        elif not is_dir and (name == LEVELS_FILE or _RECORD_TMP.match(name)):
            child.unlink(missing_ok=True)
        else:
            left.append(name)
    if not left:
        # something that appeared meanwhile stays, and so does the root
        with contextlib.suppress(OSError):
            root.rmdir()
    return left
