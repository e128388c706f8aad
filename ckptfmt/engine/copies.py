"""The copies of a level-1 checkpoint's metadata: which one to trust, and rewriting the others.

Every node's directory of a level-1 step holds the whole manifest and every ``zarr.json``
(``spec/PROTOCOL.md`` §2), byte for byte the same. A copy is *good* when its manifest's checksum
holds (format version 2, §10) and it parses with its redundancy record; the copy taken is the good
one that most directories hold (the lowest-ranked or first-listed one on a tie), and a note says
so when good copies disagree. A directory whose manifest copy is damaged (or good, of the same
save, but not the majority's bytes) gets the taken copy's bytes; every ``zarr.json`` of a
committed directory that is not exactly what the manifest implies (format version 2: byte for
byte; version 1: by version 1's rules) is written anew. Each file is replaced atomically
(temporary name, rename), so the result is byte-identical to what the save wrote.

:func:`choose` and :func:`rewrite_copies` serve the offline ``ckptfmt rebuild`` (one process
sees every directory); :func:`repair_collective` is the same at restore, every rank with its own
node's directory (called first by ``parallel.collective.rebuild.rebuild_collective``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ckptfmt.checksum import crc32c
from ckptfmt.container.members import replace_file
from ckptfmt.container.reader import DOC_MAX_BYTES, read_manifest_bytes
from ckptfmt.errors import CkptError, DamagedError, NotACheckpointError, UnrecoverableDamageError
from ckptfmt.format.zarr_meta import DocChecker, doc_bytes, documents
from ckptfmt.manifest.codec import MANIFEST_NAME, parse_manifest
from ckptfmt.manifest.model import Manifest
from ckptfmt.redundancy.record import record_of
from ckptfmt.storage.files import Inside
from ckptfmt.transport.comm import Comm

GOOD, DAMAGED, INVALID, ABSENT = "good", "damaged", "invalid", "absent"


@dataclass
class Copy:
    """One directory's manifest copy. ``state``: ``good`` (parses, checksum and record hold),
    ``damaged`` (its checksum fails: a damaged file), ``invalid`` (it parses as JSON but breaks
    a rule: damage where other copies are good, or a bad save), ``absent`` (no committed copy)."""

    directory: Path
    state: str
    data: bytes | None = None
    manifest: Manifest | None = None
    error: CkptError | None = None

    @property
    def digest(self) -> str | None:
        return None if self.data is None else f"{crc32c(self.data):08x}:{len(self.data)}"


def read_copy(directory: Path) -> Copy:
    """The manifest copy of ``directory`` and what state it is in (never raises CkptError)."""
    try:
        data = read_manifest_bytes(directory)
    except NotACheckpointError as exc:
        return Copy(directory, ABSENT, error=exc)
    try:
        manifest = parse_manifest(data, str(directory / MANIFEST_NAME))
        record_of(manifest)  # a record that does not parse makes the copy unusable for rebuild
    except DamagedError as exc:
        return Copy(directory, DAMAGED, data, error=exc)
    except CkptError as exc:
        return Copy(directory, INVALID, data, error=exc)
    return Copy(directory, GOOD, data, manifest)


@dataclass
class Choice:
    """The copy taken: its manifest and bytes; ``holders``: the directories holding exactly
    those bytes; ``to_rewrite``: directories with a damaged, invalid or minority copy of the
    same save (their manifest gets the taken bytes); ``others``: directories holding a good copy
    of another save (left alone); ``notes``: the disagreement, said in words."""

    manifest: Manifest
    data: bytes
    holders: list[Path]
    to_rewrite: list[Path] = field(default_factory=list)
    others: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def choose(copies: Sequence[Copy]) -> Choice:
    """The copy to trust among ``copies`` (in order of preference on a tie; module docstring).
    Raises the first copy's error when none is good (:class:`NotACheckpointError` when none is
    committed)."""
    groups: dict[str, list[Copy]] = {}
    for c in copies:
        if c.state == GOOD and c.digest is not None:
            groups.setdefault(c.digest, []).append(c)
    if not groups:
        errors = [c.error for c in copies if c.error is not None and c.state != ABSENT]
        if errors:
            raise errors[0]
        absent = [c.error for c in copies if c.error is not None]
        if absent:
            raise absent[0]
        raise NotACheckpointError("", "no directory given")
    ranked = sorted(groups.values(), key=lambda g: -len(g))  # stable: first listed wins a tie
    taken = ranked[0]
    manifest, data = taken[0].manifest, taken[0].data
    assert manifest is not None and data is not None
    choice = Choice(manifest, data, [c.directory for c in taken])
    if len(ranked) > 1:
        shown = "; ".join(
            f"{', '.join(str(c.directory) for c in g)} hold save {g[0].manifest.save_id} "
            f"(manifest {g[0].digest})"
            for g in ranked
            if g[0].manifest is not None
        )
        why = "the majority" if len(ranked[0]) > len(ranked[1]) else "a tie: the first listed"
        choice.notes.append(
            f"the good manifest copies disagree ({shown}); took {taken[0].digest} ({why})"
        )
    for c in copies:
        if c.state in (DAMAGED, INVALID):
            choice.to_rewrite.append(c.directory)
        elif c.state == GOOD and c.digest != taken[0].digest:
            if c.manifest is not None and c.manifest.save_id == manifest.save_id:
                choice.to_rewrite.append(c.directory)
            else:
                choice.others.append(c.directory)
    return choice


def damaged_docs(directory: Path, manifest: Manifest) -> list[str]:
    """The ``zarr.json`` documents of ``directory`` to write anew: missing, unreadable, or not
    what ``manifest`` implies (format version 2 on: not byte for byte what the writer writes, so
    a rebuild leaves every file identical to the original; version 1: by version 1's rules)."""
    src = Inside(directory)
    checker = DocChecker(manifest)
    out = []
    for rel in checker.paths:
        try:
            data = src.read(rel, DOC_MAX_BYTES + 1)
            if checker.strict:
                if data != checker.expected_bytes(rel):
                    out.append(rel)
            else:
                checker.check_bytes(rel, data)
        except (CkptError, OSError):
            out.append(rel)
    return out


def rewrite_file(root: Path, rel: str, data: bytes, fsync: bool) -> None:
    """Replace whatever is at ``root / rel`` (a damaged file, a FIFO, a link) by ``data``,
    atomically, never through a link that leads out of the directory ``root``."""
    path = root / rel
    if path.is_dir() and not path.is_symlink():
        raise UnrecoverableDamageError(str(path), "a directory where a metadata document belongs")
    replace_file(path, np.frombuffer(data, np.uint8), fsync, root)


def rewrite_copies(
    choice: Choice, committed: Sequence[Path], fsync: bool = True
) -> list[tuple[Path, str]]:
    """Write the taken manifest into every directory of ``choice.to_rewrite`` and every
    damaged ``zarr.json`` of each directory of ``committed`` (those holding a copy of the save,
    good or just repaired); returns each file written as (directory, relative path)."""
    written: list[tuple[Path, str]] = []
    for d in choice.to_rewrite:
        rewrite_file(d, MANIFEST_NAME, choice.data, fsync)
        written.append((d, MANIFEST_NAME))
    docs = documents(choice.manifest)
    for d in committed:
        for rel in damaged_docs(d, choice.manifest):
            rewrite_file(d, rel, doc_bytes(docs[rel]), fsync)
            written.append((d, rel))
    return written


def plan_offline(copies: Sequence[Copy]) -> tuple[Choice, dict[Path, list[str]]]:
    """What the offline rebuild rewrites: the choice and, per directory that holds (or will
    hold) the save's manifest, the files to write (manifest first, then documents)."""
    choice = choose(copies)
    todo: dict[Path, list[str]] = {}
    for d in choice.to_rewrite:
        todo.setdefault(d, []).append(MANIFEST_NAME)
    for c in copies:
        if c.directory in choice.holders or c.directory in choice.to_rewrite:
            docs = damaged_docs(c.directory, choice.manifest)
            if docs:
                todo.setdefault(c.directory, []).extend(docs)
    return choice, todo


def write_planned(
    choice: Choice, todo: Mapping[Path, Sequence[str]], fsync: bool = True
) -> list[str]:
    """Write what :func:`plan_offline` found; returns ``"<dir>: <file>"`` for each."""
    docs = documents(choice.manifest)
    out = []
    for d, rels in todo.items():
        for rel in rels:
            blob = choice.data if rel == MANIFEST_NAME else doc_bytes(docs[rel])
            rewrite_file(d, rel, blob, fsync)
            out.append(f"{d}: {rel}")
    return out


def repair_collective(
    comm: Comm, path: Path, group: str, fsync: bool = True
) -> tuple[list[str], list[str], bytes | None]:
    """Collective (every rank, its own node's level-1 step directory ``path``; ``group`` as in
    ``save_collective``): make every node's manifest copy and ``zarr.json`` documents whole from
    the copy most nodes hold whose checksum holds. The lowest rank of each group writes its
    directory. Returns (the files rewritten, as ``"<node dir>: <file>"``, the same on every
    rank; notes on disagreeing copies; the manifest bytes taken, the same on every rank, or
    None on every rank when no node holds a good copy). Directories without a committed copy,
    or holding another save, are left to the data rebuild. Raises
    :class:`UnrecoverableDamageError` on every rank when a rewrite failed on some rank (any
    exception)."""
    path = path.absolute()
    mine = read_copy(path)
    info = comm.allgather_json(
        {
            "group": group,
            "state": mine.state,
            "digest": mine.digest if mine.state == GOOD else None,
            "save_id": mine.manifest.save_id if mine.manifest is not None else None,
        }
    )
    leader: dict[str, int] = {}
    for r, i in enumerate(info):
        leader.setdefault(i["group"], r)
    votes: dict[str, list[int]] = {}
    for r in leader.values():
        if info[r]["state"] == GOOD:
            votes.setdefault(info[r]["digest"], []).append(r)
    if not votes:
        return [], [], None  # nothing good anywhere: the rebuild says so
    ranked = sorted(votes.values(), key=lambda rs: (-len(rs), rs[0]))
    holder = ranked[0][0]
    notes = []
    if len(ranked) > 1:
        shown = "; ".join(
            f"ranks {', '.join(map(str, rs))} hold save {info[rs[0]]['save_id']} "
            f"(manifest {info[rs[0]]['digest']})"
            for rs in ranked
        )
        why = "the majority" if len(ranked[0]) > len(ranked[1]) else "a tie: the lowest rank"
        notes.append(f"the good manifest copies disagree ({shown}); took rank {holder}'s ({why})")
    if len(ranked) == 1 and len(ranked[0]) == len(leader):
        data = mine.data or b""  # every directory holds the taken copy: nothing to send
    else:
        text = comm.bcast_json(
            mine.data.decode("utf-8") if comm.rank == holder and mine.data else None, holder
        )
        data = text.encode("utf-8")
    written: list[str] = []
    error: str | None = None
    if leader[group] == comm.rank:
        try:
            manifest = parse_manifest(data, f"rank {holder}'s {MANIFEST_NAME}")
            same_save = info[comm.rank]["save_id"] == manifest.save_id
            rewrite = mine.state in (DAMAGED, INVALID) or (
                mine.state == GOOD and mine.digest != info[holder]["digest"] and same_save
            )
            if rewrite:
                rewrite_file(path, MANIFEST_NAME, data, fsync)
                written.append(f"{path}: {MANIFEST_NAME}")
            if rewrite or (mine.state == GOOD and mine.digest == info[holder]["digest"]):
                docs = documents(manifest)
                for rel in damaged_docs(path, manifest):
                    rewrite_file(path, rel, doc_bytes(docs[rel]), fsync)
                    written.append(f"{path}: {rel}")
        except Exception as exc:  # any failure is voted on below, never a rank leaving
            error = f"{type(exc).__name__}: {exc}"
    results = comm.allgather_json({"written": written, "error": error})
    failed = {r: x["error"] for r, x in enumerate(results) if x["error"]}
    if failed:
        shown = "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items()))
        raise UnrecoverableDamageError(str(path), f"cannot rewrite damaged metadata: {shown}")
    return [w for x in results for w in x["written"]], notes, data


def copies_of(dirs: Mapping[Any, Path] | Sequence[Path]) -> list[Copy]:
    """:func:`read_copy` of each distinct directory, in order."""
    seen: list[Path] = []
    for d in dirs.values() if isinstance(dirs, Mapping) else dirs:
        if d not in seen:
            seen.append(d)
    return [read_copy(d) for d in seen]
