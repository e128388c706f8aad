"""Offline reshard: rewrite a checkpoint for another number of ranks (``ckptfmt reshard``), in
one process, no MPI (``spec/reshard.md`` §4).

The destination is what a save by ``ranks`` ranks on the given nodes would have written: the
ownership plan (``parallel.plan.make_plan``) of those ranks' holdings — every rank holds every
tensor whole (data parallel), except tensors named by ``rows`` patterns, which the ranks hold in
row blocks (``numpy.array_split``'s: the first ``rows % ranks`` ranks get one more row, as FSDP's
even split does), and per-rank tensors, whose row ``k`` rank ``k`` holds. So each rank of the new
job reads its own data back from its own files again, and on level 1 from its own node.

Each new shard file is made from the inner chunks of the source that its box needs
(``reshard.plan_reads``), every chunk's CRC checked as it is read; every source file read in
full, over one or several new files, has its data CRC checked once its last chunk is in. Files
are written into staging directories and committed by rename, manifest last (``spec/PROTOCOL.md``
§1). With ``redundancy`` the parity of the new sets is encoded before the commit
(``ckptfmt.engine.encode.encode_offline``). The destination is one directory, or with
``{node}`` one level-1
directory per new node (each holding the metadata and its own ranks' files).

This module checks the arguments and runs the steps: what the destination keeps and how the new
ranks hold it (``reshard_select``), then its write (``reshard_write``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptfmt.dtypes import by_name
from ckptfmt.errors import UsageError
from ckptfmt.format.options import WriteOptions
from ckptfmt.maintenance.nodes import node_dirs
from ckptfmt.maintenance.reshard_select import check_nodes, declarations, select
from ckptfmt.maintenance.reshard_write import write_destination
from ckptfmt.plan.options import ReadOptions
from ckptfmt.plan.ownership import make_plan
from ckptfmt.redundancy.config import Redundancy
from ckptfmt.storage.nodes import expand, is_template
from ckptfmt.storage.paths import check_destination, refuse_url
from ckptfmt.storage.progress import ProgressCallback


@dataclass
class ReshardReport:
    """What :func:`reshard` wrote."""

    source: str
    destination: list[str]
    step: int | None
    saved_ranks: int
    ranks: int
    nodes: list[str]
    tensors: int
    data_bytes: int  # the tensors' bytes
    bytes_read: int  # chunk payload bytes read from the source (a chunk two boxes cut: twice)
    bytes_written: int  # data files written
    seconds: float
    rows: list[str] = field(default_factory=list)  # tensors held in row blocks
    dropped: list[str] = field(default_factory=list)  # per-rank entries left out
    warning: str | None = None
    redundancy: dict[str, Any] | None = None

    @property
    def mb_per_s(self) -> float:
        return self.data_bytes / 1e6 / max(self.seconds, 1e-9)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "destination": self.destination,
            "step": self.step,
            "saved_ranks": self.saved_ranks,
            "ranks": self.ranks,
            "nodes": self.nodes,
            "tensors": self.tensors,
            "data_bytes": self.data_bytes,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "seconds": round(self.seconds, 6),
            "mb_per_s": round(self.mb_per_s, 1),
            "rows": self.rows,
            "dropped": self.dropped,
            "warning": self.warning,
            "redundancy": self.redundancy,
        }


def reshard(
    src: str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]],
    dst: str | os.PathLike[str],
    ranks: int,
    *,
    nodes: Sequence[str] | None = None,
    rows: Sequence[str] = (),
    read: ReadOptions | None = None,
    redundancy: Redundancy | None = None,
    write: WriteOptions = WriteOptions(),
    progress: ProgressCallback | None = None,
) -> ReshardReport:
    """Rewrite the checkpoint ``src`` for ``ranks`` ranks into ``dst`` (module docstring).

    ``src``: a complete checkpoint directory (a level-3 copy), or level-1 copies as a ``{node}``
    template or a mapping node -> directory. ``nodes[k]``: rank k's node (default: all on
    ``"n0"``). ``rows``: glob patterns of '/'-joined tensor names held in row blocks.
    ``read``: its ``rank_map``/``per_rank`` say what becomes of per-rank entries
    (``reshard.per_rank``; the same options a load takes); an entry that some new rank would get
    no item of is left out only with ``per_rank="drop"``.
    ``write``: the new files' grid, writer threads, fsync, and whether a committed checkpoint at
    ``dst`` may be replaced (:class:`~ckptfmt.format.options.WriteOptions`, as for a save).
    ``progress``: called with :class:`~ckptfmt.Progress` events (``op="reshard"``) counting
    the whole work, planned before any byte moves: each new file's data read from the source
    (``phase="read"``), the file written (``"write"``), with ``redundancy`` every new member
    read back and its parity written (``"parity"``); the last event (``final``) once every
    directory is committed (``ckptfmt.storage.progress``).
    """
    started = time.perf_counter()
    _check_arguments(src, dst, ranks, write)
    node_list = check_nodes(nodes if nodes is not None else ["n0"] * ranks, ranks)
    manifest, _, src_dirs = node_dirs(src)
    opts = read if read is not None else ReadOptions()
    sel = select(manifest, ranks, rows, opts.rank_map, opts.per_rank)
    plan = make_plan(
        declarations(sel.kept, ranks, set(sel.by_rows)),
        chunk_bytes=write.chunk_bytes,
        shard_bytes=write.shard_bytes,
    )
    if is_template(dst):
        finals = {n: expand(dst, n).absolute() for n in node_list}
    else:
        one = Path(dst).absolute()
        finals = {n: one for n in node_list}
    for final in dict.fromkeys(finals.values()):
        check_destination(final)  # a parent that is a file, a read-only file system: say so
    out, bytes_read, written, staged = write_destination(
        manifest, sel, plan, src_dirs, dst, finals, node_list, redundancy, write, progress
    )
    return ReshardReport(
        source=os.fspath(src) if not isinstance(src, Mapping) else "node directories",
        destination=[str(p) for p in staged],
        step=manifest.step,
        saved_ranks=manifest.world_size,
        ranks=ranks,
        nodes=node_list,
        tensors=len(out.tensors()),
        data_bytes=sum(t.size * by_name(t.dtype).itemsize for t in out.tensors()),
        bytes_read=bytes_read,
        bytes_written=written,
        seconds=time.perf_counter() - started,
        rows=sel.by_rows,
        dropped=sel.dropped,
        warning=sel.warning,
        redundancy=None if redundancy is None else redundancy.to_json(),
    )


def _check_arguments(
    src: str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]],
    dst: str | os.PathLike[str],
    ranks: int,
    write: WriteOptions,
) -> None:
    """Refuse what cannot be resharded before anything is read (``UsageError``)."""
    refuse_url(dst)
    if not isinstance(src, Mapping):
        refuse_url(src)
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= 1 << 20:
        raise UsageError(f"ranks must be an int from 1 to 2^20, got {ranks!r}")
    if not isinstance(write, WriteOptions):
        raise UsageError(f"write must be a WriteOptions, got {type(write).__name__}")


__all__ = ["ReshardReport", "reshard"]
