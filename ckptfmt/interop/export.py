"""Export a committed ckptfmt checkpoint as Hugging Face safetensors (``ckptfmt export``).

Because ckptfmt stores every tensor at its global shape, consolidating a checkpoint saved by
many ranks is a streaming read, not a gather: each tensor is read whole (its regions from
whichever ranks' files hold them, every chunk CRC checked, ``maintenance.source``), cast if asked,
and written at its place in its output file; a bounded window of tensors is read ahead on
``threads`` threads while the main thread writes, so memory stays within about one output shard
(``window_bytes``, at most the shard size) whatever the checkpoint's size. Headers are computed
up front from the manifest (shapes and dtypes are known), so every file is written in one pass.

The output appears whole or not at all: everything is written into a staging directory
``.<name>.export-<random>`` beside ``out`` (fsynced), then renamed to ``out``, a previous export
swapped out in one step (:func:`publish`; ``spec/CLI.md`` §4); a failure removes the staging
directory and any parent of ``out`` the export made, and what a killed export leaves (only
dot-named directories beside ``out``) the next export to ``out`` finishes
(:func:`recover_export`). A bucket
prefix (``s3://bucket/hf``) has no rename: the files are put there as plain keys, streamed,
the index last (``export_bucket``).

What is exported, under which names and in which files, is decided first (``export_plan``).

``transformers``' ``from_pretrained(out)`` also needs the model's ``config.json``: the export
copies it into ``out`` (with ``generation_config.json``, when there is one) from ``config=``, or
else from beside the checkpoint as a Hugging Face ``Trainer`` leaves it (``checkpoint-N/`` holds
``config.json`` and the ckptfmt checkpoint ``ckptfmt/``); the report says which, or that there
was none (:func:`config_beside`).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ckptfmt.dtypes import by_name
from ckptfmt.errors import (
    DamagedError,
    DestinationExistsError,
    NotDurableError,
    UsageError,
)
from ckptfmt.format.options import WriteOptions
from ckptfmt.interop import hf
from ckptfmt.interop.export_bucket import BUCKET_WINDOW, check_bucket_out, write_to_bucket
from ckptfmt.interop.export_plan import FLOATS, ExportFile, Planned, layout, plan, select
from ckptfmt.interop.export_read import ReadAhead, cast_array
from ckptfmt.interop.names import Rename, renames_of
from ckptfmt.maintenance.nodes import NodeDirs
from ckptfmt.maintenance.source import Job, Source, open_source
from ckptfmt.manifest.limits import display
from ckptfmt.storage import commit
from ckptfmt.storage.files import fsync_dir, write_error, write_gather
from ckptfmt.storage.objects.bucket import Bucket
from ckptfmt.storage.paths import check_destination, refuse_inside_checkpoint, removing_made
from ckptfmt.storage.progress import ProgressCallback, current_meter, metering
from ckptfmt.storage.store import Location, LocationSpec, parse_location
from ckptfmt.version import __version__

DEFAULT_WINDOW = 256 << 20

CONFIG = "config.json"
"""The model's configuration, which ``from_pretrained`` reads to build the model."""
GENERATION_CONFIG = "generation_config.json"
"""Carried along with ``config.json`` when it sits beside it (a generating model's defaults)."""
HF_DATA_DIR = "ckptfmt"
HF_STATE = "trainer_state.json"


@dataclass
class ExportReport:
    """What :func:`export_safetensors` wrote."""

    source: str
    destination: str
    step: int | None
    files: list[str]
    tensors: int
    total_size: int  # tensor bytes written (the index's metadata.total_size)
    names: dict[str, str]  # checkpoint name -> output name
    cast: str | None = None  # the dtype floating tensors were cast to
    cast_tensors: int = 0
    not_cast: list[str] = field(default_factory=list)  # integer/bool/complex: kept as they are
    rebuilt_nodes: list[str] = field(default_factory=list)
    bytes_read: int = 0
    seconds: float = 0.0
    format: str = "safetensors"
    config: str | None = None  # the config.json copied into the output (its source), if any

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "destination": self.destination,
            "format": self.format,
            "step": self.step,
            "files": self.files,
            "tensors": self.tensors,
            "total_size": self.total_size,
            "cast": self.cast,
            "cast_tensors": self.cast_tensors,
            "not_cast": self.not_cast,
            "rebuilt_nodes": self.rebuilt_nodes,
            "bytes_read": self.bytes_read,
            "seconds": round(self.seconds, 6),
            "config": self.config,
            "names": self.names,
        }


def _check_out(out: Path, overwrite: bool, writes: Sequence[str] = ()) -> None:
    """Refuse ``out`` when it exists, unless ``overwrite`` and it holds only what an export
    writes: the weights, and the configuration files when this export writes them
    (``writes``; a ``config.json`` put there by hand is never replaced by an export that has
    none to put in its place)."""
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise DestinationExistsError(
                str(out), "it exists (--overwrite, overwrite=True, replaces a previous export)"
            )
        if out.is_symlink() or not out.is_dir():
            raise DestinationExistsError(str(out), "it exists and is not a directory")
        ours = {hf.SINGLE, hf.INDEX, *writes}
        for p in out.iterdir():
            named = p.name in ours or (p.name.startswith("model-") and p.suffix == ".safetensors")
            if not named or (p.is_dir() and not p.is_symlink()):  # an export writes no directory
                raise DestinationExistsError(
                    str(out), f"it holds {p.name!r}, which an export does not write"
                )


def config_beside(src: NodeDirs) -> Path | None:
    """The ``config.json`` a Hugging Face ``Trainer`` checkpoint keeps beside its ckptfmt data:
    ``checkpoint-N/config.json`` when ``src`` is ``checkpoint-N/ckptfmt`` (as given, a link to
    the manager's step not followed) or its directory holds ``trainer_state.json``; None for
    any other source (a bucket, level-1 copies, a checkpoint of no HF model)."""
    if not isinstance(src, str | os.PathLike) or parse_location(src).kind != "directory":
        return None
    given = Path(os.path.abspath(src))
    if given.name != HF_DATA_DIR and not (given.parent / HF_STATE).is_file():
        return None
    found = given.parent / CONFIG
    return found if found.is_file() else None


def read_config(path: Path) -> bytes:
    """The bytes of the model configuration ``path`` (``config=``), which must be a JSON
    object: :class:`UsageError` naming it otherwise, before anything is written."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"config {path}: cannot be read ({exc.strerror or exc})") from None
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise UsageError(f"config {path}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise UsageError(f"config {path}: not a JSON object, as a model's config.json is")
    return data


def _config_files(config: str | os.PathLike[str] | None, src: NodeDirs) -> list[tuple[str, bytes]]:
    """What to write beside the weights: ``config`` (a ``config.json``), else the one beside
    ``src`` (:func:`config_beside`), with the ``generation_config.json`` beside either."""
    path = Path(config) if config is not None else config_beside(src)
    if path is None:
        return []
    files = [(CONFIG, read_config(path))]
    generation = path.parent / GENERATION_CONFIG
    if generation.is_file():
        files.append((GENERATION_CONFIG, read_config(generation)))
    return files


EXPORT_TOKEN = "export"
"""The dot-names an export uses beside ``out``: ``.<name>.export-<id>`` (its staging
directory, and after an exchange the export it replaced) and ``.<name>.export-old-<id>`` (an
export renamed aside where the file system cannot exchange)."""


def staging_of(out: Path) -> Path:
    return out.parent / f".{out.name}.{EXPORT_TOKEN}-{os.urandom(16).hex()}"


def _aside_of(out: Path) -> Path:
    return out.parent / f".{out.name}.{EXPORT_TOKEN}-old-{os.urandom(16).hex()}"


def _leftovers_of(out: Path) -> list[Path]:
    """What exports to ``out`` cut short left beside it (module docstring), oldest first: only
    names an export makes (its 32 random hex digits included), so a directory of the user's
    that merely starts alike (``.<name>.export-notes``), or the staging directory of an export
    to another name (``.<name>.export-x.export-<id>``, for ``<name>.export-x``), is not one."""
    if not out.parent.is_dir():
        return []
    ours = re.compile(rf"^\.{re.escape(out.name)}\.{EXPORT_TOKEN}-(old-)?[0-9a-f]{{32}}$")
    found = []
    for c in out.parent.iterdir():
        if ours.match(c.name) and c.is_dir() and not c.is_symlink():
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile: not left
                found.append((c.lstat().st_mtime_ns, c))
    return [c for _, c in sorted(found)]


def _is_whole_export(d: Path) -> bool:
    return (d / hf.SINGLE).is_file() or (d / hf.INDEX).is_file()


def recover_export(out: Path, clean: bool = True) -> Path | None:
    """Finish what an export to ``out`` that was killed left (the next export to ``out`` calls
    this first, and an import of a missing ``out`` with ``clean=False``): when ``out`` is missing
    and an export renamed aside (``.<name>.export-old-*``, the two-rename replacement where the
    file system could not exchange, cut between its renames) is there whole, it is renamed back
    to ``out`` (the newest, if several); then, with ``clean``, every other leftover of ``out``'s
    exports (staging directories, replaced exports) is removed (not by a reader: an export
    running now owns its staging directory). Returns the directory put back, if any."""
    back = None
    if not (out.exists() or out.is_symlink()):
        aside = [
            c
            for c in _leftovers_of(out)
            if c.name.startswith(f".{out.name}.{EXPORT_TOKEN}-old-") and _is_whole_export(c)
        ]
        if aside:
            back = aside[-1]
            os.rename(back, out)
            fsync_dir(out.parent)
    for c in _leftovers_of(out) if clean else ():
        shutil.rmtree(c, ignore_errors=True)
    return back


def publish(staging: Path, out: Path, fsync: bool) -> None:
    """Put the staged export at ``out``. A previous export there is swapped out in one step
    (``renameat2(RENAME_EXCHANGE)``, :func:`ckptfmt.storage.commit.exchange`), so ``out`` names
    the old export or the new one at every instant; where the file system cannot exchange it is
    renamed aside to ``.<name>.export-old-<id>`` first and the new one renamed in, and a kill
    between the two renames (``out`` missing, the old export whole beside it) is undone by
    :func:`recover_export`. The replaced export is removed once the new one stands (its
    directory synced: else it is kept beside ``out``, for the next export to remove)."""
    old = None
    if out.exists() or out.is_symlink():
        if commit.exchange(staging, out):
            old = staging  # the old export, now at the staging name
        else:
            old = _aside_of(out)
            os.rename(out, old)
            try:
                os.rename(staging, out)
            except OSError:  # nothing replaced: the old export back in place
                os.rename(old, out)
                raise
    else:
        os.rename(staging, out)
    try:
        if fsync:
            fsync_dir(out.parent)
    except OSError as exc:
        # the swap may not be on disk (after a power loss OUT may name the old export again):
        # the old export is kept beside OUT, and the next export to OUT removes it
        kept = f"; the export it replaced is kept at {old}" if old is not None else ""
        raise NotDurableError(
            str(out),
            f"{(exc.strerror or str(exc)).lower()}{kept}",
            level="the export's destination",
            err=exc.errno,
            replaced=old,
        ) from exc
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


class _OutFile:
    """One output file, its size reserved up front (``posix_fallocate``: a full disk is an
    ``OSError`` here, never a ``SIGBUS`` later), the header written, each tensor's bytes a
    shared mapping of its place in the file that the shard reads fill directly: the bytes go
    from the source files' page cache to the output's in one copy, CRC-checked on the way."""

    def __init__(self, path: Path, f: ExportFile) -> None:
        self.size = len(f.header) + sum(p.nbytes for p in f.tensors)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        self.fd = os.open(path, flags, 0o644)
        try:
            if self.size and hasattr(os, "posix_fallocate"):
                os.posix_fallocate(self.fd, 0, self.size)
            else:
                os.ftruncate(self.fd, self.size)
            view = memoryview(f.header)
            at = 0
            while at < len(view):
                at += os.pwrite(self.fd, view[at:], at)
        except BaseException:
            os.close(self.fd)
            raise
        self.maps: dict[int, mmap.mmap] = {}

    def window(self, key: int, offset: int, p: Planned) -> np.ndarray:
        """A writable array over ``p``'s bytes at ``offset`` in the file (kept until
        :meth:`release`)."""
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        length = offset + p.nbytes - start
        # no MAP_POPULATE: the pages are then mapped as the reader threads touch them, in
        # parallel, instead of all at once here (measured: 0.2 s per GiB on this VM, serial)
        mm = mmap.mmap(self.fd, length, flags=mmap.MAP_SHARED, offset=start)
        self.maps[key] = mm
        dt = by_name(p.dtype).numpy
        return np.frombuffer(mm, dt, p.entry.size, offset - start).reshape(p.entry.shape)

    def release(self, key: int) -> None:
        mm = self.maps.pop(key, None)
        if mm is not None:
            with contextlib.suppress(BufferError):  # a view still alive: the GC unmaps it
                mm.close()

    def close(self, fsync: bool) -> None:
        for key in list(self.maps):
            self.release(key)
        try:
            if fsync:
                os.fsync(self.fd)  # also writes back what the mappings dirtied
        finally:
            os.close(self.fd)


def export_safetensors(
    src: NodeDirs,
    out: LocationSpec | Location,
    *,
    max_shard_size: str | int = hf.DEFAULT_MAX_SHARD,
    rows: Sequence[str] = (),
    strip: str = "model/",
    renames: Iterable[str | Rename | tuple[str, str]] = (),
    dtype: str | None = None,
    write: WriteOptions | None = None,
    threads: int = 2,
    window_bytes: int | None = None,
    progress: ProgressCallback | None = None,
    config: str | os.PathLike[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> ExportReport:
    """Write the checkpoint ``src`` as a Hugging Face safetensors directory ``out`` (module
    docstring); return what was written.

    ``out`` may be the URL of a bucket prefix (``s3://bucket/hf``; ``storage_options``: its
    store's settings, as for ``ckptfmt.save``): the files are put there as plain keys, each
    streamed from the tensors as they are read, the index last (``export_bucket``); no local
    copy is made.

    ``config``: the model's ``config.json``, copied into ``out`` so that ``from_pretrained``
    builds the model the weights are of; by default the one beside ``src`` when ``src`` is a
    Hugging Face ``Trainer`` checkpoint's ``checkpoint-N/ckptfmt``. ``report.config`` says
    which was copied (None: none was found, and ``from_pretrained`` would build a default
    model: give ``config``).

    ``src``: a committed checkpoint directory (level 3), or level-1 copies as a ``{node}``
    template or a mapping node -> directory (lost or damaged parts rebuilt from the redundancy
    on the fly, the source left as it is). ``rows``: globs of the tensors to export (default:
    those under ``strip``, else all). Names: ``strip`` removed, ``/`` -> ``.``, then
    ``renames`` (``OLD=NEW`` prefix rules). ``dtype``: cast floating tensors to ``bfloat16``,
    ``float16`` or ``float32`` (integer, bool and complex tensors are never cast; the report
    lists them). ``max_shard_size``: ``"5GB"``-style or bytes. ``write``
    (:class:`~ckptfmt.WriteOptions`): its ``fsync``, and ``overwrite``: ``out`` must not exist
    unless set (then only a previous export is replaced); the chunk and shard sizes are
    ckptfmt's own, not safetensors' (``max_shard_size``), and ``threads`` here are the readers.
    ``progress``: called with :class:`~ckptfmt.Progress` events (``op="export"``,
    ``phase="write"``: the bytes of each tensor written, the total known before the first),
    from this thread (``ckptfmt.storage.progress``)."""
    started = time.perf_counter()
    write = write if write is not None else WriteOptions()
    fsync = write.fsync
    max_bytes = hf.parse_size(max_shard_size)
    rules = renames_of(renames)
    where = out if isinstance(out, Location) else parse_location(out, storage_options)
    if where.kind not in ("directory", "url"):
        raise UsageError(f"an export is written to a directory or a bucket prefix, not {where}")
    extra = _config_files(config, src)
    writes = [name for name, _ in extra]
    bucket = Bucket.at(where.spec, where.storage_options) if where.is_bucket else None
    if bucket is not None:
        there = check_bucket_out(bucket, write.overwrite, writes)
    else:
        out_path = Path(where.spec).absolute()
        check_destination(out_path)  # a parent that is a file: said, not "cannot read"
        refuse_inside_checkpoint(out_path)
        recover_export(out_path)  # a killed export to it: its old copy back, leftovers gone
        _check_out(out_path, write.overwrite, writes)
    source = open_source(src)
    planned = plan(select(source, rows, strip), strip, rules, dtype)
    meta = {
        "format": "pt",
        "ckptfmt_version": __version__,
        "ckptfmt_save_id": source.manifest.save_id,
    }
    if source.manifest.step is not None:
        meta["ckptfmt_step"] = str(source.manifest.step)
    not_cast = [display(p.entry.name) for p in planned if dtype and p.entry.dtype not in FLOATS]
    n_cast = sum(1 for p in planned if p.dtype != p.entry.dtype)
    if dtype is not None:
        meta["ckptfmt_cast"] = f"floating tensors to {dtype}; {len(not_cast)} non-floating kept"
    files = layout(planned, max_bytes, meta)
    with metering("export", progress) as meter:
        meter.expect(sum(p.nbytes for p in planned))
        window = max(1, min(window_bytes or DEFAULT_WINDOW, max_bytes))
        if bucket is not None:
            window = max(1, min(window_bytes or BUCKET_WINDOW, max_bytes))
            source, read = write_to_bucket(
                source, files, planned, bucket, there, threads, window, extra
            )
            report = _report(source, bucket.url, files, planned, read)
        else:
            report = _export(source, files, planned, out_path, threads, window, fsync, extra)
        meter.finish()
    if extra:
        report.config = str(config if config is not None else config_beside(src))
        report.files += [name for name, _ in extra]
    report.not_cast, report.cast_tensors, report.cast = not_cast, n_cast, dtype
    report.seconds = time.perf_counter() - started
    return report


def _export(
    source: Source,
    files: list[ExportFile],
    planned: list[Planned],
    out_path: Path,
    threads: int,
    window: int,
    fsync: bool,
    extra: Sequence[tuple[str, bytes]] = (),
) -> ExportReport:
    """Write ``files`` (and ``extra``: name, bytes) into a staging directory beside
    ``out_path``, then rename it there; on failure no directory it made is left."""
    with removing_made([out_path]):
        return _export_staged(source, files, planned, out_path, threads, window, fsync, extra)


def _export_staged(
    source: Source,
    files: list[ExportFile],
    planned: list[Planned],
    out_path: Path,
    threads: int,
    window: int,
    fsync: bool,
    extra: Sequence[tuple[str, bytes]],
) -> ExportReport:
    out_path.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_of(out_path)
    staging.mkdir()
    try:
        if source.level1 and source.problems():
            source = source.with_rebuild(staging / ".rebuilt")
        try:
            read = _write_files(source, files, staging, threads, window, fsync)
        except DamagedError:
            if not source.level1 or source.rebuilt_nodes:
                raise
            for f in files:  # a CRC failed on level 1: rebuild from parity, then again
                (staging / f.name).unlink(missing_ok=True)
            source = source.with_rebuild(staging / ".rebuilt")
            if not source.rebuilt_nodes:
                raise
            read = _write_files(source, files, staging, threads, window, fsync)
        total = sum(p.nbytes for p in planned)
        if len(files) > 1:
            weight_map = {p.name: f.name for f in files for p in f.tensors}
            ordered = {p.name: weight_map[p.name] for p in planned}
            blob = hf.index_doc(total, ordered, {})
            fd = os.open(staging / hf.INDEX, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, memoryview(blob))
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        for name, data in extra:
            write_gather(staging / name, [data], fsync)
        shutil.rmtree(staging / ".rebuilt", ignore_errors=True)
        if fsync:
            fsync_dir(staging)
        publish(staging, out_path, fsync)
    except NotDurableError:
        raise  # in place: ``staging`` names the export it replaced, if any, kept (publish)
    except BaseException as exc:
        needed = sum(p.nbytes for p in planned)
        failed = write_error(exc, out_path, "the export's destination", needed)  # while full
        shutil.rmtree(staging, ignore_errors=True)
        if failed is not None:
            raise failed from None
        raise
    return _report(source, str(out_path), files, planned, read)


def _report(
    source: Source,
    destination: str,
    files: Sequence[ExportFile],
    planned: Sequence[Planned],
    read: int,
) -> ExportReport:
    return ExportReport(
        source=source.shown,
        destination=destination,
        step=source.manifest.step,
        files=[f.name for f in files] + ([hf.INDEX] if len(files) > 1 else []),
        tensors=len(planned),
        total_size=sum(p.nbytes for p in planned),
        names={display(p.entry.name): p.name for p in planned},
        rebuilt_nodes=source.rebuilt_nodes,
        bytes_read=read,
    )


def _write_files(
    source: Source,
    files: Sequence[ExportFile],
    staging: Path,
    threads: int,
    window: int,
    fsync: bool,
) -> int:
    """Write every output file; returns the stored bytes read from the checkpoint. Each
    tensor's bytes are counted on the caller's progress meter once written."""
    meter = current_meter()
    places: list[tuple[int, int, Planned]] = []  # (file, byte offset, tensor) in read order
    for k, f in enumerate(files):
        at = len(f.header)
        for p in f.tensors:
            places.append((k, at, p))
            at += p.nbytes
    outs: list[_OutFile] = []
    try:
        for f in files:
            outs.append(_OutFile(staging / f.name, f))

        def dest(i: int) -> Callable[[], np.ndarray] | None:
            k, at, p = places[i]
            if p.dtype != p.entry.dtype or p.nbytes == 0:
                return None  # cast: read into memory first; empty: nothing to map
            return lambda: outs[k].window(i, at, p)

        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            reads = ReadAhead(source, [p.entry for _, _, p in places], pool, window, dest)
            try:
                for i, (k, at, p) in enumerate(places):
                    arr = reads.take()
                    if p.dtype != p.entry.dtype and p.nbytes:
                        into = outs[k].window(i, at, p)
                        np.copyto(into, cast_array(arr, p.dtype), casting="unsafe")
                        del into
                    del arr
                    outs[k].release(i)
                    meter.add(p.nbytes, "write")
            except BaseException:
                reads.cancel()
                raise
        for o in outs:
            o.close(fsync)
        outs = []
    finally:
        for o in outs:
            with contextlib.suppress(OSError):
                o.close(False)
    return reads.bytes_read


def tensors_of(
    src: NodeDirs,
    *,
    rows: Sequence[str] = (),
    strip: str = "model/",
    renames: Iterable[str | Rename | tuple[str, str]] = (),
    dtype: str | None = None,
    threads: int = 2,
    scratch: Path | None = None,
) -> tuple[Source, list[tuple[str, np.ndarray]]]:
    """Every exported tensor in memory, by output name (for writers that need them all at once:
    ``torch.save``). Same selection, names and casts as :func:`export_safetensors`, and as
    there what a level-1 source lost or holds damaged within its redundancy is rebuilt from
    parity on the fly (``Source.rebuilt_nodes`` names the nodes), into ``scratch`` (a
    directory made and removed here; default: one in ``TMPDIR``), never into ``src``."""
    source = open_source(src)
    planned = plan(select(source, rows, strip), strip, renames_of(renames), dtype)
    with contextlib.ExitStack() as stack:
        if scratch is None:
            scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ckptfmt-")))
        else:
            stack.callback(shutil.rmtree, scratch, ignore_errors=True)
        rebuilt = scratch / "rebuilt"
        if source.level1 and source.problems():
            source = source.with_rebuild(rebuilt)
        try:
            got = _read_all(source, planned, threads)
        except DamagedError:  # a CRC failed on level 1: rebuild from parity, then again
            if not source.level1 or source.rebuilt_nodes:
                raise
            source = source.with_rebuild(rebuilt)
            if not source.rebuilt_nodes:
                raise
            got = _read_all(source, planned, threads)
    return source, got


def _read_all(
    source: Source, planned: Sequence[Planned], threads: int
) -> list[tuple[str, np.ndarray]]:
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        reads = ReadAhead(source, [p.entry for p in planned], pool, 1 << 62)
        return [(p.name, cast_array(reads.take(), p.dtype)) for p in planned]


__all__ = ["ExportReport", "Job", "export_safetensors", "tensors_of"]
