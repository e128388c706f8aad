"""The safetensors file format, read and written without the ``safetensors`` library, so that
both directions stream (the library's writer wants every tensor in memory at once).

A file is: an unsigned little-endian 64-bit header length ``N``; ``N`` bytes of a UTF-8 JSON
object (each tensor's ``dtype``, ``shape`` and ``data_offsets`` ``[begin, end)`` into the data,
plus an optional ``__metadata__`` map of strings), padded with spaces; then the data, the tensors
back to back, little-endian, covering it exactly. The reader checks every rule of the format
(huggingface/safetensors ``safetensors/src/tensor.rs``) before a byte of data is used: the header
length within the file and the library's 100 MB limit, a JSON object without duplicate keys,
known dtypes, shapes of non-negative ints, each tensor's byte count matching its shape, offsets
that neither overlap nor leave holes and end exactly at the end of the file.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptfmt.dtypes import DTYPES
from ckptfmt.errors import ForeignFormatError

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
METADATA_KEY = "__metadata__"

# ckptfmt dtype name -> safetensors dtype code (complex128 has none)
CODE_OF: dict[str, str] = {
    "bool": "BOOL",
    "int8": "I8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "uint8": "U8",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
    "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
DTYPE_OF: dict[str, str] = {code: name for name, code in CODE_OF.items()}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: ckptfmt dtype name, shape, ``[begin, end)`` of the
    data section (relative to its start)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    """A checked safetensors header: its tensors in file order, its metadata, where the data
    starts in the file."""

    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str]
    data_start: int
    file_size: int


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice")
        out[k] = v
    return out


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_header(blob: bytes, file_size: int, path: str) -> Header:
    """Check the header ``blob`` (the file's first bytes, at least the whole header) of a file
    of ``file_size`` bytes; :class:`ForeignFormatError` for anything the format forbids."""
    if file_size < 8 or len(blob) < 8:
        raise ForeignFormatError(path, f"{file_size} bytes: too short for a safetensors header")
    (n,) = struct.unpack_from("<Q", blob, 0)
    if n > MAX_HEADER_BYTES:
        raise ForeignFormatError(path, f"header length {n} exceeds {MAX_HEADER_BYTES} bytes")
    if 8 + n > file_size:
        raise ForeignFormatError(
            path, f"truncated: the header says {n} bytes, the file holds {file_size - 8} after it"
        )
    if len(blob) < 8 + n:
        raise ForeignFormatError(path, "internal: header blob shorter than the header")
    raw = blob[8 : 8 + n]
    if not raw.startswith(b"{"):
        raise ForeignFormatError(path, "the header is not a JSON object")
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ForeignFormatError(path, f"the header is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ForeignFormatError(path, "the header is not a JSON object")
    meta = doc.pop(METADATA_KEY, {})
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise ForeignFormatError(path, f"{METADATA_KEY} is not a map of strings")
    data_size = file_size - 8 - n
    infos = []
    for name, d in doc.items():
        if not isinstance(d, dict) or set(d) != {"dtype", "shape", "data_offsets"}:
            raise ForeignFormatError(
                path, "a tensor entry has exactly dtype, shape and data_offsets", name
            )
        code, shape, offs = d["dtype"], d["shape"], d["data_offsets"]
        if not isinstance(code, str) or code not in DTYPE_OF:
            raise ForeignFormatError(path, f"unsupported dtype {code!r}", name)
        if not isinstance(shape, list) or not all(_int(s) and s >= 0 for s in shape):
            raise ForeignFormatError(path, f"shape {shape!r} is not a list of ints >= 0", name)
        if not (isinstance(offs, list) and len(offs) == 2 and all(_int(o) for o in offs)):
            raise ForeignFormatError(path, f"data_offsets {offs!r} is not [begin, end]", name)
        begin, end = offs
        if not 0 <= begin <= end:
            raise ForeignFormatError(path, f"data_offsets {offs!r} are not 0 <= begin <= end", name)
        count = 1
        for s in shape:
            count *= s
        want = count * DTYPES[DTYPE_OF[code]].itemsize
        if end - begin != want:
            raise ForeignFormatError(
                path,
                f"data_offsets {offs!r} hold {end - begin} bytes, shape {shape} of {code} "
                f"needs {want}",
                name,
            )
        infos.append(TensorInfo(name, DTYPE_OF[code], tuple(shape), begin, end))
    at = 0
    prev: str | None = None
    for t in sorted(infos, key=lambda t: (t.begin, t.end)):
        if t.begin < at:
            raise ForeignFormatError(path, f"its bytes overlap those of tensor {prev!r}", t.name)
        if t.begin > at:
            raise ForeignFormatError(path, f"a hole of {t.begin - at} bytes before it", t.name)
        at = t.end
        prev = t.name
    if at > data_size:
        raise ForeignFormatError(
            path, f"truncated: the header places data up to byte {at}, the file holds {data_size}"
        )
    if at < data_size:
        raise ForeignFormatError(
            path, f"{data_size - at} bytes after the last tensor that no tensor covers"
        )
    return Header(tuple(infos), dict(meta), 8 + n, file_size)


def read_header(fd: int, path: str) -> Header:
    """The checked header of the open safetensors file ``fd``."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise ForeignFormatError(path, f"{size} bytes: too short for a safetensors header")
    (n,) = struct.unpack_from("<Q", head, 0)
    if n > MAX_HEADER_BYTES or 8 + n > size:
        return parse_header(head, size, path)  # raises, with the reason
    blob = head + os.pread(fd, n, 8)
    if len(blob) != 8 + n:
        raise ForeignFormatError(path, "truncated while reading the header")
    return parse_header(blob, size, path)


def header_bytes(
    tensors: Sequence[tuple[str, str, Sequence[int], int, int]],
    metadata: Mapping[str, str] | None = None,
) -> bytes:
    """The length prefix and JSON header of a file holding ``tensors`` (name, ckptfmt dtype,
    shape, begin, end), padded with spaces so that the data starts 8-byte aligned (as the
    safetensors library writes it)."""
    doc: dict[str, Any] = {}
    if metadata:
        doc[METADATA_KEY] = dict(metadata)
    for name, dtype, shape, begin, end in tensors:
        doc[name] = {"dtype": CODE_OF[dtype], "shape": list(shape), "data_offsets": [begin, end]}
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw
