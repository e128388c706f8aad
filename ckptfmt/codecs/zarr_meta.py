"""The zarr v3 metadata documents (``zarr.json``) of a checkpoint: one group at the root and at
every mapping level, one array per tensor. They are what plain zarr readers see; the manifest is
what ckptfmt trusts. :func:`check_array_doc` keeps the two in agreement."""

from __future__ import annotations

from typing import Any

from ckptfmt.dtypes import DType, by_name
from ckptfmt.errors import MetadataMismatchError

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


def check_array_doc(
    doc: object,
    file: str,
    dtype: str,
    shape: tuple[int, ...],
    shard_shape: tuple[int, ...],
    chunk_shape: tuple[int, ...],
) -> None:
    """Raise :class:`MetadataMismatchError` unless ``doc`` is exactly the array document ckptfmt
    writes for this tensor (attributes aside)."""
    expected = array_doc(by_name(dtype), shape, shard_shape, chunk_shape)
    if not isinstance(doc, dict):
        raise MetadataMismatchError(file, "not a JSON object")
    ignored = ("attributes", "dimension_names")
    got = {k: v for k, v in doc.items() if k not in ignored}
    if got.get("storage_transformers") == []:  # zarr-python writes an empty list; same meaning
        del got["storage_transformers"]
    want = {k: v for k, v in expected.items() if k != "attributes"}
    if got != want:
        diff = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
        raise MetadataMismatchError(file, f"disagrees with the manifest on {', '.join(diff)}")
