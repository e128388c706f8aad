"""The step's directories in a collective save or rebuild: which ranks share one (and its
leader), making one under a level's root (an OS error there named with the path and the level),
and the collective commit that makes a step visible on every node or on none."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ckptfmt.errors import (
    CkptError,
    NotDurableError,
    StorageError,
    StorageFullError,
    level_name,
)
from ckptfmt.parallel.collective.boundary import Boundary
from ckptfmt.storage.store.base import Draft

FaultHook = Callable[[str], None]


def groups_of(keys: list[str]) -> list[int]:
    """For each rank, the leader (lowest rank) of the ranks whose group keys are equal (the ranks
    that see the same directory)."""
    first: dict[str, int] = {}
    return [first.setdefault(k, r) for r, k in enumerate(keys)]


@contextmanager
def level_directory(final: Path, levels: Mapping[str, Any] | int | None) -> Iterator[None]:
    """Making (or writing into) a checkpoint's directory under the root of a level the user
    gave: a file in the way, a read-only file system, a permission denied is raised as a
    :class:`StorageError` naming the path and the level, instead of a bare ``OSError``; a full
    file system as a :class:`StorageFullError` naming them too. ``levels``: the save's levels
    (their first key is the level written), or the level itself."""
    first = levels if isinstance(levels, int) or levels is None else next(iter(levels), None)
    level = level_name(first)
    try:
        yield
    except StorageFullError as exc:
        raise exc.with_context(level=level, path=str(final.parent)) from exc
    except CkptError:
        raise
    except OSError as exc:
        raise StorageError.of(exc, level=level) from exc


def publish_commit(
    b: Boundary, is_leader: bool, draft: Draft, fsync: bool, hook: FaultHook
) -> None:
    """Collective (every rank, after the vote that every node's manifest is staged): each
    group's leader publishes its draft with its store's commit (renames its staged step into
    place; writes the commit object); a last vote; if any node failed to, the nodes that did
    roll it back (their previous copy of the step, if any, comes back), so a step is committed
    on every node or on none; a node whose rename was done but whose directory could not be
    synced (``NotDurableError``) rolls back too. (A rank that dies between its rename and this
    vote leaves a step committed on some nodes: a torn commit of a save whose every data and
    parity file was written, which the restore rebuilds.)"""
    old: Any = None
    published = False
    with b.guard("commit"):
        if is_leader:
            hook("committing")
            try:
                old = draft.publish(hook, fsync)
            except NotDurableError as exc:
                # renamed into place, its directory not synced: rolled back with the others
                # below (kept, the step would stand on this node only)
                old, published = exc.replaced, True
                raise
            published = True
        hook("committed")

    def roll_back() -> None:
        if published:
            draft.unpublish(old, fsync)
        elif is_leader:
            draft.abort()

    b.vote("commit", cleanup=roll_back)
    if is_leader:
        draft.discard(old)
