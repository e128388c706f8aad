"""The destination's write in an offline reshard: every new shard file made from the source
chunks its box needs (each chunk's CRC checked as it is read, every source file read in full
checked whole once its last chunk is in, a chunk several new files need read once), the new
manifest, each destination store's draft committed by its store (a directory's rename, a
bucket's commit object), manifest last."""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ckptfmt.checksum import combine
from ckptfmt.container.metadata import utc_now, write_metadata, writer_info
from ckptfmt.dtypes import by_name
from ckptfmt.engine.copies import GOOD, read_copy
from ckptfmt.engine.encode import encode_offline, offline_work
from ckptfmt.errors import (
    ChecksumError,
    CkptError,
    NotDurableError,
    StorageError,
    StorageFullError,
    UsageError,
)
from ckptfmt.format.chunk_reads import read_chunks
from ckptfmt.format.options import WriteOptions
from ckptfmt.format.shard_io import Geometry, plan_region, region_cells, shard_file_nbytes
from ckptfmt.maintenance.nodes import remove_stale_nodes, superseded_by
from ckptfmt.maintenance.reshard_select import Selection
from ckptfmt.manifest.codec import dump_manifest
from ckptfmt.manifest.grid import cells, grid_shape
from ckptfmt.manifest.limits import display
from ckptfmt.manifest.model import (
    Entry,
    FileRef,
    Manifest,
    PerRankValueEntry,
    RankInfo,
    Region,
    TensorEntry,
)
from ckptfmt.plan.ownership import SavePlan, TensorPlan
from ckptfmt.plan.reads import Box, Layout, plan_reads
from ckptfmt.redundancy.config import Redundancy
from ckptfmt.storage.files import Files, Inside, storage_full, write_error
from ckptfmt.storage.progress import Meter, ProgressCallback, metering
from ckptfmt.storage.store import Draft, Location, Store

Name = tuple[str, ...]


class _SourceCrcs:
    """Chunk CRCs of source files read in parts; a file's data CRC is checked once all of its
    in-bounds chunks have been read (in slot order)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: dict[str, dict[int, tuple[int, int]]] = {}
        self.done: set[str] = set()

    def checked(self, ref: FileRef) -> None:
        with self.lock:
            self.done.add(ref.path)
            self.seen.pop(ref.path, None)

    def add(
        self,
        ref: FileRef,
        slots: Sequence[int],
        crcs: Sequence[int],
        n_present: int,
        nb: int,
        tensor: str,
    ) -> None:
        with self.lock:
            if ref.path in self.done:
                return
            got = self.seen.setdefault(ref.path, {})
            got.update({s: (c, nb) for s, c in zip(slots, crcs)})
            if len(got) < n_present:
                return
            crc = 0
            for s in sorted(got):
                c, n = got[s]
                crc = combine(crc, c, n)
            self.done.add(ref.path)
            del self.seen[ref.path]
        if crc != ref.crc32c:
            raise ChecksumError(ref.path, "data (all chunks)", ref.crc32c, crc, (tensor,))


class _ChunkCache:
    """Recently read source chunks (verified), so that a chunk that several new shards need is
    read once: a finer new grid than the source's chunks would otherwise read each source chunk
    once per new shard it overlaps. Least recently used first out, up to ``max_bytes``."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.lock = threading.Lock()
        self.max_bytes = max_bytes
        self.size = 0
        self.chunks: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()

    def get(self, key: tuple[str, int]) -> np.ndarray | None:
        with self.lock:
            got = self.chunks.get(key)
            if got is not None:
                self.chunks.move_to_end(key)
            return got

    def put(self, key: tuple[str, int], chunk: np.ndarray) -> None:
        with self.lock:
            if key in self.chunks or chunk.nbytes > self.max_bytes:
                return
            self.chunks[key] = chunk
            self.size += chunk.nbytes
            while self.size > self.max_bytes:
                _, old = self.chunks.popitem(last=False)
                self.size -= old.nbytes


Sources = Mapping[str, Path | Files]
"""Each saved node's files: its directory, or a bucket checkpoint's objects (every node's)."""


def write_destination(
    manifest: Manifest,
    sel: Selection,
    plan: SavePlan,
    src_dirs: Sources,
    dst: Location,
    stores: dict[str, Store],
    node_list: list[str],
    redundancy: Redundancy | None,
    write: WriteOptions,
    progress: ProgressCallback | None,
) -> tuple[Manifest, int, int, list[str]]:
    """Write every destination store's draft (``stores``: each new node's) and commit them
    (manifest last: every draft's manifest is staged before any is published); on any failure
    abort every draft not published yet and raise (a full disk as :class:`StorageFullError`
    saying where and how much). Returns the new manifest, the bytes read and written, and
    where each store committed (its path or URL)."""
    per_node = dst.kind == "spread"  # a {node} template (a node map is refused before)
    sources = {n: Inside(p) if isinstance(p, Path) else p for n, p in src_dirs.items()}
    save_id = os.urandom(16).hex()
    drafts: dict[Store, Draft] = {}
    published: set[Store] = set()
    not_durable: list[NotDurableError] = []
    try:
        for store in dict.fromkeys(stores.values()):
            drafts[store] = store.prepare(save_id, write.overwrite)
        draft_of = {k: drafts[stores[node_list[k]]] for k in range(len(node_list))}
        ranks = len(node_list)
        skeleton = _manifest(
            manifest, sel.kept, plan, {}, sel.sources, node_list, save_id, ranks
        )  # fmt: skip
        for d in drafts.values():
            write_metadata(d, skeleton, write.fsync)
        threads = max(write.threads, *(d.writes_in_flight for d in drafts.values()))
        with metering("reshard", progress) as meter:
            meter.expect(_planned_work(plan, node_list, redundancy))
            refs, read, written = _write_files(
                manifest, plan, sel.sources, sources, draft_of, threads, write.fsync, meter
            )
            out = _manifest(manifest, sel.kept, plan, refs, sel.sources, node_list, save_id, ranks)
            if per_node:
                out = replace(out, levels={"1": {}})
            if redundancy is not None:  # directories only (reshard's arguments check)
                dir_of = {k: _local(d) for k, d in draft_of.items()}
                out = encode_offline(out, dir_of, redundancy, write.fsync)  # counts on the meter
            data = dump_manifest(out)
            for d in drafts.values():
                d.stage_manifest(data, [d.written()], write.fsync)
            before, old_nodes = _saves_replaced(drafts) if per_node else (set(), set())
            replaced: list[tuple[Draft, Any]] = []
            try:
                for store, d in drafts.items():
                    try:
                        old = d.publish(fsync=write.fsync)
                    except NotDurableError as exc:  # renamed into place: published, not synced
                        old = exc.replaced
                        not_durable.append(exc)
                    replaced.append((d, old))
                    published.add(store)
            except BaseException as exc:  # the nodes published take their previous copy back
                stuck = _roll_back(replaced, drafts, write.fsync)
                err: BaseException = exc
                if isinstance(exc, OSError) and not isinstance(exc, CkptError):
                    err = StorageError.of(exc, str(store.where), "the reshard's destination")
                if stuck and isinstance(exc, Exception):
                    # the failure and what it left: nodes still on the new save (no errno: the
                    # message is this one, not a full disk's rewritten from its fields below)
                    path, why = str(store.where), str(err)
                    if isinstance(err, StorageError):
                        path, why = err.path, err.reason
                    level = err.level if isinstance(err, StorageError) else None
                    err = StorageError(path, f"{why}; {stuck}", level=level)
                if err is exc:
                    raise
                raise err from exc
            if not not_durable:  # else nothing more is deleted while the commit may not be on disk
                for d, old in replaced:
                    d.discard(old)
                if per_node and isinstance(dst.spec, str | os.PathLike):
                    remove_stale_nodes(os.fspath(dst.spec), node_list, before, old_nodes)
            meter.finish()
    except BaseException as exc:
        for store, d in drafts.items():
            if store not in published:
                d.abort()
        local = all(d.path is not None for d in drafts.values())
        if isinstance(exc, OSError) and not isinstance(exc, StorageFullError) and local:
            exc = storage_full(exc, Path(str(dst))) or exc  # e.g. no inode for a mkdir
        if isinstance(exc, StorageFullError):  # say where, how much, and that it was a write
            level = "level 1, every node's directory" if per_node else None
            needed = sum(t.size * by_name(t.dtype).itemsize for t in manifest.tensors())
            raise exc.with_context(
                level=level or "the reshard's destination",
                needed=max(needed, exc.needed or 0),
                path=str(dst),
            ) from None
        failed = write_error(exc, Path(str(dst)), "the reshard's destination") if local else None
        if failed is not None:  # a file over the size limit
            raise failed from None
        raise
    if not_durable:  # committed on every node: said, not undone
        first = not_durable[0]
        where = ", ".join(e.path for e in not_durable)
        raise NotDurableError(
            where,
            first.cause,
            level="the reshard's destination",
            err=first.errno,
            replaced=[e.replaced for e in not_durable],
        )
    return out, read, written, [s.where for s in drafts]


def _saves_replaced(drafts: Mapping[Store, Draft]) -> tuple[set[str], set[str]]:
    """The save ids that the directories ``drafts`` are about to replace hold, and the saves
    those rewrote (a reshard in place onto the same ``{node}`` template, done twice): whose
    other nodes' directories :func:`remove_stale_nodes` removes once the new save stands; and
    the nodes those saves' manifests list (the old layout)."""
    ids: set[str] = set()
    nodes: set[str] = set()
    for d in drafts.values():
        final = getattr(d, "final", None)
        if isinstance(final, Path):
            c = read_copy(final)
            if c.state == GOOD and c.manifest is not None:
                ids.add(c.manifest.save_id)
                nodes.update(r.node for r in c.manifest.ranks)
                older = superseded_by(c.manifest)
                if older is not None:
                    ids.add(older)
    return ids, nodes


def _roll_back(
    replaced: list[tuple[Draft, Any]], drafts: Mapping[Store, Draft], fsync: bool
) -> str:
    """Give every node in ``replaced`` (each draft published, with what it replaced; ``drafts``
    their stores) its previous copy back, the last published first; a node whose rollback fails
    does not stop the others'. Returns what is left undone, for the error ('' when nothing):
    each such node's directory and why its rollback failed."""
    where = {id(d): s.where for s, d in drafts.items()}
    stuck = []
    for d, old in reversed(replaced):
        try:
            d.unpublish(old, fsync)
        except Exception as exc:  # the other nodes are rolled back all the same
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            stuck.append(f"{where[id(d)]} ({why.lower()})")
    if not stuck:
        return ""
    return "and could not be rolled back to its previous checkpoint: " + ", ".join(stuck)


def _local(draft: Draft) -> Path:
    """A draft's staging directory (the parity files are written there)."""
    if draft.path is None:
        raise UsageError(f"redundancy is encoded over node-local directories, not {draft.where}")
    return draft.path


def _planned_work(plan: SavePlan, nodes: list[str], redundancy: Redundancy | None) -> int:
    """The bytes of work :func:`_write_files` (and, with ``redundancy``, the parity encoding)
    counts for ``plan``: every new file's data read, every file written; every member read
    back and every parity file written. From the plan's geometry, before any byte moves."""
    total = 0
    member_bytes = [0] * len(nodes)
    for t in plan.tensors:
        geo = Geometry.of("/".join(t.name), t.dtype, t.shape, t.shard_shape, t.chunk_shape)
        for r in t.regions:
            for cell in region_cells(geo, r.offset, r.shape):
                lo = tuple(c * h for c, h in zip(cell, t.shard_shape))
                hi = tuple(min(a + h, s) for a, h, s in zip(lo, t.shard_shape, t.shape))
                size = shard_file_nbytes(geo, cell)
                total += math.prod(b - a for a, b in zip(lo, hi)) * geo.dtype.itemsize + size
                member_bytes[r.writer] += size
    if redundancy is not None:
        total += offline_work(redundancy, nodes, member_bytes)
    return total


def _manifest(
    m: Manifest,
    kept: Sequence[Entry],
    plan: SavePlan,
    refs: Mapping[tuple[Name, tuple[int, ...]], tuple[FileRef, ...]],
    sources: Sequence[int | None],
    nodes: list[str],
    save_id: str,
    ranks: int,
) -> Manifest:
    plans = {t.name: t for t in plan.tensors}
    entries: list[Entry] = []
    for e in kept:
        if isinstance(e, TensorEntry):
            t = plans[e.name]
            regions = tuple(
                Region(r.offset, r.shape, r.writer, refs.get((e.name, r.offset), ()))
                for r in t.regions
            )
            entries.append(
                TensorEntry(
                    e.name,
                    e.path,
                    e.dtype,
                    t.shape,
                    t.shard_shape,
                    t.chunk_shape,
                    regions,
                    e.per_rank,
                    e.encoding,
                )
            )
        elif isinstance(e, PerRankValueEntry):
            entries.append(
                PerRankValueEntry(e.name, tuple(e.values[s] for s in sources if s is not None))
            )
        else:
            entries.append(e)
    writer = {
        **writer_info(),
        "resharded_from": {"save_id": m.save_id, "world_size": m.world_size},
    }
    return Manifest(
        save_id=save_id,
        step=m.step,
        created=utc_now(),
        world_size=ranks,
        ranks=tuple(RankInfo(k, nodes[k]) for k in range(ranks)),
        entries=tuple(entries),
        levels={},
        writer=writer,
    )


def _write_files(
    m: Manifest,
    plan: SavePlan,
    sources: Sequence[int | None],
    src_of_node: Mapping[str, Files],
    draft_of: Mapping[int, Draft],
    threads: int,
    fsync: bool,
    meter: Meter,
) -> tuple[dict[tuple[Name, tuple[int, ...]], tuple[FileRef, ...]], int, int]:
    """Write every new shard file (each from the source chunks its box needs); returns the
    files of each region, bytes read and bytes written. Each file's data read and the file
    written are counted on ``meter`` (from the pool's threads: they do the work)."""
    olds = {t.name: t for t in m.tensors()}
    crcs = _SourceCrcs()
    cache = _ChunkCache()
    counters = [0, 0]
    lock = threading.Lock()
    jobs: list[tuple[Name, tuple[int, ...], Callable[[], FileRef]]] = []

    def one_cell(t: TensorPlan, old: TensorEntry, writer: int, cell: tuple[int, ...]) -> FileRef:
        geo = Geometry.of("/".join(t.name), t.dtype, t.shape, t.shard_shape, t.chunk_shape)
        lo = tuple(c * h for c, h in zip(cell, t.shard_shape))
        hi = tuple(min(a + h, s) for a, h, s in zip(lo, t.shard_shape, t.shape))
        data = np.empty(tuple(b - a for a, b in zip(lo, hi)), dtype=geo.dtype)
        nread = 0
        if old.per_rank:  # new row r is saved rank sources[r]'s row
            for r in range(lo[0], hi[0]):
                s = sources[r]
                assert s is not None  # entries some rank has no source for were left out
                box = ((s, *lo[1:]), (1, *(b - a for a, b in zip(lo[1:], hi[1:]))))
                nread += _read_box(
                    old, box, data[r - lo[0] : r - lo[0] + 1], m, src_of_node, crcs, cache
                )
        else:
            nread += _read_box(old, (lo, data.shape), data, m, src_of_node, crcs, cache)
        meter.add(data.nbytes, "read")
        (job,) = plan_region(draft_of[writer], geo, data, lo)
        ref = job.run(fsync)
        with lock:
            counters[0] += nread
            counters[1] += ref.size
        meter.add(ref.size, "write")
        return ref

    for t in plan.tensors:
        old = olds[t.name]
        for r in t.regions:  # a 0-d tensor's one region has the one cell ()
            first = tuple(o // h for o, h in zip(r.offset, t.shard_shape))
            n = grid_shape(r.shape, t.shard_shape)
            for rel in cells((0,) * len(n), n):
                cell = tuple(a + b for a, b in zip(first, rel))
                jobs.append((t.name, r.offset, _bind(one_cell, t, old, r.writer, cell)))
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        futures = [pool.submit(fn) for _, _, fn in jobs]
        results = [f.result() for f in futures]
    refs: dict[tuple[Name, tuple[int, ...]], list[FileRef]] = {}
    for (name, offset, _), ref in zip(jobs, results):
        refs.setdefault((name, offset), []).append(ref)
    return {k: tuple(v) for k, v in refs.items()}, counters[0], counters[1]


def _bind(fn: Callable[..., FileRef], *args: Any) -> Callable[[], FileRef]:
    return lambda: fn(*args)


def _read_box(
    t: TensorEntry,
    box: Box,
    out: np.ndarray,
    m: Manifest,
    src_of_node: Mapping[str, Files],
    crcs: _SourceCrcs,
    cache: _ChunkCache,
) -> int:
    """Fill ``out`` with the box of source tensor ``t``; returns the bytes read."""
    geo = Geometry.of(t.path, t.dtype, t.shape, t.shard_shape, t.chunk_shape)
    nb = geo.chunk_nbytes
    name = display(t.name)
    total = 0
    for fr in plan_reads(Layout.of(t), box):
        ref = t.regions[fr.region].files[fr.file]
        chunks = {s: cache.get((ref.path, s)) for s in fr.slots}
        missing = [s for s, c in chunks.items() if c is None]
        if missing:
            buf = np.empty(len(missing) * nb, np.uint8)
            views = [buf[i * nb : (i + 1) * nb] for i in range(len(missing))]
            got = read_chunks(
                src_of_node[m.ranks[fr.writer].node],
                geo,
                ref,
                fr.cell,
                missing,
                [memoryview(v) for v in views],  # type: ignore[arg-type]
                len(missing) == fr.n_present,
                (name,),
            )
            if len(missing) == fr.n_present:  # read whole: read_chunks checked the data CRC
                crcs.checked(ref)
            else:
                crcs.add(ref, missing, got, fr.n_present, nb, name)
            total += len(missing) * nb
            for s, v in zip(missing, views):
                chunks[s] = v
                cache.put((ref.path, s), v)
        for p in fr.pieces:
            chunk = chunks[p.slot]
            assert chunk is not None
            out[p.dst(box[0])] = chunk.view(geo.dtype).reshape(geo.chunk_shape)[p.src()]
    return total
