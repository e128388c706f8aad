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
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ckptfmt.copies import Choice, Copy, choose, copies_of, plan_offline, read_copy, write_planned
from ckptfmt.errors import CkptError, NotACheckpointError, UnrecoverableDamageError, UsageError
from ckptfmt.manifest.model import Manifest
from ckptfmt.parallel.protocol import write_metadata
from ckptfmt.parallel.rebuild import plan_all
from ckptfmt.redundancy.config import Redundancy
from ckptfmt.redundancy.engine import MemberBuffers, run_ops
from ckptfmt.redundancy.record import RedundancyRecord, record_of
from ckptfmt.storage import commit
from ckptfmt.storage.files import Inside
from ckptfmt.storage.members import assess_member, buffer_sizes, write_member, write_parity

NodeDirs = str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]]


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
    # (rewritten from the taken copy, ckptfmt.copies) and zarr documents (from the manifest:
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


def node_dirs(spec: NodeDirs) -> tuple[Manifest, bytes, dict[str, Path]]:
    """The manifest (and its bytes) of a level-1 checkpoint and each node's directory.

    ``spec``: a ``{node}`` template, a mapping node -> directory, or one directory for all. The
    manifest is the good copy most directories hold (``ckptfmt.copies``)."""
    choice, dirs, _ = node_copies(spec)
    return choice.manifest, choice.data, dirs


def node_copies(spec: NodeDirs) -> tuple[Choice, dict[str, Path], list[Copy]]:
    """:func:`node_dirs` with the choice among the copies and every directory's copy."""
    if isinstance(spec, Mapping):
        given = {str(k): Path(v) for k, v in spec.items()}
        candidates = list(given.values())
    else:
        text = os.fspath(spec)
        if "{node}" in text:
            pattern = glob.escape(text).replace(glob.escape("{node}"), "*")
            candidates = [Path(p) for p in sorted(glob.glob(pattern))]
        else:
            candidates = [Path(text)]
        given = {}
    copies = copies_of(candidates)
    try:
        choice = choose(copies)
    except NotACheckpointError as exc:
        shown = (
            os.fspath(spec) if not isinstance(spec, Mapping) else ", ".join(map(str, candidates))
        )
        errors = [str(c.error) for c in copies if c.error is not None]
        raise NotACheckpointError(
            shown, "no committed copy found" + (f" ({'; '.join(errors[:3])})" if errors else "")
        ) from exc
    manifest = choice.manifest
    nodes = sorted({r.node for r in manifest.ranks})
    if isinstance(spec, Mapping):
        missing = [n for n in nodes if n not in given]
        if missing:
            raise UsageError(f"no directory given for node(s) {', '.join(missing)}")
        return choice, {n: given[n] for n in nodes}, copies
    text = os.fspath(spec)
    if "{node}" in text:
        dirs = {n: Path(text.replace("{node}", n)) for n in nodes}
        known = {c.directory for c in copies}
        copies += [read_copy(d) for d in dirs.values() if d not in known]
        return choice, dirs, copies
    return choice, {n: Path(text) for n in nodes}, copies


def rebuild(spec: NodeDirs, fsync: bool = True, dry_run: bool = False) -> RepairReport:
    """Repair a level-1 checkpoint offline (module docstring). Returns the report; raises
    :class:`UnrecoverableDamageError` when the damage is beyond the redundancy (nothing is
    written then), :class:`NotACheckpointError` when no directory holds a readable manifest."""
    started = time.perf_counter()
    choice, dirs, copies = node_copies(spec)
    manifest, data = choice.manifest, choice.data
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
        _check_without_redundancy(manifest, dir_of, intact_dir, report, shown)
        if not dry_run:
            _rewrite_docs(choice, docs, fsync, report)
        report.seconds = time.perf_counter() - started
        return report
    report.scheme = record.scheme
    # one pass over every set to learn what is lost (and fail before writing anything)
    status: list[dict[str, Any]] = []
    for rank in range(manifest.world_size):
        bufs = _buffers(record, rank)
        src = Inside(dir_of[rank]) if intact_dir[dir_of[rank]] else None
        damage, parity_ok = assess_member(src, manifest, record, rank, bufs.data, bufs.parity)
        report.bytes_read += bufs.data.size + bufs.parity.size
        status.append({"data_ok": not damage, "parity_ok": parity_ok, "damage": damage})
    report.lost_data = [r for r, s in enumerate(status) if not s["data_ok"]]
    report.lost_parity = [r for r, s in enumerate(status) if not all(s["parity_ok"])]
    lost = set(report.lost_data) | set(report.lost_parity)
    report.lost_nodes = sorted({manifest.ranks[r].node for r in lost})
    plans = plan_all(record, status, shown, manifest)
    recreate = sorted({d for d, ok in intact_dir.items() if not ok}, key=str)
    if not report.repaired or dry_run:
        report.recreated = [str(d) for d in recreate] if report.repaired else []
        report.seconds = time.perf_counter() - started
        return report
    staging = {d: commit.staging_dir(d.absolute(), manifest.save_id) for d in recreate}
    try:
        for d in recreate:
            final = d.absolute()
            if final.exists() and not commit.is_committed(final):
                commit.remove(final)
            commit.prepare(final, manifest.save_id, overwrite=True)
            write_metadata(staging[d], manifest, fsync)
        _rewrite_docs(choice, docs, fsync, report)
        for i, ops in plans:
            s = record.sets[i]
            local = {}
            for j, rank in enumerate(s.members):  # read again: one set in memory at a time
                bufs = _buffers(record, rank)
                src = Inside(dir_of[rank]) if intact_dir[dir_of[rank]] else None
                assess_member(src, manifest, record, rank, bufs.data, bufs.parity)
                if not status[rank]["data_ok"]:
                    bufs.data[:] = 0
                step = bufs.parity.size // max(len(status[rank]["parity_ok"]), 1)
                for p, ok in enumerate(status[rank]["parity_ok"]):
                    if not ok:
                        bufs.parity[p * step : (p + 1) * step] = 0
                local[j] = bufs
            run_ops(ops, s.members, s.sizes, s.chunk, local)
            for j, rank in enumerate(s.members):
                d = dir_of[rank]
                target = staging.get(d, d)
                if not status[rank]["data_ok"]:
                    only = None if d in staging else [e.file for e in status[rank]["damage"]]
                    for f in write_member(target, manifest, rank, local[j].data, only, fsync):
                        report.files_written.append(f"{d}: {f}")
                if not all(status[rank]["parity_ok"]):
                    write_parity(target, s.parity[j], local[j].parity, fsync)
                    report.files_written.append(f"{d}: {s.parity[j].path}")
        for d in recreate:
            commit.finalize(staging[d], d.absolute(), data, manifest.save_id, fsync)
            report.recreated.append(str(d))
    except BaseException as exc:
        for st in staging.values():
            commit.abort(st)
        if isinstance(exc, OSError) and not isinstance(exc, CkptError):
            # e.g. a directory where a file belongs: damage the repair cannot write over
            raise UnrecoverableDamageError(
                shown,
                f"cannot write the rebuilt files: {exc}",
                report.lost_data,
                sorted({manifest.ranks[r].node for r in report.lost_data}),
            ) from None
        raise
    report.seconds = time.perf_counter() - started
    return report


def _buffers(record: RedundancyRecord, rank: int) -> MemberBuffers:
    n_data, n_parity = buffer_sizes(record, rank)
    return MemberBuffers(np.zeros(n_data, np.uint8), np.zeros(n_parity, np.uint8))


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
) -> None:
    """No redundancy: the data is intact, or :class:`UnrecoverableDamageError`."""
    from ckptfmt.parallel.rebuild import lost_tensors
    from ckptfmt.redundancy.record import member_size
    from ckptfmt.storage.members import read_member

    lost = []
    for rank in range(manifest.world_size):
        d = dir_of[rank]
        buf = np.zeros(member_size(manifest, rank), np.uint8)
        if not intact_dir[d] or read_member(Inside(d), manifest, rank, buf, verify=True):
            lost.append(rank)
    if lost:
        raise UnrecoverableDamageError(
            shown,
            "damaged, and the save has no redundancy to rebuild from",
            lost,
            sorted({manifest.ranks[r].node for r in lost}),
            lost_tensors(manifest, set(lost)),
        )


def encode_offline(
    manifest: Manifest,
    dir_of: Mapping[int, str | os.PathLike[str]],
    red: Redundancy,
    fsync: bool = True,
) -> Manifest:
    """Encode redundancy for a checkpoint whose data files are already written, in one process:
    ``dir_of[rank]`` is the (staging) directory holding rank ``rank``'s files; each rank's parity
    file is written there. Returns ``manifest`` with the record in ``levels["1"]`` (the caller
    writes it and commits). The sets follow ``manifest.ranks``' nodes, as a save's do. Used by
    ``ckptfmt reshard``; one set in memory at a time."""
    from dataclasses import replace

    from ckptfmt.codecs.crc32c import crc32c
    from ckptfmt.parallel.encode import make_record, member_sets, set_geometry
    from ckptfmt.redundancy.record import parity_path
    from ckptfmt.redundancy.stripes import encode_plan
    from ckptfmt.storage.files import write_gather
    from ckptfmt.storage.members import read_member

    sets = member_sets(red, [r.node for r in manifest.ranks])
    parity: dict[int, dict[str, Any]] = {}
    for members in sets:
        sizes, chunk, parity_bytes = set_geometry(red, manifest, members)
        n = len(members)
        local = {}
        for j, rank in enumerate(members):
            if red.scheme == "partner":
                bufs = MemberBuffers(np.zeros(sizes[j], np.uint8), np.zeros(sizes[j - 1], np.uint8))
            else:
                bufs = MemberBuffers(
                    np.zeros((n - red.m) * chunk, np.uint8), np.zeros(parity_bytes, np.uint8)
                )
            damage = read_member(Inside(Path(dir_of[rank])), manifest, rank, bufs.data, True)
            if damage:
                raise damage[0]
            local[j] = bufs
        run_ops(encode_plan(red.scheme, n, red.m), members, sizes, chunk, local)
        for j, rank in enumerate(members):
            buf = local[j].parity
            k = max(red.m, 1)
            step = buf.size // k
            path = Path(dir_of[rank]) / parity_path(rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            write_gather(path, [buf.data], fsync)
            parity[rank] = {
                "path": parity_path(rank),
                "size": int(buf.size),
                "crc32c": [crc32c(buf[p * step : (p + 1) * step]) for p in range(k)],
            }
    record = make_record(red, manifest, sets, [parity[r] for r in range(manifest.world_size)])
    levels = dict(manifest.levels)
    levels["1"] = {**dict(levels.get("1", {})), "redundancy": record.to_json()}
    return replace(manifest, levels=levels)
