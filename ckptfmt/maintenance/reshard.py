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
are written into a draft of the destination's store (``storage.store``) and committed by the
store's commit, manifest last: a directory's staging directory renamed into place
(``spec/PROTOCOL.md`` §1), a bucket's objects put under ``U/<save_id>/`` then its commit object
(§7). With ``redundancy`` the parity of the new sets is encoded before the commit
(``ckptfmt.engine.encode.encode_offline``). The destination is one directory or the URL of a
bucket prefix, or with ``{node}`` one level-1 directory per new node (each holding the metadata
and its own ranks' files). The source is a checkpoint directory, level-1 copies, or the URL of a
checkpoint in a bucket (read through its objects, ranged GETs of the chunks each new file
needs).

This module checks the arguments and runs the steps: what the destination keeps and how the new
ranks hold it (``reshard_select``), then its write (``reshard_write``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ckptfmt.dtypes import by_name
from ckptfmt.errors import DamagedError, UsageError
from ckptfmt.format.options import WriteOptions
from ckptfmt.maintenance import objects as in_bucket
from ckptfmt.maintenance.nodes import node_dirs
from ckptfmt.maintenance.reshard_select import check_nodes, declarations, select
from ckptfmt.maintenance.reshard_write import Sources, write_destination
from ckptfmt.manifest.model import Manifest
from ckptfmt.plan.options import ReadOptions
from ckptfmt.plan.ownership import make_plan
from ckptfmt.redundancy.config import Redundancy
from ckptfmt.storage.nodes import expand
from ckptfmt.storage.objects.source import ObjectInside
from ckptfmt.storage.paths import check_destination, refuse_inside_checkpoint, removing_made
from ckptfmt.storage.progress import ProgressCallback
from ckptfmt.storage.store import DirectoryStore, Location, Store, parse_location


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
    dst: str | os.PathLike[str] | Location | Store,
    ranks: int,
    *,
    nodes: Sequence[str] | None = None,
    rows: Sequence[str] = (),
    read: ReadOptions | None = None,
    redundancy: Redundancy | None = None,
    write: WriteOptions = WriteOptions(),
    progress: ProgressCallback | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> ReshardReport:
    """Rewrite the checkpoint ``src`` for ``ranks`` ranks into ``dst`` (module docstring).

    ``src``: a complete checkpoint directory (a level-3 copy), or level-1 copies as a ``{node}``
    template or a mapping node -> directory, or the URL of a checkpoint in a bucket. ``dst``: a
    directory, a ``{node}`` template (one level-1 directory per new node) or the URL of a bucket
    prefix (``s3://bucket/run/ckpt``: the new checkpoint appears there by its commit object, and
    one there already, replaced with ``write.overwrite``, stays whole until then), or a
    :class:`Store` or a parsed :class:`Location` of one of these.
    ``storage_options``: the object store's settings for whichever of them is a URL (as for
    ``ckptfmt.save``). ``nodes[k]``: rank k's node (default: all on
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
    src_at = _parsed(src, storage_options)
    dst_at = _parsed(dst, storage_options)
    _check_arguments(dst_at, ranks, write, redundancy)
    node_list = check_nodes(nodes if nodes is not None else ["n0"] * ranks, ranks)
    manifest, sources = _open_source(src_at)
    opts = read if read is not None else ReadOptions()
    sel = select(manifest, ranks, rows, opts.rank_map, opts.per_rank)
    plan = make_plan(
        declarations(sel.kept, ranks, set(sel.by_rows)),
        chunk_bytes=write.chunk_bytes,
        shard_bytes=write.shard_bytes,
    )
    if dst_at.kind == "spread":  # a {node} template: one directory per new node
        stores: dict[str, Store] = {
            n: DirectoryStore(expand(dst_at.spec, n).absolute()) for n in node_list
        }
    else:
        one = dst_at.store()
        stores = {n: one for n in node_list}
    for store in dict.fromkeys(stores.values()):
        if isinstance(store, DirectoryStore):  # a parent that is a file, a read-only file system
            check_destination(store.path)
            refuse_inside_checkpoint(store.path)  # deleted with it when it is replaced
    local = [s.path for s in stores.values() if isinstance(s, DirectoryStore)]
    try:
        with removing_made(local):  # a failed reshard leaves no directory it made
            out, bytes_read, written, committed = write_destination(
                manifest, sel, plan, sources, dst_at, stores, node_list, redundancy, write, progress
            )
    except DamagedError as exc:  # name the object's URL, not its path inside the checkpoint
        objects = next(iter(sources.values()), None)
        if src_at.kind == "url" and isinstance(objects, ObjectInside):
            raise in_bucket.at_key(exc, objects) from None
        raise
    return ReshardReport(
        source=os.fspath(src) if not isinstance(src, Mapping) else "node directories",
        destination=committed,
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


def _parsed(
    spec: str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]] | Location | Store,
    storage_options: Mapping[str, Any] | None,
) -> Location:
    """``spec`` parsed once, ``storage_options`` going with it where it is a URL."""
    where = parse_location(spec)
    if where.kind != "url" or storage_options is None:
        return where
    return replace(where, storage_options=storage_options)


def _open_source(src: Location) -> tuple[Manifest, Sources]:
    """The source's manifest and each saved node's files: a directory or level-1 copies
    (``maintenance.nodes``), or a bucket's checkpoint, every node's files its objects."""
    if src.kind == "url":
        manifest, objects = in_bucket.open_source(src.spec, src.storage_options)
        return manifest, {r.node: objects for r in manifest.ranks}
    if src.kind == "store":
        raise UsageError(f"reshard reads a directory or a URL, not the store {src}")
    manifest, _, dirs = node_dirs(src.spec)
    return manifest, dirs


def _check_arguments(
    dst: Location, ranks: int, write: WriteOptions, redundancy: Redundancy | None
) -> None:
    """Refuse what cannot be resharded before anything is read (``UsageError``)."""
    if dst.kind == "spread" and not isinstance(dst.spec, str | os.PathLike):
        raise UsageError("the reshard's destination is a directory, a {node} template or a URL")
    if redundancy is not None and dst.kind not in ("directory", "spread"):
        raise UsageError(
            f"redundancy is encoded over node-local directories, not into {dst}: give a "
            "directory (with {node}, one per new node)"
        )
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= 1 << 20:
        raise UsageError(f"ranks must be an int from 1 to 2^20, got {ranks!r}")
    if not isinstance(write, WriteOptions):
        raise UsageError(f"write must be a WriteOptions, got {type(write).__name__}")


__all__ = ["ReshardReport", "reshard"]
