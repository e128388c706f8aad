"""How a checkpoint's files are written: one options object that the collective save, the
one-process save, the manager and the offline rewrite (``ckptfmt reshard``) take instead of the
same five parameters each."""

from __future__ import annotations

from dataclasses import dataclass

from ckptfmt.errors import UsageError
from ckptfmt.manifest.grid import DEFAULT_CHUNK_BYTES, DEFAULT_SHARD_BYTES
from ckptfmt.manifest.limits import MAX_CHUNK_BYTES

__all__ = ["WriteOptions", "checked_write"]


@dataclass(frozen=True)
class WriteOptions:
    """The same on every rank of a save.

    ``chunk_bytes`` / ``shard_bytes``: the target size of an inner chunk (the unit of checksums
    and partial reads) and of a shard file (``spec/FORMAT.md`` §7); ``threads``: writer
    threads per node; ``fsync``: make every file and directory durable before the commit;
    ``overwrite``: replace a committed checkpoint at the destination (else refused);
    ``content_hash``: record a content hash of every data file in the manifest's ``writer``,
    so that a later save can be incremental against this one (``format/incremental.py``; a
    save with a ``base`` records them anyway). Checked when made (a :class:`UsageError`
    naming the field): ``1 <= chunk_bytes <= shard_bytes``, ``chunk_bytes`` at most
    ``MAX_CHUNK_BYTES`` (an inner chunk is read whole), ``threads >= 1``, the flags booleans;
    every caller can take one as it is."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    shard_bytes: int = DEFAULT_SHARD_BYTES
    threads: int = 2
    fsync: bool = True
    overwrite: bool = False
    content_hash: bool = False

    def __post_init__(self) -> None:
        for name in ("chunk_bytes", "shard_bytes", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"WriteOptions: {name} must be an int >= 1, got {value!r}")
        if not self.chunk_bytes <= min(self.shard_bytes, MAX_CHUNK_BYTES):
            raise UsageError(
                f"WriteOptions: need chunk_bytes <= shard_bytes and chunk_bytes <= "
                f"{MAX_CHUNK_BYTES}, got chunk_bytes={self.chunk_bytes}, "
                f"shard_bytes={self.shard_bytes}"
            )
        for name in ("fsync", "overwrite", "content_hash"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"WriteOptions: {name} must be True or False")


def checked_write(value: object, name: str = "write") -> WriteOptions:
    """``value``, a :class:`WriteOptions` (whose fields checked themselves when it was made),
    or the :class:`UsageError` of an argument ``name`` of another type (a dict of its fields,
    say), the same wherever one is handed in."""
    if not isinstance(value, WriteOptions):
        raise UsageError(f"{name} must be a ckptfmt.WriteOptions, got {type(value).__name__}")
    return value
