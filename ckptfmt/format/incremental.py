"""Incremental saves: a data file whose content is unchanged since a base checkpoint is
hard-linked from the base instead of written again (``spec/FORMAT.md`` §17).

The decision is per shard file, by content: the file's **content hash** (a 64-bit hash of its
chunk payloads in slot order, the bytes its manifest CRC32C covers) is compared with the hash
the base's manifest records for the file at the same path, together with the file's size and
its tensor's geometry. When the base has such a file, the writer first hashes the shard's
chunks alone (one pass over memory, no CRC32C): the same hash links the base's file, whose
manifest CRC32C is then the base's; another hash, or no such file in the base, and the file is
written by the ordinary pass, which computes the hash right after each chunk's CRC32C while the
chunk is in the cache. With redundancy (whose parity needs every file's bytes, chunk CRCs
included) only that one pass runs, and an unchanged file must match on the CRC32C as well.
Never on the CRC32C alone (32 bits: one false match in 4 billion changed files).

The hash is CRC-64/XZ computed by ISA-L (``redundancy/isal.py``, about 30 GB/s on one core) when
it is available, else BLAKE2b with an 8-byte digest (``hashlib``, about 1 GB/s); the manifest
names the algorithm, and a base hashed with another algorithm (or none) links nothing. A random
change goes unseen by a 64-bit hash with probability 2^-64 (as by xxHash64); the writer is the
training job itself, so the content is not adversarial, and a CRC's guarantee (every change
confined to 64 consecutive bits is seen) is worth more than a cryptographic hash's 30x cost.

The hashes are recorded in the manifest's open ``writer`` object (readers ignore it, §12):
``writer["content_hash"] = {"algorithm": ..., "files": [16 hex digits per data file, in
manifest order]}``. A reader needs none of this: a hard link is a second name of the same file.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptfmt.manifest.model import Manifest
from ckptfmt.redundancy import isal

__all__ = [
    "CONTENT_HASH",
    "Hasher",
    "Incremental",
    "algorithm",
    "hashes_of",
    "unchanged_files",
    "with_hashes",
]

CONTENT_HASH = "content_hash"  # the member of the manifest's ``writer`` object
_CRC64, _BLAKE = "crc64-xz", "blake2b-64"
# errors of os.link that mean "no link here" (another file system, a file system without hard
# links, too many links): the file is written instead
_NO_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP}

GeoKey = tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def algorithm() -> str:
    """The content hash this process computes: ``"crc64-xz"`` with ISA-L, else BLAKE2b."""
    return _CRC64 if isal.crc64_available() else _BLAKE


class Hasher:
    """The running content hash of one file, fed chunk payload by chunk payload."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._crc = 0
        self._blake = hashlib.blake2b(digest_size=8) if name == _BLAKE else None

    def add(self, data: Any) -> None:
        if self._blake is not None:
            self._blake.update(data)
        else:
            self._crc = isal.crc64(data, self._crc)

    def hexdigest(self) -> str:
        if self._blake is not None:
            return self._blake.hexdigest()
        return f"{self._crc:016x}"


@dataclass(frozen=True)
class BaseFile:
    """What the base's manifest says of one data file."""

    geo: GeoKey
    size: int
    crc32c: int
    digest: str


def hashes_of(manifest: Manifest) -> tuple[str, list[str]] | None:
    """(algorithm, one hex digest per data file in manifest order) recorded in ``manifest``, or
    None when it records none (or a list that does not fit its files)."""
    doc = manifest.writer.get(CONTENT_HASH) if isinstance(manifest.writer, dict) else None
    if not isinstance(doc, dict):
        return None
    name, files = doc.get("algorithm"), doc.get("files")
    if not isinstance(name, str) or not isinstance(files, list):
        return None
    if len(files) != len(manifest.files()) or not all(isinstance(h, str) for h in files):
        return None
    return name, files


def with_hashes(writer: dict[str, Any], name: str, digests: Sequence[str]) -> dict[str, Any]:
    """``writer`` with the content hashes of a manifest's files (in manifest order)."""
    return {**writer, CONTENT_HASH: {"algorithm": name, "files": list(digests)}}


def base_files(manifest: Manifest, name: str) -> dict[str, BaseFile]:
    """Every data file of a base checkpoint by path, when it records hashes of algorithm
    ``name`` (else none: nothing can be linked)."""
    recorded = hashes_of(manifest)
    if recorded is None or recorded[0] != name:
        return {}
    out = {}
    for (t, f), digest in zip(manifest.files(), recorded[1]):
        geo = (t.dtype, tuple(t.shape), tuple(t.shard_shape), tuple(t.chunk_shape))
        out[f.path] = BaseFile(geo, f.size, f.crc32c, digest)
    return out


def unchanged_files(manifest: Manifest, base: Manifest) -> set[str]:
    """The paths of ``manifest``'s data files that ``base`` holds with the same content: the
    same path, tensor geometry, size, CRC32C and content hash (both manifests record hashes of
    one algorithm; else none). What a flush or a save to a bucket copies from the base instead
    of writing (``storage/objects/copies.py``), and a flush to a directory links."""
    recorded = hashes_of(manifest)
    if recorded is None:
        return set()
    known = base_files(base, recorded[0])
    out = set()
    for (t, f), digest in zip(manifest.files(), recorded[1]):
        geo = (t.dtype, tuple(t.shape), tuple(t.shard_shape), tuple(t.chunk_shape))
        b = known.get(f.path)
        if b is not None and (b.geo, b.size, b.crc32c, b.digest) == (geo, f.size, f.crc32c, digest):
            out.add(f.path)
    return out


@dataclass
class Incremental:
    """One rank's incremental write: the hash algorithm, the base (its directory and files; no
    base: only hash, for the next save), and what was done, for the manifest and the report.
    Writer threads call :meth:`place` and :meth:`record` at once (a lock guards the tallies).

    The base is a directory (``base_root``: an unchanged file is hard-linked from it) or a
    checkpoint in the draft's own store (``copy_in_store``: a bucket, where an unchanged file is
    copied by the store, ``storage.objects.copies``; called with the file's path, False when it
    could not be copied, and the file is written then)."""

    name: str = field(default_factory=algorithm)
    base_root: Path | None = None
    copy_in_store: Callable[[str], bool] | None = None
    base: dict[str, BaseFile] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)  # path -> hex digest
    linked_bytes: int = 0
    linked_files: int = 0
    written_bytes: int = 0
    unlinkable: list[str] = field(default_factory=list)  # link refused: written instead
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def hasher(self) -> Hasher:
        return Hasher(self.name)

    def can_place(self, target: Path | None) -> bool:
        """Whether an unchanged file written at ``target`` (its path in a directory draft, else
        None) can be taken from the base instead of written."""
        return self.copy_in_store is not None or (self.base_root is not None and target is not None)

    def candidate(self, key: str, geo: GeoKey, size: int) -> BaseFile | None:
        """The base's record of the file at ``key`` if it has this geometry and size (then
        the content decides, :meth:`unchanged`)."""
        known = self.base.get(key)
        has_base = self.base_root is not None or self.copy_in_store is not None
        if known is None or not has_base or (known.geo, known.size) != (geo, size):
            return None
        return known

    def place(
        self, key: str, geo: GeoKey, size: int, crc: int, digest: str, target: Path | None
    ) -> bool | None:
        """Take the file ``key`` holding exactly these bytes from the base: hard-linked as
        ``target`` from a directory, copied inside the store from a bucket. None when the base
        does not hold these bytes (or no such file); False when it does but the file system or
        the store refused (the caller writes the file, and does not try again); True when done."""
        if self.copy_in_store is not None:
            known = self.base.get(key)
            if known is None or (known.geo, known.size, known.crc32c, known.digest) != (
                geo,
                size,
                crc,
                digest,
            ):
                return None
            return self.copy_in_store(key)
        source = self.unchanged(key, geo, size, crc, digest)
        if source is None or target is None:
            return None
        return self.link(source, target)

    def unchanged(self, key: str, geo: GeoKey, size: int, crc: int, digest: str) -> Path | None:
        """The base's file holding exactly these bytes, if there is one on disk (a regular file
        of the recorded size; its chunks are checked by every reader as any file's)."""
        known = self.base.get(key)
        if known is None or self.base_root is None:
            return None
        if (known.geo, known.size, known.crc32c, known.digest) != (geo, size, crc, digest):
            return None
        path = self.base_root / key
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return None
        return path

    def link(self, source: Path, target: Path) -> bool:
        """Hard-link ``source`` as ``target``; False when the file system cannot (another file
        system, no hard links, too many links): the caller writes the file instead."""
        try:
            os.link(source, target, follow_symlinks=False)
        except OSError as exc:
            if exc.errno in _NO_LINK:
                with self._lock:
                    self.unlinkable.append(f"{target}: {os.strerror(exc.errno or 0)}")
                return False
            raise
        return True

    def record(self, key: str, digest: str, size: int, linked: bool) -> None:
        with self._lock:
            self.digests[key] = digest
            if linked:
                self.linked_bytes += size
                self.linked_files += 1
            else:
                self.written_bytes += size

    def report(self) -> dict[str, Any]:
        """This rank's tallies, as the save's vote gathers them."""
        return {
            "linked_bytes": self.linked_bytes,
            "linked_files": self.linked_files,
            "written_bytes": self.written_bytes,
            "unlinkable": len(self.unlinkable),
            "unlinkable_example": self.unlinkable[0] if self.unlinkable else None,
        }
