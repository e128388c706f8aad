"""Offline repair of a level-1 checkpoint from its redundancy, in one process, no MPI
(``ckptfmt rebuild``; ``spec/redundancy.md`` §7).

A level-1 checkpoint is spread over node-local directories, one per node: name them with a
``{node}`` template (``/local/{node}/ckpt/step-0000000100``), a mapping from node to directory,
or one directory that holds every node's files. Every member's data is read (each CRC checked) and
every parity file; what is missing or damaged is rebuilt set by set (one set in memory at a time)
and written back: damaged files are replaced one by one (temporary name, then rename), a node's
directory that is gone is recreated whole (staging directory, metadata, files, manifest last,
rename), exactly as the collective rebuild at restart does. Zarr documents missing or damaged in
a committed directory are written anew from the manifest (every node holds the same ones). Beyond
the tolerance nothing is written and :class:`UnrecoverableDamageError` names the ranks, nodes and
tensors lost.

Progress (``rebuild(progress=)``, :class:`~ckptfmt.Progress` events, ``op="rebuild"``): the check
of every member's data and parity (``phase="check"``), then, when something is to be rebuilt,
that work is added to the total (the members of each damaged set read again, what is rebuilt
written: ``phase="rebuild"``); the last event once every directory is committed.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ckptfmt.container.members import buffer_sizes, read_member
from ckptfmt.engine.copies import (
    Choice,
    plan_offline,
    write_planned,
)
from ckptfmt.engine.rebuild import (
    MemberStatus,
    clear_lost,
    lost_tensors,
    member_buffers,
    plan_all,
    prepare_recreated,
    read_status,
    write_rebuilt,
)
from ckptfmt.errors import CkptError, StorageError, UnrecoverableDamageError, level_name
from ckptfmt.format.options import WriteOptions
from ckptfmt.maintenance.nodes import NodeDirs, node_copies
from ckptfmt.manifest.model import Manifest
from ckptfmt.redundancy.engine import run_ops
from ckptfmt.redundancy.record import RedundancyRecord, member_files, member_size, record_of
from ckptfmt.redundancy.stripes import Op
from ckptfmt.storage import commit
from ckptfmt.storage.files import Inside
from ckptfmt.storage.progress import Meter, ProgressCallback, metering


@dataclass
class RepairReport:
    """What :func:`rebuild` found and did."""

    where: str
    step: int | None = None
    scheme: str | None = None
    lost_data: list[int] = field(default_factory=list)
    lost_parity: list[int] = field(default_factory=list)
    lost_nodes: list[str] = field(default_factory=list)  # the nodes of those ranks
    # metadata missing or damaged in committed directories, "<dir>: <file>": manifest copies
    # (rewritten from the taken copy, ckptfmt.engine.copies) and zarr documents (from the manifest:
    # they are the same on every node)
    metadata: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # e.g. good manifest copies that disagree
    recreated: list[str] = field(default_factory=list)  # directories made anew (dry run: to be)
    files_written: list[str] = field(default_factory=list)  # "<dir>: <file>"
    bytes_read: int = 0
    seconds: float = 0.0

    @property
    def repaired(self) -> bool:
        return bool(self.lost_data or self.lost_parity or self.metadata)


def rebuild(
    spec: NodeDirs,
    *,
    write: WriteOptions | None = None,
    dry_run: bool = False,
    progress: ProgressCallback | None = None,
) -> RepairReport:
    """Repair a level-1 checkpoint offline (module docstring). Returns the report; raises
    :class:`UnrecoverableDamageError` when the damage is beyond the redundancy (nothing is
    written then), :class:`NotACheckpointError` when no directory holds a readable manifest.
    ``write``: only its ``fsync`` applies (what is lost is written back in place, at the
    saved layout: the checkpoint's own grid, nothing overwritten that is intact). ``dry_run``:
    find what is lost, write nothing. ``progress``: called with :class:`~ckptfmt.Progress`
    events, from this thread (module docstring)."""
    fsync = (write if write is not None else WriteOptions()).fsync
    with metering("rebuild", progress) as meter:
        report = _rebuild(spec, fsync, dry_run, meter)
        meter.finish()
    return report


def _rebuild(spec: NodeDirs, fsync: bool, dry_run: bool, meter: Meter) -> RepairReport:
    started = time.perf_counter()
    choice, dirs, copies = node_copies(spec)
    manifest = choice.manifest
    shown = os.fspath(spec) if not isinstance(spec, Mapping) else "the node directories"
    report = RepairReport(shown, manifest.step, notes=list(choice.notes))
    record = record_of(manifest)
    # a directory is intact when it holds the taken copy, or a damaged copy of its manifest
    # (rewritten below from the taken one; its data files are checked like any other's)
    keep = set(choice.holders) | set(choice.to_rewrite)
    intact_dir = {d: d in keep for d in set(dirs.values())}
    dir_of = {r.rank: dirs[r.node] for r in manifest.ranks}
    _, docs = plan_offline([c for c in copies if c.directory in intact_dir])
    report.metadata = [f"{d}: {rel}" for d, rels in docs.items() for rel in rels]
    if record is None:
        _check_without_redundancy(manifest, dir_of, intact_dir, report, shown, meter)
        if not dry_run:
            _rewrite_docs(choice, docs, fsync, report)
        report.seconds = time.perf_counter() - started
        return report
    report.scheme = record.scheme
    status = _assess(manifest, record, dir_of, intact_dir, report, meter)
    report.lost_data = [r for r, s in enumerate(status) if not s.data_ok]
    report.lost_parity = [r for r, s in enumerate(status) if not all(s.parity_ok)]
    lost = set(report.lost_data) | set(report.lost_parity)
    report.lost_nodes = sorted({manifest.ranks[r].node for r in lost})
    plans = plan_all(record, status, shown, manifest)
    recreate = sorted({d for d, ok in intact_dir.items() if not ok}, key=str)
    if not report.repaired or dry_run:
        report.recreated = [str(d) for d in recreate] if report.repaired else []
        report.seconds = time.perf_counter() - started
        return report
    _write_back(
        choice, docs, record, status, plans, dir_of, intact_dir, recreate, report, fsync, meter
    )
    report.seconds = time.perf_counter() - started
    return report


def _assess(
    manifest: Manifest,
    record: RedundancyRecord,
    dir_of: dict[int, Path],
    intact_dir: dict[Path, bool],
    report: RepairReport,
    meter: Meter,
) -> list[MemberStatus]:
    """One pass over every set to learn what is lost (and fail before writing anything):
    every member's status, its bytes counted as read and checked."""
    status: list[MemberStatus] = []
    meter.expect(sum(sum(buffer_sizes(record, r)) for r in range(manifest.world_size)))
    for rank in range(manifest.world_size):
        bufs = member_buffers(record, rank, reuse=False)
        src = Inside(dir_of[rank]) if intact_dir[dir_of[rank]] else None
        status.append(read_status(src, manifest, record, rank, bufs))
        report.bytes_read += bufs.data.size + bufs.parity.size
        meter.add(bufs.data.size + bufs.parity.size, "check")
    return status


# What a rebuilt file's write meets where the checkpoint itself is damaged: a directory where a
# file belongs, a file where a directory does. Any other refusal is the storage's, not damage.
_IN_THE_WAY = frozenset({errno.EISDIR, errno.ENOTDIR, errno.ENOTEMPTY, errno.EEXIST})


def _write_back(
    choice: Choice,
    docs: dict[Path, list[str]],
    record: RedundancyRecord,
    status: list[MemberStatus],
    plans: list[tuple[int, list[Op]]],
    dir_of: dict[int, Path],
    intact_dir: dict[Path, bool],
    recreate: list[Path],
    report: RepairReport,
    fsync: bool,
    meter: Meter,
) -> None:
    """Rebuild every damaged set (one set in memory at a time) and write what was lost back:
    damaged files replaced one by one, lost directories recreated whole and committed; on any
    failure every staging directory is removed (an OS error raised as
    :class:`UnrecoverableDamageError`)."""
    manifest, data, shown = choice.manifest, choice.data, report.where
    staging = {d: commit.staging_dir(d.absolute(), manifest.save_id) for d in recreate}
    writes = {  # the bytes each rank of a damaged set writes (progress)
        rank: _rebuilt_bytes(manifest, record, rank, status[rank], dir_of[rank] in staging)
        for i, _ in plans
        for rank in record.sets[i].members
    }
    meter.expect(sum(sum(buffer_sizes(record, r)) + n for r, n in writes.items()))
    try:
        for d in recreate:
            prepare_recreated(d.absolute(), manifest, fsync)
        _rewrite_docs(choice, docs, fsync, report)
        for i, ops in plans:
            s = record.sets[i]
            local = {}
            for j, rank in enumerate(s.members):  # read again: one set in memory at a time
                bufs = member_buffers(record, rank, reuse=False)
                src = Inside(dir_of[rank]) if intact_dir[dir_of[rank]] else None
                read_status(src, manifest, record, rank, bufs)
                clear_lost(bufs, status[rank].data_ok, status[rank].parity_ok)
                local[j] = bufs
                meter.add(bufs.data.size + bufs.parity.size, "rebuild")
            run_ops(ops, s.members, s.sizes, s.chunk, local)
            for j, rank in enumerate(s.members):
                d = dir_of[rank]
                target = staging.get(d, d)
                whole = d in staging
                for f in write_rebuilt(
                    target, manifest, record, rank, local[j], status[rank], whole, fsync
                ):
                    report.files_written.append(f"{d}: {f}")
                meter.add(writes[rank], "rebuild")
        for d in recreate:
            commit.finalize(staging[d], d.absolute(), data, manifest.save_id, fsync)
            report.recreated.append(str(d))
    except BaseException as exc:
        for st in staging.values():
            commit.abort(st)
        if isinstance(exc, OSError) and not isinstance(exc, CkptError):
            if exc.errno not in _IN_THE_WAY:  # read-only, permission denied, too large, I/O
                where = exc.filename if exc.filename is not None else shown
                reason = f"cannot write the rebuilt files: {(exc.strerror or str(exc)).lower()}"
                raise StorageError(str(where), reason, level=level_name(1), err=exc.errno) from None
            # a directory where a file belongs: damage the repair cannot write over
            raise UnrecoverableDamageError(
                shown,
                f"cannot write the rebuilt files: {exc}",
                report.lost_data,
                sorted({manifest.ranks[r].node for r in report.lost_data}),
            ) from None
        raise


def _rebuilt_bytes(
    manifest: Manifest, record: RedundancyRecord, rank: int, status: MemberStatus, whole: bool
) -> int:
    """The bytes :func:`write_rebuilt` writes for ``rank``: its data files (``whole``: every
    one; else the damaged ones) when its data was lost, its parity file when any of it was."""
    n = 0
    if not status.data_ok:
        damaged = {e.path for e in status.damage}
        n += sum(f.size for _, f in member_files(manifest, rank) if whole or f.path in damaged)
    if not all(status.parity_ok):
        rset, j = record.set_of(rank)
        n += rset.parity[j].size
    return n


def _rewrite_docs(
    choice: Choice, docs: dict[Path, list[str]], fsync: bool, report: RepairReport
) -> None:
    """Write the metadata files ``docs`` anew (the taken manifest copy, the documents the
    manifest implies), each replaced atomically: the same bytes as the save wrote."""
    report.files_written += write_planned(choice, docs, fsync)


def _check_without_redundancy(
    manifest: Manifest,
    dir_of: dict[int, Path],
    intact_dir: dict[Path, bool],
    report: RepairReport,
    shown: str,
    meter: Meter,
) -> None:
    """No redundancy: the data is intact, or :class:`UnrecoverableDamageError`."""

    lost = []
    meter.expect(sum(member_size(manifest, r) for r in range(manifest.world_size)))
    for rank in range(manifest.world_size):
        d = dir_of[rank]
        buf = np.zeros(member_size(manifest, rank), np.uint8)
        if not intact_dir[d] or read_member(Inside(d), manifest, rank, buf, verify=True):
            lost.append(rank)
        meter.add(buf.size, "check")
    if lost:
        raise UnrecoverableDamageError(
            shown,
            "damaged, and the save has no redundancy to rebuild from",
            lost,
            sorted({manifest.ranks[r].node for r in lost}),
            lost_tensors(manifest, set(lost)),
        )
