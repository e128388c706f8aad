"""Encoding a level-1 save's redundancy during the collective save (``spec/redundancy.md``).

``save_collective`` calls :func:`encode_collective` on every rank once all data files are in the
staging directories and every rank knows every file (the manifest without its ``levels``). Data
moves between the members of a set over the ``Comm``, never through storage: a rank reads only
its own files and writes only its own parity file, in its own node's directory.

xor / rs: in round ``d = 1 .. n-1`` member ``j`` sends to member ``j + d`` the chunks that member
needs for its parity and receives from ``j - d`` (a ``sendrecv`` ring per round, so every member
sends and receives at once), multiplying each received chunk into its parity as it arrives.
partner: one round, ``d = 1``, of whole member data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptfmt.codecs.crc32c import crc32c
from ckptfmt.errors import CkptError, UsageError
from ckptfmt.manifest.model import Manifest
from ckptfmt.parallel.comm import Comm
from ckptfmt.redundancy.config import Redundancy
from ckptfmt.redundancy.engine import mul_xor_into, scratch
from ckptfmt.redundancy.record import (
    ParityFile,
    RedundancyRecord,
    RedundancySet,
    member_size,
    parity_path,
)
from ckptfmt.redundancy.sets import make_sets
from ckptfmt.redundancy.stripes import generator
from ckptfmt.storage.files import Inside, write_gather
from ckptfmt.storage.members import read_exact, read_member

ENCODE_TAG = 0x45


def set_geometry(
    red: Redundancy, manifest: Manifest, members: list[int]
) -> tuple[list[int], int, int]:
    """(member sizes, chunk size S, parity bytes per member) of one set."""
    sizes = [member_size(manifest, r) for r in members]
    n, longest = len(members), max(sizes)
    if red.scheme == "partner":
        return sizes, longest, 0
    chunk = -(-longest // (n - red.m))
    return sizes, chunk, red.m * chunk


def make_record(
    red: Redundancy, manifest: Manifest, sets: list[list[int]], parity: list[dict[str, Any]]
) -> RedundancyRecord:
    """The record from the sets and every rank's parity file (``parity[rank]``)."""
    out = []
    for members in sets:
        sizes, chunk, _ = set_geometry(red, manifest, members)
        files = tuple(
            ParityFile(parity[r]["path"], parity[r]["size"], tuple(parity[r]["crc32c"]))
            for r in members
        )
        out.append(RedundancySet(tuple(members), tuple(sizes), chunk, files))
    return RedundancyRecord(red.scheme, red.m, red.set_size, tuple(out))


def member_sets(red: Redundancy, nodes: list[str]) -> list[list[int]]:
    """The redundancy sets of a job whose rank r runs on ``nodes[r]``; a clear error when the
    nodes cannot carry the scheme (e.g. one node: nothing to protect against)."""
    try:
        return make_sets(nodes, red.set_size, red.min_size)
    except UsageError as exc:
        raise UsageError(f"redundancy {red.scheme!r}: {exc}") from None


def encode_collective(
    comm: Comm,
    red: Redundancy,
    manifest: Manifest,
    staging: Path,
    nodes: list[str],
    fsync: bool,
    vote: Any,
    preread: int | None = None,
) -> dict[str, Any]:
    """Collective over all ranks of ``comm``: encode this rank's share of its set's redundancy
    and write its parity file into ``staging`` (its node's staging directory). Returns this
    rank's parity file as JSON (``path``, ``size``, ``crc32c`` list) for the record.

    ``vote(error)`` is the save's collective vote (raises everywhere if any rank failed); it is
    called once after reading, before any message, so no rank waits on a rank that failed.
    ``preread``: the caller already read this rank's member data (that many bytes) into the
    thread's ``scratch(.., "data")`` buffer and voted on it (``read_own_files``); then neither the
    read nor that vote happen here."""
    sets = member_sets(red, nodes)
    members = next(s for s in sets if comm.rank in s)
    j, n = members.index(comm.rank), len(members)
    sizes, chunk, parity_bytes = set_geometry(red, manifest, members)
    error: str | None = None
    if red.scheme == "partner":
        data = scratch(sizes[j], "data")
        parity = scratch(sizes[(j - 1) % n], "parity")
    else:
        data = scratch((n - red.m) * chunk, "data")
        parity = scratch(parity_bytes, "parity")
        parity[:] = 0
    if preread is None:
        try:
            damage = read_member(Inside(staging), manifest, comm.rank, data, verify=False)
            if damage:
                error = f"cannot read back its files for redundancy: {damage[0]}"
        except (CkptError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        vote(error)
    else:
        data[preread:] = 0  # the padding
    if red.scheme == "partner":
        comm.sendrecv(data, members[(j + 1) % n], parity, members[(j - 1) % n], ENCODE_TAG)
        crcs = [crc32c(parity)]
    else:
        m, c = red.m, n - red.m
        g = generator(red.scheme, c, m)
        tmp = scratch(chunk, "recv")
        for d in range(1, n) if chunk else ():
            for p in range(m):
                t = (p - m - d) % n
                if t >= c:
                    continue
                comm.sendrecv(
                    data[t * chunk : (t + 1) * chunk],
                    members[(j + d) % n],
                    tmp,
                    members[(j - d) % n],
                    ENCODE_TAG,
                )
                mul_xor_into(parity[p * chunk : (p + 1) * chunk], int(g[c + p, t]), tmp)
        crcs = [crc32c(parity[p * chunk : (p + 1) * chunk]) for p in range(m)]
    path = parity_path(comm.rank)
    (staging / path).parent.mkdir(parents=True, exist_ok=True)
    write_gather(staging / path, [parity.data], fsync)
    return {"path": path, "size": int(parity.size), "crc32c": [int(x) for x in crcs]}


def read_own_files(staging: Path, files: list[tuple[str, int]]) -> int:
    """Read this rank's just-written data files (``(path, size)`` in manifest order) into the
    thread's ``scratch(.., "data")`` buffer, before the save's data vote, so that the encoding
    needs no vote of its own; returns the bytes read (for ``encode_collective(preread=...)``)."""
    total = sum(size for _, size in files)
    data = scratch(total, "data")
    src = Inside(staging)
    off = 0
    for path, size in files:
        read_exact(src, path, size, data[off : off + size], ())
        off += size
    return total
