"""Reading a committed checkpoint: its manifest, whole tensors, and the lazy view ``ckptfmt.open``.

Nothing here trusts a file before checking it: the manifest is parsed by ``manifest.codec`` (which
also checks every path it names is the shard key of a grid cell, so nothing outside the checkpoint
is opened), and every data byte is checked against its CRC32C as it is read.
"""

from __future__ import annotations

import functools
import math
import os
import re
import shlex
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ckptfmt.dtypes import by_name
from ckptfmt.errors import (
    AllocationLimitError,
    CkptError,
    MetadataMismatchError,
    MissingFileError,
    NotACheckpointError,
    NotRegularFileError,
    UsageError,
)
from ckptfmt.errors.base import few
from ckptfmt.format.chunk_reads import read_chunks
from ckptfmt.format.shard_io import Geometry, byte_view
from ckptfmt.format.shard_read import decode_shard, read_file, read_region, region_reads
from ckptfmt.format.zarr_meta import DocChecker
from ckptfmt.manifest.codec import MANIFEST_NAME, parse_manifest
from ckptfmt.manifest.grid import ChunkSlot, cells
from ckptfmt.manifest.limits import MANIFEST_MAX_BYTES, display
from ckptfmt.manifest.model import (
    FileRef,
    GroupEntry,
    Manifest,
    PerRankValueEntry,
    Region,
    TensorEntry,
    ValueEntry,
)
from ckptfmt.storage.files import (
    Files,
    Inside,
    each_in_flight,
    naming,
    naming_checkpoint,
    physical_memory,
)
from ckptfmt.storage.objects.source import latest_url
from ckptfmt.storage.steps import StepRef, list_step_dirs
from ckptfmt.storage.store.location import Location, parse_location


def read_manifest_bytes(root: Path) -> bytes:
    """The manifest file of the committed checkpoint at ``root``, as stored."""
    if not root.is_dir():
        reason = "no such directory" if not root.exists() else "not a directory"
        raise NotACheckpointError(str(root), reason)
    try:
        return Inside(root).read(MANIFEST_NAME, MANIFEST_MAX_BYTES + 1)
    except NotRegularFileError as exc:
        raise NotACheckpointError(str(root), f"{MANIFEST_NAME} is {exc.what}, refused") from None
    except FileNotFoundError:
        raise NotACheckpointError(
            str(root),
            f"no {MANIFEST_NAME} (never committed, torn before commit, or not ours)",
            near_miss(root),
        ) from None
    except OSError as exc:
        raise NotACheckpointError(str(root), f"cannot read {MANIFEST_NAME}: {exc}") from None


HF_DATA_DIR = "ckptfmt"
"""Where a Hugging Face ``Trainer`` checkpoint (``checkpoint-N/``) keeps its ckptfmt data."""
_HF_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def near_miss(root: Path) -> str:
    """Where the checkpoint meant probably is, when ``root`` (a directory without a manifest)
    is a near miss, said as a hint; empty otherwise. Only names and manifests' presence are
    looked at (one directory listing):

    * a Hugging Face ``Trainer``'s ``checkpoint-N/``: its ckptfmt data is ``checkpoint-N/ckptfmt``;
    * a root of step directories (``step-0000000100``, ``step-100``): one of them, the newest
      committed named, and ``ckptfmt list ROOT`` (``ckptfmt.latest(ROOT)``) to choose;
    * a ``Trainer``'s ``output_dir``: the newest ``checkpoint-N/ckptfmt``."""
    if (root / HF_DATA_DIR / MANIFEST_NAME).is_file():
        return (
            f"its ckptfmt checkpoint is {root / HF_DATA_DIR} (a Hugging Face Trainer "
            "checkpoint-N/ keeps it there): give that path"
        )
    steps = list_step_dirs(root, loose=True)
    if steps:
        committed = [p for _, p in steps if (p / MANIFEST_NAME).is_file()]
        newest = f", such as the newest committed, {committed[-1]}" if committed else ""
        shown = few([p.name for _, p in steps])
        return (
            f"it holds the checkpoints of {len(steps)} step(s) ({shown}): give one{newest}; "
            f"`ckptfmt list {shlex.quote(str(root))}` lists them "
            f"(in Python, ckptfmt.latest({str(root)!r}) gives the newest)"
        )
    hf = sorted(
        (int(m[1]), p)
        for p in _subdirs(root)
        if (m := _HF_CHECKPOINT.match(p.name)) and (p / HF_DATA_DIR / MANIFEST_NAME).is_file()
    )
    if hf:
        return (
            f"it holds Hugging Face Trainer checkpoints ({few([p.name for _, p in hf])}), each "
            f"with its ckptfmt checkpoint in ckptfmt/: give one, the newest is "
            f"{hf[-1][1] / HF_DATA_DIR}"
        )
    return ""


def _subdirs(root: Path) -> list[Path]:
    try:
        return [p for p in root.iterdir() if p.is_dir()]
    except OSError:
        return []


def read_manifest(root: Path) -> Manifest:
    """Read and check the manifest of the committed checkpoint at ``root`` (a directory: a
    user's path is parsed where it is handed in, ``storage.store.location``)."""
    return parse_manifest(read_manifest_bytes(root), str(root / MANIFEST_NAME))


DOC_MAX_BYTES = 1 << 20  # a zarr.json is a few hundred bytes; anything longer is not ours


@naming_checkpoint
def read_doc(src: Files, manifest: Manifest, rel: str, checker: DocChecker | None = None) -> bytes:
    """The bytes of the ``zarr.json`` at ``rel``, checked against what ``manifest`` implies
    (``codecs.zarr_meta.DocChecker``: from format version 2 on, exactly that document; pass one
    ``checker`` for many documents). Raises :class:`MissingFileError` (absent, a link, not a
    regular file) or :class:`MetadataMismatchError`."""
    try:
        data = src.read(rel, DOC_MAX_BYTES + 1)
    except NotRegularFileError as exc:
        raise NotRegularFileError(rel, exc.what) from None
    except FileNotFoundError:
        raise MissingFileError(rel) from None
    if len(data) > DOC_MAX_BYTES:
        raise MetadataMismatchError(rel, f"longer than {DOC_MAX_BYTES} bytes")
    (checker or DocChecker(manifest)).check_bytes(rel, data)
    return data


def check_documents(src: Files, manifest: Manifest, share: tuple[int, int] = (0, 1)) -> None:
    """Check every ``zarr.json`` of the checkpoint in ``src`` (``ckptfmt.load`` does, so that a
    damaged metadata document is found by a load as by ``verify``); raises the first problem,
    a :class:`DamagedError` naming the file. ``share`` ``(i, n)``: only every ``n``-th document
    from the ``i``-th, in name order (one copy read by ``n`` ranks, each its share). The
    documents are read ``src.reads_in_flight`` at a time."""
    checker, docs = _share_of_documents(manifest, share)
    check = functools.partial(read_doc, src, manifest, checker=checker)
    for _ in each_in_flight(src, check, docs):
        pass  # the first problem in name order raises here


def document_checks(
    src: Files, manifest: Manifest, share: tuple[int, int] = (0, 1), batch: int = 32
) -> list[Callable[[], None]]:
    """:func:`check_documents` as jobs of up to ``batch`` documents each, for a load to run on
    its read threads beside the data (what a job raises is damage, the load's to vote on)."""
    checker, docs = _share_of_documents(manifest, share)

    def check(rels: list[str]) -> None:
        for rel in rels:
            read_doc(src, manifest, rel, checker)

    return [functools.partial(check, docs[k : k + batch]) for k in range(0, len(docs), batch)]


def _share_of_documents(manifest: Manifest, share: tuple[int, int]) -> tuple[DocChecker, list[str]]:
    """The checker of ``manifest``'s documents and share ``(i, n)`` of them, in name order."""
    checker = DocChecker(manifest)
    i, n = share
    return checker, sorted(checker.paths)[i::n]


def check_allocation(tensors: Sequence[TensorEntry], limit: int | None) -> int:
    """Raise :class:`AllocationLimitError` before anything is allocated when one of ``tensors``,
    or all of them together, would take more than ``limit`` bytes (None: :func:`physical_memory`;
    0: no limit). Returns the bytes they take."""
    if limit is None:
        limit = physical_memory()
    total = 0
    for t in tensors:
        nbytes = t.size * by_name(t.dtype).itemsize
        if limit and nbytes > limit:
            raise AllocationLimitError(display(t.name), nbytes, limit)
        total += nbytes
    if limit and total > limit:
        raise AllocationLimitError(None, total, limit)
    return total


def geometry(t: TensorEntry) -> Geometry:
    return Geometry.of(t.path, t.dtype, t.shape, t.shard_shape, t.chunk_shape)


Where = Files | Callable[[int], Files]
"""Where a checkpoint's files are: one directory (or one checkpoint in a bucket), or (a level-1
checkpoint spread over node directories) the directory of the node of each saved rank
(rank -> directory)."""


def _inside(src: Where, rank: int) -> Files:
    return src(rank) if callable(src) else src  # a Files is never callable


def read_tensor(src: Where, t: TensorEntry, pool: Executor | None = None) -> np.ndarray:
    """A whole tensor, every byte verified (shard files read concurrently with ``pool``)."""
    out, jobs = tensor_reads(src, t)
    if pool is None or len(jobs) < 2:
        for job in jobs:
            job()
    else:
        for future in [pool.submit(job) for job in jobs]:
            future.result()
    return out


def tensor_reads(
    src: Where,
    t: TensorEntry,
    sizes: list[int] | None = None,
    into: Callable[[], np.ndarray] | None = None,
) -> tuple[np.ndarray, list[Callable[[], None]]]:
    """The destination of a whole tensor and the jobs (one per shard file) that fill it, each
    region from the directory of the rank that wrote it. ``sizes``: each job's stored bytes
    are appended to it, in the order of the jobs (a progress count). ``into()`` gives the
    destination (C-contiguous, ``t``'s shape and dtype: a mapped window of an output file,
    say); default a new array.

    File sizes are checked against the manifest before the tensor's memory is allocated, so a
    hostile manifest cannot make a reader allocate what the disk does not hold."""
    geo = geometry(t)
    for r in t.regions:
        for ref in r.files:
            _inside(src, r.rank).check_size(ref.path, ref.size, (display(t.name),))
    out = np.empty(t.shape, dtype=geo.dtype) if into is None else into()
    jobs: list[Callable[[], None]] = []
    for r in t.regions:
        inside = _inside(src, r.rank)
        view = out[tuple(slice(o, o + s) for o, s in zip(r.offset, r.shape))] if t.shape else out
        if view.flags.c_contiguous:
            jobs += region_reads(inside, geo, r.files, r.offset, view, (display(t.name),))
            if sizes is not None:
                sizes += [f.size for f in r.files]
        else:  # a region narrower than the tensor on a trailing axis: read, then place
            jobs.append(functools.partial(_read_and_place, inside, geo, r, view, display(t.name)))
            if sizes is not None:
                sizes.append(sum(f.size for f in r.files))
    return out, jobs


def _read_and_place(src: Files, geo: Geometry, r: Region, view: np.ndarray, name: str) -> None:
    target = np.empty(r.shape, dtype=geo.dtype)
    read_region(src, geo, r.files, r.offset, target, (name,))
    view[...] = target


def _read_inner(
    src: Files,
    geo: Geometry,
    ref: FileRef,
    cell: tuple[int, ...],
    bounds: Sequence[tuple[int, int]],
    tensors: Sequence[str],
) -> list[tuple[ChunkSlot, np.ndarray]]:
    """The inner chunks of the shard file ``ref`` (at grid ``cell``) that overlap the box
    ``bounds``, each at full chunk shape and CRC-checked (``format.chunk_reads``): the shard
    index and those chunks are all that is read."""
    _, slots = geo.slots(cell)
    want = [
        s
        for s in slots
        if all(max(x, a) < min(y, b) for x, y, (a, b) in zip(s.box_lo, s.box_hi, bounds))
    ]
    chunks = [np.empty(geo.chunk_shape, dtype=geo.dtype) for _ in want]
    if want:
        targets = [byte_view(c) for c in chunks]
        whole = len(want) == len(slots)
        read_chunks(src, geo, ref, cell, [s.slot for s in want], targets, whole, tensors)
    return list(zip(want, chunks))


def _normalize_key(
    key: Any, shape: tuple[int, ...]
) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """Basic slicing (ints, step-1 slices, one Ellipsis) as per-axis ``[start, stop)`` and the
    axes indexed by an int (dropped from the result)."""
    if not isinstance(key, tuple):
        key = (key,)
    if any(k is Ellipsis for k in key):
        i = next(i for i, k in enumerate(key) if k is Ellipsis)
        key = key[:i] + (slice(None),) * (len(shape) - len(key) + 1) + key[i + 1 :]
    if len(key) > len(shape):
        raise UsageError(f"too many indices for a {len(shape)}-d tensor")
    key = key + (slice(None),) * (len(shape) - len(key))
    out = []
    dropped = []
    for axis, (k, d) in enumerate(zip(key, shape)):
        if isinstance(k, (int, np.integer)) and not isinstance(k, bool):
            i = int(k) + d if k < 0 else int(k)
            if not 0 <= i < d:
                raise UsageError(f"index {k} out of range for size {d}")
            out.append((i, i + 1))
            dropped.append(axis)
        elif isinstance(k, slice):
            start, stop, step = k.indices(d)
            if step != 1:
                raise UsageError("only step-1 slices are supported; slice the result further")
            out.append((start, max(start, stop)))
        else:
            raise UsageError(f"unsupported index {k!r}")
    return tuple(out), tuple(dropped)


@dataclass(frozen=True)
class TensorView:
    """A lazily read tensor of an open checkpoint: shape, dtype and sizes without reading data;
    indexing reads only the shard files the selection touches, verifying what it reads."""

    src: Where
    entry: TensorEntry

    @property
    def name(self) -> str:
        return display(self.entry.name)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape

    @property
    def dtype(self) -> np.dtype:
        return by_name(self.entry.dtype).numpy

    @property
    def nbytes(self) -> int:
        return self.entry.size * self.dtype.itemsize

    def read(self, max_bytes: int | None = None) -> np.ndarray:
        """The whole tensor, every byte verified; ``max_bytes`` as for ``ckptfmt.load``."""
        check_allocation([self.entry], max_bytes)
        return read_tensor(self.src, self.entry)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self.read()
        return arr if dtype is None else arr.astype(dtype)

    def __getitem__(self, key: Any) -> np.ndarray:
        bounds, dropped = _normalize_key(key, self.shape)
        nbytes = math.prod(b - a for a, b in bounds) * self.dtype.itemsize
        limit = physical_memory()
        if limit and nbytes > limit:
            raise AllocationLimitError(self.name, nbytes, limit)
        out = np.empty(tuple(b - a for a, b in bounds), dtype=self.dtype)
        if out.size:
            self.read_into(out, bounds)
        return out.reshape([d for i, d in enumerate(out.shape) if i not in dropped])

    def read_into(self, out: np.ndarray, bounds: Sequence[tuple[int, int]]) -> None:
        """Fill ``out`` (of this tensor's dtype, shaped ``[b - a for a, b in bounds]``) with the
        box ``bounds`` (``(start, stop)`` per dimension) of this tensor, reading only the shard
        files that overlap it, every chunk's CRC32C checked: the indexing of ``view[...]``
        without the array it allocates (the DCP reader fills a training tensor in place)."""
        bounds = tuple((int(a), int(b)) for a, b in bounds)
        want = tuple(b - a for a, b in bounds)
        if out.dtype != self.dtype or tuple(out.shape) != want:
            raise UsageError(
                f"{self.name}: read_into needs a {self.dtype} array of shape {list(want)}, "
                f"got {out.dtype} {list(out.shape)}"
            )
        t, geo = self.entry, geometry(self.entry)
        tensors = (self.name,)
        lo = tuple(a // h for (a, _), h in zip(bounds, t.shard_shape))
        hi = tuple(-(-b // h) for (_, b), h in zip(bounds, t.shard_shape))
        by_cell = {
            geo.cell_of([o + i * h for o, i, h in zip(r.offset, idx, t.shard_shape)]): (f, r.rank)
            for r in t.regions
            for idx, f in zip(
                cells((0,) * len(r.shape), [-(-s // h) for s, h in zip(r.shape, t.shard_shape)]),
                r.files,
            )
        }
        for cell in cells(lo, hi):
            ref, rank = by_cell[cell]
            src = _inside(self.src, rank)
            with naming(src):
                if src.reads_parts:  # an object: ranged GETs of its index and the chunks needed
                    found = _read_inner(src, geo, ref, cell, bounds, tensors)
                else:  # a local file: read whole, every CRC of it checked
                    found = decode_shard(read_file(src, ref, tensors), geo, cell, ref, tensors)
            for s, chunk in found:
                a = [max(x, b0) for x, (b0, _) in zip(s.box_lo, bounds)]
                b = [min(x, b1) for x, (_, b1) in zip(s.box_hi, bounds)]
                if any(x >= y for x, y in zip(a, b)):
                    continue
                out[tuple(slice(x - b0, y - b0) for x, y, (b0, _) in zip(a, b, bounds))] = chunk[
                    tuple(slice(x - c, y - c) for x, y, c in zip(a, b, s.box_lo))
                ]

    def __repr__(self) -> str:
        return f"TensorView({self.name!r}, shape={self.shape}, dtype={self.entry.dtype})"


class Checkpoint:
    """A committed checkpoint opened read-only (``ckptfmt.open``). Nothing but the manifest is
    read until a tensor is indexed.

    ``path``: its directory (or the URL of ``U/<save_id>`` in a bucket), a path or its parsed
    :class:`~ckptfmt.storage.store.location.Location`. A checkpoint in a bucket, or spread
    over node directories, is given with its ``manifest`` and ``src`` (its objects; rank ->
    the directory holding that rank's files); ``keep``: what must live as long as this object
    (a scratch directory its reads go to)."""

    def __init__(
        self,
        path: str | os.PathLike[str] | Location,
        *,
        manifest: Manifest | None = None,
        src: Where | None = None,
        keep: object = None,
    ) -> None:
        where = parse_location(path)
        self.path: Path | str = where.shown  # a bucket's URL stays one: a Path folds its "//"
        if manifest is None or src is None:  # read here: a directory (a URL is refused)
            root = where.directory()
            manifest = read_manifest(root) if manifest is None else manifest
            src = Inside(root) if src is None else src
        self.manifest = manifest
        self._src: Where = src
        self._keep = keep
        self._entries = {display(e.name): e for e in self.manifest.entries}

    @property
    def step(self) -> int | None:
        return self.manifest.step

    def keys(self) -> list[str]:
        """Names of all tensors and values, components joined by '/'."""
        return [n for n, e in self._entries.items() if not isinstance(e, GroupEntry)]

    def tensors(self) -> dict[str, TensorView]:
        return {
            n: TensorView(self._src, e)
            for n, e in self._entries.items()
            if isinstance(e, TensorEntry)
        }

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __contains__(self, name: object) -> bool:
        key = display(name) if isinstance(name, tuple) else name
        e = self._entries.get(key) if isinstance(key, str) else None
        return e is not None and not isinstance(e, GroupEntry)

    def __getitem__(self, name: str | tuple[str, ...]) -> Any:
        key = display(name) if isinstance(name, tuple) else name
        e = self._entries.get(key)
        if e is None or isinstance(e, GroupEntry):
            raise KeyError(name)
        if isinstance(e, TensorEntry):
            return TensorView(self._src, e)
        if isinstance(e, ValueEntry):
            return e.value
        assert isinstance(e, PerRankValueEntry)
        return list(e.values)

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, step={self.step}, entries={len(self._entries)})"


def latest(
    root: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
) -> StepRef | None:
    """The newest :class:`StepRef` ``(step, path)`` under a checkpoint root whose manifest
    reads and parses.

    Step directories are named ``step-0000000100`` (what the manager and ``step_dir_name``
    write); ``step-100``, a name given by hand, counts too (``spec/PROTOCOL.md`` §4). Steps
    whose manifest is missing or damaged are skipped (a torn save never becomes latest); their
    data is not read here, ``verify`` does that.

    ``root`` may be a level-3 root in a bucket (``s3://bucket/run``, what a manager with
    ``shared_dir=`` that URL writes): the step its latest pointer names, when that step's
    commit object is there and every object it lists is there with its size; else (no pointer,
    or a step that no longer commits) the newest whole step found by one LIST. The path of the
    :class:`StepRef` is then the step's URL. ``storage_options``: as for ``ckptfmt.save``.
    """
    where = parse_location(root, storage_options)
    if where.is_bucket:
        return latest_url(where.spec, where.storage_options)
    for step, path in reversed(list_step_dirs(where.directory(), loose=True)):
        try:
            read_manifest(path)
        except CkptError:
            continue
        return StepRef(step, path)
    return None
