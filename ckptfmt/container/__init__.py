"""One checkpoint directory: its metadata documents, its manifest, the member files of each rank,
and the read-only view (:class:`Checkpoint`)."""

from __future__ import annotations

from ckptfmt.container.metadata import ManifestMeta, utc_now, write_metadata, writer_info
from ckptfmt.container.reader import (
    Checkpoint,
    TensorView,
    latest,
    read_manifest,
)

__all__ = [
    "ManifestMeta",
    "Checkpoint",
    "latest",
    "read_manifest",
    "TensorView",
    "utc_now",
    "write_metadata",
    "writer_info",
]
