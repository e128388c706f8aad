"""A committed ckptfmt checkpoint as the source of an export: level 3 (one directory) or
level-1 copies (a ``{node}`` template or a mapping node -> directory), read tensor by tensor,
every byte checked against its CRC32C as it is read (``storage.shard_io``, the reader's own
code), each region from the directory of the node whose rank wrote it.

When level-1 copies are damaged or a node's directory is gone, the lost data is rebuilt from
the redundancy by ``ckptfmt.maintenance.repair.rebuild`` (what ``ckptfmt rebuild`` runs), but
never into the
source: the nodes with anything to repair are given to it as fresh directories under a scratch
directory of the caller's (inside the export's staging directory), so it recreates them there
whole, one redundancy set in memory at a time, and the source is left exactly as it was.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ckptfmt.container.reader import geometry, read_manifest_bytes
from ckptfmt.errors import CkptError, DamagedError
from ckptfmt.format.shard_io import Geometry, read_region, region_reads
from ckptfmt.maintenance.nodes import NodeDirs, node_dirs
from ckptfmt.maintenance.repair import rebuild
from ckptfmt.manifest.codec import parse_manifest
from ckptfmt.manifest.limits import display
from ckptfmt.manifest.model import Manifest, Region, TensorEntry
from ckptfmt.redundancy.record import record_of
from ckptfmt.storage.files import Inside
from ckptfmt.storage.nodes import is_spread

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
        self, t: TensorEntry, into: Callable[[], np.ndarray] | None = None
    ) -> tuple[np.ndarray, list[Job]]:
        """The destination of the whole tensor ``t`` and the jobs (one per shard file) that
        fill it, every chunk CRC and every file's size and data CRC checked; sizes are checked
        before the memory is allocated. ``into()`` gives the destination (C-contiguous, ``t``'s
        shape and dtype: a mapped window of an output file, say); default a new array."""
        geo = geometry(t)
        name = display(t.name)
        for r in t.regions:
            for ref in r.files:
                self.inside(r.rank).check_size(ref.path, ref.size, (name,))
        out = np.empty(t.shape, dtype=geo.dtype) if into is None else into()
        jobs: list[Job] = []
        for r in t.regions:
            src = self.inside(r.rank)
            view = (
                out[tuple(slice(o, o + s) for o, s in zip(r.offset, r.shape))] if t.shape else out
            )
            if view.flags.c_contiguous:
                jobs += region_reads(src, geo, r.files, r.offset, view, (name,))
            else:  # narrower than the tensor on a trailing axis: read, then place
                jobs.append(functools.partial(_read_and_place, src, geo, r, view, name))
        return out, jobs

    def with_rebuild(self, scratch: Path) -> Source:
        """This source with every node that has anything to repair rebuilt under ``scratch``
        (module docstring); the source directories are not written. Raises
        :class:`UnrecoverableDamageError` beyond the redundancy's tolerance."""
        found = rebuild(self.dirs, fsync=False, dry_run=True)  # learns what; writes nothing
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
        rebuild(dirs, fsync=False)
        return Source(self.spec, self.manifest, dirs, sorted(lost))


def _read_and_place(src: Inside, geo: Geometry, r: Region, view: np.ndarray, name: str) -> None:
    target = np.empty(r.shape, dtype=geo.dtype)
    read_region(src, geo, r.files, r.offset, target, (name,))
    view[...] = target


def open_source(spec: NodeDirs) -> Source:
    """The committed checkpoint ``spec`` (one directory, a ``{node}`` template, or a mapping
    node -> directory); :class:`NotACheckpointError` when no directory holds its manifest."""
    manifest, _, dirs = node_dirs(spec)
    return Source(spec, manifest, {n: Path(p) for n, p in dirs.items()})
