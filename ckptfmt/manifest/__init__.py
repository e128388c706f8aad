"""The manifest (``ckptfmt.json``): its model, its limits, value encoding, the chunk grid, and the
codec that reads and writes it with its checksum (``spec/FORMAT.md``)."""

from __future__ import annotations

from ckptfmt.manifest.codec import MANIFEST_NAME, dump_manifest, parse_manifest
from ckptfmt.manifest.grid import DEFAULT_CHUNK_BYTES, DEFAULT_SHARD_BYTES
from ckptfmt.manifest.limits import check_component, display
from ckptfmt.manifest.model import (
    GroupEntry,
    Manifest,
    PerRankValueEntry,
    Region,
    TensorEntry,
    ValueEntry,
)
from ckptfmt.manifest.values import decode_value, encode_value

__all__ = [
    "check_component",
    "decode_value",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_SHARD_BYTES",
    "display",
    "dump_manifest",
    "encode_value",
    "GroupEntry",
    "Manifest",
    "MANIFEST_NAME",
    "parse_manifest",
    "PerRankValueEntry",
    "Region",
    "TensorEntry",
    "ValueEntry",
]
