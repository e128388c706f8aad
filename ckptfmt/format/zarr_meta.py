"""The zarr v3 metadata documents (``zarr.json``) of a checkpoint: one group at the root and at
every mapping level, one array per tensor. They are what plain zarr readers see; the manifest is
what ckptfmt trusts. :func:`check_array_doc` and :func:`check_group_doc` keep the two in
agreement.

From format version 2 on (``spec/FORMAT.md`` §10) every document is covered: it must parse to
exactly the document the manifest implies (:func:`expected_doc`), ``attributes`` included, so a
damaged byte anywhere in it is found (a change that parses to the same document, such as other
whitespace, is not damage). Version 1 let writers put anything in ``attributes`` and add
``dimension_names``; its documents are still checked as version 1 asked.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from ckptfmt.dtypes import DType, by_name
from ckptfmt.errors import MetadataMismatchError
from ckptfmt.manifest.limits import CHECKSUM_SINCE
from ckptfmt.manifest.model import GroupEntry, Manifest

_CRC = {"name": "crc32c"}


def _bytes_codec(dtype: DType) -> dict[str, Any]:
    if dtype.itemsize == 1:
        return {"name": "bytes"}
    return {"name": "bytes", "configuration": {"endian": "little"}}


def group_doc(attributes: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}


def array_doc(
    dtype: DType,
    shape: tuple[int, ...],
    shard_shape: tuple[int, ...],
    chunk_shape: tuple[int, ...],
    attributes: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``zarr.json`` of one tensor.

    0-d tensors cannot be sharded (the sharding codec needs at least one dimension), so they use
    the plain codec chain ``[bytes, crc32c]`` with their single chunk at key ``c``.
    """
    if shape:
        codecs: list[dict[str, Any]] = [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": list(chunk_shape),
                    "codecs": [_bytes_codec(dtype), _CRC],
                    "index_codecs": [
                        {"name": "bytes", "configuration": {"endian": "little"}},
                        _CRC,
                    ],
                    "index_location": "end",
                },
            }
        ]
    else:
        codecs = [_bytes_codec(dtype), _CRC]
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": dtype.name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(shard_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": dtype.fill_value,
        "codecs": codecs,
        "attributes": attributes or {},
    }


def doc_bytes(doc: Any) -> bytes:
    """A metadata document's bytes as ckptfmt writes them (``storage.files.write_json``)."""
    return json.dumps(doc, allow_nan=False, indent=1).encode("utf-8")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate member names")
    return out


def _no_constant(token: str) -> Any:
    raise ValueError(f"{token} is not JSON")


def parse_doc(data: bytes, file: str) -> Any:
    """A ``zarr.json`` document from its bytes: strict JSON (UTF-8, no NaN, no duplicate member
    names); :class:`MetadataMismatchError` otherwise."""
    try:
        return json.loads(
            data.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant
        )
    except (ValueError, RecursionError) as exc:
        raise MetadataMismatchError(file, f"not a valid JSON document: {exc}") from None


def _canonical(doc: Any) -> str:
    """Equal for equal JSON documents only (``json`` keeps 1, 1.0 and true apart, Python's ==
    does not)."""
    return json.dumps(doc, sort_keys=True, allow_nan=True, separators=(",", ":"))


def check_group_doc(doc: object, file: str, strict: bool = True) -> None:
    """Raise :class:`MetadataMismatchError` unless ``doc`` is the group document. ``strict``
    (format version 2 on): exactly ``group_doc()``; else a zarr v3 group with any attributes."""
    if strict:
        if _canonical(doc) != _canonical(group_doc()):
            raise MetadataMismatchError(file, "is not the group document the format implies")
        return
    if not isinstance(doc, dict) or doc.get("node_type") != "group" or doc.get("zarr_format") != 3:
        raise MetadataMismatchError(file, "expected a zarr v3 group document")


def check_array_doc(
    doc: object,
    file: str,
    dtype: str,
    shape: tuple[int, ...],
    shard_shape: tuple[int, ...],
    chunk_shape: tuple[int, ...],
    strict: bool = False,
) -> None:
    """Raise :class:`MetadataMismatchError` unless ``doc`` is exactly the array document ckptfmt
    writes for this tensor (``strict``, format version 2 on: attributes included; else
    attributes and dimension names aside)."""
    expected = array_doc(by_name(dtype), shape, shard_shape, chunk_shape)
    if not isinstance(doc, dict):
        raise MetadataMismatchError(file, "not a JSON object")
    if strict:
        if _canonical(doc) != _canonical(expected):
            diff = sorted(
                k
                for k in set(doc) | set(expected)
                if _canonical(doc.get(k)) != _canonical(expected.get(k))
            )
            raise MetadataMismatchError(file, f"disagrees with the manifest on {', '.join(diff)}")
        return
    ignored = ("attributes", "dimension_names")
    got = {k: v for k, v in doc.items() if k not in ignored}
    if got.get("storage_transformers") == []:  # zarr-python writes an empty list; same meaning
        del got["storage_transformers"]
    want = {k: v for k, v in expected.items() if k != "attributes"}
    if got != want:
        diff = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
        raise MetadataMismatchError(file, f"disagrees with the manifest on {', '.join(diff)}")


def _group_paths(manifest: Manifest) -> list[tuple[str, ...]]:
    """The root group, a group at every proper prefix of every name and at every group entry."""
    names = [e.name for e in manifest.entries]
    groups = {n[:k] for n in names for k in range(len(n))} | {()}
    groups |= {e.name for e in manifest.entries if isinstance(e, GroupEntry)}
    return sorted(groups)


def document_paths(manifest: Manifest) -> list[str]:
    """The relative path of every ``zarr.json`` a checkpoint of ``manifest`` holds (the keys of
    :func:`documents`, without building the documents)."""
    out = ["/".join((*g, "zarr.json")) for g in _group_paths(manifest)]
    return out + [f"{t.path}/zarr.json" for t in manifest.tensors()]


def documents(manifest: Manifest) -> dict[str, dict[str, Any]]:
    """Every ``zarr.json`` a checkpoint of ``manifest`` holds (relative path -> document): the
    root group, a group at every proper prefix of every name and at every group entry, one
    array per tensor (``spec/FORMAT.md`` §2). Each node's level-1 directory holds all of them."""
    out: dict[str, dict[str, Any]] = {}
    for g in _group_paths(manifest):
        out["/".join((*g, "zarr.json"))] = group_doc()
    for t in manifest.tensors():
        out[f"{t.path}/zarr.json"] = array_doc(
            by_name(t.dtype), t.shape, t.shard_shape, t.chunk_shape
        )
    return out


@lru_cache(maxsize=1)
def group_doc_bytes() -> bytes:
    """The group document's bytes as ckptfmt writes them."""
    return doc_bytes(group_doc())


@lru_cache(maxsize=2048)
def array_doc_bytes(
    dtype: str, shape: tuple[int, ...], shard: tuple[int, ...], chunk: tuple[int, ...]
) -> bytes:
    """An array's ``zarr.json`` bytes as ckptfmt writes them, kept for the process: a model's
    documents are the same at every save and every load, and ``json`` with an indent encodes
    in Python (~3 ms of a 30 ms level-1 save of 11 tensors; ~4 ms of checking the 278
    documents of a GPT-2's model and Adam at a load)."""
    return doc_bytes(array_doc(by_name(dtype), shape, shard, chunk))


class DocChecker:
    """Checks the ``zarr.json`` documents of one manifest (:func:`document_paths`), each
    against what the manifest implies, by the rules of its format version; built once per
    manifest."""

    def __init__(self, manifest: Manifest) -> None:
        self.strict = manifest.format_version >= CHECKSUM_SINCE
        self.tensors = {f"{t.path}/zarr.json": t for t in manifest.tensors()}
        self.paths = dict.fromkeys(document_paths(manifest))  # in order, each looked up fast

    def expected_bytes(self, rel: str) -> bytes:
        """The bytes ckptfmt writes for ``rel`` (a path of :attr:`paths`)."""
        t = self.tensors.get(rel)
        if t is None:
            if rel not in self.paths:
                raise KeyError(rel)
            return group_doc_bytes()
        return array_doc_bytes(t.dtype, tuple(t.shape), tuple(t.shard_shape), tuple(t.chunk_shape))

    def check_bytes(self, rel: str, data: bytes) -> None:
        """Raise :class:`MetadataMismatchError` unless ``data`` is a valid document for
        ``rel`` (the bytes the writer writes pass at once; others are parsed and compared)."""
        if self.strict and data == self.expected_bytes(rel):
            return
        self.check(rel, parse_doc(data, rel))

    def check(self, rel: str, doc: object) -> None:
        """Raise :class:`MetadataMismatchError` unless the parsed ``doc`` is valid for ``rel``."""
        t = self.tensors.get(rel)
        if t is None:
            check_group_doc(doc, rel, self.strict)
        else:
            check_array_doc(doc, rel, t.dtype, t.shape, t.shard_shape, t.chunk_shape, self.strict)


def check_doc(manifest: Manifest, rel: str, doc: object) -> None:
    """Check the document ``doc`` found at ``rel`` (a key of :func:`documents`) against what
    ``manifest`` implies, by the rules of the manifest's format version (one document; for
    many, :class:`DocChecker`)."""
    DocChecker(manifest).check(rel, doc)
