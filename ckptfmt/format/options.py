"""How a checkpoint's files are written: one options object that the collective save, the
one-process save, the manager and the offline rewrite (``ckptfmt reshard``) take instead of the
same five parameters each."""

from __future__ import annotations

from dataclasses import dataclass

from ckptfmt.manifest.grid import DEFAULT_CHUNK_BYTES, DEFAULT_SHARD_BYTES

__all__ = ["WriteOptions"]


@dataclass(frozen=True)
class WriteOptions:
    """The same on every rank of a save.

    ``chunk_bytes`` / ``shard_bytes``: the target size of an inner chunk (the unit of checksums
    and partial reads) and of a shard file (``spec/FORMAT.md`` §7); ``threads``: writer
    threads per node; ``fsync``: make every file and directory durable before the commit;
    ``overwrite``: replace a committed checkpoint at the destination (else refused);
    ``content_hash``: record a content hash of every data file in the manifest's ``writer``,
    so that a later save can be incremental against this one (``format/incremental.py``; a
    save with a ``base`` records them anyway). The sizes are checked where the plan is made
    (``ckptfmt.plan.make_plan``)."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    shard_bytes: int = DEFAULT_SHARD_BYTES
    threads: int = 2
    fsync: bool = True
    overwrite: bool = False
    content_hash: bool = False
