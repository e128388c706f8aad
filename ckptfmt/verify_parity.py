"""Verifying a level-1 checkpoint node by node, with its redundancy (``spec/redundancy.md`` §5).

:func:`ckptfmt.verify` hands a ``{node}`` template or a mapping node -> directory here. Each
node's directory must hold a committed copy of the step with the same manifest, every zarr
metadata document, the data files of that node's ranks (every CRC checked) and, when the save has
redundancy, their parity files under ``ckptfmt-redundancy/``. Each parity chunk is checked
against its CRC32C in the record, and then, set by set (one set in memory at a time), against the
members' data: the parity is encoded afresh (``stripes.encode_plan`` run by ``engine.run_ops``)
and compared byte for byte, so a parity file that its CRCs vouch for but that does not belong to
this data (a bad encode, a file swapped in from elsewhere with its record) is still found.

Every parity finding is a :class:`~ckptfmt.verify.Problem` of kind ``"parity"`` with no tensors:
the data is intact, but a lost node could no longer be rebuilt (``ckptfmt rebuild`` repairs it).

A single directory is checked by :func:`ckptfmt.verify` itself; :func:`check_single_dir` adds the
redundancy there: a level-3 copy keeps the record but holds no parity files by design ("not
present on this level", not a problem); a directory that does hold ``ckptfmt-redundancy/`` (every
node's files gathered in one place) has its parity checked as above.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ckptfmt.codecs.crc32c import crc32c
from ckptfmt.errors import CkptError
from ckptfmt.manifest.codec import MANIFEST_NAME, parse_manifest
from ckptfmt.manifest.model import Manifest
from ckptfmt.reader import read_manifest_bytes
from ckptfmt.redundancy.engine import MemberBuffers, run_ops
from ckptfmt.redundancy.record import (
    PARITY_DIR,
    ParityFile,
    RedundancyRecord,
    RedundancySet,
    member_files,
    record_of,
)
from ckptfmt.redundancy.stripes import encode_plan
from ckptfmt.storage.files import Inside, read_scatter
from ckptfmt.storage.members import buffer_sizes, read_member
from ckptfmt.verify import (
    Problem,
    VerifyReport,
    _kind,
    check_metadata,
    check_schema,
    unexpected_files,
)

NOT_PRESENT = "not present on this level"
CHECKED = "checked"

Progress = Callable[[int], None] | None


def summary(record: RedundancyRecord, status: str) -> dict[str, Any]:
    """The record in brief, for :attr:`VerifyReport.redundancy`."""
    return {
        "scheme": record.scheme,
        "m": record.m,
        "sets": [list(s.members) for s in record.sets],
        "parity_files": sum(s.n for s in record.sets),
        "status": status,
        "sets_not_compared": [],  # sets whose parity could not be re-encoded (data damaged)
    }


def verify_nodes(
    spec: str | os.PathLike[str] | Mapping[str, Any], progress: Progress
) -> VerifyReport:
    """Verify a level-1 checkpoint given as a ``{node}`` template or a mapping node ->
    directory (module docstring). Raises :class:`NotACheckpointError` when no node holds a
    committed copy, :class:`ManifestError` when the manifest (or its record) is invalid."""
    from ckptfmt.parallel.rebuild import lost_tensors
    from ckptfmt.repair import node_dirs

    manifest, data, dirs = node_dirs(spec)
    if isinstance(spec, Mapping):
        shown = "; ".join(f"{n}={os.fspath(d)}" for n, d in sorted(spec.items()))
    else:
        shown = os.fspath(spec)
    check_schema(data, Path(shown))
    record = record_of(manifest)
    report = VerifyReport(shown, manifest, nodes={n: str(d) for n, d in dirs.items()})
    by_dir: dict[Path, list[str]] = {}
    for node, d in dirs.items():
        by_dir.setdefault(d, []).append(node)
    src_of_dir: dict[Path, Inside | None] = {}
    expected: dict[Path, set[str]] = {}
    for d, nodes in by_dir.items():
        label = ",".join(nodes)
        ranks = [r.rank for r in manifest.ranks if r.node in nodes]
        lost = f"the data{' and parity' if record else ''} of rank(s) {_ranks(ranks)} are lost"
        tensors = tuple(lost_tensors(manifest, set(ranks)))
        try:
            mine = read_manifest_bytes(d)
            other = parse_manifest(mine, str(d / MANIFEST_NAME))
        except CkptError as exc:
            reason = getattr(exc, "reason", str(exc))
            report.problems.append(
                Problem(
                    MANIFEST_NAME,
                    "missing",
                    f"no copy of the step in {d} ({reason}): {lost}",
                    tensors,
                    label,
                )
            )
            src_of_dir[d] = None
            continue
        if other.save_id != manifest.save_id:
            report.problems.append(
                Problem(
                    MANIFEST_NAME,
                    "metadata",
                    f"{d} holds another save ({other.save_id}, not {manifest.save_id}): {lost}",
                    tensors,
                    label,
                )
            )
            src_of_dir[d] = None
            continue
        if mine != data:
            report.problems.append(
                Problem(
                    MANIFEST_NAME,
                    "metadata",
                    "differs from the manifest of the same save on the other node(s)",
                    (),
                    label,
                )
            )
        src = Inside(d)
        src_of_dir[d] = src
        problems, expected[d] = check_metadata(src, manifest, label)
        report.problems.extend(problems)
    dir_of = {r.rank: dirs[r.node] for r in manifest.ranks}
    node_of = {r.rank: r.node for r in manifest.ranks}
    for rank, d in dir_of.items():
        if d in expected:
            expected[d].update(f.path for _, f in member_files(manifest, rank))
    if record is None:
        for rank in range(manifest.world_size):
            here = src_of_dir[dir_of[rank]]
            if here is not None:
                buf = np.zeros(sum(f.size for _, f in member_files(manifest, rank)), np.uint8)
                _check_member(here, manifest, rank, buf, report, node_of[rank], progress)
    else:
        report.redundancy = summary(record, CHECKED)
        for i, rset in enumerate(record.sets):
            _check_set(
                i,
                rset,
                record,
                manifest,
                report,
                progress,
                lambda r: src_of_dir[dir_of[r]],
                node_of.get,
                None,
            )
            for j, rank in enumerate(rset.members):
                if dir_of[rank] in expected:
                    expected[dir_of[rank]].add(rset.parity[j].path)
    for d, exp in expected.items():
        report.unexpected_files.extend(f"{d}/{rel}" for rel in unexpected_files(d, exp))
    report.unexpected_files.sort()
    return report


def check_single_dir(
    root: Path, manifest: Manifest, report: VerifyReport, expected: set[str]
) -> None:
    """The redundancy of a checkpoint verified as one directory (module docstring): sets
    ``report.redundancy`` and, when the directory holds parity files, checks them (adding their
    paths to ``expected``). The data files must already have been checked into ``report``."""
    record = record_of(manifest)
    if record is None:
        return
    if not os.path.lexists(root / PARITY_DIR):
        report.redundancy = summary(record, NOT_PRESENT)
        return
    report.redundancy = summary(record, CHECKED)
    damaged = {p.file for p in report.problems}
    src = Inside(root)
    for i, rset in enumerate(record.sets):
        _check_set(i, rset, record, manifest, report, None, lambda r: src, lambda r: None, damaged)
        expected.update(f.path for f in rset.parity)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _check_member(
    src: Inside,
    manifest: Manifest,
    rank: int,
    out: np.ndarray,
    report: VerifyReport,
    node: str | None,
    progress: Progress,
) -> bool:
    """Read and check ``rank``'s data files into ``out``; report what is damaged."""
    damage = read_member(src, manifest, rank, out, verify=True)
    bad = {e.file for e in damage}
    for e in damage:
        report.problems.append(Problem(e.file, _kind(e), e.reason, e.tensors, node))
    files = member_files(manifest, rank)
    report.files_checked += len(files)
    report.bytes_checked += sum(f.size for _, f in files if f.path not in bad)
    if progress:
        progress(sum(f.size for _, f in files))
    return not damage


def _check_set(
    index: int,
    rset: RedundancySet,
    record: RedundancyRecord,
    manifest: Manifest,
    report: VerifyReport,
    progress: Progress,
    src_of: Callable[[int], Inside | None],
    node_of: Callable[[int], str | None],
    known_damaged: set[str] | None,
) -> None:
    """Check one set: its members' data (unless ``known_damaged`` lists the files already found
    damaged), every parity chunk's CRC, then the parity against its re-encoding (only possible
    when every member's data is intact; else the set is listed in ``sets_not_compared``)."""
    bufs: dict[int, MemberBuffers] = {}
    data_ok: list[bool] = []
    parity_ok: list[list[bool]] = []
    for j, rank in enumerate(rset.members):
        n_data, n_parity = buffer_sizes(record, rank)
        bufs[j] = MemberBuffers(np.zeros(n_data, np.uint8), np.zeros(n_parity, np.uint8))
        src, node = src_of(rank), node_of(rank)
        if src is None:  # the node's directory is gone: reported once, as a whole
            data_ok.append(False)
            parity_ok.append([False] * len(rset.parity[j].crc32c))
            continue
        if known_damaged is None:
            data_ok.append(_check_member(src, manifest, rank, bufs[j].data, report, node, progress))
        else:
            damage = read_member(src, manifest, rank, bufs[j].data, verify=False)
            mine = {f.path for _, f in member_files(manifest, rank)}
            data_ok.append(not damage and not mine & known_damaged)
        ok, problems = _check_parity_file(src, rset.parity[j], bufs[j].parity, node)
        parity_ok.append(ok)
        report.problems.extend(problems)
    if not all(data_ok):
        if report.redundancy is not None:
            report.redundancy["sets_not_compared"].append(index)
        return
    fresh = {j: MemberBuffers(b.data, np.zeros_like(b.parity)) for j, b in bufs.items()}
    ops = encode_plan(record.scheme, rset.n, record.m)
    run_ops(ops, rset.members, rset.sizes, rset.chunk, fresh)
    for j, rank in enumerate(rset.members):
        pf = rset.parity[j]
        step = pf.size // len(pf.crc32c)
        for p, chunk_ok in enumerate(parity_ok[j]):
            a = bufs[j].parity[p * step : (p + 1) * step]
            b = fresh[j].parity[p * step : (p + 1) * step]
            if chunk_ok and not np.array_equal(a, b):
                first = int(np.flatnonzero(a != b)[0])
                report.problems.append(
                    Problem(
                        pf.path,
                        "parity",
                        f"chunk {p} passes its CRC32C but is not the parity of the set's data "
                        f"(ranks {_ranks(list(rset.members))}, set {index}): it differs from a "
                        f"fresh encoding from byte {p * step + first}",
                        (),
                        node_of(rank),
                    )
                )


def _check_parity_file(
    src: Inside, pf: ParityFile, out: np.ndarray, node: str | None
) -> tuple[list[bool], list[Problem]]:
    """Read a parity file into ``out``; which of its chunks match their CRC32C, and the
    problems found (kind ``"parity"``)."""
    n = len(pf.crc32c)

    def whole(reason: str) -> tuple[list[bool], list[Problem]]:
        return [False] * n, [Problem(pf.path, "parity", reason, (), node)]

    try:
        fd = src.open_fd(pf.path)
    except FileNotFoundError:
        return whole("missing")
    except OSError as exc:
        return whole(f"cannot be read: {exc}")
    try:
        actual = os.fstat(fd).st_size
        if actual != pf.size:
            return whole(f"size {actual} bytes, expected {pf.size}")
        read_scatter(fd, [out[: pf.size].data], 0)
    except EOFError:
        return whole("shorter than its size while being read")
    except OSError as exc:
        return whole(f"cannot be read: {exc}")
    finally:
        os.close(fd)
    step = pf.size // n
    ok, problems = [], []
    for p in range(n):
        got = crc32c(out[p * step : (p + 1) * step])
        ok.append(got == pf.crc32c[p])
        if got != pf.crc32c[p]:
            problems.append(
                Problem(
                    pf.path,
                    "parity",
                    f"chunk {p} CRC32C mismatch (expected {pf.crc32c[p]:08x}, got {got:08x})",
                    (),
                    node,
                )
            )
    return ok, problems
