"""Rebuilding lost level-1 data from the redundancy of its set, collectively, at restart
(``spec/redundancy.md`` §7).

``rebuild_collective`` (every rank calls it, with its own node's level-1 root):

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
4. a node whose step directory is gone gets a fresh staging directory (its lowest rank), with
   the zarr metadata; vote;
5. the ops run (messages between the members of each set, in one global order); each rank writes
   what it rebuilt (its data files, its parity), each file checked against the manifest's CRCs;
   vote;
6. recreated directories are committed with the same manifest; vote.

Afterwards the step loads from level 1 as if nothing had been lost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptfmt.container.reader import read_manifest_bytes
from ckptfmt.engine.copies import repair_collective
from ckptfmt.engine.rebuild import (
    MemberStatus,
    clear_lost,
    member_buffers,
    plan_all,
    prepare_recreated,
    read_status,
    write_rebuilt,
)
from ckptfmt.errors import CkptError, UnrecoverableDamageError
from ckptfmt.manifest.codec import parse_manifest
from ckptfmt.manifest.model import Manifest
from ckptfmt.parallel.collective.boundary import Boundary
from ckptfmt.parallel.collective.publish import groups_of, publish_commit
from ckptfmt.redundancy.engine import run_ops
from ckptfmt.redundancy.record import record_of
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


def rebuild_collective(
    comm: Comm, path: Path, group: str, fsync: bool = True, seq: int | None = None
) -> tuple[RebuildReport, Manifest]:
    """Collective: make the level-1 step directory ``path`` (this rank's node's copy; ``group``
    as in ``save_collective``: ranks with equal keys share it) whole again from the redundancy
    recorded in its manifest. Returns the report and the manifest.

    Raises :class:`UnrecoverableDamageError` on every rank when no node holds the step, the save
    has no redundancy, or more is lost than it tolerates; any other failure on any rank (any
    exception) is voted on and raises ``SaveFailedError`` on every rank, with the directories
    it was recreating removed. Nothing that was intact is changed."""
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
    )
    if not (report.lost_data or report.lost_parity):
        return report, manifest
    plans = plan_all(record, status, str(path), manifest)
    leaders = groups_of([i["group"] for i in info])
    recreate = not intact_dir
    report.recreated_nodes = sorted(
        {manifest.ranks[r].node for r, v in enumerate(votes) if not v["intact_dir"]}
    )
    is_leader = leaders[comm.rank] == comm.rank
    staging = commit.staging_dir(path, manifest.save_id)
    with b.guard("rebuild-stage"):
        if recreate and is_leader:
            prepare_recreated(path, manifest, fsync)
    cleanup = staging if recreate and is_leader else None
    b.vote("rebuild-stage", cleanup=cleanup)
    clear_lost(bufs, mine.data_ok, mine.parity_ok)
    rset, j = record.set_of(comm.rank)
    for i, ops in plans:
        s = record.sets[i]
        local = {j: bufs} if i == record.sets.index(rset) else {}
        report.received_bytes += run_ops(ops, s.members, s.sizes, s.chunk, local, comm)
    with b.guard("rebuild-write"):
        target = staging if recreate else path
        write_rebuilt(target, manifest, record, comm.rank, bufs, mine, recreate, fsync)
        if recreate and is_leader:
            commit.stage_manifest(staging, text.encode("utf-8"), fsync)
    b.vote("rebuild-write", cleanup=cleanup)
    draft = DirectoryDraft(path, manifest.save_id, staging)
    publish_commit(b, recreate and is_leader, draft, fsync, _no_hook)
    report.seconds = time.perf_counter() - started
    return report, manifest
