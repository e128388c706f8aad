"""Rebuilding lost level-1 data from the redundancy of its set, collectively, at restart
(``spec/redundancy.md`` §7).

``rebuild_collective`` (every rank calls it, with its own node's level-1 root) is
``rebuild_in_memory`` (steps 0 to 4) then ``write_rebuilt_collective`` (steps 5 to 7); a restore
calls the first, loads the step from the members' buffers (``Rebuilt.files``) and has the
manager's saver thread call the second after it returned:

0. ``ckptfmt.engine.copies.repair_collective``: a node's damaged copy of the manifest or of a
   ``zarr.json`` is written anew from the good copy (checksum holds) most nodes hold;
1. each rank reads the step's manifest from its node, if committed; ``allgather`` of the save ids;
   the lowest rank holding one broadcasts its manifest (ranks whose copy is another save count
   as lost);
2. each rank reads its member data (every CRC checked) and its parity file; ``allgather`` of what
   is intact;
3. every rank plans the same rebuild (``redundancy/stripes.plan_rebuild``); if a set lost more
   than its scheme tolerates, every rank raises :class:`UnrecoverableDamageError` naming the
   ranks, nodes and tensors lost;
4. the ops that rebuild lost data run (messages between the members of each set, in one global
   order): every rank's member buffer holds its data whole;
5. the ops that recompute lost parity from the whole data run; a node whose step directory is
   gone gets a fresh staging directory (its lowest rank), with the zarr metadata; vote;
6. each rank writes what it rebuilt (its data files, its parity), each file checked against the
   manifest's CRCs; vote;
7. recreated directories are committed with the same manifest; vote.

Afterwards the step loads from level 1 as if nothing had been lost. Until step 7, a recreated
directory is a staging directory (removed as a leftover, never loaded) and a damaged file is
replaced by a rename or not at all: a rebuild cut short leaves the step as rebuildable as before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptfmt.container.reader import read_manifest_bytes
from ckptfmt.engine.copies import repair_collective
from ckptfmt.engine.member_files import MemberFiles
from ckptfmt.engine.rebuild import (
    MemberStatus,
    clear_lost,
    member_buffers,
    plan_all,
    prepare_recreated,
    read_status,
    split_parity,
    write_rebuilt,
)
from ckptfmt.errors import CkptError, UnrecoverableDamageError
from ckptfmt.manifest.codec import parse_manifest
from ckptfmt.manifest.model import Manifest
from ckptfmt.parallel.collective.boundary import Boundary
from ckptfmt.parallel.collective.publish import FaultHook, groups_of, publish_commit
from ckptfmt.redundancy.engine import MemberBuffers, run_ops
from ckptfmt.redundancy.record import RedundancyRecord, record_of
from ckptfmt.redundancy.stripes import Op
from ckptfmt.storage import commit
from ckptfmt.storage.files import Inside
from ckptfmt.storage.store.directory import DirectoryDraft
from ckptfmt.transport.comm import Comm


@dataclass
class RebuildReport:
    """What a rebuild found and did (the same on every rank, except ``received_bytes``)."""

    lost_data: list[int] = field(default_factory=list)  # ranks whose data was rebuilt
    lost_parity: list[int] = field(default_factory=list)  # ranks whose parity was rebuilt
    recreated_nodes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    received_bytes: int = 0
    metadata: list[str] = field(default_factory=list)  # manifest/zarr.json copies rewritten
    notes: list[str] = field(default_factory=list)  # e.g. good manifest copies that disagree

    @property
    def repaired(self) -> bool:
        return bool(self.lost_data or self.lost_parity or self.metadata)

    def describe(self) -> str:
        if not self.repaired:
            return "nothing lost"
        parts = []
        if self.lost_data:
            parts.append(f"data of rank(s) {', '.join(map(str, self.lost_data))}")
        if self.lost_parity:
            parts.append(f"parity of rank(s) {', '.join(map(str, self.lost_parity))}")
        if self.metadata:
            parts.append(f"metadata {', '.join(self.metadata)}")
        nodes = (
            f"; recreated node(s) {', '.join(self.recreated_nodes)}" if self.recreated_nodes else ""
        )
        notes = "".join(f"; {n}" for n in self.notes)
        return f"rebuilt {' and '.join(parts)}{nodes} in {self.seconds:.2f} s{notes}"


def _no_hook(_point: str) -> None:
    pass


def _agree_manifest(
    comm: Comm, path: Path, group: str, agreed: bytes | None
) -> tuple[list[dict[str, Any]], str | None, str]:
    """Collective (step 1; every rank, after the metadata repair): an allgather of each rank's
    save id and group, then, unless the repair already agreed on the manifest, a broadcast of
    the lowest holder's copy. Returns every rank's entry, this rank's save id (None: no
    committed copy here) and the manifest's text. Raises :class:`UnrecoverableDamageError` on
    every rank when no node holds a committed copy."""
    data: bytes | None = None
    save_id: str | None = None
    try:
        data = read_manifest_bytes(path)
        save_id = parse_manifest(data, str(path)).save_id
    except CkptError:
        data = None
    info = comm.allgather_json({"save_id": save_id, "group": group})
    holders = [r for r, i in enumerate(info) if i["save_id"]]
    if not holders:
        raise UnrecoverableDamageError(str(path), "no node holds a committed copy of this step")
    if agreed is not None:  # the repair already agreed on the manifest: no second broadcast
        text = agreed.decode("utf-8")
    else:
        mine_text = data.decode("utf-8") if comm.rank == holders[0] and data else None
        text = comm.bcast_json(mine_text, holders[0])
    return info, save_id, text


@dataclass
class Rebuilt:
    """A level-1 step made whole in memory by :func:`rebuild_in_memory` (one rank's part): what
    :func:`files` lets a load read and :func:`write_rebuilt_collective` writes. The same on every
    rank but the buffers, ``mine`` and ``path`` (each rank's own node's copy). The buffers are
    the calling thread's reused scratch (``redundancy.engine.scratch``): they hold the step until
    that thread rebuilds or encodes again (the manager's next restore waits for the write
    first; every file written is checked against the manifest's CRCs, so a buffer reused too
    early fails the write, never stores other bytes)."""

    path: Path
    manifest: Manifest
    text: bytes  # the manifest every rank agreed on
    record: RedundancyRecord
    bufs: MemberBuffers  # this rank's member data and parity, intact or rebuilt
    mine: MemberStatus  # what this rank's read found (its damaged files)
    intact_dirs: list[bool]  # by rank: whether its node's directory holds this save
    groups: list[str]  # by rank: the group key (ranks with equal keys share a directory)
    report: RebuildReport
    # by set: the ops that recompute lost parity from the whole data, left to the write
    parity_ops: list[tuple[int, list[Op]]] = field(default_factory=list)

    @property
    def written(self) -> bool:
        """Whether files are to be written (data or parity was lost somewhere)."""
        return bool(self.report.lost_data or self.report.lost_parity)

    def files(self, rank: int) -> MemberFiles:
        """What a collective load reads on this rank (``rank``: this rank's own, whose member
        buffer this is): its member data from memory (see ``engine.member_files``), the rest
        from its node's directory when intact."""
        disk = Inside(self.path) if self.intact_dirs[rank] else None
        # a survivor's member data was read with every CRC checked (``read_status``); a
        # rebuilt one's is checked by ``MemberFiles.verify``, or else by the load's reads
        checked = self.mine.data_ok
        return MemberFiles(self.path, disk, self.manifest, self.text, rank, self.bufs.data, checked)


def rebuild_collective(
    comm: Comm, path: Path, group: str, fsync: bool = True, seq: int | None = None
) -> tuple[RebuildReport, Manifest]:
    """Collective: make the level-1 step directory ``path`` (this rank's node's copy; ``group``
    as in ``save_collective``: ranks with equal keys share it) whole again from the redundancy
    recorded in its manifest: :func:`rebuild_in_memory`, then, when something was lost,
    :func:`write_rebuilt_collective`. Returns the report and the manifest.

    Raises :class:`UnrecoverableDamageError` on every rank when no node holds the step, the save
    has no redundancy, or more is lost than it tolerates; any other failure on any rank (any
    exception) is voted on and raises ``SaveFailedError`` on every rank, with the directories
    it was recreating removed. Nothing that was intact is changed."""
    started = time.perf_counter()
    rebuilt = rebuild_in_memory(comm, path, group, fsync, seq)
    if rebuilt.written:
        write_rebuilt_collective(comm, rebuilt, fsync, seq)
    rebuilt.report.seconds = time.perf_counter() - started
    return rebuilt.report, rebuilt.manifest


def rebuild_in_memory(
    comm: Comm, path: Path, group: str, fsync: bool = True, seq: int | None = None
) -> Rebuilt:
    """Collective (steps 0 to 3 and the ops of step 5 in the module's docstring): repair the
    metadata copies, agree on the manifest, read and check every rank's member, vote, plan,
    and run the ops, so that every rank's member buffers hold its data and parity whole. Nothing
    of the data or parity is written (:func:`write_rebuilt_collective` does, later). Raises as
    :func:`rebuild_collective`."""
    started = time.perf_counter()
    path = path.absolute()
    rewritten, notes, agreed = repair_collective(comm, path, group, fsync)  # metadata first
    info, save_id, text = _agree_manifest(comm, path, group, agreed)
    manifest = parse_manifest(text.encode("utf-8"), str(path))
    record = record_of(manifest)
    if record is None:
        raise UnrecoverableDamageError(str(path), "the save has no redundancy to rebuild from")
    if manifest.world_size != comm.size:
        raise UnrecoverableDamageError(
            str(path),
            f"saved by {manifest.world_size} ranks, rebuilding with {comm.size} is not supported",
        )
    intact_dir = save_id == manifest.save_id
    b = Boundary(comm, "rebuild", manifest.step, seq=seq)
    mine = MemberStatus(False, [])
    with b.guard("rebuild-assess"):
        bufs = member_buffers(record, comm.rank, reuse=True)
        mine = read_status(Inside(path) if intact_dir else None, manifest, record, comm.rank, bufs)
    votes = b.vote("rebuild-assess", {**mine.to_json(), "intact_dir": intact_dir})
    status = [MemberStatus.from_json(v) for v in votes]
    report = RebuildReport(
        lost_data=[r for r, s in enumerate(status) if not s.data_ok],
        lost_parity=[r for r, s in enumerate(status) if not all(s.parity_ok)],
        metadata=rewritten,
        notes=notes,
        recreated_nodes=sorted(
            {manifest.ranks[r].node for r, v in enumerate(votes) if not v["intact_dir"]}
        ),
    )
    rebuilt = Rebuilt(
        path,
        manifest,
        text.encode("utf-8"),
        record,
        bufs,
        mine,
        [bool(v["intact_dir"]) for v in votes],
        [i["group"] for i in info],
        report,
    )
    if not rebuilt.written:
        report.recreated_nodes = []
        report.seconds = time.perf_counter() - started
        return rebuilt
    data_ops, rebuilt.parity_ops = split_parity(
        record, plan_all(record, status, str(path), manifest), status
    )
    clear_lost(bufs, mine.data_ok, mine.parity_ok)
    report.received_bytes += _run(comm, rebuilt, data_ops)
    report.seconds = time.perf_counter() - started
    return rebuilt


def _run(comm: Comm, rebuilt: Rebuilt, plans: list[tuple[int, list[Op]]]) -> int:
    """Collective (every rank, the same ``plans`` in the same order): run the ops of every
    set on this rank's member buffers; the bytes received."""
    record = rebuilt.record
    rset, j = record.set_of(comm.rank)
    received = 0
    for i, ops in plans:
        s = record.sets[i]
        local = {j: rebuilt.bufs} if i == record.sets.index(rset) else {}
        received += run_ops(ops, s.members, s.sizes, s.chunk, local, comm)
    return received


def write_rebuilt_collective(
    comm: Comm, rebuilt: Rebuilt, fsync: bool, seq: int | None = None, hook: FaultHook = _no_hook
) -> None:
    """Collective (steps 4 to 6 in the module's docstring, every rank after the same
    :func:`rebuild_in_memory`, on any communicator of the same ranks: the manager's saver
    thread writes them after the restore returned): the ops that recompute lost parity from the
    whole data (``Rebuilt.parity_ops``: the restore needed the data only); a node whose step
    directory is gone gets a
    staging directory with the zarr metadata (its lowest rank); vote; each rank writes what was
    rebuilt of its member (data files, each checked against the manifest's CRCs, and parity);
    vote; the recreated directories are committed; vote. A failure anywhere raises
    ``SaveFailedError`` on every rank with the staging directories removed: a recreated
    directory is committed whole or not at all, and a damaged file in an intact directory is
    replaced atomically or left as it was, so the step stays rebuildable from the same
    redundancy. ``hook`` (a test's fault hook) is called at ``"rebuild-writing"`` between the
    data files and the rest, and at the commit's points (prefixed ``"rebuild-"``)."""
    manifest, path = rebuilt.manifest, rebuilt.path
    rebuilt.report.received_bytes += _run(comm, rebuilt, rebuilt.parity_ops)
    rebuilt.parity_ops = []  # run once: the parity is whole now
    leaders = groups_of(rebuilt.groups)
    recreate = not rebuilt.intact_dirs[comm.rank]
    is_leader = leaders[comm.rank] == comm.rank
    staging = commit.staging_dir(path, manifest.save_id)
    b = Boundary(comm, "rebuild-write", manifest.step, seq=seq)
    with b.guard("rebuild-stage"):
        if recreate and is_leader:
            prepare_recreated(path, manifest, fsync)
    cleanup = staging if recreate and is_leader else None
    b.vote("rebuild-stage", cleanup=cleanup)
    with b.guard("rebuild-write"):
        target = staging if recreate else path
        mine, bufs = rebuilt.mine, rebuilt.bufs
        data_only = MemberStatus(mine.data_ok, [True] * len(mine.parity_ok), mine.damage)
        write_rebuilt(target, manifest, rebuilt.record, comm.rank, bufs, data_only, recreate, fsync)
        hook("rebuild-writing")
        parity_only = MemberStatus(True, mine.parity_ok, [])
        write_rebuilt(
            target, manifest, rebuilt.record, comm.rank, bufs, parity_only, recreate, fsync
        )
        if recreate and is_leader:
            commit.stage_manifest(staging, rebuilt.text, fsync)
    b.vote("rebuild-write", cleanup=cleanup)
    draft = DirectoryDraft(path, manifest.save_id, staging)
    publish_commit(b, recreate and is_leader, draft, fsync, lambda point: hook(f"rebuild-{point}"))
