"""``WriteOptions`` checks itself when made: every caller (the saves, the manager, reshard, the
adapters) can take one as it is, and a bad value is refused once, naming its field, before any
file is touched."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.errors import UsageError
from ckptfmt.manifest.limits import MAX_CHUNK_BYTES

BAD: list[tuple[dict[str, Any], str]] = [
    ({"chunk_bytes": 0}, "chunk_bytes"),
    ({"chunk_bytes": -5}, "chunk_bytes"),
    ({"chunk_bytes": 1.5}, "chunk_bytes"),
    ({"chunk_bytes": True}, "chunk_bytes"),
    ({"shard_bytes": 0}, "shard_bytes"),
    ({"threads": 0}, "threads"),
    ({"threads": "2"}, "threads"),
    ({"chunk_bytes": 4096, "shard_bytes": 1024}, "chunk_bytes <= shard_bytes"),
    ({"chunk_bytes": MAX_CHUNK_BYTES + 1, "shard_bytes": 2 * MAX_CHUNK_BYTES}, "chunk_bytes <="),
    ({"fsync": 1}, "fsync"),
    ({"overwrite": "yes"}, "overwrite"),
    ({"content_hash": None}, "content_hash"),
]


@pytest.mark.parametrize(("fields", "named"), BAD, ids=[str(f) for f, _ in BAD])
def test_a_bad_field_is_refused_when_made(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(UsageError, match=named):
        WriteOptions(**fields)


def test_replace_checks_again() -> None:
    with pytest.raises(UsageError, match="threads"):
        dataclasses.replace(WriteOptions(), threads=0)


def test_good_options_are_taken_as_they_are(tmp_path: Path) -> None:
    write = WriteOptions(chunk_bytes=64, shard_bytes=256, threads=1, fsync=False)
    state = {"w": np.arange(100, dtype=np.float32)}
    ckptfmt.save(state, tmp_path / "a", write=write)
    assert (ckptfmt.load(tmp_path / "a")["w"] == state["w"]).all()
    assert len(list((tmp_path / "a" / "w" / "c").iterdir())) == 2  # 400 bytes in 256-byte shards
