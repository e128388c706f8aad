"""``ckptfmt.verify``: re-read every byte of a checkpoint and report what is damaged.

One directory is checked by :mod:`ckptfmt.maintenance.checks` (every document, every CRC, the
files nobody wrote); a level-1 checkpoint spread over node-local directories (a ``{node}``
template or a mapping node -> directory) is checked node by node, with its redundancy, by
:mod:`ckptfmt.maintenance.verify_parity`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckptfmt.container.reader import read_manifest_bytes
from ckptfmt.maintenance.checks import (
    Problem,
    VerifyReport,
    check_data,
    check_metadata,
    check_schema,
    manifest_schema,
    unexpected_files,
)
from ckptfmt.maintenance.objects import verify_url
from ckptfmt.maintenance.verify_parity import check_single_dir, verify_nodes
from ckptfmt.manifest.codec import MANIFEST_NAME, parse_manifest
from ckptfmt.storage.files import Inside
from ckptfmt.storage.progress import ProgressCallback, current_meter, metering
from ckptfmt.storage.store.location import Location, parse_location

__all__ = ["Problem", "VerifyReport", "manifest_schema", "verify"]


def verify(
    path: str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]] | Location,
    *,
    progress: ProgressCallback | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> VerifyReport:
    """Check a whole checkpoint. ``progress``: called with :class:`~ckptfmt.Progress` events
    (``op="verify"``, ``phase="read"``: the bytes of the data files read and checked; the last,
    ``final``, once every check is done), from this thread (``ckptfmt.storage.progress``).

    ``path``: the checkpoint's directory; or, for a level-1 checkpoint spread over node-local
    directories, a ``{node}`` template (``/local/{node}/ckpt/step-0000000100``) or a mapping
    node -> directory, checked node by node with its parity
    (:mod:`ckptfmt.maintenance.verify_parity`).
    A single directory is checked as a whole checkpoint; when its manifest records level-1
    redundancy but it holds no parity files (a level-3 copy), the report says the redundancy is
    not present on this level, which is not a problem.

    ``path`` may be the URL of a checkpoint in a bucket (``s3://bucket/run/ckpt``): every
    object its commit object lists must be there with its size (one missing or of another size
    is a problem naming its key), and every object is read and checked as a file would be.
    ``storage_options``: as for ``ckptfmt.save``.

    Raises :class:`NotACheckpointError` or :class:`ManifestError` when there is no readable
    manifest (or, in a bucket, no commit object); every other finding goes into the report.
    """
    where = parse_location(path, storage_options)  # http://... is refused, not ./http:/...
    with metering("verify", progress) as meter:
        if where.is_bucket:
            report = verify_url(where.spec, where.storage_options)
        elif where.kind == "spread":
            report = verify_nodes(where.spec)
        else:
            report = _verify_dir(where.directory())
        meter.finish()
    return report


def _verify_dir(root: Path) -> VerifyReport:
    """:func:`verify` of one directory, counted on the caller's progress meter."""
    data = read_manifest_bytes(root)  # read once: parsed and checked, then schema-validated
    manifest = parse_manifest(data, str(root / MANIFEST_NAME))
    check_schema(data, root)
    src = Inside(root)
    report = VerifyReport(str(root), manifest)
    report.problems, expected = check_metadata(src, manifest)
    current_meter().expect(sum(f.size for _, f in manifest.files()))
    check_data(src, manifest, report, expected)
    check_single_dir(root, manifest, report, expected)
    report.unexpected_files = unexpected_files(root, expected)
    return report
