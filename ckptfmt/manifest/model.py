"""The manifest as frozen dataclasses. The JSON form (``ckptfmt.manifest.codec``) is the contract;
these classes are its in-memory image and carry no behaviour beyond derived sizes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ckptfmt.manifest.limits import CONTAINERS_SINCE, FORMAT_VERSION

JSON = Any  # a value json.dumps accepts (after non-finite floats are taken out)


@dataclass(frozen=True)
class FileRef:
    """One stored file: its path relative to the checkpoint root, its size, and the CRC32C of its
    inner-chunk payloads in slot order (``spec/FORMAT.md`` §10; not of the whole file)."""

    path: str
    size: int
    crc32c: int


@dataclass(frozen=True)
class Region:
    """A box of a tensor, aligned to its shard grid, written by one rank into whole shard files.

    ``files`` lists the box's shard files in C order of their shard-grid indices.
    """

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    rank: int
    files: tuple[FileRef, ...]

    @property
    def nbytes_stored(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class TensorEntry:
    """A logical tensor at its global shape, stored as the zarr v3 array at ``path``.

    ``shard_shape`` is the zarr chunk-grid shape (one shard file per grid cell), ``chunk_shape``
    the inner chunk shape of the sharding codec (one CRC32C each). ``per_rank`` marks a tensor whose
    leading axis is the rank: each rank's own copy of something (an RNG state, say).
    ``encoding`` marks a 1-d ``uint8`` tensor that holds opaque bytes: ``"bytes"`` (a bytes
    value) or ``"pickle"`` (an object's pickle, unpickled only by a reader told to trust it).
    """

    name: tuple[str, ...]
    path: str
    dtype: str
    shape: tuple[int, ...]
    shard_shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    regions: tuple[Region, ...]
    per_rank: bool = False
    encoding: str | None = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def nbytes(self, itemsize: int) -> int:
        return self.size * itemsize


@dataclass(frozen=True)
class ValueEntry:
    """A JSON value (int, float incl. non-finite, str, bool, None, lists, str-keyed dicts)."""

    name: tuple[str, ...]
    value: JSON


@dataclass(frozen=True)
class GroupEntry:
    """An empty mapping, kept so that ``load`` gives back the structure ``save`` was given; or,
    with ``container`` (``"list"``, ``"tuple"``), a list or tuple whose items are the entries
    named by its name and the item's index (``"0"``, ``"1"``, ...)."""

    name: tuple[str, ...]
    container: str | None = None


@dataclass(frozen=True)
class PerRankValueEntry:
    """A JSON value of which every rank holds its own copy (data-loader position, say).

    ``values[r]`` is rank ``r``'s value. Reserved in version 1 for the framework adapters.
    """

    name: tuple[str, ...]
    values: tuple[JSON, ...]


Entry = TensorEntry | ValueEntry | GroupEntry | PerRankValueEntry


@dataclass(frozen=True)
class RankInfo:
    """Where one rank ran at save time: its failure domain (node)."""

    rank: int
    node: str


@dataclass(frozen=True)
class Manifest:
    """Everything a reader needs to know about one checkpoint, written last at its root."""

    save_id: str
    step: int | None
    created: str
    world_size: int
    ranks: tuple[RankInfo, ...]
    entries: tuple[Entry, ...]
    levels: dict[str, JSON] = field(default_factory=dict)
    writer: dict[str, JSON] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        # a writer writes the lowest version whose rules its entries follow (FORMAT.md §15)
        if self.format_version < CONTAINERS_SINCE and any(
            (isinstance(e, GroupEntry) and e.container is not None)
            or (isinstance(e, TensorEntry) and e.encoding is not None)
            for e in self.entries
        ):
            object.__setattr__(self, "format_version", CONTAINERS_SINCE)

    def tensors(self) -> list[TensorEntry]:
        return [e for e in self.entries if isinstance(e, TensorEntry)]

    def files(self) -> list[tuple[TensorEntry, FileRef]]:
        """Every stored data file with the tensor it belongs to, in manifest order."""
        return [(t, f) for t in self.tensors() for r in t.regions for f in r.files]

    def values(self, prefix: str = "") -> dict[str, JSON]:
        """The JSON values saved under ``prefix`` ('/'-joined; ``""``: all of them), by name
        relative to it ('/'-joined), as ``load`` gives them back (a per-rank value as the list
        of every rank's). They are in the manifest, so no data file is read: what a load that
        fills objects in place returns its counters through (``ck.load(model, path).values(
        "counters")``)."""
        head = tuple(c for c in prefix.split("/") if c)
        out: dict[str, JSON] = {}
        for e in self.entries:
            if not isinstance(e, ValueEntry | PerRankValueEntry) or e.name[: len(head)] != head:
                continue
            rel = "/".join(e.name[len(head) :])
            if rel:
                out[rel] = e.value if isinstance(e, ValueEntry) else list(e.values)
        return out
