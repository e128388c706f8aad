"""Import foreign weights as a ckptfmt checkpoint (``ckptfmt import``): safetensors files and
Hugging Face directories here (framework-free); ``torch.save`` files and DCP directories in
``ckptfmt_torch.interop``, which hand their tensors to :func:`import_named`.

Everything about the source is checked before anything is written (every header, the index
against the files, every name against ckptfmt's name rules), so bad input raises
:class:`ForeignFormatError` with nothing written; the checkpoint itself is written by
``ckptfmt.save`` through the store of ``out`` (a directory: staging directory, manifest last,
rename; a bucket: the files put straight from the arrays, the commit object last), so ``out``
appears whole or not at all. Safetensors data is mapped, not copied: the save writes (and
checksums) straight from the page cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ckptfmt.checkpoint import save
from ckptfmt.dtypes import by_name
from ckptfmt.errors import (
    DestinationExistsError,
    ForeignFormatError,
    InvalidNameError,
    UsageError,
)
from ckptfmt.format.options import WriteOptions
from ckptfmt.interop import hf
from ckptfmt.interop.export import recover_export
from ckptfmt.interop.names import Rename, import_name, renames_of, unique
from ckptfmt.interop.safetensors_format import Header, read_header
from ckptfmt.maintenance.reshard import reshard
from ckptfmt.manifest.limits import display
from ckptfmt.storage.nodes import expand, parent_of
from ckptfmt.storage.paths import check_destination, refuse_inside_checkpoint, removing_made
from ckptfmt.storage.progress import Progress, ProgressCallback
from ckptfmt.storage.store import Location, LocationSpec, parse_location


@dataclass
class ImportReport:
    """What an import wrote."""

    source: str
    destination: str
    format: str
    files: list[str]
    tensors: int
    values: int
    total_size: int  # tensor bytes
    names: dict[str, str]  # source name -> ckptfmt name ('/'-joined)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "destination": self.destination,
            "format": self.format,
            "files": self.files,
            "tensors": self.tensors,
            "values": self.values,
            "total_size": self.total_size,
            "seconds": round(self.seconds, 6),
            "notes": self.notes,
            "names": self.names,
        }


def nest(items: Iterable[tuple[str, tuple[str, ...], Any]], where: str) -> dict[str, Any]:
    """``(source name, ckptfmt name, leaf)`` triples as the nested state ``ckptfmt.save``
    takes; two names where one is a leaf and the other goes below it cannot both be a tree."""
    root: dict[str, Any] = {}
    owner: dict[tuple[str, ...], str] = {}
    for src, name, leaf in items:
        node = root
        for depth, c in enumerate(name[:-1]):
            nxt = node.setdefault(c, {})
            if not isinstance(nxt, dict) or name[: depth + 1] in owner:
                other = owner.get(name[: depth + 1], "?")
                raise ForeignFormatError(where, f"{src!r} would go below tensor {other!r}", src)
            node = nxt
        if name[-1] in node:
            other = owner.get(name, "a group of other tensors")
            raise ForeignFormatError(where, f"{src!r} and {other!r} get one name", src)
        node[name[-1]] = leaf
        owner[name] = src
    return root


def ckpt_names(
    names: Sequence[str], prefix: str, rules: Sequence[Rename], where: dict[str, str]
) -> list[tuple[str, ...]]:
    """Each source name's ckptfmt name; a name ckptfmt cannot hold (``../x``, ``a//b``,
    ``__x``, control characters) is :class:`ForeignFormatError` of the file that has it."""
    out = []
    for n in names:
        try:
            out.append(import_name(n, prefix, rules))
        except InvalidNameError as exc:
            raise ForeignFormatError(
                where.get(n, "?"), f"the tensor name is not allowed: {exc.reason}", n
            ) from None
    unique(((n, display(c)) for n, c in zip(names, out)), "two source names would get one name")
    return out


def import_named(
    items: Sequence[tuple[str, Any]],
    out: LocationSpec | Location,
    *,
    source: str,
    fmt: str,
    files: Sequence[str] = (),
    prefix: str = "model",
    renames: Iterable[str | Rename | tuple[str, str]] = (),
    write: WriteOptions | None = None,
    step: int | None = None,
    started: float | None = None,
    where: Mapping[str, str] | None = None,
    ranks: int = 1,
    nodes: Sequence[str] | None = None,
    rows: Sequence[str] = (),
    progress: ProgressCallback | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> ImportReport:
    """Save ``(source name, numpy array or JSON value)`` pairs as the checkpoint ``out``: each
    name renamed, put under ``prefix`` and split at ``/`` (``interop.names``).

    ``ranks`` > 1 (or ``nodes``): the checkpoint a job of that many ranks would have saved,
    every rank its share (``rows`` globs: tensors held in row blocks, FSDP-like; ``nodes[k]``
    rank k's node; ``out`` may be a ``{node}`` template of level-1 directories), written by
    ``ckptfmt.maintenance.reshard.reshard`` from a one-process save in a staging directory
    beside ``out``. ``write``: how ``out`` is written, as for ``ckptfmt.save`` (``overwrite``
    replaces a committed checkpoint). ``progress``: :class:`~ckptfmt.Progress` events of
    ``op="import"`` (:class:`_Relay`).

    ``out`` may be the URL of a bucket prefix (``storage_options``: its store's settings) or a
    :class:`~ckptfmt.storage.store.Store`: the checkpoint is written through its store, each
    file straight from the arrays (``ckptfmt.save``), and committed the way the store commits
    (a bucket: the commit object last; an overwrite replaces the old one on its etag, so the old
    checkpoint stays whole until then). With ``ranks`` > 1 the one-process save is made in a
    scratch directory of ``TMPDIR``, and the reshard writes from it through the store."""
    started = time.perf_counter() if started is None else started
    rules = renames_of(renames)
    where = where if where is not None else {n: source for n, _ in items}
    names = ckpt_names([n for n, _ in items], prefix, rules, dict(where))
    state = nest(((n, c, v) for (n, v), c in zip(items, names)), source)
    arrays = [v for _, v in items if isinstance(v, np.ndarray)]
    write = write if write is not None else WriteOptions()
    relay = _Relay(progress)
    on_stage, on_save = (relay.stage, relay.save) if progress is not None else (None, None)
    dest = out if isinstance(out, Location) else parse_location(out, storage_options)
    if dest.kind in ("url", "store") and "{node}" in str(dest):
        raise UsageError(f"{dest}: a bucket holds one level-3 checkpoint, no {{node}} template")
    if dest.kind in ("url", "store") and not write.overwrite and dest.store().is_committed():
        raise DestinationExistsError(  # before the work, as a directory is refused
            str(dest), "a checkpoint is committed there (overwrite=True, --overwrite, replaces it)"
        )
    made: list[str | os.PathLike[str]] = []  # what a failure must not leave made above
    if dest.kind == "directory":
        made = [dest.spec]
    elif dest.kind == "spread" and isinstance(dest.spec, str | os.PathLike):
        made = [expand(dest.spec, n) for n in (nodes or ["n0"])]
    for path in made:
        refuse_inside_checkpoint(path)  # deleted with it when it is replaced
    with removing_made(made):
        destination = _write(state, dest, step, write, ranks, nodes, rows, on_stage, on_save)
    return ImportReport(
        source=source,
        destination=destination,
        format=fmt,
        files=list(files),
        tensors=len(arrays),
        values=len(items) - len(arrays),
        total_size=sum(a.nbytes for a in arrays),
        names={n: display(c) for (n, _), c in zip(items, names)},
        seconds=time.perf_counter() - started,
    )


def _write(
    state: dict[str, Any],
    dest: Location,
    step: int | None,
    write: WriteOptions,
    ranks: int,
    nodes: Sequence[str] | None,
    rows: Sequence[str],
    on_stage: ProgressCallback | None,
    on_save: ProgressCallback | None,
) -> str:
    """Write the imported ``state`` to ``dest`` (:func:`import_named`); where it committed."""
    if ranks == 1 and nodes is None and not rows:
        if dest.kind in ("url", "store"):
            store = dest.store()
            save(state, store, step=step, write=write, progress=on_save)
            destination = store.where
        else:
            save(state, dest.spec, step=step, write=write, progress=on_save)
            destination = str(Path(dest.spec).absolute())
    elif dest.kind in ("url", "store"):
        with tempfile.TemporaryDirectory(prefix="ckptfmt-import-") as scratch:
            tmp = Path(scratch) / "one"
            staged = replace(write, fsync=False, overwrite=False)
            save(state, tmp, step=step, write=staged, progress=on_stage)
            done = reshard(
                tmp,
                dest,
                ranks,
                nodes=nodes,
                rows=rows,
                write=write,
                progress=on_save,
                storage_options=dest.storage_options,
            )
        destination = ", ".join(done.destination)
    else:
        spec = dest.spec
        parent = parent_of(spec).absolute()
        check_destination(spec)  # a file in the way: said, not "cannot read"
        parent.mkdir(parents=True, exist_ok=True)
        key = _scratch_key(spec)
        _remove_scratch(parent, key)  # what an import to ``spec`` that was killed left
        tmp = parent / f".import-{key}-{os.urandom(16).hex()}"
        staged = replace(write, fsync=False, overwrite=False)  # removed below
        try:
            save(state, tmp, step=step, write=staged, progress=on_stage)
            done = reshard(tmp, spec, ranks, nodes=nodes, rows=rows, write=write, progress=on_save)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        destination = ", ".join(done.destination)
    return destination


def _scratch_key(spec: str | os.PathLike[str]) -> str:
    """What names the scratch checkpoints of imports to ``spec`` (its absolute path, hashed):
    ``.import-<key>-<random>`` beside it."""
    return hashlib.sha256(os.fsencode(os.path.abspath(spec))).hexdigest()[:16]


def _remove_scratch(parent: Path, key: str) -> None:
    """Remove the scratch checkpoints (and their saves' staging directories) that imports to
    the destination of ``key`` left in ``parent`` when they were killed: a whole checkpoint's
    bytes per kill otherwise, which nothing else removes."""
    heads = (f".import-{key}-", f"..import-{key}-")
    for c in parent.iterdir():
        if c.name.startswith(heads) and c.is_dir() and not c.is_symlink():
            shutil.rmtree(c, ignore_errors=True)


class _Relay:
    """The events of the operations an import runs (a save; or a save into a staging directory,
    then the reshard that writes ``out``) as one operation, ``op="import"``: the staging save's
    bytes first, the reshard's added to ``done`` and ``total`` once it starts (the one time
    ``total`` grows), one ``final`` event at the end."""

    def __init__(self, callback: ProgressCallback | None) -> None:
        self.callback = callback
        self.base = 0  # the work of the staging save, once it is done

    def stage(self, p: Progress) -> None:
        if self.callback is not None:
            self.callback(replace(p, op="import", phase="stage", final=False))
        if p.final:
            self.base = p.total

    def save(self, p: Progress) -> None:
        if self.callback is not None:
            self.callback(
                replace(p, op="import", done=self.base + p.done, total=self.base + p.total)
            )


def safetensors_files(src: Path) -> tuple[str, list[tuple[Path, list[str] | None]]]:
    """The format (``safetensors`` or ``hf``) and files of ``src`` with, for a sharded
    directory, the tensors its index places in each file. A Hugging Face directory that an
    export killed while replacing it left renamed aside is put back first
    (``export.recover_export``)."""
    if not (src.exists() or src.is_symlink()):
        recover_export(src.absolute(), clean=False)
    if src.is_dir():
        if (src / hf.INDEX).exists():
            return "hf", [(src / f, names) for f, names in hf.read_index(src).items()]
        if (src / hf.SINGLE).is_file():
            return "hf", [(src / hf.SINGLE, None)]
        raise ForeignFormatError(str(src), f"a directory with neither {hf.INDEX} nor {hf.SINGLE}")
    if not src.is_file():
        raise ForeignFormatError(str(src), "no such file or directory")
    return "safetensors", [(src, None)]


def _map(fd: int, size: int) -> mmap.mmap | None:
    if size == 0:
        return None
    # not MAP_POPULATE: the save's writer threads then map the pages as they read them, in
    # parallel, instead of this thread mapping all of them first
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)


def import_safetensors(
    src: str | os.PathLike[str],
    out: LocationSpec | Location,
    *,
    prefix: str | None = "model",
    renames: Iterable[str | Rename | tuple[str, str]] = (),
    write: WriteOptions | None = None,
    step: int | None = None,
    ranks: int = 1,
    nodes: Sequence[str] | None = None,
    rows: Sequence[str] = (),
    progress: ProgressCallback | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> ImportReport:
    """Import a safetensors file, or a Hugging Face directory (``model.safetensors``, or the
    shards its ``model.safetensors.index.json`` names), as the ckptfmt checkpoint ``out``.

    Names go under ``prefix`` (default ``model``: ``ckptfmt_torch.load({"model": model}, out)``
    loads it in place) after the ``OLD=NEW`` ``renames``. Every header and the index are
    checked first (module docstring); :class:`ForeignFormatError` with nothing written.
    ``ranks``/``nodes``/``rows``: the layout of a job of that many ranks, ``out`` (a path, a
    ``{node}`` template, a bucket URL with its ``storage_options``, a store), ``write`` and
    ``progress`` (``op="import"``) as for :func:`import_named`."""
    started = time.perf_counter()
    src_path = Path(src)
    fmt, files = safetensors_files(src_path)
    maps: list[mmap.mmap] = []
    fds: list[int] = []
    try:
        headers = _open_headers(src_path, files, fds)
        items, where = _mapped_items(headers, maps)
        report = import_named(
            items,
            out,
            source=str(src_path),
            fmt=fmt,
            files=[str(p) for p, _, _ in headers],
            prefix="model" if prefix is None else prefix,
            renames=renames,
            write=write,
            step=step,
            started=started,
            ranks=ranks,
            nodes=nodes,
            rows=rows,
            where=where,
            progress=progress,
            storage_options=storage_options,
        )
        del items
        return report
    finally:
        for mm in maps:
            with contextlib.suppress(BufferError):  # an array still refers to it
                mm.close()
        for fd in fds:
            os.close(fd)


def _open_headers(
    src_path: Path, files: list[tuple[Path, list[str] | None]], fds: list[int]
) -> list[tuple[Path, Header, int]]:
    """Open every file and check its header (and, for a sharded directory, that the index
    lists exactly the tensors the file holds). Each descriptor is added to ``fds`` as soon as
    it is open, so the caller closes it whatever fails next."""
    headers: list[tuple[Path, Header, int]] = []
    for path, listed in files:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise ForeignFormatError(str(path), f"cannot open: {exc}") from None
        fds.append(fd)
        header = read_header(fd, str(path))
        if listed is not None:
            have = {t.name for t in header.tensors}
            for name in listed:
                if name not in have:
                    raise ForeignFormatError(
                        str(src_path / hf.INDEX),
                        f"the index places it in {path.name}, which does not hold it",
                        name,
                    )
            extra = sorted(have - set(listed))
            if extra:
                raise ForeignFormatError(
                    str(path), "holds a tensor its directory's index does not list", extra[0]
                )
        headers.append((path, header, fd))
    return headers


def _mapped_items(
    headers: list[tuple[Path, Header, int]], maps: list[mmap.mmap]
) -> tuple[list[tuple[str, Any]], dict[str, str]]:
    """Every tensor as an array over its file's mapping (added to ``maps``, for the caller to
    close), by source name, and the file each name came from (a name in two files refused)."""
    items: list[tuple[str, Any]] = []
    where: dict[str, str] = {}
    for path, header, fd in headers:
        mm = _map(fd, header.file_size)
        if mm is not None:
            maps.append(mm)
        for t in header.tensors:
            dt = by_name(t.dtype).numpy
            count = t.nbytes // dt.itemsize
            if mm is None or count == 0:
                arr = np.zeros(t.shape, dt)
            else:
                arr = np.frombuffer(mm, dt, count, header.data_start + t.begin).reshape(t.shape)
            if t.name in where:
                raise ForeignFormatError(str(path), f"also in {where[t.name]}", t.name)
            where[t.name] = str(path)
            items.append((t.name, arr))
    return items, where
