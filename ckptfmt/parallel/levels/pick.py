"""Which level 3 a manager has, from what it was given: a shared directory
(:class:`~ckptfmt.parallel.levels.shared.DirLevel`) or a bucket prefix
(:class:`~ckptfmt.parallel.levels.bucket.BucketLevel`); and ``ckptfmt list`` of either."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckptfmt.errors import ObjectStoreSetupError, UsageError, level_name
from ckptfmt.parallel.levels.bucket import BucketLevel, bucket_levels
from ckptfmt.parallel.levels.layout import (
    LEVELS_FILE,
    Levels,
    dir_level3,
    read_record,
    with_level1,
)
from ckptfmt.parallel.levels.shared import DirLevel, SharedLevel
from ckptfmt.storage.store import parse_location

__all__ = ["level3_of", "list_levels", "shared_level"]


def shared_level(
    shared_dir: str | os.PathLike[str] | None,
    storage_options: Mapping[str, Any] | None = None,
    *,
    local_dir: object = None,
) -> SharedLevel | None:
    """The level 3 that ``shared_dir`` names: a :class:`DirLevel` for a path, a
    :class:`BucketLevel` for an object-store URL (``s3://``, ``gs://``, ``az://``; needs
    ``ckptfmt[cloud]``), None for None. A bucket takes flushes of level-1 checkpoints only: it
    needs a ``local_dir``. Makes no request."""
    if shared_dir is None:
        if storage_options:
            raise UsageError("storage_options is for a shared_dir that is an object-store URL")
        return None
    where = parse_location(shared_dir)  # an unsupported scheme (file://, http://) is named
    if where.is_bucket:
        if local_dir is None:
            raise UsageError(
                f"shared_dir={shared_dir!r} is a bucket: level 1 (local_dir) is needed, since "
                "level 3 on object storage is written by flushing level-1 checkpoints"
            )
        try:
            return BucketLevel.at(where.spec, storage_options)
        except ObjectStoreSetupError as exc:  # told by the settings alone, before a request
            raise exc.at_level(level_name(3) or "level 3") from None
    if storage_options:
        raise UsageError("storage_options is for a shared_dir that is an object-store URL")
    return DirLevel(Path(shared_dir).absolute())


def level3_of(levels: Levels) -> SharedLevel | None:
    """The level 3 of ``levels``: its bucket, or its shared directory, or None."""
    if levels.bucket is not None:
        assert isinstance(levels.bucket, SharedLevel)  # what the manager put there
        return levels.bucket
    return None if levels.shared_dir is None else DirLevel(levels.shared_dir)


def list_levels(
    shared_root: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """What is saved where, for ``ckptfmt list``: every step found on level 3 and on the level-1
    directories recorded in ``ckptfmt-levels.json`` (those visible from here). ``shared_root``
    is a directory or a bucket root URL (``s3://bucket/run``, with ``storage_options``; needs
    ``ckptfmt[cloud]``): a bucket's steps are flushed (a commit object whose objects are all
    there), damaged (some missing or of another size), or not committed (objects without a
    commit object: a flush in progress or one that failed)."""
    if parse_location(shared_root).is_bucket:
        level3, cfg = bucket_levels(os.fspath(shared_root), storage_options)
        return with_level1(os.fspath(shared_root), cfg, level3)
    root = Path(shared_root)
    cfg_file = root / LEVELS_FILE
    cfg = read_record(cfg_file.read_bytes(), str(cfg_file)) if cfg_file.is_file() else {}
    return with_level1(str(root), cfg, dir_level3(root))
