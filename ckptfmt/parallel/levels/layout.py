"""Storage levels: node-local level 1, shared level 3, the flush between them, and their listing.

Level 1 is a directory on each node (``local_dir``, which may contain ``{node}`` so that one
machine can simulate several nodes); a rank only ever touches its own node's directory. Level 3 is
one shared directory. A checkpoint of step ``s`` lives at ``<level root>/step-<s>`` on each level
(``storage/steps.py``). The manager records where the levels are in ``ckptfmt-levels.json`` at
the level-3 root, so that ``ckptfmt list`` can find them.
"""

from __future__ import annotations

import json
import os
import socket
import stat
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ckptfmt.container.metadata import write_metadata
from ckptfmt.container.reader import geometry, read_manifest
from ckptfmt.errors import (
    CkptError,
    NotACheckpointError,
    SaveFailedError,
    StorageError,
    UnreadableError,
    UsageError,
    level_name,
)
from ckptfmt.format.incremental import Incremental, hashes_of, unchanged_files
from ckptfmt.format.shard_read import decode_shard, read_file
from ckptfmt.manifest.codec import dump_manifest
from ckptfmt.manifest.grid import shard_cell
from ckptfmt.manifest.limits import display
from ckptfmt.manifest.model import FileRef, Manifest, TensorEntry
from ckptfmt.parallel.collective.boundary import Boundary
from ckptfmt.parallel.collective.publish import FaultHook, level_directory, publish_commit
from ckptfmt.storage import commit
from ckptfmt.storage.files import Inside, naming, write_gather
from ckptfmt.storage.nodes import expand
from ckptfmt.storage.paths import unwritable
from ckptfmt.storage.steps import STEP_NAME, list_step_dirs, step_dir_name
from ckptfmt.storage.store.directory import DirectoryDraft
from ckptfmt.transport.comm import Comm

LEVELS_FILE = "ckptfmt-levels.json"
NODE_ENV = "CKPTFMT_NODE"


def valid_node(name: object) -> bool:
    """Whether ``name`` is a node's name (``spec/PROTOCOL.md`` §5): a non-empty string without
    ``/`` (nor NUL, which no path holds), not ``.`` or ``..``, so that it fills ``{node}`` with
    one directory."""
    return (
        isinstance(name, str)
        and bool(name)
        and "/" not in name
        and "\0" not in name
        and name not in (".", "..")
    )


def resolve_node(node: str | None = None) -> str:
    """This process's failure domain: ``node`` if given, else the ``CKPTFMT_NODE`` environment
    variable (stable across restarts; how tests simulate several nodes on one machine), else the
    host name. Read here once, by the manager's constructor, and nowhere else."""
    name = node or os.environ.get(NODE_ENV) or socket.gethostname()
    if not valid_node(name):
        raise UsageError(f"invalid node name {name!r}")
    return name


def read_record(data: bytes | str, where: str) -> dict[str, Any]:
    """The levels record ``ckptfmt-levels.json`` (what :meth:`Levels.record` writes) read from
    ``data``, the file or object at ``where``: an object whose ``local_dir`` is a path template
    or null and whose ``nodes`` are node names. Anything else (torn, edited by hand) is an
    :class:`UnreadableError` naming it: ``ckptfmt list`` expands those names into paths."""
    try:
        doc = json.loads(data)
    except ValueError as exc:
        doc, why = None, f"not JSON ({exc})"
    else:
        why = "not a JSON object"
    if isinstance(doc, dict):
        local, nodes = doc.get("local_dir"), doc.get("nodes", [])
        if local is not None and not isinstance(local, str):
            why = f"local_dir is {local!r}, not a path or null"
        elif not isinstance(nodes, list) or not all(valid_node(n) for n in nodes):
            why = f"nodes is {nodes!r}, not a list of node names"
        else:
            return doc
    raise UnreadableError(
        f"{where}: not a levels record a CheckpointManager writes: {why}; the manager writes it "
        "anew when it starts, or remove it to list level 3 alone"
    )


def group_key(node: str, node_local: bool) -> str:
    """Which ranks see the same directory: a node's ranks on level 1, everyone on level 3."""
    return f"node:{node}" if node_local else "shared"


class RecordedElsewhere(Protocol):
    """A level 3 that is no directory (a bucket, ``levels.bucket.BucketLevel``): what
    :class:`Levels` asks of it at a job's start."""

    def record(self, local_dir: str | None, nodes: list[str]) -> None: ...

    def problems(self) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class Levels:
    """Where the levels of one job are."""

    local_dir: str | None  # may contain "{node}"
    shared_dir: Path | None  # level 3 when it is a directory
    bucket: RecordedElsewhere | None = None  # level 3 when it is an object-store prefix

    def local_root(self, node: str) -> Path | None:
        if self.local_dir is None:
            return None
        return expand(self.local_dir, node).absolute()

    def record(self, nodes: list[str]) -> None:
        """Write ``ckptfmt-levels.json`` at the shared root (rank 0, once per job start). A
        root that cannot be made or written is a :class:`StorageError` naming it and level 3."""
        if self.bucket is not None:
            self.bucket.record(self.local_dir, nodes)
        if self.shared_dir is None:
            return
        doc = {"local_dir": self.local_dir, "nodes": sorted(set(nodes))}
        tmp = self.shared_dir / f".{LEVELS_FILE}.tmp-{os.getpid()}"
        try:
            self.shared_dir.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(doc, indent=1))
            os.replace(tmp, self.shared_dir / LEVELS_FILE)
        except OSError as exc:
            raise StorageError.of(exc, str(self.shared_dir), level_name(3)) from exc

    def problems(self, node: str, shared: bool) -> list[dict[str, Any]]:
        """What stands in the way of writing this rank's level roots: its node's level-1 root
        and, ``shared``, the level-3 root (a file where a directory belongs, a read-only file
        system, no permission), as the fields of a :class:`StorageError` each. Looks only."""
        roots = [(1, self.local_root(node))]
        if shared:
            roots.append((3, self.shared_dir))
        out = []
        for level, root in roots:
            problem = None if root is None else unwritable(root)
            if root is not None and problem is not None:
                out.append(
                    {"path": str(root), "reason": problem[0], "err": problem[1], "level": level}
                )
        if shared and self.bucket is not None:
            out += self.bucket.problems()
        return out


def agree_nodes(comm: Comm, levels: Levels, node: str) -> list[str]:
    """Collective (one allgather; every rank calls it once, at the manager's start): every
    rank's node, in rank order, after every rank looked at the level roots it writes (rank 0
    also at level 3). A root that cannot be written raises the same :class:`StorageError`
    (naming the path, the level and the rank) on every rank, before any of them saves."""
    seen = comm.allgather_json([node, levels.problems(node, comm.rank == 0)])
    for rank, (_, problems) in enumerate(seen):
        for p in problems:
            raise StorageError(
                p["path"],
                f"{p['reason']} (seen by rank {rank})" if comm.size > 1 else p["reason"],
                level=level_name(p["level"]),
                err=p["err"],
            )
    return [n for n, _ in seen]


def copy_verified(src: Inside, t: TensorEntry, ref: FileRef, dst: Path, fsync: bool = True) -> None:
    """Copy one shard file after checking every CRC in it: damage on level 1 is refused, not
    propagated to level 3."""
    with naming(src):
        blob = read_file(src, ref, (display(t.name),))
        decode_shard(blob, geometry(t), shard_cell(ref.path), ref, (display(t.name),))
    dst.parent.mkdir(parents=True, exist_ok=True)
    write_gather(dst, [blob], fsync)


def newest_base(
    root: Path | None, but: Path | None = None, among: Collection[str] | None = None
) -> Path | None:
    """The base of an incremental save or flush into ``root``: its newest committed step
    (other than ``but``) whose manifest reads and, with ``among``, is of one of those saves
    (save ids); None when there is none (a full save). A linked file is not read again, so a
    manager passes the saves it knows whole (``among``): a damaged file of another step would
    otherwise become a file of every step linked from it."""
    if root is None or not root.is_dir():
        return None
    for _, path in reversed(list_step_dirs(root)):
        if not commit.is_committed(path):
            continue
        if but is not None and path.absolute() == but.absolute():
            continue
        try:
            manifest = read_manifest(path)
        except CkptError:
            continue
        if among is not None and manifest.save_id not in among:
            continue
        return path
    return None


def _link_plan(manifest: Manifest, base: Path | None) -> dict[str, Path]:
    """The files of ``manifest`` that the level-3 step at ``base`` holds with the same content
    (path, geometry, size, CRC32C and content hash, ``format/incremental.py``): path -> the
    base's file. Empty without a base or without hashes on either side."""
    if base is None or hashes_of(manifest) is None:
        return {}
    try:
        same = unchanged_files(manifest, read_manifest(base))
    except CkptError:
        return {}
    return {path: base / path for path in sorted(same)}


def _linkable(path: Path, size: int) -> bool:
    """Whether the base's file is there to link: a regular file of its recorded size."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == size


def _already_flushed(final: Path, manifest: Manifest) -> bool:
    """Whether ``final`` is a committed copy of this very save with every file in place."""
    if not commit.is_committed(final):
        return False
    try:
        existing = read_manifest(final)
    except CkptError:
        return False  # an unreadable copy is replaced, never a reason to give up
    if existing.save_id != manifest.save_id:
        return False
    src = Inside(final)
    try:
        for t, ref in existing.files():
            src.check_size(ref.path, ref.size, (display(t.name),))
    except CkptError:
        return False
    return True


def flush_collective(
    comm: Comm,
    manifest: Manifest,
    local_path: Path,
    shared_root: Path,
    *,
    fsync: bool = True,
    fault: FaultHook | None = None,
    seq: int | None = None,
    incremental: bool = False,
    report: dict[str, Any] | None = None,
    bases: Collection[str] | None = None,
) -> Path:
    """Collective: copy a committed level-1 checkpoint to the shared level, every rank copying the
    files it wrote from its own node's directory; rank 0 commits the copy once every rank's files
    are in place (same protocol as a save: staging directory, one vote per phase, manifest last,
    rename).

    ``incremental``: rank 0 picks the newest other committed step on the shared level as the
    base (its vote tells every rank; with ``bases``, the newest of those saves); a file whose
    content hash, CRC32C and size the base's manifest records alike (``format/incremental.py``)
    is hard-linked from the base instead of read and copied; a link the file system refuses is
    a copy. ``report``: this rank's ``linked_bytes``, ``written_bytes`` (copied) and
    ``unlinkable``.

    Raises :class:`SaveFailedError` on every rank if any rank failed (any exception); the shared
    level then holds no trace of this step beyond what was there before.
    """
    hook = fault or (lambda _point: None)
    b = Boundary(comm, "flush", manifest.step, seq=seq)
    final = shared_root.absolute() / step_dir_name(manifest.step or 0)
    staging = commit.staging_dir(final, manifest.save_id)
    mine = staging if comm.rank == 0 else None
    already = False
    base: Path | None = None
    with b.guard("flush-stage"), level_directory(final, 3):
        if manifest.world_size != comm.size:  # every rank copies what it wrote: the same ranks
            raise UsageError(f"cannot flush a save of {manifest.world_size} ranks with {comm.size}")
        if comm.rank == 0:
            already = _already_flushed(final, manifest)
            if not already:
                if incremental:
                    base = newest_base(shared_root.absolute(), but=final, among=bases)
                commit.prepare(final, manifest.save_id, overwrite=True)
    votes = b.vote(
        "flush-stage",
        [already, None if base is None else str(base)],
        cleanup=mine if not already else None,
    )
    if votes[0][0]:
        return final
    tally = {"linked_bytes": 0, "written_bytes": 0, "unlinkable": 0}
    with b.guard("flush-copy"):
        hook("flush-staged")
        links = _link_plan(manifest, Path(votes[0][1])) if votes[0][1] else {}
        linker = Incremental()
        src = Inside(local_path)
        mine_files: list[tuple[TensorEntry, FileRef]] = []
        for t in manifest.tensors():
            for r in t.regions:
                if r.rank != comm.rank:
                    continue
                for f in r.files:
                    mine_files.append((t, f))
                    dst = staging / f.path
                    if f.path in links and _linkable(links[f.path], f.size):
                        dst.parent.mkdir(parents=True, exist_ok=True)
                        if linker.link(links[f.path], dst):
                            tally["linked_bytes"] += f.size
                            continue
                        tally["unlinkable"] += 1
                    copy_verified(src, t, f, dst, fsync)
                    tally["written_bytes"] += f.size
        hook("flush-copied")
    if report is not None:
        report.update(tally)
    b.vote("flush-copy", cleanup=mine)
    with b.guard("flush-manifest"):
        # after the vote: every rank's copies are over, so a file removed under any of them
        # is missed by its own rank now, before the manifest can be voted on and committed
        _check_staged(staging, mine_files)
        if comm.rank == 0:
            write_metadata(staging, manifest, fsync)
            commit.stage_manifest(staging, dump_manifest(manifest), fsync)
    b.vote("flush-manifest", cleanup=mine)
    draft = DirectoryDraft(final, manifest.save_id, staging)
    publish_commit(b, comm.rank == 0, draft, fsync, _flush_hook(hook))
    hook("flushed")
    return final


def _check_staged(staging: Path, files: list[tuple[TensorEntry, FileRef]]) -> None:
    """Every rank, once every rank has copied its files (after the copy's vote): each file this
    rank copied is still in the staging directory with its size. A staging directory removed
    under a running flush (a restore's clean-up of leftovers on another thread, another flush
    of the same step) is made again by the copies that come after, so without this the flush
    would commit a step lacking the files copied before; with it, the flush fails (voted,
    nothing committed) and the next save flushes again. Each rank looks at the files it wrote
    itself (no other node's cached view of them)."""
    into = Inside(staging)
    gone = []
    for t, ref in files:
        try:
            into.check_size(ref.path, ref.size, (display(t.name),))
        except CkptError:
            gone.append(ref.path)
    if gone:
        raise StorageError(
            str(staging),
            f"{len(gone)} of the {len(files)} files this rank copied there are gone (first: "
            f"{gone[0]}): the staging directory was removed while the flush ran (a restore's "
            "clean-up of leftovers, or another flush of the same step); nothing is committed, "
            "and the next save flushes again",
            level=level_name(3),
        )


def _flush_hook(hook: FaultHook) -> FaultHook:
    """The flush's names for the commit's fault points (tests crash at ``flush-committing``)."""
    return lambda point: hook("flush-committing") if point == "committing" else None


def retain(root: Path | None, keep: int, protect: set[int]) -> list[int]:
    """Remove all but the newest ``keep`` committed steps under ``root`` (never a protected one);
    return the steps removed. Called by one rank per directory."""
    if root is None or keep <= 0:
        return []
    committed = [(s, p) for s, p in list_step_dirs(root) if commit.is_committed(p)]
    removed = []
    for step, path in committed[:-keep]:
        if step in protect:
            continue
        commit.remove(path)  # out of sight first: a reader never sees half a checkpoint
        removed.append(step)
    return removed


def retain_steps(
    root: Path | None, keep: set[int], retire: Callable[[Path], None] | None = None
) -> list[int]:
    """Remove every committed step under ``root`` that is not in ``keep``; return those
    removed. Called by one rank per directory, with the same ``keep`` on every node.
    ``retire``: how a step goes (default ``commit.remove``; a manager's level 1 recycles it,
    ``storage.slots.Slots.recycle``); either way it is out of sight in one rename first."""
    if root is None:
        return []
    removed = []
    for step, path in list_step_dirs(root):
        if step not in keep and commit.is_committed(path):
            # out of sight first: a reader never sees half a checkpoint
            (retire or commit.remove)(path)
            removed.append(step)
    return removed


# --- listing (``ckptfmt list``) ------------------------------------------------------------------


def _state_of(path: Path, node: str | None) -> tuple[str, str]:
    """(state, detail) of one step directory: complete, damaged, or flushing/partial."""
    try:
        m = read_manifest(path)
    except NotACheckpointError:
        return "not committed", "no manifest"
    except CkptError as exc:
        return "damaged", str(exc)
    missing = 0
    for t in m.tensors():
        for r in t.regions:
            if node is not None and m.ranks[r.rank].node != node:
                continue  # that node's files live in that node's directory
            for f in r.files:
                p = path / f.path
                if not p.is_file() or p.stat().st_size != f.size:
                    missing += 1
    if missing:
        return "damaged", f"{missing} file(s) missing or of the wrong size"
    return "complete", f"save {m.save_id[:8]}"


def dir_level3(shared_root: Path) -> dict[int, str]:
    """The state on level 3 of every step found in the shared directory ``shared_root``."""
    out: dict[int, str] = {}
    if shared_root.is_dir():
        for step, path in list_step_dirs(shared_root, loose=True):
            state, detail = _state_of(path, None)
            labels = {"complete": "flushed", "not committed": "not committed"}
            out[step] = labels.get(state, f"damaged: {detail}")
        for child in shared_root.iterdir():
            m = commit.LEFTOVER.match(child.name)
            if m and m["kind"] == "tmp" and STEP_NAME.match(m["name"]):
                out.setdefault(int(m["name"][5:]), "flushing")
    return out


def with_level1(shared: str, cfg: Mapping[str, Any], level3: Mapping[int, str]) -> dict[str, Any]:
    """The listing's document: level 3's states, and each recorded node's level-1 steps."""
    doc: dict[str, Any] = {"shared": shared, "nodes": {}, "steps": {}}
    levels = Levels(cfg.get("local_dir"), None)
    nodes = cfg.get("nodes", [])
    steps: dict[str, dict[str, Any]] = {}
    invisible: list[str] = []

    def entry(step: int) -> dict[str, Any]:
        return steps.setdefault(str(step), {"level3": "absent", "level1": {}})

    for step, state in level3.items():
        entry(step)["level3"] = state
    for node in nodes:
        root = levels.local_root(node)
        visible = root is not None and root.is_dir()
        doc["nodes"][node] = str(root) if visible else "not visible from here"
        if not visible:
            invisible.append(node)
            continue
        assert root is not None
        for step, path in list_step_dirs(root, loose=True):
            state, detail = _state_of(path, node)
            ok = state in ("complete", "not committed")
            entry(step)["level1"][node] = state if ok else f"damaged: {detail}"
    for e in steps.values():
        for node in nodes:
            e["level1"].setdefault(node, "not visible" if node in invisible else "absent")
    doc["steps"] = dict(sorted(steps.items(), key=lambda kv: int(kv[0])))
    return doc


__all__ = [
    "LEVELS_FILE",
    "read_record",
    "Levels",
    "SaveFailedError",
    "agree_nodes",
    "dir_level3",
    "flush_collective",
    "group_key",
    "resolve_node",
    "retain",
    "retain_steps",
    "with_level1",
]
