"""A committed ckptfmt checkpoint to read from: level 3 (one directory) or level-1 copies (a
``{node}`` template or a mapping node -> directory), read tensor by tensor, every byte checked
against its CRC32C as it is read (``container.reader``'s own code), each region from the
directory of the node whose rank wrote it. What ``ckptfmt.load``, ``ckptfmt.open`` and the
export read through.

When level-1 copies are damaged or a node's directory is gone, the lost data is rebuilt from
the redundancy by ``ckptfmt.maintenance.repair.rebuild`` (what ``ckptfmt rebuild`` runs), but
never into the source: the nodes with anything to repair are given to it as fresh directories
under a scratch directory of the caller's (an export's staging directory, a load's temporary
directory), so it recreates them there whole, one redundancy set in memory at a time, and the
source is left exactly as it was.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ckptfmt.container.reader import check_documents, read_manifest_bytes, tensor_reads
from ckptfmt.errors import CkptError, DamagedError
from ckptfmt.format.options import WriteOptions
from ckptfmt.maintenance import objects as in_bucket
from ckptfmt.maintenance.nodes import NodeDirs, node_dirs
from ckptfmt.maintenance.repair import rebuild
from ckptfmt.manifest.codec import parse_manifest
from ckptfmt.manifest.limits import display
from ckptfmt.manifest.model import Manifest, TensorEntry
from ckptfmt.redundancy.record import record_of
from ckptfmt.storage.files import Files, Inside
from ckptfmt.storage.nodes import is_spread
from ckptfmt.storage.objects.source import ObjectInside
from ckptfmt.storage.store.location import Location, parse_location

Job = Callable[[], None]


@dataclass
class Source:
    """The checkpoint being exported: its manifest and each saved node's directory."""

    spec: NodeDirs
    manifest: Manifest
    dirs: dict[str, Path]
    rebuilt_nodes: list[str] = field(default_factory=list)
    _inside: dict[Path, Inside] = field(default_factory=dict)

    @property
    def shown(self) -> str:
        return os.fspath(self.spec) if not isinstance(self.spec, Mapping) else "node directories"

    @property
    def level1(self) -> bool:
        """Level-1 copies that a rebuild could repair: several directories, or a template."""
        spread = is_spread(self.spec)
        return spread and record_of(self.manifest) is not None

    def inside(self, rank: int) -> Inside:
        d = self.dirs[self.manifest.ranks[rank].node]
        if d not in self._inside:
            self._inside[d] = Inside(d)
        return self._inside[d]

    def problems(self) -> list[str]:
        """What a cheap look finds wrong (a directory without this save's manifest, a file
        missing or of the wrong size); the CRCs are checked as the data is read."""
        out = []
        for node, d in sorted(self.dirs.items()):
            try:
                if parse_manifest(read_manifest_bytes(d)).save_id != self.manifest.save_id:
                    out.append(f"{d}: holds another save")
            except CkptError as exc:
                out.append(f"node {node}: {exc}")
        if out:
            return out
        for t in self.manifest.tensors():
            for r in t.regions:
                src = self.inside(r.rank)
                for ref in r.files:
                    try:
                        src.check_size(ref.path, ref.size, (display(t.name),))
                    except DamagedError as exc:
                        out.append(str(exc))
        return out

    def tensor_reads(
        self,
        t: TensorEntry,
        into: Callable[[], np.ndarray] | None = None,
        sizes: list[int] | None = None,
    ) -> tuple[np.ndarray, list[Job]]:
        """The destination of the whole tensor ``t`` and the jobs (one per shard file) that
        fill it, every chunk CRC and every file's size and data CRC checked
        (``container.reader.tensor_reads``, each region from its rank's node directory)."""
        return tensor_reads(self.inside, t, sizes, into)

    def check_documents(self) -> None:
        """Check every node directory's ``zarr.json`` documents against the manifest; raises
        the first problem (a :class:`DamagedError` naming the file)."""
        for d in sorted(set(self.dirs.values())):
            inside = self._inside.setdefault(d, Inside(d))
            check_documents(inside, self.manifest)

    def with_rebuild(self, scratch: Path) -> Source:
        """This source with every node that has anything to repair rebuilt under ``scratch``
        (module docstring); the source directories are not written. Raises
        :class:`UnrecoverableDamageError` beyond the redundancy's tolerance."""
        found = rebuild(self.dirs, dry_run=True)  # learns what; writes nothing
        lost = {self.manifest.ranks[r].node for r in (*found.lost_data, *found.lost_parity)}
        for entry in found.metadata:  # "<dir>: <file>": a zarr document to write anew
            d = entry.split(": ", 1)[0]
            lost |= {n for n, p in self.dirs.items() if str(p) == d}
        if not lost:
            return self
        dirs = {
            n: (scratch / f"node-{i}" if n in lost else p)
            for i, (n, p) in enumerate(sorted(self.dirs.items()))
        }
        scratch.mkdir(parents=True, exist_ok=True)
        rebuild(dirs, write=WriteOptions(fsync=False))  # scratch: gone after the read
        return Source(self.spec, self.manifest, dirs, sorted(lost))


@dataclass
class ObjectSource(Source):
    """A committed checkpoint in a bucket (``spec`` its URL): every rank's files are in the one
    :class:`ObjectInside`, whose opening already checked every object against the commit."""

    objects: ObjectInside | None = None

    def inside(self, rank: int) -> Files:  # type: ignore[override]
        assert self.objects is not None
        return self.objects

    def problems(self) -> list[str]:
        return []

    def check_documents(self) -> None:
        assert self.objects is not None
        check_documents(self.objects, self.manifest)


def open_source(spec: NodeDirs | Location) -> Source:
    """The committed checkpoint ``spec`` (one directory, a ``{node}`` template, a mapping
    node -> directory, or the URL of a checkpoint in a bucket, reached with the ``AWS_*``
    environment, or the storage options its :class:`Location` was parsed with);
    :class:`NotACheckpointError` when no directory holds its manifest."""
    where = parse_location(spec)
    if where.is_bucket:
        manifest, objects = in_bucket.open_source(where.spec, where.storage_options)
        return ObjectSource(where.spec, manifest, {}, objects=objects)
    spec = where.spec if where.kind == "spread" else where.directory()
    manifest, _, dirs = node_dirs(spec)
    return Source(spec, manifest, {n: Path(p) for n, p in dirs.items()})


def open_whole(spec: NodeDirs | Location, scratch: Path) -> Source:
    """:func:`open_source`, with what a cheap look finds wrong on level-1 copies (a node's
    directory gone, a file missing or of the wrong size, a damaged ``zarr.json``) rebuilt
    under ``scratch`` (:meth:`Source.with_rebuild`); a CRC that fails later is the reader's
    to meet (a load then rebuilds and reads again, as an export does)."""
    source = open_source(spec)
    if not source.level1:
        return source
    damaged = bool(source.problems())
    if not damaged:
        try:
            source.check_documents()
        except DamagedError:
            damaged = True
    return source.with_rebuild(scratch) if damaged else source
