"""A rebuilt step read from memory: the :class:`~ckptfmt.storage.files.Files` a collective load
reads when a restore has just rebuilt a level-1 step (``spec/redundancy.md`` §7).

A rebuild holds, on every rank, that rank's member data in one buffer: its data files back to
back, read from disk with every CRC checked (a survivor) or rebuilt from the others' data and
parity (a rank whose data was lost). Loading the step from those buffers, instead of writing the
rebuilt files and reading the whole step again, keeps both the second read and the writes off
the restore's path (the files are written afterwards, ``parallel.collective.rebuild``).

:class:`MemberFiles` serves this rank's data files from its buffer, the manifest from the text
the ranks agreed on, the ``zarr.json`` documents from the node's directory when it is intact or
else as the manifest implies them (what the rebuild will write); anything else from the
directory, when there is one. The readers check every chunk's CRC32C and every file's data CRC
as they would on disk, so rebuilt bytes are vouched for by the manifest before the state holds
them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path

import numpy as np

from ckptfmt.container.members import check_member
from ckptfmt.errors import MissingFileError, SizeMismatchError
from ckptfmt.format.zarr_meta import DocChecker
from ckptfmt.manifest.codec import MANIFEST_NAME
from ckptfmt.manifest.model import Manifest
from ckptfmt.redundancy.record import member_files
from ckptfmt.storage.files import ClosedOnExit, Inside, ReadHandle

__all__ = ["MemberFiles", "MemoryHandle"]


class MemoryHandle(ClosedOnExit):
    """A :class:`~ckptfmt.storage.files.ReadHandle` over bytes already in memory (one data
    file's part of a member buffer); reads are copies, chunk by chunk like a local file's.
    ``checked``: the bytes were checked against every CRC of the file when they were read from
    storage into that buffer (``format.chunk_reads.read_chunks`` does not compute their chunk
    CRCs again); False for bytes a rebuild made, which the reader checks."""

    __slots__ = ("_data", "checked")
    read_batch = 0

    def __init__(self, data: memoryview, checked: bool = False) -> None:
        self._data = data
        self.checked = checked

    def pread(self, n: int, offset: int) -> bytes:
        return bytes(self._data[offset : offset + n])

    def read_into(self, views: Sequence[memoryview], offset: int) -> None:
        at = offset
        for v in views:
            n = len(v)
            if at + n > len(self._data):
                raise EOFError(f"{at + n} bytes asked of {len(self._data)}")
            v[:] = self._data[at : at + n]
            at += n

    def prefetch(self) -> None:
        pass

    def close(self) -> None:
        pass


class MemberFiles:
    """One rank's view of a step rebuilt in memory (see the module's docstring). ``root``: the
    node's step directory (named in messages); ``disk``: it, when it holds this save (a
    survivor's), else None (the directory is gone: only this rank's own files are here);
    ``text``: the agreed manifest; ``member``: this rank's member data (``rank``'s files in
    manifest order, back to back); ``checked``: whether ``member`` is as read from disk with
    every CRC of every file checked (a survivor's: ``engine.rebuild.read_status``), so that a
    load does not compute its chunk CRCs a second time (a rebuilt member's are computed)."""

    reads_in_flight = 1
    reads_parts = True

    def __init__(
        self,
        root: Path,
        disk: Inside | None,
        manifest: Manifest,
        text: bytes,
        rank: int,
        member: np.ndarray,
        checked: bool = False,
    ) -> None:
        self._root = root
        self._disk = disk
        self._manifest = manifest
        self._text = text
        self._rank = rank
        self._member = member
        self._checked = checked
        self._docs: DocChecker | None = None
        self._files: dict[str, memoryview] = {}
        off = 0
        for _, ref in member_files(manifest, rank):
            self._files[ref.path] = memoryview(member[off : off + ref.size])  # type: ignore[arg-type]
            off += ref.size

    @property
    def root(self) -> str:
        return str(self._root)

    def verify(self) -> None:
        """Check the member data against every CRC of its files and the manifest's (a rebuilt
        member's; a survivor's was checked as it was read), raising the first file's damage;
        the load's reads then take its CRCs as checked. A load runs it before anything is read
        (``load_collective``'s ``check_first``), so that bytes a rebuild got wrong are found
        before any of them lands in a caller's arrays."""
        if self._checked:
            return
        damage = check_member(self._manifest, self._rank, self._member)
        if damage:
            raise damage[0].in_checkpoint(self.root)
        self._checked = True

    def _doc(self, rel: str) -> bytes | None:
        if self._docs is None:  # each distinct document encoded once (DocChecker's cache)
            self._docs = DocChecker(self._manifest)
        return self._docs.expected_bytes(rel) if rel in self._docs.paths else None

    def read(self, rel: str, limit: int) -> bytes:
        if rel == MANIFEST_NAME:
            return self._text[:limit]
        if rel in self._files:
            return bytes(self._files[rel][:limit])
        if self._disk is not None:
            return self._disk.read(rel, limit)
        doc = self._doc(rel)
        if doc is None:
            raise FileNotFoundError(rel)
        return doc[:limit]

    def open_exact(self, rel: str, size: int, tensors: Sequence[str] = ()) -> ReadHandle:
        data = self._files.get(rel)
        if data is None:
            if self._disk is not None:
                return self._disk.open_exact(rel, size, tensors)
            raise MissingFileError(rel, tensors).in_checkpoint(self.root)
        if len(data) != size:
            raise SizeMismatchError(rel, size, len(data), tensors).in_checkpoint(self.root)
        return MemoryHandle(data, self._checked)

    def check_size(self, rel: str, size: int, tensors: tuple[str, ...] = ()) -> None:
        data = self._files.get(rel)
        if data is None:
            if self._disk is not None:
                self._disk.check_size(rel, size, tensors)
                return
            raise MissingFileError(rel, tensors).in_checkpoint(self.root)
        if len(data) != size:
            raise SizeMismatchError(rel, size, len(data), tensors).in_checkpoint(self.root)

    def presence_checks(
        self, read: AbstractSet[str], rank: int, ranks: int
    ) -> list[Callable[[], None]]:
        """None, as for a local directory (``Inside.presence_checks``)."""
        return []
