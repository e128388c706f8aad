"""``ckptfmt.verify``: re-read every byte of a checkpoint and report what is damaged.

Checked: the manifest against ``spec/manifest.schema.json`` and the format's rules; every zarr
metadata document against the manifest; every data file's presence, size, data CRC32C (of all
its chunk payloads), shard index CRC and inner-chunk CRC32Cs. Each problem names the file and
the tensors it affects. Files the manifest does not list are reported separately (they do not
make a checkpoint damaged, but nothing vouches for them).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from ckptfmt.codecs.grid import shard_cell
from ckptfmt.codecs.zarr_meta import check_array_doc
from ckptfmt.errors import DamagedError, ManifestError, MetadataMismatchError, MissingFileError
from ckptfmt.manifest.codec import MANIFEST_NAME, parse_manifest
from ckptfmt.manifest.limits import display
from ckptfmt.manifest.model import GroupEntry, Manifest, TensorEntry
from ckptfmt.reader import geometry, read_manifest_bytes
from ckptfmt.storage.files import Inside
from ckptfmt.storage.shard_io import decode_shard, read_file


@dataclass(frozen=True)
class Problem:
    """One damaged or missing file."""

    file: str
    kind: str  # missing | size | checksum | corrupt | metadata
    reason: str
    tensors: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "kind": self.kind,
            "reason": self.reason,
            "tensors": list(self.tensors),
        }


@dataclass
class VerifyReport:
    """What :func:`verify` found. ``healthy`` is true when there are no problems."""

    path: str
    manifest: Manifest
    problems: list[Problem] = field(default_factory=list)
    unexpected_files: list[str] = field(default_factory=list)
    files_checked: int = 0
    bytes_checked: int = 0

    @property
    def healthy(self) -> bool:
        return not self.problems

    @property
    def damaged_tensors(self) -> list[str]:
        return sorted({t for p in self.problems for t in p.tensors})

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "healthy": self.healthy,
            "format_version": self.manifest.format_version,
            "step": self.manifest.step,
            "save_id": self.manifest.save_id,
            "files_checked": self.files_checked,
            "bytes_checked": self.bytes_checked,
            "problems": [p.to_json() for p in self.problems],
            "damaged_tensors": self.damaged_tensors,
            "unexpected_files": self.unexpected_files,
        }


@lru_cache(maxsize=1)
def manifest_schema() -> dict[str, Any]:
    """The JSON schema of the manifest (a copy of ``spec/manifest.schema.json``)."""
    text = resources.files("ckptfmt.manifest").joinpath("manifest.schema.json").read_text()
    return json.loads(text)  # type: ignore[no-any-return]


def check_schema(data: bytes, root: Path) -> None:
    """Validate the manifest's bytes against the JSON schema; raise :class:`ManifestError`."""
    import jsonschema

    doc = json.loads(data)
    validator = jsonschema.Draft202012Validator(manifest_schema())
    error = jsonschema.exceptions.best_match(validator.iter_errors(doc))
    if error is not None:
        pointer = "".join(f"/{p}" for p in error.absolute_path)
        raise ManifestError(f"schema: {error.message}", pointer, str(root / MANIFEST_NAME))


def _kind(exc: DamagedError) -> str:
    from ckptfmt.errors import ChecksumError, SizeMismatchError

    if isinstance(exc, MissingFileError):
        return "missing"
    if isinstance(exc, SizeMismatchError):
        return "size"
    if isinstance(exc, ChecksumError):
        return "checksum"
    if isinstance(exc, MetadataMismatchError):
        return "metadata"
    return "corrupt"


def _check_doc(
    src: Inside, rel: str, tensors: tuple[str, ...], check: Callable[[Any], None]
) -> Problem | None:
    try:
        doc = json.loads(src.read(rel, 1 << 20))
        check(doc)
    except FileNotFoundError:
        return Problem(rel, "missing", "missing", tensors)
    except (OSError, ValueError, RecursionError) as exc:
        return Problem(rel, "metadata", f"unreadable: {exc}", tensors)
    except DamagedError as exc:
        return Problem(rel, _kind(exc), exc.reason, tensors)
    return None


def _check_array(doc: Any, rel: str, t: TensorEntry) -> None:
    check_array_doc(doc, rel, t.dtype, t.shape, t.shard_shape, t.chunk_shape)


def verify(
    path: str | os.PathLike[str],
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Check a whole checkpoint. ``progress(n)`` is called with each file's size once it is read.

    Raises :class:`NotACheckpointError` or :class:`ManifestError` when there is no readable
    manifest; every other finding goes into the report.
    """
    root = Path(path)
    data = read_manifest_bytes(root)  # read once: parsed and checked, then schema-validated
    manifest = parse_manifest(data, str(root / MANIFEST_NAME))
    check_schema(data, root)
    src = Inside(root)
    report = VerifyReport(str(root), manifest)
    expected = {MANIFEST_NAME}

    def want_group(doc: Any) -> None:
        if (
            not isinstance(doc, dict)
            or doc.get("node_type") != "group"
            or doc.get("zarr_format") != 3
        ):
            raise MetadataMismatchError("", "expected a zarr v3 group document")

    groups = {e.name[:k] for e in manifest.entries for k in range(len(e.name))} | {()}
    groups |= {e.name for e in manifest.entries if isinstance(e, GroupEntry)}
    for g in sorted(groups):
        rel = "/".join((*g, "zarr.json"))
        expected.add(rel)
        problem = _check_doc(src, rel, (), want_group)
        if problem:
            report.problems.append(problem)
    for t in manifest.tensors():
        name = (display(t.name),)
        rel = f"{t.path}/zarr.json"
        expected.add(rel)
        problem = _check_doc(src, rel, name, functools.partial(_check_array, rel=rel, t=t))
        if problem:
            report.problems.append(problem)
        geo = geometry(t)
        for r in t.regions:
            for ref in r.files:
                expected.add(ref.path)
                cell = shard_cell(ref.path)
                try:
                    blob = read_file(src, ref, name)
                    decode_shard(blob, geo, cell, ref, name)
                    report.bytes_checked += len(blob)
                except DamagedError as exc:
                    report.problems.append(Problem(ref.path, _kind(exc), exc.reason, name))
                except OSError as exc:  # unreadable: permissions, I/O error
                    report.problems.append(Problem(ref.path, "unreadable", str(exc), name))
                report.files_checked += 1
                if progress:
                    progress(ref.size)
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/")
            if rel not in expected:
                report.unexpected_files.append(rel)
    report.unexpected_files.sort()
    return report
