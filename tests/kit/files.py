"""A checkpoint's manifest as a document, snapshots of a directory's files, and the files a
checkpoint's manifest says it holds."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptfmt.manifest.model import Manifest


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


def committed_steps(path: Path) -> list[int]:
    """The steps committed under ``path`` (a level's root), oldest first."""
    from ckptfmt.storage import commit

    if not path.is_dir():
        return []
    return sorted(
        int(p.name[5:])
        for p in path.iterdir()
        if p.name.startswith("step-") and commit.is_committed(p)
    )


def files_under(path: Path) -> set[str]:
    """Every file under ``path`` by relative path."""
    return {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}


def metadata_files(m: Manifest) -> set[str]:
    """The manifest and the zarr documents of every group and array of the hierarchy."""
    from ckptfmt.manifest.model import GroupEntry

    names = [e.name for e in m.entries]
    groups = {n[:k] for n in names for k in range(len(n))} | {()}
    groups |= {e.name for e in m.entries if isinstance(e, GroupEntry)}
    docs = {"/".join((*g, "zarr.json")) for g in groups}
    return {"ckptfmt.json"} | docs | {f"{t.path}/zarr.json" for t in m.tensors()}


def data_files(m: Manifest, node: str | None = None) -> set[str]:
    """Data files of the regions written by ``node``'s ranks (every node's when None)."""
    return {
        f.path
        for t in m.tensors()
        for r in t.regions
        if node is None or m.ranks[r.rank].node == node
        for f in r.files
    }
