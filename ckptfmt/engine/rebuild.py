"""The rebuild engine: the steps that make a level-1 step whole again from its redundancy,
shared by the collective restore (``ckptfmt.parallel.collective.rebuild``: one member per rank, the
data moving over a ``Comm``) and the offline repair (``ckptfmt.maintenance.repair``: every member in
one process, no transport). Each driver decides how the members' statuses meet (a vote, a loop);
what a member's buffers hold, how the plan is made from the statuses, what is zeroed before the
ops run and what is written afterwards is decided here, once (``spec/redundancy.md`` §7).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ckptfmt.container.members import assess_member, buffer_sizes, write_member, write_parity
from ckptfmt.container.metadata import write_metadata
from ckptfmt.errors import DamagedError, UnrecoverableDamageError, UnrecoverableError
from ckptfmt.manifest.limits import display
from ckptfmt.manifest.model import Manifest
from ckptfmt.redundancy.engine import MemberBuffers, scratch
from ckptfmt.redundancy.record import RedundancyRecord
from ckptfmt.redundancy.stripes import Op
from ckptfmt.storage import commit
from ckptfmt.storage.files import Inside

__all__ = [
    "MemberStatus",
    "clear_lost",
    "lost_tensors",
    "member_buffers",
    "plan_all",
    "prepare_recreated",
    "read_status",
    "split_parity",
    "write_rebuilt",
]


@dataclass
class MemberStatus:
    """What one member's read found: whether its data is intact, which chunks of its parity
    file are, and (on the rank that read it) the damaged data files."""

    data_ok: bool
    parity_ok: list[bool]
    damage: list[DamagedError] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """What a rank votes with (the damage stays on the rank that read it: only it writes)."""
        return {"data_ok": self.data_ok, "parity_ok": list(self.parity_ok)}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> MemberStatus:
        return cls(bool(doc["data_ok"]), [bool(x) for x in doc["parity_ok"]])


def member_buffers(record: RedundancyRecord, rank: int, reuse: bool) -> MemberBuffers:
    """``rank``'s data and parity buffers (sizes from the scheme's geometry). ``reuse``: this
    thread's scratch buffers (the collective restore: one member per rank, again and again);
    otherwise fresh ones (offline: several members in memory at once)."""
    n_data, n_parity = buffer_sizes(record, rank)
    if reuse:
        return MemberBuffers(scratch(n_data, "data"), scratch(n_parity, "parity"))
    return MemberBuffers(np.zeros(n_data, np.uint8), np.zeros(n_parity, np.uint8))


def read_status(
    src: Inside | None, manifest: Manifest, record: RedundancyRecord, rank: int, bufs: MemberBuffers
) -> MemberStatus:
    """Read ``rank``'s member data and parity from ``src`` (None: its directory is gone) into
    ``bufs``, every CRC checked; what is intact."""
    damage, parity_ok = assess_member(src, manifest, record, rank, bufs.data, bufs.parity)
    return MemberStatus(not damage, parity_ok, damage)


def clear_lost(bufs: MemberBuffers, data_ok: bool, parity_ok: Sequence[bool]) -> None:
    """Zero what was lost before the ops run: the ops XOR into it (``redundancy.engine``)."""
    if not data_ok:
        bufs.data[:] = 0
    step = len(bufs.parity) // max(len(parity_ok), 1)
    for p, ok in enumerate(parity_ok):
        if not ok:
            bufs.parity[p * step : (p + 1) * step] = 0


def write_rebuilt(
    target: Path,
    manifest: Manifest,
    record: RedundancyRecord,
    rank: int,
    bufs: MemberBuffers,
    status: MemberStatus,
    whole: bool,
    fsync: bool,
) -> list[str]:
    """Write what was rebuilt of ``rank``'s member into ``target``: its data files (``whole``:
    every one, into a recreated directory; else only the damaged ones, each replaced
    atomically) and its parity file; each data file is checked against the manifest's CRCs.
    Returns the files written, relative to ``target``."""
    written: list[str] = []
    if not status.data_ok:
        only = None if whole else [e.path for e in status.damage]
        written += write_member(target, manifest, rank, bufs.data, only, fsync)
    if not all(status.parity_ok):
        rset, j = record.set_of(rank)
        write_parity(target, rset.parity[j], bufs.parity, fsync)
        written.append(rset.parity[j].path)
    return written


def prepare_recreated(final: Path, manifest: Manifest, fsync: bool) -> Path:
    """Start recreating the step directory ``final`` of a node that lost it: a torn directory of
    this step is removed (nothing in it is vouched for), a staging directory made with the
    zarr documents. Returns the staging directory; the caller commits it with the manifest."""
    if final.exists() and not commit.is_committed(final):
        commit.remove(final)
    commit.prepare(final, manifest.save_id, overwrite=True)
    staging = commit.staging_dir(final, manifest.save_id)
    write_metadata(staging, manifest, fsync)
    return staging


def lost_tensors(manifest: Manifest, ranks: set[int]) -> list[str]:
    """Tensors with data written by any of ``ranks``."""
    return sorted(
        {display(t.name) for t in manifest.tensors() for r in t.regions if r.rank in ranks}
    )


def plan_all(
    record: RedundancyRecord, status: Sequence[MemberStatus], where: str, manifest: Manifest
) -> list[tuple[int, list[Op]]]:
    """The ops of every set (by set index) from every rank's status; raises
    :class:`UnrecoverableDamageError` when a set cannot be rebuilt."""
    plans = []
    unrecoverable: list[str] = []
    lost_ranks: set[int] = set()
    for i, s in enumerate(record.sets):
        data_lost = [j for j, r in enumerate(s.members) if not status[r].data_ok]
        parity_lost = [
            (j, p)
            for j, r in enumerate(s.members)
            for p, ok in enumerate(status[r].parity_ok)
            if not ok
        ]
        if not data_lost and not parity_lost:
            continue
        try:
            plans.append((i, record.code.rebuild_plan(s.n, data_lost, parity_lost)))
        except UnrecoverableError as exc:
            ranks = [s.members[j] for j in data_lost]
            lost_ranks.update(ranks)
            parity_ranks = sorted({s.members[j] for j, _ in parity_lost})
            unrecoverable.append(
                f"set {i} (ranks {list(s.members)}): data of ranks {ranks} and parity of ranks "
                f"{parity_ranks} lost, {record.scheme} tolerates {exc.tolerates} per stripe"
            )
    if unrecoverable:
        nodes = sorted({manifest.ranks[r].node for r in lost_ranks})
        raise UnrecoverableDamageError(
            where,
            "beyond what its redundancy rebuilds: " + "; ".join(unrecoverable),
            sorted(lost_ranks),
            nodes,
            lost_tensors(manifest, lost_ranks),
        )
    return plans


def split_parity(
    record: RedundancyRecord, plans: list[tuple[int, list[Op]]], status: Sequence[MemberStatus]
) -> tuple[list[tuple[int, list[Op]]], list[tuple[int, list[Op]]]]:
    """``plans`` (:func:`plan_all`'s) in two parts: the ops that rebuild lost data, and the ops
    that then recompute lost parity from the whole data (every scheme's plan ends with those,
    the same as a plan of the parity alone). A restore runs the first part, loads the data, and
    leaves the second to the write of the rebuilt files. A plan that does not end so is kept
    whole in the first part."""
    data: list[tuple[int, list[Op]]] = []
    parity: list[tuple[int, list[Op]]] = []
    for i, ops in plans:
        s = record.sets[i]
        lost = [
            (j, p)
            for j, r in enumerate(s.members)
            for p, ok in enumerate(status[r].parity_ok)
            if not ok
        ]
        tail = record.code.rebuild_plan(s.n, (), lost) if lost else []
        head = ops[: len(ops) - len(tail)]
        if not tail or ops[len(head) :] != tail:
            head, tail = ops, []
        if head:
            data.append((i, head))
        if tail:
            parity.append((i, tail))
    return data, parity
