"""The redundancy record of a level-1 save: ``levels["1"]["redundancy"]`` in the manifest
(``spec/redundancy.md``, "Manifest record"). Everything a rebuild needs, online or offline, comes
from here and the manifest's file lists.

Parity lives in each member's node-local step directory as ``ckptfmt-redundancy/<rank>``: for
``xor``/``rs`` its ``m`` parity chunks (parity ``p`` of stripe ``(j - p) mod n``, ``j`` its position
in the set) one after the other, ``chunk`` bytes each; for ``partner`` the copy of the previous
member's data. Each chunk has its own CRC32C.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptfmt.errors import ManifestError
from ckptfmt.manifest.model import FileRef, Manifest, TensorEntry
from ckptfmt.redundancy.schemes import POLYNOMIAL as POLYNOMIAL  # re-exported
from ckptfmt.redundancy.schemes import SCHEMES, RedundancyScheme

PARITY_DIR = "ckptfmt-redundancy"  # a reserved name component (FORMAT.md §3)


def parity_path(rank: int) -> str:
    return f"{PARITY_DIR}/{rank}"


@dataclass(frozen=True)
class ParityFile:
    """One member's parity file: its path, size and the CRC32C of each chunk in it."""

    path: str
    size: int
    crc32c: tuple[int, ...]


@dataclass(frozen=True)
class RedundancySet:
    """One set: its members (ranks, ascending), each member's data length, the chunk size ``S``
    (partner: the longest member) and each member's parity file (in member order)."""

    members: tuple[int, ...]
    sizes: tuple[int, ...]
    chunk: int
    parity: tuple[ParityFile, ...]

    @property
    def n(self) -> int:
        return len(self.members)


@dataclass(frozen=True)
class RedundancyRecord:
    scheme: str
    m: int  # parity chunks per stripe (xor 1, partner 0)
    set_size: int
    sets: tuple[RedundancySet, ...]

    def set_of(self, rank: int) -> tuple[RedundancySet, int]:
        """The set holding ``rank`` and the rank's member position in it."""
        for s in self.sets:
            if rank in s.members:
                return s, s.members.index(rank)
        raise ManifestError(f"rank {rank} is in no redundancy set", "/levels/1/redundancy/sets")

    @property
    def code(self) -> RedundancyScheme:
        """The scheme object: the one owner of this scheme's geometry and plans."""
        return SCHEMES[self.scheme].with_m(self.m)

    def to_json(self) -> dict[str, Any]:
        code = self.code.code_json()
        return {
            "scheme": self.scheme,
            "m": self.m,
            "set_size": self.set_size,
            "code": code,
            "sets": [
                {
                    "members": list(s.members),
                    "sizes": list(s.sizes),
                    "chunk": s.chunk,
                    "parity": [
                        {"path": f.path, "size": f.size, "crc32c": [f"{c:08x}" for c in f.crc32c]}
                        for f in s.parity
                    ],
                }
                for s in self.sets
            ],
        }


def member_files(manifest: Manifest, rank: int) -> list[tuple[TensorEntry, FileRef]]:
    """The data files ``rank`` wrote, in manifest order: its member data is their bytes, whole,
    one after the other."""
    return [
        (t, f) for t in manifest.tensors() for r in t.regions if r.rank == rank for f in r.files
    ]


def member_size(manifest: Manifest, rank: int) -> int:
    return sum(f.size for _, f in member_files(manifest, rank))


def record_of(manifest: Manifest) -> RedundancyRecord | None:
    """The manifest's redundancy record, or None when the save has none. Checked strictly
    against the manifest (ranks, sizes, parity file sizes), raising :class:`ManifestError`."""
    level = manifest.levels.get("1")
    if not isinstance(level, Mapping) or "redundancy" not in level:
        return None
    doc = level["redundancy"]
    at = "/levels/1/redundancy"

    def need(obj: Any, key: str, typ: type | tuple[type, ...], where: str) -> Any:
        if not isinstance(obj, Mapping) or key not in obj:
            raise ManifestError(f"missing {key!r}", where)
        v = obj[key]
        if not isinstance(v, typ) or isinstance(v, bool):
            raise ManifestError(f"{key!r} has the wrong type", f"{where}/{key}")
        return v

    scheme = need(doc, "scheme", str, at)
    if scheme not in SCHEMES:
        raise ManifestError(f"unknown redundancy scheme {scheme!r}", f"{at}/scheme")
    m = need(doc, "m", int, at)
    set_size = need(doc, "set_size", int, at)
    want_m = SCHEMES[scheme].M_RANGE
    if not want_m[0] <= m <= want_m[1]:
        raise ManifestError(f"m={m} is not valid for {scheme}", f"{at}/m")
    code = SCHEMES[scheme].with_m(m)
    sets = []
    seen: set[int] = set()
    for i, sd in enumerate(need(doc, "sets", list, at)):
        where = f"{at}/sets/{i}"
        members = need(sd, "members", list, where)
        sizes = need(sd, "sizes", list, where)
        chunk = need(sd, "chunk", int, where)
        parity = need(sd, "parity", list, where)
        n = len(members)
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in members + sizes):
            raise ManifestError("members and sizes are integers", where)
        if (
            n < max(2, m + 1)
            or n > 256
            or members != sorted(set(members))
            or len(sizes) != n
            or len(parity) != n
        ):
            raise ManifestError("a set needs m + 1 to 256 sorted distinct members", where)
        for j, r in enumerate(members):
            if not 0 <= r < manifest.world_size or r in seen:
                raise ManifestError(f"rank {r} is not a rank, or in two sets", f"{where}/members")
            seen.add(r)
            if sizes[j] != member_size(manifest, r):
                raise ManifestError(
                    f"member {r}: size {sizes[j]} is not that of its files", f"{where}/sizes/{j}"
                )
        want_chunk = code.set_chunk(sizes)
        if chunk != want_chunk:
            raise ManifestError(f"chunk {chunk}, expected {want_chunk}", f"{where}/chunk")
        files = []
        for j, pd in enumerate(parity):
            pw = f"{where}/parity/{j}"
            path = need(pd, "path", str, pw)
            size = need(pd, "size", int, pw)
            crcs = need(pd, "crc32c", list, pw)
            want_size = code.parity_bytes(sizes, j, chunk)
            if path != parity_path(members[j]) or size != want_size:
                raise ManifestError(f"expected {parity_path(members[j])}, {want_size} bytes", pw)
            if len(crcs) != code.parity_chunks() or not all(
                isinstance(c, str) and len(c) == 8 and all(ch in "0123456789abcdef" for ch in c)
                for c in crcs
            ):
                raise ManifestError("one 8-hex-digit crc32c per chunk", f"{pw}/crc32c")
            files.append(ParityFile(path, size, tuple(int(c, 16) for c in crcs)))
        sets.append(RedundancySet(tuple(members), tuple(sizes), chunk, tuple(files)))
    if seen != set(range(manifest.world_size)):
        raise ManifestError("not every rank is in a redundancy set", f"{at}/sets")
    return RedundancyRecord(scheme, m, set_size, tuple(sets))
