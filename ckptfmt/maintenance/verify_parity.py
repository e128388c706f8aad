"""Verifying a level-1 checkpoint node by node, with its redundancy (``spec/redundancy.md`` §5).

:func:`ckptfmt.verify` hands a ``{node}`` template or a mapping node -> directory here. Each
node's directory must hold a committed copy of the step with the same manifest, every zarr
metadata document, the data files of that node's ranks (every CRC checked) and, when the save has
redundancy, their parity files under ``ckptfmt-redundancy/``. Each parity chunk is checked
against its CRC32C in the record, and, set by set, against the members' data: the parity is
encoded afresh (``stripes.encode_plan`` run by ``engine.run_ops``) and compared byte for byte, so
a parity file that its CRCs vouch for but that does not belong to this data (a bad encode, a file
swapped in from elsewhere with its record) is still found.

Memory stays bounded: data files are checked one at a time; a set is re-encoded in windows of
:data:`WINDOW` bytes of each chunk (the same byte range of every chunk of every member is one small
set of the same code, so ``encode_plan`` runs on it unchanged), during one pass over the parity
files that also computes their CRCs.

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

from ckptfmt.checksum import crc32c
from ckptfmt.engine.copies import ABSENT, GOOD
from ckptfmt.engine.rebuild import lost_tensors
from ckptfmt.errors import DamagedError
from ckptfmt.maintenance.checks import (
    Problem,
    VerifyReport,
    check_data,
    check_metadata,
    check_schema,
)
from ckptfmt.maintenance.checks import unexpected_files as unexpected_in
from ckptfmt.maintenance.nodes import node_copies
from ckptfmt.manifest.codec import MANIFEST_NAME
from ckptfmt.manifest.model import Manifest
from ckptfmt.redundancy.engine import MemberBuffers, run_ops
from ckptfmt.redundancy.record import (
    PARITY_DIR,
    RedundancyRecord,
    RedundancySet,
    member_files,
    record_of,
)
from ckptfmt.storage.files import FileHandle, Inside
from ckptfmt.storage.progress import current_meter

NOT_PRESENT = "not present on this level"
CHECKED = "checked"
WINDOW = 1 << 18  # bytes of each chunk re-encoded at once: n * (n - m + m) windows in memory


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
    spec: str | os.PathLike[str] | Mapping[str, Any],
) -> VerifyReport:
    """Verify a level-1 checkpoint given as a ``{node}`` template or a mapping node ->
    directory (module docstring). Raises :class:`NotACheckpointError` when no node holds a
    committed copy, :class:`ManifestError` when the manifest (or its record) is invalid."""

    choice, dirs, copies = node_copies(spec)
    manifest, data = choice.manifest, choice.data
    current_meter().expect(sum(f.size for _, f in manifest.files()))
    copy_of = {c.directory: c for c in copies}
    if isinstance(spec, Mapping):
        shown = "; ".join(f"{n}={os.fspath(d)}" for n, d in sorted(spec.items()))
    else:
        shown = os.fspath(spec)
    check_schema(data, Path(shown))
    record = record_of(manifest)
    report = VerifyReport(shown, manifest, nodes={n: str(d) for n, d in dirs.items()})
    report.notes = list(choice.notes)
    node_of = {r.rank: r.node for r in manifest.ranks}
    by_dir: dict[Path, list[str]] = {}
    for node, d in dirs.items():
        by_dir.setdefault(d, []).append(node)
    src_of_dir: dict[Path, Inside | None] = {}
    for d, nodes in by_dir.items():
        label = ",".join(nodes)
        ranks = {r: n for r, n in node_of.items() if n in nodes}
        lost = f"the data{' and parity' if record else ''} of rank(s) {_ranks(ranks)} are lost"
        tensors = tuple(lost_tensors(manifest, set(ranks)))
        src_of_dir[d] = None
        copy = copy_of.get(d)
        if copy is None or copy.state == ABSENT:
            exc = copy.error if copy is not None else None
            reason = f"no copy of the step in {d} ({getattr(exc, 'reason', exc)}): {lost}"
            report.problems.append(Problem(MANIFEST_NAME, "missing", reason, tensors, label))
            continue
        if copy.state != GOOD:  # damaged in place: its data is checked against the good copy
            why = getattr(copy.error, "reason", copy.error)
            reason = f"this node's copy is damaged ({why}); rebuild writes it anew from a good one"
            kind = "checksum" if isinstance(copy.error, DamagedError) else "metadata"
            report.problems.append(Problem(MANIFEST_NAME, kind, reason, (), label))
        elif copy.manifest is not None and copy.manifest.save_id != manifest.save_id:
            other = copy.manifest.save_id
            reason = f"{d} holds another save ({other}, not {manifest.save_id}): {lost}"
            report.problems.append(Problem(MANIFEST_NAME, "metadata", reason, tensors, label))
            continue
        elif copy.data != data:
            reason = "differs from the manifest of the same save on the other node(s)"
            report.problems.append(Problem(MANIFEST_NAME, "metadata", reason, (), label))
        src = src_of_dir[d] = Inside(d)
        problems, expected = check_metadata(src, manifest, label)
        report.problems.extend(problems)
        check_data(src, manifest, report, expected, ranks)
        if record is not None:
            expected.update(record.set_of(r)[0].parity[record.set_of(r)[1]].path for r in ranks)
        report.unexpected_files.extend(f"{d}/{rel}" for rel in unexpected_in(d, expected))
    report.unexpected_files.sort()
    if record is not None:
        report.redundancy = summary(record, CHECKED)
        dir_of = {rank: dirs[node] for rank, node in node_of.items()}
        _check_sets(record, manifest, report, lambda r: src_of_dir[dir_of[r]], node_of.get)
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
    src = Inside(root)
    _check_sets(record, manifest, report, lambda r: src, lambda r: None)
    expected.update(f.path for s in record.sets for f in s.parity)


def _ranks(ranks: Mapping[int, str] | list[int]) -> str:
    return ", ".join(map(str, ranks))


def _check_sets(
    record: RedundancyRecord,
    manifest: Manifest,
    report: VerifyReport,
    src_of: Callable[[int], Inside | None],
    node_of: Callable[[int], str | None],
) -> None:
    """Check every set's parity files (module docstring). A member's data counts as intact when
    its directory is there and ``report`` has no problem with any of its files."""
    bad = {(p.node, p.file) for p in report.problems}
    for index, rset in enumerate(record.sets):
        data_ok = []
        for rank in rset.members:
            files = member_files(manifest, rank)
            node = node_of(rank)
            present = src_of(rank) is not None
            data_ok.append(present and not any((node, f.path) in bad for _, f in files))
        checker = _SetCheck(record, manifest, rset, src_of, node_of)
        try:
            compared = checker.run(all(data_ok))
        finally:
            checker.close()
        report.problems.extend(checker.problems)
        if not compared and report.redundancy is not None:
            report.redundancy["sets_not_compared"].append(index)


class _SetCheck:
    """One set: one pass over its parity files in windows, computing each chunk's CRC32C and,
    when every member's data is intact, comparing each window with a fresh encoding."""

    def __init__(
        self,
        record: RedundancyRecord,
        manifest: Manifest,
        rset: RedundancySet,
        src_of: Callable[[int], Inside | None],
        node_of: Callable[[int], str | None],
    ) -> None:
        self.record, self.manifest, self.rset = record, manifest, rset
        self.src_of, self.node_of = src_of, node_of
        self.problems: list[Problem] = []
        self.fds: dict[tuple[int, str], FileHandle] = {}  # (member, path) -> open file

    def close(self) -> None:
        for handle in self.fds.values():
            handle.close()
        self.fds.clear()

    def _problem(self, j: int, reason: str) -> None:
        node = self.node_of(self.rset.members[j])
        self.problems.append(Problem(self.rset.parity[j].path, "parity", reason, (), node))

    def _open(self, j: int, path: str, size: int) -> FileHandle | str:
        """Member ``j``'s file ``path`` of ``size`` bytes, open, or why not."""
        src = self.src_of(self.rset.members[j])
        if src is None:
            return "its node's directory is gone"
        try:
            fd = src.open_fd(path)
        except FileNotFoundError:
            return "missing"
        except OSError as exc:
            return f"cannot be read: {exc}"
        handle = self.fds[(j, path)] = FileHandle(fd)
        actual = handle.size()
        return handle if actual == size else f"size {actual} bytes, expected {size}"

    def _read(self, j: int, path: str, start: int, out: np.ndarray) -> None:
        if out.size:
            self.fds[(j, path)].read_into([out.data], start)

    def _read_member(self, j: int, start: int, out: np.ndarray) -> None:
        """Bytes ``[start, start + len(out))`` of member ``j``'s data (zeros past its end)."""
        out[:] = 0
        end, off = start + out.size, 0
        for _, ref in member_files(self.manifest, self.rset.members[j]):
            lo, hi = max(start, off), min(end, off + ref.size)
            if lo < hi:
                if (j, ref.path) not in self.fds:
                    opened = self._open(j, ref.path, ref.size)
                    if isinstance(opened, str):
                        raise OSError(f"{ref.path}: {opened}")
                self._read(j, ref.path, lo - off, out[lo - start : hi - start])
            off += ref.size

    def run(self, compare: bool) -> bool:
        """Check the CRCs of every parity file; with ``compare``, the bytes too. Returns
        whether the parity was compared with the data."""
        rset, record = self.rset, self.record
        n, m, chunk = rset.n, record.m, rset.chunk
        partner = record.code.copies_whole  # whole copies, not striped chunks
        k = len(rset.parity[0].crc32c)  # chunks per parity file
        readable = []
        for j, pf in enumerate(rset.parity):
            opened = self._open(j, pf.path, pf.size)
            if isinstance(opened, str):
                if self.src_of(rset.members[j]) is not None:  # a gone directory: reported once
                    self._problem(j, opened)
                readable.append(False)
            else:
                readable.append(True)
        span = max(rset.sizes) if partner else chunk  # bytes of each chunk to go through
        crcs = [[0] * k for _ in range(n)]
        first_diff: dict[tuple[int, int], int] = {}
        try:
            for o in range(0, span, WINDOW):
                w = min(WINDOW, span - o)
                if partner:
                    sizes = [max(0, min(w, s - o)) for s in rset.sizes]
                    stored = {
                        j: np.zeros(sizes[(j - 1) % n], np.uint8) for j in range(n) if readable[j]
                    }
                    for j, buf in stored.items():
                        self._read(j, rset.parity[j].path, o, buf)
                        crcs[j][0] = crc32c(buf, crcs[j][0])
                else:
                    sizes = list(rset.sizes)  # unused by chunk-indexed ops
                    stored = {j: np.zeros(m * w, np.uint8) for j in range(n) if readable[j]}
                    for j, buf in stored.items():
                        for p in range(m):
                            part = buf[p * w : (p + 1) * w]
                            self._read(j, rset.parity[j].path, p * chunk + o, part)
                            crcs[j][p] = crc32c(part, crcs[j][p])
                if compare:
                    self._compare(o, w, sizes, stored, first_diff)
        except (OSError, EOFError) as exc:  # changed under us since the data was checked
            self._problem(0, f"the set could not be read through: {exc}")
            return False
        step = rset.parity[0].size // k if k else 0
        for j, pf in enumerate(rset.parity):
            if not readable[j]:
                continue
            for p in range(k):
                if crcs[j][p] != pf.crc32c[p]:
                    self._problem(
                        j,
                        f"chunk {p} CRC32C mismatch (expected {pf.crc32c[p]:08x}, "
                        f"got {crcs[j][p]:08x})",
                    )
                elif (j, p) in first_diff:
                    members = _ranks(list(rset.members))
                    self._problem(
                        j,
                        f"chunk {p} passes its CRC32C but is not the parity of the set's data "
                        f"(ranks {members}): it differs from a fresh encoding from byte "
                        f"{p * step + first_diff[(j, p)]}",
                    )
        return compare

    def _compare(
        self,
        o: int,
        w: int,
        sizes: list[int],
        stored: dict[int, np.ndarray],
        first_diff: dict[tuple[int, int], int],
    ) -> None:
        """Encode bytes ``[o, o + w)`` of every chunk afresh and compare with ``stored``."""
        rset, record = self.rset, self.record
        n, m = rset.n, record.m
        partner = record.code.copies_whole  # whole copies, not striped chunks
        local = {}
        for j in range(n):
            if partner:
                data = np.empty(sizes[j], np.uint8)
                self._read_member(j, o, data)
                parity = np.zeros(sizes[(j - 1) % n], np.uint8)
            else:
                c = n - m
                data = np.empty(c * w, np.uint8)
                for t in range(c):
                    self._read_member(j, t * rset.chunk + o, data[t * w : (t + 1) * w])
                parity = np.zeros(m * w, np.uint8)
            local[j] = MemberBuffers(data, parity)
        run_ops(record.code.encode_plan(n), rset.members, sizes, w, local)
        for j, buf in stored.items():
            fresh = local[j].parity
            step = buf.size // max(m, 1)
            for p in range(max(m, 1)):
                a, b = buf[p * step : (p + 1) * step], fresh[p * step : (p + 1) * step]
                if (j, p) not in first_diff and not np.array_equal(a, b):
                    first_diff[(j, p)] = o + int(np.flatnonzero(a != b)[0])
