"""Manifest JSON in and out (``spec/FORMAT.md``, "The manifest").

:func:`parse_manifest` is the only way bytes from disk become a :class:`Manifest`. It checks every
member's type and range and the format's cross-member rules (names form a tree, regions tile each
tensor on its shard grid, file paths are the shard keys the grid implies), so that code past it
can trust what it reads. Anything wrong raises :class:`ManifestError` with a JSON pointer; nothing
else escapes, whatever the input (the fuzz tests hold it to that).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from ckptfmt.checksum import crc32c
from ckptfmt.dtypes import DTYPES, itemsize_of
from ckptfmt.errors import CkptError, FormatVersionError, ManifestChecksumError, ManifestError
from ckptfmt.manifest.grid import cells, grid_shape, shard_key
from ckptfmt.manifest.limits import (
    CHECKSUM_SINCE,
    CONTAINERS_SINCE,
    MANIFEST_MAX_BYTES,
    MAX_CHUNK_BYTES,
    MAX_CHUNKS_PER_SHARD,
    MAX_DIM,
    MAX_ENTRIES,
    MAX_NDIM,
    MAX_TENSOR_BYTES,
    MAX_WORLD_SIZE,
    SUPPORTED_VERSIONS,
    check_name,
    display,
)
from ckptfmt.manifest.model import (
    Entry,
    FileRef,
    GroupEntry,
    Manifest,
    PerRankValueEntry,
    RankInfo,
    Region,
    TensorEntry,
    ValueEntry,
)
from ckptfmt.manifest.values import decode_value, encode_value

MANIFEST_NAME = "ckptfmt.json"
CONTAINERS = ("list", "tuple")  # a group entry's container kinds
ENCODINGS = ("bytes", "pickle")  # what an encoded uint8 tensor holds
FORMAT_ID = "ckptfmt"
_SAVE_ID = re.compile(r"^[0-9a-f]{32}$")
_CRC = re.compile(r"^[0-9a-f]{8}$")

# The manifest's own checksum (format version 2, spec/FORMAT.md §10): the document's last member,
# written exactly as _TRAILER_HEAD + 8 lowercase hex digits + _TRAILER_END, so that the bytes it
# covers (everything before it) are found without parsing the JSON.
CHECKSUM_MEMBER = "manifest_crc32c"
_TRAILER_HEAD = b'"' + CHECKSUM_MEMBER.encode() + b'": "'
_TRAILER_END = b'"\n}\n'
_TRAILER_LEN = len(_TRAILER_HEAD) + 8 + len(_TRAILER_END)


# --- writing -------------------------------------------------------------------------------------


def _tensor_json(t: TensorEntry) -> dict[str, Any]:
    out: dict[str, Any] = {
        "kind": "tensor",
        "name": list(t.name),
        "path": t.path,
        "dtype": t.dtype,
        "shape": list(t.shape),
        "shard_shape": list(t.shard_shape),
        "chunk_shape": list(t.chunk_shape),
        "regions": [
            {
                "offset": list(r.offset),
                "shape": list(r.shape),
                "rank": r.rank,
                "files": [
                    {"path": f.path, "size": f.size, "crc32c": f"{f.crc32c:08x}"} for f in r.files
                ],
            }
            for r in t.regions
        ],
    }
    if t.per_rank:
        out["per_rank"] = True
    if t.encoding is not None:
        out["encoding"] = t.encoding
    return out


def _entry_json(e: Entry) -> dict[str, Any]:
    if isinstance(e, TensorEntry):
        return _tensor_json(e)
    if isinstance(e, ValueEntry):
        value, nonfinite = encode_value(e.value, display(e.name))
        out: dict[str, Any] = {"kind": "value", "name": list(e.name), "value": value}
        if nonfinite:
            out["nonfinite"] = nonfinite
        return out
    if isinstance(e, GroupEntry):
        if e.container is not None:
            return {"kind": "group", "name": list(e.name), "container": e.container}
        return {"kind": "group", "name": list(e.name)}
    encoded = [encode_value(v, display(e.name)) for v in e.values]
    out = {"kind": "per_rank_value", "name": list(e.name), "values": [v for v, _ in encoded]}
    nonfinite_per_rank = {str(i): nf for i, (_, nf) in enumerate(encoded) if nf}
    if nonfinite_per_rank:
        out["nonfinite"] = nonfinite_per_rank
    return out


def manifest_to_json(m: Manifest) -> dict[str, Any]:
    """The manifest as a JSON document, without its checksum (:func:`seal` adds it)."""
    return {
        "format": FORMAT_ID,
        "format_version": m.format_version,
        "save_id": m.save_id,
        "step": m.step,
        "created": m.created,
        "writer": m.writer,
        "world": {
            "size": m.world_size,
            "ranks": [{"rank": r.rank, "node": r.node} for r in m.ranks],
        },
        "entries": [_entry_json(e) for e in m.entries],
        "levels": m.levels,
    }


def dump_manifest(m: Manifest) -> bytes:
    """The manifest file's bytes: UTF-8 JSON, strict (no NaN), keys in a fixed order; from
    format version 2 on, sealed with its checksum (:func:`seal`)."""
    doc = manifest_to_json(m)
    if m.format_version >= CHECKSUM_SINCE:
        return seal(doc)
    return json.dumps(doc, allow_nan=False, indent=1).encode("utf-8") + b"\n"


def seal(doc: dict[str, Any]) -> bytes:
    """The bytes of the manifest document ``doc`` (members in the order given; any checksum
    member it has is dropped) followed by its checksum member: the CRC32C of every byte before
    that member (spec/FORMAT.md §10). Also for tests and tools that write a manifest by hand."""
    body = {k: v for k, v in doc.items() if k != CHECKSUM_MEMBER}
    if not body:
        raise ManifestError("an empty document cannot be sealed")
    return seal_bytes(json.dumps(body, allow_nan=False, indent=1).encode("utf-8"))


def seal_bytes(text: bytes) -> bytes:
    """Seal the bytes of a JSON object that has no checksum member yet (see :func:`seal`): its
    closing brace and the whitespace around it are replaced by the checksum member, the last."""
    body = text.rstrip()
    if not body.endswith(b"}"):
        raise ManifestError("not a JSON object: cannot be sealed")
    covered = body[:-1].rstrip() + b",\n "
    return covered + _TRAILER_HEAD + f"{crc32c(covered):08x}".encode() + _TRAILER_END


def check_seal(data: bytes, path: str | None = None) -> bool:
    """Check the manifest checksum of a file's bytes before anything else is read from them.

    Returns True when the file ends with an intact checksum member whose CRC32C holds (a sealed
    manifest, format version 2 or later); False when it has no checksum member at all (format
    version 1; the version rule then decides). Raises :class:`ManifestChecksumError` (a damaged
    file: ``verify`` exit 1) when the checksum does not hold or the member itself is damaged:
    its bytes are recognised while at most two of them differ from the form writers use."""
    file = path or MANIFEST_NAME
    at = data.rfind(_TRAILER_HEAD, max(0, len(data) - 4 * _TRAILER_LEN))
    if at >= 0:
        tail = data[at:]
        digits = tail[len(_TRAILER_HEAD) : len(_TRAILER_HEAD) + 8]
        if len(tail) != _TRAILER_LEN or tail[len(_TRAILER_HEAD) + 8 :] != _TRAILER_END:
            raise ManifestChecksumError(file, "its checksum member is damaged (bytes differ)")
        if not _CRC.match(digits.decode("latin-1")):
            raise ManifestChecksumError(file, f"its checksum {digits!r} is not 8 hex digits")
        actual = crc32c(data[:at])
        if actual != int(digits, 16):
            raise ManifestChecksumError(
                file,
                f"manifest CRC32C mismatch (recorded {digits.decode()}, computed {actual:08x})",
            )
        return True
    tail = data[-_TRAILER_LEN:]
    if len(tail) == _TRAILER_LEN:
        template = _TRAILER_HEAD + b"\0" * 8 + _TRAILER_END
        fixed = [
            i for i in range(_TRAILER_LEN) if not len(_TRAILER_HEAD) <= i < len(_TRAILER_HEAD) + 8
        ]
        if sum(tail[i] != template[i] for i in fixed) <= 2:
            raise ManifestChecksumError(file, "its checksum member is damaged")
    return False


# --- reading -------------------------------------------------------------------------------------


def _reject_constant(token: str) -> Any:
    raise ManifestError(f"{token} is not JSON")


def parse_manifest(data: bytes, path: str | None = None) -> Manifest:
    """Parse and fully check a manifest file's bytes."""
    if len(data) > MANIFEST_MAX_BYTES:
        raise ManifestError(f"{len(data)} bytes, the limit is {MANIFEST_MAX_BYTES}", path=path)
    sealed = check_seal(data, path)  # a damaged file is damage, whatever else is wrong with it
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except ManifestError as exc:
        raise ManifestError(exc.reason, path=path) from None
    except (ValueError, RecursionError) as exc:  # bad UTF-8, bad JSON, absurd integer literals
        raise ManifestError(f"not JSON: {exc}", path=path) from None
    if not sealed and isinstance(doc, dict) and doc.get("format") == FORMAT_ID:
        version = doc.get("format_version")
        if type(version) is int and CHECKSUM_SINCE <= version <= max(SUPPORTED_VERSIONS):
            # a version that carries a checksum, without one: the member is lost or mangled
            raise ManifestChecksumError(path or MANIFEST_NAME, "its checksum member is missing")
    try:
        return manifest_from_json(doc)
    except FormatVersionError:
        raise
    except ManifestError as exc:
        raise ManifestError(exc.reason, exc.pointer, path) from None
    except CkptError as exc:  # a name or limit rule, found while parsing
        raise ManifestError(str(exc), path=path) from None


class _Reader:
    """Typed access to a JSON object, raising ManifestError with a pointer."""

    def __init__(self, obj: Any, pointer: str) -> None:
        if not isinstance(obj, dict):
            raise ManifestError("expected an object", pointer)
        self.obj = obj
        self.pointer = pointer

    def at(self, key: str) -> str:
        return f"{self.pointer}/{key}"

    def get(self, key: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
        if key not in self.obj:
            if optional:
                return None
            raise ManifestError("missing", self.at(key))
        value = self.obj[key]
        if kind is object:
            return value
        if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
            raise ManifestError(f"expected {kind}, got a boolean", self.at(key))
        if not isinstance(value, kind):
            raise ManifestError(f"expected {getattr(kind, '__name__', kind)}", self.at(key))
        return value

    def only(self, *allowed: str) -> None:
        """No members but ``allowed`` (the schema is closed; unknown members are errors)."""
        extra = sorted(set(self.obj) - set(allowed))
        if extra:
            raise ManifestError(f"unknown member {extra[0]!r}", self.at(extra[0]))

    def integer(self, key: str, lo: int, hi: int) -> int:
        value = self.get(key, int)
        if not lo <= value <= hi:
            raise ManifestError(f"{value} is outside [{lo}, {hi}]", self.at(key))
        return int(value)

    def integers(self, key: str, lo: int, hi: int, max_len: int = MAX_NDIM) -> tuple[int, ...]:
        values = self.get(key, list)
        if len(values) > max_len:
            raise ManifestError(f"more than {max_len} items", self.at(key))
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ManifestError(f"expected an integer in [{lo}, {hi}]", f"{self.at(key)}/{i}")
        return tuple(values)


def manifest_from_json(doc: Any) -> Manifest:
    top = _Reader(doc, "")
    if top.get("format", str) != FORMAT_ID:
        raise ManifestError(f"format is not {FORMAT_ID!r}", "/format")
    version = top.obj.get("format_version")
    if type(version) is not int or version not in SUPPORTED_VERSIONS:
        raise FormatVersionError(version, SUPPORTED_VERSIONS)  # before any other rule
    members = ["format", "format_version", "save_id", "step", "created", "writer", "world"]
    members += ["entries", "levels"]
    if version >= CHECKSUM_SINCE:
        members.append(CHECKSUM_MEMBER)  # checked on the bytes by parse_manifest
    top.only(*members)
    if "step" not in top.obj:
        raise ManifestError("missing (null when the checkpoint has no step)", "/step")
    save_id = top.get("save_id", str)
    if not _SAVE_ID.match(save_id):
        raise ManifestError("save_id must be 32 lowercase hex digits", "/save_id")
    step = top.obj.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ManifestError("step must be a non-negative integer or null", "/step")
    created = top.get("created", str)
    writer = top.get("writer", dict)
    world = _Reader(top.get("world", dict), "/world")
    world.only("size", "ranks")
    size = world.integer("size", 1, MAX_WORLD_SIZE)
    ranks_json = world.get("ranks", list)
    if len(ranks_json) != size:
        raise ManifestError(f"{len(ranks_json)} ranks listed for world size {size}", "/world/ranks")
    ranks = []
    for i, r in enumerate(ranks_json):
        rr = _Reader(r, f"/world/ranks/{i}")
        rr.only("rank", "node")
        if rr.integer("rank", 0, size - 1) != i:
            raise ManifestError("ranks must be listed in order", rr.at("rank"))
        ranks.append(RankInfo(i, rr.get("node", str)))
    entries_json = top.get("entries", list)
    if len(entries_json) > MAX_ENTRIES:
        raise ManifestError(f"more than {MAX_ENTRIES} entries", "/entries")
    entries = [_parse_entry(e, f"/entries/{i}", size, version) for i, e in enumerate(entries_json)]
    _check_tree(entries)
    levels = top.get("levels", dict)
    return Manifest(
        save_id=save_id,
        step=step,
        created=created,
        world_size=size,
        ranks=tuple(ranks),
        entries=tuple(entries),
        levels=levels,
        writer=writer,
        format_version=int(version),
    )


def _parse_entry(obj: Any, pointer: str, world_size: int, version: int) -> Entry:
    r = _Reader(obj, pointer)
    if version < CONTAINERS_SINCE:  # members of later versions are unknown members here
        for member in ("container", "encoding"):
            if member in r.obj:
                raise ManifestError(f"unknown member {member!r}", r.at(member))
    kind = r.get("kind", str)
    name = check_name(r.get("name", list))
    if kind == "tensor":
        r.only(
            "kind",
            "name",
            "path",
            "dtype",
            "shape",
            "shard_shape",
            "chunk_shape",
            "regions",
            "per_rank",
            "encoding",
        )
        return _parse_tensor(r, name, world_size)
    if kind == "value":
        r.only("kind", "name", "value", "nonfinite")
        nonfinite = r.get("nonfinite", dict, optional=True) or {}
        return ValueEntry(name, decode_value(r.get("value", object), nonfinite, pointer))
    if kind == "group":
        r.only("kind", "name", "container")
        container = r.get("container", str, optional=True)
        if container is not None and container not in CONTAINERS:
            raise ManifestError(f"unknown container {container!r}", r.at("container"))
        return GroupEntry(name, container)
    if kind == "per_rank_value":
        r.only("kind", "name", "values", "nonfinite")
        values = r.get("values", list)
        if len(values) != world_size:
            raise ManifestError("one value per rank is required", r.at("values"))
        nonfinite = r.get("nonfinite", dict, optional=True) or {}
        for key, per in nonfinite.items():
            if not isinstance(per, dict):
                raise ManifestError("expected an object", f"{r.at('nonfinite')}/{key}")
        return PerRankValueEntry(
            name,
            tuple(
                decode_value(v, nonfinite.get(str(i), {}), f"{pointer}/values/{i}")
                for i, v in enumerate(values)
            ),
        )
    raise ManifestError(f"unknown entry kind {kind!r}", r.at("kind"))


def _parse_tensor(r: _Reader, name: tuple[str, ...], world_size: int) -> TensorEntry:
    path = r.get("path", str)
    if path != "/".join(name):
        raise ManifestError("path must be the name's components joined by '/'", r.at("path"))
    dtype = r.get("dtype", str)
    if dtype not in DTYPES:
        raise ManifestError(f"unknown dtype {dtype!r}", r.at("dtype"))
    shape = r.integers("shape", 0, MAX_DIM)
    ndim = len(shape)
    shard = r.integers("shard_shape", 1, MAX_DIM)
    chunk = r.integers("chunk_shape", 1, MAX_DIM)
    if len(shard) != ndim or len(chunk) != ndim:
        raise ManifestError("shape, shard_shape and chunk_shape differ in length", r.pointer)
    if any(h % c for h, c in zip(shard, chunk)):
        raise ManifestError("shard_shape must be a multiple of chunk_shape", r.at("shard_shape"))
    if math.prod(h // c for h, c in zip(shard, chunk)) > MAX_CHUNKS_PER_SHARD:
        raise ManifestError(f"more than {MAX_CHUNKS_PER_SHARD} chunks per shard", r.pointer)
    if math.prod(chunk) * itemsize_of(dtype) > MAX_CHUNK_BYTES:
        raise ManifestError(f"inner chunks larger than {MAX_CHUNK_BYTES} bytes", r.pointer)
    if math.prod(shape) * itemsize_of(dtype) > MAX_TENSOR_BYTES:
        raise ManifestError(f"tensor larger than {MAX_TENSOR_BYTES} bytes", r.at("shape"))
    per_rank = r.get("per_rank", bool, optional=True) or False
    if per_rank and (ndim == 0 or shape[0] != world_size):
        raise ManifestError("a per-rank tensor's first dimension is the world size", r.at("shape"))
    regions_json = r.get("regions", list)
    regions = []
    grid = grid_shape(shape, shard)
    claimed: set[tuple[int, ...]] = set()
    for i, reg in enumerate(regions_json):
        rp = f"{r.pointer}/regions/{i}"
        rr = _Reader(reg, rp)
        rr.only("offset", "shape", "rank", "files")
        offset = rr.integers("offset", 0, MAX_DIM)
        rshape = rr.integers("shape", 1, MAX_DIM)
        rank = rr.integer("rank", 0, world_size - 1)
        if len(offset) != ndim or len(rshape) != ndim:
            raise ManifestError("offset and shape must have the tensor's rank", rp)
        for a in range(ndim):
            end = offset[a] + rshape[a]
            if offset[a] % shard[a] or end > shape[a] or (end % shard[a] and end != shape[a]):
                raise ManifestError("region is not aligned to the shard grid", rp)
        lo = tuple(o // h for o, h in zip(offset, shard))
        hi = tuple(-(-(o + s) // h) for o, s, h in zip(offset, rshape, shard))
        files_json = rr.get("files", list)
        if len(files_json) != math.prod(b - a for a, b in zip(lo, hi)):
            raise ManifestError("a region lists one file per shard it covers", rr.at("files"))
        files = []
        for j, (cell, fj) in enumerate(zip(cells(lo, hi), files_json)):
            fr = _Reader(fj, f"{rp}/files/{j}")
            fr.only("path", "size", "crc32c")
            fpath = fr.get("path", str)
            if fpath != shard_key(path, cell):
                raise ManifestError(f"expected {shard_key(path, cell)!r}", fr.at("path"))
            crc = fr.get("crc32c", str)
            if not _CRC.match(crc):
                raise ManifestError("crc32c must be 8 lowercase hex digits", fr.at("crc32c"))
            if cell in claimed:
                raise ManifestError("regions overlap", rp)
            claimed.add(cell)
            size = fr.integer("size", 0, MAX_TENSOR_BYTES)
            if size < _min_file_size(shape, shard, chunk, itemsize_of(dtype), cell):
                raise ManifestError("file too small for its chunks and index", fr.at("size"))
            files.append(FileRef(fpath, size, int(crc, 16)))
        regions.append(Region(offset, rshape, rank, tuple(files)))
    encoding = r.get("encoding", str, optional=True)
    if encoding is not None:
        if encoding not in ENCODINGS:
            raise ManifestError(f"unknown encoding {encoding!r}", r.at("encoding"))
        if dtype != "uint8" or ndim != 1 or per_rank:
            raise ManifestError("an encoded tensor is 1-d uint8, not per rank", r.at("encoding"))
    if math.prod(shape) and len(claimed) != math.prod(grid):
        raise ManifestError("regions do not cover the tensor", f"{r.pointer}/regions")
    if not math.prod(shape) and regions:
        raise ManifestError("an empty tensor has no regions", f"{r.pointer}/regions")
    return TensorEntry(name, path, dtype, shape, shard, chunk, tuple(regions), per_rank, encoding)


def _min_file_size(
    shape: tuple[int, ...],
    shard: tuple[int, ...],
    chunk: tuple[int, ...],
    itemsize: int,
    cell: tuple[int, ...],
) -> int:
    """The smallest valid shard file: its in-bounds chunks with their CRCs and the index. Checking
    it bounds what a reader allocates by what the disk really holds."""
    if not shape:
        return itemsize + 4
    extents = [min(h, s - c * h) for c, h, s in zip(cell, shard, shape)]
    present = math.prod(-(-e // c) for e, c in zip(extents, chunk))
    n_slots = math.prod(h // c for h, c in zip(shard, chunk))
    return present * (math.prod(chunk) * itemsize + 4) + 16 * n_slots + 4


def _check_tree(entries: list[Entry]) -> None:
    """Names must form a tree: no name twice, and only groups have descendants; a plain group
    has none (it is an empty mapping), a container group exactly its items ``"0"`` to
    ``"n-1"``, listed after it."""
    seen: set[tuple[str, ...]] = set()
    leaves: set[tuple[str, ...]] = set()
    for e in entries:
        if e.name in seen:
            raise ManifestError(f"name {display(e.name)!r} appears twice", "/entries")
        seen.add(e.name)
        if not isinstance(e, GroupEntry):
            leaves.add(e.name)
    prefixes = {e.name[:k] for e in entries for k in range(1, len(e.name))}
    for prefix in prefixes & leaves:
        raise ManifestError(f"{display(prefix)!r} is a leaf and a group", "/entries")
    items: dict[tuple[str, ...], set[str]] = {}
    first: dict[tuple[str, ...], int] = {}  # the first entry below each prefix
    for i, e in enumerate(entries):
        for k in range(1, len(e.name)):
            items.setdefault(e.name[:k], set()).add(e.name[k])
            first.setdefault(e.name[:k], i)
    for i, e in enumerate(entries):
        if not isinstance(e, GroupEntry):
            continue
        if e.container is None and e.name in prefixes:
            raise ManifestError(f"group entry {display(e.name)!r} is not empty", "/entries")
        if e.container is not None:
            got = items.get(e.name, set())
            if got != {str(k) for k in range(len(got))}:
                raise ManifestError(
                    f"container {display(e.name)!r}: items must be named 0 to n-1", "/entries"
                )
            if first.get(e.name, i) < i:
                raise ManifestError(
                    f"container {display(e.name)!r} is listed after its items", "/entries"
                )
