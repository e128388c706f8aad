"""Encoding a level-1 save's redundancy during the collective save (``spec/redundancy.md``).

Every rank knows, from the save plan alone, how large every rank's member data will be
(:func:`ckptfmt.format.shard_io.shard_file_nbytes`: ckptfmt's shard files have no compression,
so their layout is fixed by the geometry). So before writing, each rank knows its set, the set's
chunk size and where each of its files lies in its member data (:class:`SetLayout`); its writer
threads leave each file's bytes there as they write it, and the encoding starts as soon as the
rank's own files are written: no read-back, and no vote between the data and the parity (the
save's one data vote carries both). Data moves between the members of a set over the ``Comm``,
never through storage: a rank writes only its own parity file, in its own node's directory.

xor / rs: in round ``d = 1 .. n-1`` member ``j`` sends to member ``j + d`` the chunks that member
needs for its parity and receives from ``j - d`` (a ring of ``sendrecv``, one per chunk, so every
member sends and receives at once), and multiplies each received chunk into its parity while the
next one moves (``Comm.start_exchange``, two receive buffers).
partner: one round, ``d = 1``, of whole member data.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ckptfmt.checksum import crc32c
from ckptfmt.container.members import read_member
from ckptfmt.errors import CkptError, UsageError
from ckptfmt.manifest.model import Manifest
from ckptfmt.redundancy.config import Redundancy
from ckptfmt.redundancy.engine import MemberBuffers, mul_xor_into, run_ops, scratch
from ckptfmt.redundancy.record import (
    ParityFile,
    RedundancyRecord,
    RedundancySet,
    member_size,
    parity_path,
    record_of,
)
from ckptfmt.redundancy.sets import make_sets
from ckptfmt.storage.files import Inside, write_gather
from ckptfmt.storage.progress import current_meter
from ckptfmt.transport.comm import Comm, Pending

ENCODE_TAG = 0x45


def set_geometry(red: Redundancy, manifest: Manifest, members: list[int]) -> tuple[list[int], int]:
    """(member sizes, chunk size S) of one set of a manifest (the scheme's geometry)."""
    sizes = [member_size(manifest, r) for r in members]
    return sizes, red.code.set_chunk(sizes)


@dataclass(frozen=True)
class SetLayout:
    """This rank's redundancy set, as the save plan fixes it before any byte is written."""

    red: Redundancy
    members: tuple[int, ...]  # ranks, by position
    position: int  # this rank's
    sizes: tuple[int, ...]  # member data bytes, by position
    chunk: int

    @property
    def parity_bytes(self) -> int:
        """This rank's parity file (the scheme's geometry: m chunks, or a whole copy)."""
        return self.red.code.parity_bytes(self.sizes, self.position, self.chunk)

    @property
    def data_bytes(self) -> int:
        """This rank's data buffer: its member data, zero-padded to what the ops address."""
        return self.red.code.data_bytes(self.sizes, self.position, self.chunk)


def plan_set(red: Redundancy, nodes: list[str], member_bytes: list[int], rank: int) -> SetLayout:
    """``rank``'s set and its geometry, from every rank's node and planned member data size."""
    sets = member_sets(red, nodes)
    members = next(s for s in sets if rank in s)
    sizes = [member_bytes[r] for r in members]
    chunk = red.code.set_chunk(sizes)
    return SetLayout(red, tuple(members), members.index(rank), tuple(sizes), chunk)


def data_buffer(layout: SetLayout) -> np.ndarray:
    """This thread's reused buffer for the rank's member data (the writers fill its first
    ``sizes[position]`` bytes), its padding zeroed."""
    data = scratch(layout.data_bytes, "data")
    data[layout.sizes[layout.position] :] = 0
    return data


def reserve_buffers(layout: SetLayout) -> None:
    """Allocate this thread's reused buffers that :func:`exchange` uses, before any message
    moves: an allocation failure is then this rank's failure in a phase that is voted on, not a
    rank leaving its set in the middle of an exchange (its peers would wait for it forever).
    The save's progress meter is told the parity bytes to come here too: the layout fixes them
    before any byte is written (``storage.progress``)."""
    scratch(layout.parity_bytes, "parity")
    current_meter().expect(layout.parity_bytes)
    if layout.red.code.copies_whole:
        return
    for k in range(2):
        scratch(layout.chunk, f"recv{k}")


def make_record(
    red: Redundancy, manifest: Manifest, sets: list[list[int]], parity: list[dict[str, Any]]
) -> RedundancyRecord:
    """The record from the sets and every rank's parity file (``parity[rank]``)."""
    out = []
    for members in sets:
        sizes, chunk = set_geometry(red, manifest, members)
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


def exchange(comm: Comm, layout: SetLayout, data: np.ndarray) -> np.ndarray:
    """Collective over the ranks of this rank's set (the other sets run theirs at the same time,
    on other ranks): this rank's parity, computed from ``data`` (:func:`data_buffer`) and the
    chunks the other members send. Returns a view of this thread's reused parity buffer."""
    red, members, j = layout.red, layout.members, layout.position
    n, chunk = len(members), layout.chunk
    parity = scratch(layout.parity_bytes, "parity")
    if red.code.copies_whole:  # partner: one round, whole member data
        comm.sendrecv(data, members[(j + 1) % n], parity, members[(j - 1) % n], ENCODE_TAG)
        return parity
    parity[:] = 0
    m, c = red.m, n - red.m
    g = red.code.generator(c)  # type: ignore[attr-defined]  # striped codes only
    # step (d, p): the chunk t = (p - m - d) mod n < c that member j + d needs for its parity p
    steps = [(d, p, (p - m - d) % n) for d in range(1, n) for p in range(m) if (p - m - d) % n < c]
    # two receive buffers: step k + 1 moves while step k is multiplied in
    recv = [scratch(chunk, f"recv{k}") for k in range(2)]

    def start(k: int) -> Pending:
        d, _p, t = steps[k]
        return comm.start_exchange(
            [
                (
                    data[t * chunk : (t + 1) * chunk],
                    members[(j + d) % n],
                    recv[k % 2],
                    members[(j - d) % n],
                )
            ],
            ENCODE_TAG,
        )

    if not chunk or not steps:
        return parity
    pending = start(0)
    for k, (_d, p, t) in enumerate(steps):
        pending.wait()
        if k + 1 < len(steps):
            pending = start(k + 1)
        mul_xor_into(parity[p * chunk : (p + 1) * chunk], int(g[c + p, t]), recv[k % 2])
    return parity


def write_parity(
    staging: Path,
    rank: int,
    layout: SetLayout,
    parity: np.ndarray,
    fsync: bool,
    in_place: bool = False,
) -> dict[str, Any]:
    """Write this rank's parity file into its staging directory; its JSON for the record
    (``path``, ``size``, ``crc32c``: one per parity chunk, partner: one for the copy).
    ``in_place``: a recycled step's parity file there is overwritten (``storage/slots.py``)."""
    k = layout.red.code.parity_chunks()
    step = parity.size // k
    crcs = [crc32c(parity[p * step : (p + 1) * step]) for p in range(k)]
    path = parity_path(rank)
    (staging / path).parent.mkdir(parents=True, exist_ok=True)
    if in_place:
        write_gather(staging / path, [parity.data], fsync, in_place=True)
    else:
        write_gather(staging / path, [parity.data], fsync)
    return {"path": path, "size": int(parity.size), "crc32c": [int(x) for x in crcs]}


def encode_collective(
    comm: Comm,
    layout: SetLayout,
    data: np.ndarray,
    staging: Path,
    fsync: bool,
    failed: bool,
    in_place: bool = False,
) -> dict[str, Any] | None:
    """Collective over the ranks of this rank's set, once its own files are written (or failed):
    exchange, then write the parity file. A rank whose data failed (``failed``) still takes part
    in the messages, since its set's members wait for them, but writes nothing; the save's data
    vote then fails everywhere. Returns the parity file's JSON (None when ``failed``); a failure
    to write it raises (the caller's error boundary records it for the vote). ``in_place``:
    the staging directory is a recycled step's, whose parity file is overwritten."""
    parity = exchange(comm, layout, data)
    if failed:
        return None
    written = write_parity(staging, comm.rank, layout, parity, fsync, in_place)
    current_meter().add(int(parity.size), "parity")
    return written


def base_parity(layout: SetLayout, base: Manifest, rank: int) -> ParityFile | None:
    """The base checkpoint's parity file of ``rank``, when the base's redundancy record gives
    this rank's set exactly this save's layout: the same scheme, ``m`` and ``set_size``, the same
    members in the same positions, the same member sizes and chunk, a parity file of the size
    the layout gives. Else None (a base without a record, or one it fails the checks of, too).
    Such a file holds this save's parity when every member's data is also the base's byte for
    byte (the code is a fixed function of the set's member data and its geometry): what the
    caller establishes, for every member, before it links the file (:func:`link_parity`)."""
    red = layout.red
    try:
        record = record_of(base)
        if record is None or (record.scheme, record.m, record.set_size) != (
            red.scheme,
            red.m,
            red.set_size,
        ):
            return None
        found, position = record.set_of(rank)
    except CkptError:
        return None
    same = (found.members, found.sizes, found.chunk, position) == (
        layout.members,
        layout.sizes,
        layout.chunk,
        layout.position,
    )
    mine = found.parity[position]
    if not same or mine.path != parity_path(rank) or mine.size != layout.parity_bytes:
        return None
    return mine


def link_parity(staging: Path, base_root: Path, parity: ParityFile) -> dict[str, Any] | None:
    """Hard-link the base's parity file ``parity`` (in ``base_root``, the base's directory on
    this rank's node) into ``staging`` at the same path; its JSON for the record (the base's
    size and CRCs: the same bytes), or None when the base's file is not a regular file of the
    recorded size or the file system refuses the link (the caller then encodes)."""
    source = base_root / parity.path
    try:
        st = os.stat(source, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or st.st_size != parity.size:
            return None
        (staging / parity.path).parent.mkdir(parents=True, exist_ok=True)
        os.link(source, staging / parity.path, follow_symlinks=False)
    except OSError:
        return None
    return {"path": parity.path, "size": parity.size, "crc32c": list(parity.crc32c)}


def encode_offline(
    manifest: Manifest,
    dir_of: Mapping[int, str | os.PathLike[str]],
    red: Redundancy,
    fsync: bool = True,
) -> Manifest:
    """Encode redundancy for a checkpoint whose data files are already written, in one process
    (no transport): ``dir_of[rank]`` is the (staging) directory holding rank ``rank``'s files;
    each rank's parity file is written there, as the collective save writes it. Returns
    ``manifest`` with the record in ``levels["1"]`` (the caller writes it and commits). The sets
    and every buffer's geometry are the save's (:func:`plan_set`); the parity is the same
    generator's product, computed here by the set's encode plan with every member in memory
    (one set at a time) where the save streams it over the ``Comm`` (:func:`exchange`). Used by
    ``ckptfmt reshard``. Counts on the operation's progress meter what :func:`offline_work`
    says, as each member is read and each parity file written."""
    nodes = [r.node for r in manifest.ranks]
    sets = member_sets(red, nodes)
    member_bytes = [member_size(manifest, r) for r in range(manifest.world_size)]
    parity: dict[int, dict[str, Any]] = {}
    meter = current_meter()
    for members in sets:
        layouts = [plan_set(red, nodes, member_bytes, rank) for rank in members]
        local = {}
        for j, rank in enumerate(members):
            lay = layouts[j]
            bufs = MemberBuffers(
                np.zeros(lay.data_bytes, np.uint8), np.zeros(lay.parity_bytes, np.uint8)
            )
            damage = read_member(Inside(Path(dir_of[rank])), manifest, rank, bufs.data, True)
            if damage:
                raise damage[0]
            local[j] = bufs
            meter.add(member_bytes[rank], "parity")
        lay = layouts[0]
        ops = red.code.encode_plan(len(members))
        run_ops(ops, members, list(lay.sizes), lay.chunk, local)
        for j, rank in enumerate(members):
            buf = local[j].parity
            parity[rank] = write_parity(Path(dir_of[rank]), rank, layouts[j], buf, fsync)
            meter.add(int(buf.size), "parity")
    record = make_record(red, manifest, sets, [parity[r] for r in range(manifest.world_size)])
    levels = dict(manifest.levels)
    levels["1"] = {**dict(levels.get("1", {})), "redundancy": record.to_json()}
    return dataclasses.replace(manifest, levels=levels)


def offline_work(red: Redundancy, nodes: list[str], member_bytes: list[int]) -> int:
    """The bytes :func:`encode_offline` counts for a checkpoint whose rank ``r`` runs on
    ``nodes[r]`` and writes ``member_bytes[r]``: every member read back, every parity file
    written. Known from the plan, before any byte is written (a progress total)."""
    parity = sum(plan_set(red, nodes, member_bytes, r).parity_bytes for r in range(len(nodes)))
    return sum(member_bytes) + parity
