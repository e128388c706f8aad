"""PyTorch's own files in and out of ckptfmt: ``torch.save`` files (both ways) and DCP
checkpoint directories (in), for ``ckptfmt export --to torch`` and ``ckptfmt import``.

The framework-free part (safetensors, the Hugging Face layout, names, writing the checkpoint)
is ``ckptfmt.interop``; this module only turns PyTorch's containers into named arrays and back.

Unpickling: a ``torch.save`` file is read only with ``torch.load(weights_only=True)``, PyTorch's
restricted unpickler (tensors, containers, numbers, strings); anything that needs more is refused
with :class:`ForeignFormatError`. A DCP checkpoint's ``.metadata`` is a plain pickle, and DCP's
reader unpickles it: :func:`import_dcp` does so only with ``trust_pickle=True`` (the CLI's
``--trust-pickle``), and raises :class:`PickleRefusedError` otherwise. Nothing else here unpickles.
Writing a ``torch.save`` file (:func:`export_torch`) writes a pickle because the user asks for one.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ckptfmt.errors import (
    DestinationExistsError,
    ForeignFormatError,
    PickleRefusedError,
    UsageError,
)
from ckptfmt.format import WriteOptions
from ckptfmt.interop import ExportReport, ImportReport, Rename, import_named, select, tensors_of
from ckptfmt.manifest import display
from ckptfmt.storage import (
    ProgressCallback,
    check_destination,
    fsync_dir,
    metering,
    refuse_inside_checkpoint,
    removing_made,
    write_error,
)
from ckptfmt_torch import _compat
from ckptfmt_torch.convert import numpy_to_tensor, to_state


def _remove_leftovers(out_path: Path) -> None:
    """Remove what a killed ``export_torch`` to ``out_path`` left beside it: its temporary
    file ``.<name>.export-*`` (a whole state's bytes), its scratch ``.<name>.rebuilt-*``."""
    if not out_path.parent.is_dir():
        return
    # only the names an export makes (their random hex digits included): a file of the user's
    # that merely starts alike (``.model.pt.export-notes``) is not one
    ours = re.compile(rf"^\.{re.escape(out_path.name)}\.(?P<kind>export|rebuilt)-[0-9a-f]{{16}}$")
    for c in out_path.parent.iterdir():
        m = ours.match(c.name)
        if m is None or c.is_symlink():
            continue
        if m["kind"] == "export" and c.is_file():
            c.unlink(missing_ok=True)
        elif m["kind"] == "rebuilt" and c.is_dir():
            shutil.rmtree(c, ignore_errors=True)


def export_torch(
    src: Any,
    out: str | os.PathLike[str],
    *,
    rows: Sequence[str] = (),
    strip: str = "model/",
    renames: Iterable[str | Rename | tuple[str, str]] = (),
    dtype: str | None = None,
    write: WriteOptions | None = None,
    progress: ProgressCallback | None = None,
) -> ExportReport:
    """Write the checkpoint ``src`` as one ``torch.save`` file ``out`` of a flat state dict
    (``name -> tensor``: the names, selection and casts of
    :func:`ckptfmt.interop.export_safetensors`, and its ``write``: ``fsync``, ``overwrite``).
    The whole state is in memory once (``torch.save`` takes it whole); the file appears by
    rename, complete or not at all. ``progress``: :class:`~ckptfmt.Progress` events
    (``op="export"``): the tensors' bytes, counted once the file is written (``torch.save``
    writes it in one call)."""
    started = time.perf_counter()
    write = write if write is not None else WriteOptions()
    fsync = write.fsync
    out_path = Path(out).absolute()
    check_destination(out_path)  # a parent that is a file: said, not "cannot read"
    refuse_inside_checkpoint(out_path)
    _remove_leftovers(out_path)
    if out_path.exists() and not write.overwrite:
        raise DestinationExistsError(
            str(out_path), "it exists (--overwrite, overwrite=True, replaces it)"
        )
    if out_path.is_dir():
        raise DestinationExistsError(str(out_path), "it is a directory; --to torch writes a file")
    with removing_made([out_path]):  # a failure leaves no directory it made
        scratch = out_path.with_name(f".{out_path.name}.rebuilt-{os.urandom(8).hex()}")
        source, named = tensors_of(
            src, rows=rows, strip=strip, renames=renames, dtype=dtype, scratch=scratch
        )
        # (not np.ascontiguousarray: it turns a 0-d array into a 1-d one)
        state = {
            name: numpy_to_tensor(a if a.flags.c_contiguous else a.copy()) for name, a in named
        }
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_path.with_name(f".{out_path.name}.export-{os.urandom(8).hex()}")
        with metering("export", progress) as meter:
            meter.expect(sum(a.nbytes for _, a in named))
            try:
                with open(tmp, "xb") as f:
                    torch.save(state, f)
                    f.flush()
                    if fsync:
                        os.fsync(f.fileno())
                os.replace(tmp, out_path)
                if fsync:
                    fsync_dir(out_path.parent)
            except BaseException as exc:
                # torch.save's zip writer turns a failed write into a RuntimeError, the OSError
                # its context
                cause = exc if isinstance(exc, OSError) else exc.__context__
                needed = sum(a.nbytes for _, a in named)
                failed = write_error(cause, out_path, "the export's destination", needed)
                tmp.unlink(missing_ok=True)
                if failed is not None:
                    raise failed from None
                raise
            meter.finish()
    entries = {display(t.name): t for t in source.manifest.tensors()}
    names = dict(zip(_selected(source, rows, strip), (n for n, _ in named)))
    floats = ("float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")
    not_cast = [n for n in names if dtype and entries[n].dtype not in floats]
    return ExportReport(
        source=source.shown,
        destination=str(out_path),
        step=source.manifest.step,
        files=[out_path.name],
        tensors=len(named),
        total_size=sum(a.nbytes for _, a in named),
        names=names,
        cast=dtype,
        cast_tensors=sum(
            1 for n in names if dtype and entries[n].dtype in floats and entries[n].dtype != dtype
        ),
        not_cast=not_cast,
        seconds=time.perf_counter() - started,
        format="torch",
        rebuilt_nodes=source.rebuilt_nodes,
    )


def _selected(source: Any, rows: Sequence[str], strip: str) -> list[str]:
    return [display(t.name) for t in select(source, rows, strip)]


def _first_line(exc: BaseException) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _leaves(state: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """A converted state as ``('/'-joined keys, leaf)`` pairs (empty mappings dropped)."""
    out: list[tuple[str, Any]] = []
    for k, v in state.items():
        name = f"{prefix}/{k}" if prefix else k
        if isinstance(v, Mapping):
            out += _leaves(v, name)
        else:
            out.append((name, v))
    return out


def _auto_prefix(obj: Mapping[Any, Any], prefix: str | None) -> str:
    """``model`` for a flat state dict of tensors (what ``model.state_dict()`` gives), nothing
    for a nested one (``{"model": ..., "optim": ...}`` keeps its structure)."""
    if prefix is not None:
        return prefix
    flat = bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())
    return "model" if flat else ""


def _convert(obj: Any, path: str) -> list[tuple[str, Any]]:
    if not isinstance(obj, Mapping):
        raise ForeignFormatError(
            path, f"holds a {type(obj).__name__}, not a state dict (a mapping)"
        )
    try:
        return _leaves(to_state(obj))
    except UsageError as exc:  # a value neither a tensor nor JSON-able, a key not a str/int
        raise ForeignFormatError(path, str(exc)) from None


def import_torch(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    renames: Iterable[str | Rename | tuple[str, str]] = (),
    write: WriteOptions | None = None,
    step: int | None = None,
    ranks: int = 1,
    nodes: Sequence[str] | None = None,
    rows: Sequence[str] = (),
    progress: ProgressCallback | None = None,
) -> ImportReport:
    """Import a ``torch.save`` file (a state dict, possibly nested, of tensors and plain values)
    as the checkpoint ``out``, read with ``torch.load(weights_only=True)`` only. ``prefix``:
    where the names go (default: ``model`` for a flat state dict of tensors, else the file's own
    structure); ``renames``: ``OLD=NEW`` prefix rules on the '/'-joined source names;
    ``ranks``/``nodes``/``rows``: the layout of a job of that many ranks, ``write`` and
    ``progress`` (``op="import"``) as for ``ckptfmt.interop.import_named``."""
    started = time.perf_counter()
    path = Path(src)
    if not path.is_file():
        raise ForeignFormatError(str(path), "no such file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        raise ForeignFormatError(
            str(path),
            "needs more than torch.load(weights_only=True) allows (ckptfmt never unpickles "
            f"arbitrary objects): {_first_line(exc)}",
        ) from None
    except (RuntimeError, EOFError, ValueError, OSError, AttributeError, KeyError) as exc:
        raise ForeignFormatError(str(path), f"torch.load cannot read it: {exc}") from None
    items = _convert(obj, str(path))
    return import_named(
        items,
        out,
        source=str(path),
        fmt="torch",
        files=[str(path)],
        prefix=_auto_prefix(obj, prefix),
        renames=renames,
        write=write,
        step=step,
        started=started,
        ranks=ranks,
        nodes=nodes,
        rows=rows,
        progress=progress,
    )


def import_dcp(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    trust_pickle: bool = False,
    prefix: str | None = None,
    renames: Iterable[str | Rename | tuple[str, str]] = (),
    write: WriteOptions | None = None,
    step: int | None = None,
    ranks: int = 1,
    nodes: Sequence[str] | None = None,
    rows: Sequence[str] = (),
    progress: ProgressCallback | None = None,
) -> ImportReport:
    """Import a ``torch.distributed.checkpoint`` directory as the checkpoint ``out``, read by
    DCP's own ``FileSystemReader`` in this process (the whole state in memory, as DCP's
    ``dcp_to_torch_save`` does), the nesting of the saved state dict kept.

    DCP's ``.metadata`` is a pickle, which its reader unpickles: only with ``trust_pickle=True``
    (a checkpoint from someone you trust); :class:`PickleRefusedError` otherwise, before any
    file is opened. ``prefix``, ``renames``, ``write``, ``ranks``, ``nodes``, ``rows``,
    ``progress``: as for :func:`import_torch`."""
    started = time.perf_counter()
    path = Path(src)
    meta = path / ".metadata"
    if not path.is_dir() or not meta.is_file():
        raise ForeignFormatError(str(path), "not a DCP checkpoint directory (no .metadata file)")
    if not trust_pickle:
        raise PickleRefusedError(
            str(meta),
            "DCP's .metadata is a pickle; importing it runs whatever it holds. Pass "
            "trust_pickle=True (ckptfmt import --trust-pickle) only for a checkpoint you trust",
        )
    _compat.private("dcp.load_state_dict")  # a framework too new: its own error, not DCP's
    _compat.private("dcp.empty_state_dict_planner")
    try:
        sd = _compat.dcp_read_whole(path)
    except Exception as exc:  # DCP raises CheckpointException, RuntimeError, pickle errors...
        raise ForeignFormatError(
            str(path), f"DCP's reader cannot read it: {_first_line(exc)}"
        ) from None
    items = _convert(sd, str(path))
    return import_named(
        items,
        out,
        source=str(path),
        fmt="dcp",
        files=sorted(str(p) for p in path.iterdir() if p.is_file()),
        prefix=_auto_prefix(sd, prefix),
        renames=renames,
        write=write,
        step=step,
        started=started,
        ranks=ranks,
        nodes=nodes,
        rows=rows,
        progress=progress,
    )


__all__ = ["export_torch", "import_dcp", "import_torch"]
