"""What an export writes, decided from the manifest before any byte is read: the tensors
chosen, their output names and dtypes (``plan``), and the output files with each one's header
and byte order (``layout``)."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ckptfmt.dtypes import by_name
from ckptfmt.errors import UnsupportedDtypeError, UsageError
from ckptfmt.interop import hf
from ckptfmt.interop.names import Rename, export_name, unique
from ckptfmt.interop.safetensors_format import CODE_OF, header_bytes
from ckptfmt.maintenance.source import Source
from ckptfmt.manifest.limits import display
from ckptfmt.manifest.model import TensorEntry

FLOATS = ("float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")
CAST_TARGETS = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class Planned:
    """One exported tensor: the checkpoint's entry, its output name and dtype."""

    entry: TensorEntry
    name: str
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.entry.size * by_name(self.dtype).itemsize


def select(source: Source, rows: Sequence[str], strip: str) -> list[TensorEntry]:
    """The tensors to export, in manifest order: those matching a ``rows`` glob ('/'-joined
    names); by default those under ``strip`` when there are any (a ``ckptfmt_torch`` checkpoint's
    ``model/``, not its optimizer), else every tensor."""
    tensors = list(source.manifest.tensors())
    if rows:
        chosen = [t for t in tensors if any(fnmatch.fnmatchcase(display(t.name), p) for p in rows)]
        if not chosen:
            raise UsageError(f"no tensor matches {', '.join(rows)}")
        return chosen
    under = [t for t in tensors if strip and display(t.name).startswith(strip)]
    return under or tensors


def plan(
    entries: Iterable[TensorEntry], strip: str, renames: Sequence[Rename], dtype: str | None
) -> list[Planned]:
    if dtype is not None and dtype not in CAST_TARGETS:
        raise UsageError(f"--dtype is one of {', '.join(CAST_TARGETS)}, got {dtype!r}")
    out = []
    for e in entries:
        if e.dtype not in CODE_OF:
            raise UnsupportedDtypeError(
                f"{e.dtype} (safetensors has no such type)", display(e.name)
            )
        target = dtype if dtype is not None and e.dtype in FLOATS else e.dtype
        name = export_name(display(e.name), strip, renames)
        if not name or name == "__metadata__":
            raise UsageError(f"{display(e.name)!r} would be exported as {name!r}")
        out.append(Planned(e, name, target))
    unique(((display(p.entry.name), p.name) for p in out), "two tensors would get one name")
    return out


@dataclass
class ExportFile:
    name: str
    tensors: list[Planned]  # in the order of their bytes in the file
    header: bytes


def layout(
    planned: Sequence[Planned], max_bytes: int, metadata: dict[str, str]
) -> list[ExportFile]:
    """Shards (greedy, in order) and each file's byte order: by itemsize, largest first, then in
    order, so every tensor is aligned to its itemsize (the safetensors library's own order)."""
    groups = hf.plan_shards([p.nbytes for p in planned], max_bytes)
    names = hf.shard_names(len(groups))
    files = []
    for fname, idx in zip(names, groups):
        ordered = sorted((planned[i] for i in idx), key=lambda p: -by_name(p.dtype).itemsize)
        at = 0
        rows = []
        for p in ordered:
            rows.append((p.name, p.dtype, p.entry.shape, at, at + p.nbytes))
            at += p.nbytes
        files.append(ExportFile(fname, ordered, header_bytes(rows, metadata)))
    return files
