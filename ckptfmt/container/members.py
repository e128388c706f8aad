"""Member data and parity files of a redundancy set, between disk and memory
(``spec/redundancy.md`` §2, §5).

A member's data is its data files in manifest order, back to back; it is read into (and written
back out of) one buffer, zero-padded beyond its length. Reads check sizes and, when asked, every
CRC (a damaged member counts as lost); writes of rebuilt data check every CRC first, so a rebuild
never stores bytes the manifest does not vouch for.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ckptfmt.checksum import crc32c
from ckptfmt.errors import (
    ChecksumError,
    DamagedError,
    MissingFileError,
    SizeMismatchError,
    UnrecoverableDamageError,
)
from ckptfmt.format.shard_io import Geometry
from ckptfmt.format.shard_read import decode_shard
from ckptfmt.manifest.grid import shard_cell
from ckptfmt.manifest.limits import display
from ckptfmt.manifest.model import FileRef, Manifest, TensorEntry
from ckptfmt.redundancy.record import ParityFile, RedundancyRecord, member_files
from ckptfmt.storage.files import (
    Inside,
    fsync_dir,
    link_out_of,
    naming_checkpoint,
    write_gather,
)


@naming_checkpoint
def read_exact(src: Inside, rel: str, size: int, out: np.ndarray, tensors: tuple[str, ...]) -> None:
    with src.open_exact(rel, size, tensors) as handle:
        try:
            handle.read_into([out.data], 0)
        except EOFError:
            raise SizeMismatchError(rel, size, -1, tensors) from None


def read_member(
    src: Inside, manifest: Manifest, rank: int, out: np.ndarray, verify: bool = True
) -> list[DamagedError]:
    """Read ``rank``'s data files into ``out`` (uint8, at least the member's length; the rest is
    zeroed). Returns the damage found (missing, wrong size, with ``verify`` a failed CRC), one
    error per damaged file; an empty list means the member is intact."""
    damage: list[DamagedError] = []
    off = 0
    for t, ref in member_files(manifest, rank):
        view = out[off : off + ref.size]
        shown = (display(t.name),)
        try:
            read_exact(src, ref.path, ref.size, view, shown)
            if verify:
                _check_file(t, ref, view)
        except DamagedError as exc:
            damage.append(exc.in_checkpoint(src.root))
        except OSError as exc:
            damage.append(
                DamagedError(ref.path, f"cannot be read: {exc}", shown).in_checkpoint(src.root)
            )
        off += ref.size
    out[off:] = 0
    return damage


def check_member(manifest: Manifest, rank: int, data: np.ndarray) -> list[DamagedError]:
    """Check ``rank``'s data files held in memory (``data``: its member data, the files back to
    back, as :func:`read_member` reads them) against every CRC of each and the manifest's:
    one error per damaged file; an empty list means every byte is vouched for."""
    damage: list[DamagedError] = []
    off = 0
    for t, ref in member_files(manifest, rank):
        try:
            _check_file(t, ref, data[off : off + ref.size])
        except DamagedError as exc:
            damage.append(exc)
        off += ref.size
    return damage


def _check_file(t: TensorEntry, ref: FileRef, view: np.ndarray) -> None:
    geo = Geometry.of(t.path, t.dtype, t.shape, t.shard_shape, t.chunk_shape)
    decode_shard(memoryview(view), geo, shard_cell(ref.path), ref, (display(t.name),))  # type: ignore[arg-type]


def write_member(
    root: Path,
    manifest: Manifest,
    rank: int,
    data: np.ndarray,
    only: Iterable[str] | None = None,
    fsync: bool = True,
) -> list[str]:
    """Write ``rank``'s data files (all, or those whose paths are in ``only``) from its member
    data ``data`` into the directory ``root``, each checked against its CRCs first and replaced
    atomically (a temporary name, then rename). Returns the paths written."""
    wanted = None if only is None else set(only)
    written = []
    off = 0
    for t, ref in member_files(manifest, rank):
        blob = data[off : off + ref.size]
        off += ref.size
        if wanted is not None and ref.path not in wanted:
            continue
        _check_file(t, ref, blob)
        replace_file(root / ref.path, blob, fsync, root)
        written.append(ref.path)
    return written


def parity_chunks(pf: ParityFile) -> int:
    return len(pf.crc32c)


def read_parity(src: Inside, pf: ParityFile, out: np.ndarray) -> list[bool]:
    """Read a parity file into ``out`` (uint8, ``pf.size`` bytes); which of its chunks are intact
    (all False when the file is missing or of the wrong size)."""
    n = parity_chunks(pf)
    try:
        read_exact(src, pf.path, pf.size, out[: pf.size], ())
    except (DamagedError, OSError):
        return [False] * n
    step = pf.size // n if n else 0
    return [crc32c(out[i * step : (i + 1) * step]) == pf.crc32c[i] for i in range(n)]


def check_parity(pf: ParityFile, data: np.ndarray) -> None:
    """Raise :class:`ChecksumError` unless every chunk of ``data`` matches ``pf``'s CRCs."""
    n = parity_chunks(pf)
    step = pf.size // n if n else 0
    for i in range(n):
        actual = crc32c(data[i * step : (i + 1) * step])
        if actual != pf.crc32c[i]:
            raise ChecksumError(pf.path, f"rebuilt parity chunk {i}", pf.crc32c[i], actual)


def write_parity(root: Path, pf: ParityFile, data: np.ndarray, fsync: bool = True) -> None:
    """Write a parity file (checked against its CRCs first), replacing it atomically."""
    check_parity(pf, data[: pf.size])
    replace_file(root / pf.path, data[: pf.size], fsync, root)


def replace_file(path: Path, data: np.ndarray, fsync: bool, root: Path | None = None) -> None:
    """Write ``data`` to ``path`` through a temporary name and a rename (never half a file);
    the temporary file is removed if that fails. ``root``: the checkpoint directory ``path``
    lies in; a directory on the way that is a symbolic link leading out of it is never written
    through (readers do not read through it either, ``spec/FORMAT.md`` §14):
    :class:`UnrecoverableDamageError` naming it."""
    if root is not None:
        out = link_out_of(root, path)
        if out is not None:
            raise UnrecoverableDamageError(
                str(out[0]),
                f"a symbolic link to {out[1]}, outside {root}, where a directory belongs: not "
                "written through (replace it by the directory it stands for, or remove it and "
                "rebuild)",
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.rebuild-{os.getpid()}")
    if tmp.exists():
        tmp.unlink()
    try:
        write_gather(tmp, [data.data], fsync)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)


def assess_member(
    src: Inside | None,
    manifest: Manifest,
    record: RedundancyRecord,
    rank: int,
    data: np.ndarray,
    parity: np.ndarray,
) -> tuple[list[DamagedError], list[bool]]:
    """Read ``rank``'s member data (every CRC checked) into ``data`` and its parity file into
    ``parity`` from the step directory ``src`` (None: the directory is gone or holds another
    save). Returns the damaged data files and which parity chunks are intact."""
    rset, j = record.set_of(rank)
    pf = rset.parity[j]
    if src is None:
        files = member_files(manifest, rank)
        missing: list[DamagedError] = [
            MissingFileError(f.path, (display(t.name),)) for t, f in files
        ]
        return missing or [MissingFileError("(no step directory)")], [False] * len(pf.crc32c)
    return read_member(src, manifest, rank, data, verify=True), read_parity(src, pf, parity)


def buffer_sizes(record: RedundancyRecord, rank: int) -> tuple[int, int]:
    """(data, parity) buffer bytes for ``rank``: its padded data and its parity file."""
    rset, j = record.set_of(rank)
    return record.code.data_bytes(rset.sizes, j, rset.chunk), rset.parity[j].size
