"""A checkpoint's manifest as a document, and snapshots of a directory's files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def manifest_doc(root: Path) -> dict[str, Any]:
    """The manifest of the checkpoint at ``root`` as a JSON document."""
    return json.loads((root / "ckptfmt.json").read_text())


def write_manifest(root: Path, doc: Any) -> None:
    """Write ``doc`` as the manifest, as a writer would: sealed with its checksum when its
    format version has one (an edit that is not resealed is damage)."""
    (root / "ckptfmt.json").write_bytes(seal_if_sealed(doc))


def seal_if_sealed(doc: Any) -> bytes:
    """``doc``'s bytes: sealed with the manifest checksum when its ``format_version`` is an
    integer from 2 on, else plain JSON without a checksum member (as version 1 is written)."""
    from ckptfmt.manifest.codec import seal

    if not isinstance(doc, dict):
        return json.dumps(doc).encode()
    version = doc.get("format_version")
    if type(version) is int and version >= 2:
        return seal(doc)
    return json.dumps({k: v for k, v in doc.items() if k != "manifest_crc32c"}).encode()


def tree_snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (relative paths)."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def tree(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``root``: its bytes and modification time (ns), so that a test can tell
    a file left alone from one rewritten with the same bytes."""
    return {
        p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def tree_digests(root: Path) -> dict[str, str]:
    """SHA-256 of every file under ``root`` by relative path (small enough to write as JSON from
    a worker rank)."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def leftovers(parent: Path) -> list[str]:
    """Dot-named staging or temporary entries an interrupted write would leave in ``parent``."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def leftover_dirs(root: Path) -> list[str]:
    """Directories anywhere under ``root`` that a commit makes and removes on its way (a step's
    ``.tmp-``, ``.old-`` and ``.del-`` names): none may stay after a save, failed or not."""
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_dir() and (".tmp-" in p.name or ".old-" in p.name or ".del-" in p.name)
    )
