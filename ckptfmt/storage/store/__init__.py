"""The write side of storage (``base``): a :class:`Store` per place a checkpoint can live, each
with its commit strategy, and the :class:`Location` a user's path or URL is parsed into once.

Stores: :class:`DirectoryStore` (a POSIX directory: staging directory and rename),
:class:`BucketStore` (an object-store prefix: objects and a create-only commit object),
:class:`MemoryStore` (a dict in this process: for tests). Adding one is one module here
(``docs/stores.md``).
"""

from __future__ import annotations

from ckptfmt.storage.store.base import Draft, Store
from ckptfmt.storage.store.directory import DirectoryDraft, DirectoryStore, draft_at
from ckptfmt.storage.store.location import (
    Location,
    LocationSpec,
    incremental_base,
    parse_location,
)
from ckptfmt.storage.store.memory import MemoryStore

__all__ = [
    "Draft",
    "DirectoryDraft",
    "DirectoryStore",
    "Location",
    "LocationSpec",
    "MemoryStore",
    "Store",
    "draft_at",
    "incremental_base",
    "parse_location",
]
