"""The checks of one checkpoint directory that :func:`ckptfmt.maintenance.verify.verify` makes:
re-read every byte of a checkpoint and report what is damaged.

Checked: the manifest's own CRC32C (format version 2), then the manifest against
``spec/manifest.schema.json`` and the format's rules; every zarr metadata document against the
manifest (version 2: the whole parsed document); every data file's presence, size, data CRC32C
(of all its chunk payloads), shard index CRC and inner-chunk CRC32Cs, read chunk by chunk so
that memory stays bounded whatever size a file claims. Each problem names the file and
the tensors it affects. Files the manifest does not list are reported separately (they do not
make a checkpoint damaged, but nothing vouches for them).

A level-1 checkpoint spread over node-local directories (a ``{node}`` template or a mapping node
-> directory) is checked node by node, with its redundancy:
:mod:`ckptfmt.maintenance.verify_parity`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from ckptfmt.container.reader import geometry, read_doc
from ckptfmt.errors import (
    ChecksumError,
    DamagedError,
    ManifestError,
    MetadataMismatchError,
    MissingFileError,
    SizeMismatchError,
)
from ckptfmt.format.shard_io import Geometry
from ckptfmt.format.shard_read import verify_file
from ckptfmt.format.zarr_meta import DocChecker
from ckptfmt.manifest.codec import MANIFEST_NAME
from ckptfmt.manifest.grid import shard_cell
from ckptfmt.manifest.limits import display
from ckptfmt.manifest.model import FileRef, Manifest
from ckptfmt.storage.files import Files, each_in_flight
from ckptfmt.storage.progress import current_meter


@dataclass(frozen=True)
class Problem:
    """One damaged or missing file. ``node``: the node whose level-1 directory holds it, when a
    checkpoint is verified node by node (else None)."""

    file: str
    kind: str  # missing | size | checksum | corrupt | metadata | unreadable | parity
    reason: str
    tensors: tuple[str, ...] = ()
    node: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "file": self.file,
            "kind": self.kind,
            "reason": self.reason,
            "tensors": list(self.tensors),
        }
        if self.node is not None:
            doc["node"] = self.node
        return doc


@dataclass
class VerifyReport:
    """What :func:`verify` found. ``healthy`` is true when there are no problems.

    ``nodes``: node -> directory when verified node by node (else None). ``redundancy``: the
    level-1 redundancy record in brief and its ``status``: ``"checked"`` (every parity file read,
    its CRCs and its agreement with the members' data checked) or ``"not present on this level"``
    (a level-3 copy: no parity files, by design); None when the save has no redundancy."""

    path: str
    manifest: Manifest
    problems: list[Problem] = field(default_factory=list)
    unexpected_files: list[str] = field(default_factory=list)
    files_checked: int = 0
    bytes_checked: int = 0
    nodes: dict[str, str] | None = None
    redundancy: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)  # e.g. good manifest copies that disagree

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
            "nodes": self.nodes,
            "redundancy": self.redundancy,
            "notes": self.notes,
        }


@lru_cache(maxsize=1)
def manifest_schema() -> dict[str, Any]:
    """The JSON schema of the manifest (a copy of ``spec/manifest.schema.json``)."""
    text = resources.files("ckptfmt.manifest").joinpath("manifest.schema.json").read_text()
    return json.loads(text)  # type: ignore[no-any-return]


def check_schema(data: bytes, root: Path | str) -> None:
    """Validate the manifest's bytes against the JSON schema; raise :class:`ManifestError`."""
    import jsonschema

    doc = json.loads(data)
    validator = jsonschema.Draft202012Validator(manifest_schema())
    error = jsonschema.exceptions.best_match(validator.iter_errors(doc))
    if error is not None:
        pointer = "".join(f"/{p}" for p in error.absolute_path)
        raise ManifestError(f"schema: {error.message}", pointer, f"{root}/{MANIFEST_NAME}")


def _kind(exc: DamagedError) -> str:

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
    src: Files, manifest: Manifest, rel: str, tensors: tuple[str, ...], checker: DocChecker
) -> Problem | None:
    try:
        read_doc(src, manifest, rel, checker)
    except DamagedError as exc:
        return Problem(rel, _kind(exc), exc.reason, tensors)
    except OSError as exc:
        return Problem(rel, "unreadable", f"unreadable: {exc}", tensors)
    return None


def check_metadata(
    src: Files, manifest: Manifest, node: str | None = None
) -> tuple[list[Problem], set[str]]:
    """Check every zarr metadata document of ``manifest`` in the directory ``src`` (format
    version 2 on: each must parse to exactly the document the manifest implies). Returns the
    problems (labelled with ``node``) and the paths of the documents (with the manifest's)."""
    problems: list[Problem] = []
    checker = DocChecker(manifest)
    names = {rel: (display(t.name),) for rel, t in checker.tensors.items()}
    docs = list(checker.paths)

    def one(rel: str) -> Problem | None:
        return _check_doc(src, manifest, rel, names.get(rel, ()), checker)

    for p in each_in_flight(src, one, docs):
        if p is not None:
            problems.append(replace(p, node=node) if node is not None else p)
    return problems, {MANIFEST_NAME, *docs}


def unexpected_files(root: Path, expected: set[str]) -> list[str]:
    """Files under ``root`` (relative, sorted) that are not in ``expected``."""
    out = []
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/")
            if rel not in expected:
                out.append(rel)
    return sorted(out)


def check_data(
    src: Files,
    manifest: Manifest,
    report: VerifyReport,
    expected: set[str],
    ranks: Mapping[int, str] | None = None,
) -> None:
    """Read and check every data file in ``src`` (only those of ``ranks``, labelled with their
    node, when given) into ``report``, in the manifest's order; add their paths to
    ``expected``. One file at a time from a local directory, ``src.reads_in_flight`` from a
    bucket (each read chunk by chunk: memory stays bounded whatever size a file claims). Each
    file's size is counted on the caller's progress meter, in this thread, once it is read
    (``ckptfmt.storage.progress.metering``)."""
    meter = current_meter()
    files: list[tuple[Geometry, FileRef, tuple[str, ...], str | None]] = []
    for t in manifest.tensors():
        name = (display(t.name),)
        geo = geometry(t)
        for r in t.regions:
            if ranks is not None and r.rank not in ranks:
                continue
            node = None if ranks is None else ranks[r.rank]
            for ref in r.files:
                expected.add(ref.path)
                files.append((geo, ref, name, node))

    def one(item: tuple[Geometry, FileRef, tuple[str, ...], str | None]) -> Problem | None:
        geo, ref, name, node = item
        try:
            verify_file(src, geo, ref, shard_cell(ref.path), name)
        except DamagedError as exc:
            return Problem(ref.path, _kind(exc), exc.reason, name, node)
        except OSError as exc:  # unreadable: permissions, I/O error
            return Problem(ref.path, "unreadable", str(exc), name, node)
        return None

    for (_, ref, _, _), problem in zip(files, each_in_flight(src, one, files)):
        if problem is None:
            report.bytes_checked += ref.size
        else:
            report.problems.append(problem)
        report.files_checked += 1
        meter.add(ref.size, "read")
