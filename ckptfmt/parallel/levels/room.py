"""Making room on a full level: which older steps go so that a new checkpoint fits.

A level that fills up must not stop a training loop from checkpointing. Retention normally runs
after a save commits (it keeps the newest ``keep_local``/``keep_shared`` steps), so a level
sized for ``keep`` checkpoints is full while it writes the ``keep + 1``-th. When a save (or a
flush) fails because its file system is full, the manager removes the oldest committed steps of
that level, oldest first, until what was free plus what they held covers what the write needs,
and writes once more. The rules, the same on every rank (each decides from the same gathered
figures, so the nodes remove the same steps):

- the newest committed step of the level is never removed (nor a step the caller protects);
- steps are removed oldest first, and only as many as the write needs;
- when even removing every other step would not make room (a checkpoint larger than the level),
  nothing is removed: the save fails and is told, and the level keeps what it had.

A bucket has no such limit to make room under: only directories are handled here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ckptfmt.errors import CkptError, SaveFailedError
from ckptfmt.storage import commit
from ckptfmt.storage.slots import Slots
from ckptfmt.storage.steps import list_step_dirs
from ckptfmt.transport.comm import Comm

log = logging.getLogger("ckptfmt")

__all__ = ["choose", "directory_sizes", "is_full", "make_room_here", "make_room_on_nodes"]

#: room kept beyond a write's own bytes (metadata documents, the manifest, partly filled
#: file-system blocks): a fixed part and a fraction of the write
SLACK_BYTES = 64 << 10
SLACK_PART = 50


def _with_slack(need: int) -> int:
    return need + SLACK_BYTES + need // SLACK_PART


def is_full(exc: CkptError) -> bool:
    """Whether a collective write failed because some rank's file system was full (and for no
    other reason on any rank): then removing older steps may let it through."""
    if not isinstance(exc, SaveFailedError) or not exc.rank_failures:
        return False
    kinds = {f.kind for f in exc.rank_failures.values()}
    return kinds == {"storage"} and any(
        f.type == "StorageFullError" for f in exc.rank_failures.values()
    )


def _tree_bytes(path: Path) -> int:
    """The bytes the files under ``path`` hold on disk (allocated blocks); a file hard-linked
    into other steps by incremental saves counts its share (its blocks over its links): removing
    one of the steps that name it frees nothing of it, removing all of them frees it all."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            total += st.st_blocks * 512 // max(1, st.st_nlink)
    return total


def directory_sizes(root: Path | None) -> list[tuple[int, int]]:
    """``(step, bytes on disk)`` of every committed step under ``root``, oldest first."""
    if root is None:
        return []
    return [(s, _tree_bytes(p)) for s, p in list_step_dirs(root) if commit.is_committed(p)]


def free_bytes(root: Path) -> int:
    """The bytes an unprivileged writer may still write under ``root``."""
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize


def choose(
    held: Mapping[str, Sequence[tuple[int, int]]],
    free: Mapping[str, int],
    need: Mapping[str, int],
    protect: set[int],
) -> list[int] | None:
    """The steps to remove so that every place (a node's directory, or the one shared
    directory) has ``need`` bytes free: oldest first, never the newest step held anywhere nor
    one in ``protect``. ``held``: each place's committed steps with their sizes; ``free``: its
    free bytes now. ``[]`` when every place has room already; None when no choice makes room
    (nothing is to be removed then). A pure function: every rank computes the same."""
    everywhere = sorted({s for steps in held.values() for s, _ in steps})
    newest = everywhere[-1] if everywhere else None
    room = {place: free.get(place, 0) for place in need}
    short = {p for p in need if room[p] < _with_slack(need[p])}
    if not short:
        return []
    chosen: list[int] = []
    for step in everywhere:
        if step == newest or step in protect:
            continue
        chosen.append(step)
        for place, steps in held.items():
            room[place] = room.get(place, 0) + sum(b for s, b in steps if s == step)
        short = {p for p in need if room[p] < _with_slack(need[p])}
        if not short:
            return chosen
    return None


def make_room_here(root: Path, need: int, protect: set[int]) -> list[int]:
    """One rank, one directory (a shared level 3): remove the oldest committed steps under
    ``root`` until ``need`` bytes fit (see the module's rules); the steps removed (none when
    no choice makes room)."""
    try:
        held = directory_sizes(root)
        chosen = choose({"": held}, {"": free_bytes(root)}, {"": need}, protect) or []
        for step in chosen:
            _remove(root, step)
    except OSError as exc:  # the write is tried again only when room was made
        log.warning("could not make room in %s: %s", root, exc)
        return []
    return chosen


def make_room_on_nodes(
    comm: Comm,
    root: Path,
    node: str,
    leader: bool,
    need: int,
    protect: set[int],
) -> list[int]:
    """Collective (one allgather on ``comm``; every rank, after a level-1 write failed full on
    some rank): every node's first rank (``leader``) tells its directory's committed steps,
    their sizes and its free bytes, every rank the bytes it writes (``need``); the same choice
    is made everywhere and each leader removes the chosen steps from its node's ``root``.
    The steps removed (the same on every rank; empty when none made room)."""
    mine: dict[str, Any] = {"node": node, "need": need, "leader": leader, "held": [], "free": 0}
    if leader:
        try:
            Slots(root).clear()  # spare step directories (``storage/slots.py``) go first
            mine["held"] = directory_sizes(root)
            mine["free"] = free_bytes(root) if root.is_dir() else 0
        except OSError as exc:  # this node tells nothing: no step is removed for it
            log.warning("could not look at %s: %s", root, exc)
    seen = comm.allgather_json(mine)
    held: dict[str, list[tuple[int, int]]] = {}
    free: dict[str, int] = {}
    needs: dict[str, int] = {}
    for doc in seen:
        needs[doc["node"]] = needs.get(doc["node"], 0) + int(doc["need"])
        if doc["leader"]:
            held[doc["node"]] = [(int(s), int(b)) for s, b in doc["held"]]
            free[doc["node"]] = int(doc["free"])
    chosen = choose(held, free, needs, protect) or []
    if leader:
        try:
            for step in chosen:
                _remove(root, step)
        except OSError as exc:  # the write tried again fails, and is voted on, as before
            log.warning("could not make room in %s: %s", root, exc)
    return chosen


def _remove(root: Path, step: int) -> None:
    for s, path in list_step_dirs(root):
        if s == step and commit.is_committed(path):
            commit.remove(path)
