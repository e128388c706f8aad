"""The first step of a collective load: every rank opens its copy of the checkpoint (the
manifest, this node's zarr documents, which saved nodes' files its directory holds), and the
ranks agree in one all-gather on what is loaded, or all fail alike (``load_collective``, step 1)."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ckptfmt.container.reader import check_documents, read_manifest_bytes
from ckptfmt.errors import (
    DamagedError,
    LoadFailedError,
    NotACheckpointError,
    RankFailure,
    UsageError,
)
from ckptfmt.manifest.codec import MANIFEST_NAME, parse_manifest
from ckptfmt.manifest.limits import MANIFEST_MAX_BYTES
from ckptfmt.manifest.model import Manifest
from ckptfmt.plan import per_rank as rules
from ckptfmt.plan.options import ReadOptions
from ckptfmt.plan.reads import Box
from ckptfmt.storage.files import Files
from ckptfmt.transport.comm import Comm


def _visible_nodes(src: Files, m: Manifest, node: str | None) -> list[str]:
    """The saved nodes whose data files this rank's directory holds: ``node``'s alone when the
    caller says the directory is that node's level-1 copy; otherwise the nodes of which one
    data file is there (one look-up per node, nothing read)."""
    probes: dict[str, tuple[str, int]] = {}
    for t in m.tensors():
        for r in t.regions:
            if r.files:
                probes.setdefault(m.ranks[r.rank].node, (r.files[0].path, r.files[0].size))
    if node is not None and node in probes:
        return [node]
    # no node given, or a node the save does not know (a spare that replaced a failed host
    # under a new name holds what the rebuild wrote for the saved node it replaces): which
    # saved nodes' files are here is looked up
    out = []
    for n, (path, size) in probes.items():
        try:
            src.check_size(path, size)
        except DamagedError as exc:
            if not isinstance(exc, FileNotFoundError):
                out.append(n)  # there, but damaged: reading it will say so
            continue
        out.append(n)
    return out


@dataclass
class _Own:
    """What this rank found in its own directory, before the ranks compare."""

    error: dict[str, Any] | None = None
    absent: str | None = None  # no checkpoint here at all (a node new to the job, say)
    data: bytes = b""
    manifest: Manifest | None = None
    visible: list[str] = field(default_factory=list)


def open_copies(
    comm: Comm,
    root: Path | str,
    src: Files,
    wants: Mapping[str, Box | None] | None,
    expect_step: int | None,
    node: str | None,
    read: ReadOptions,
    seq: int | None,
    host: str | None = None,
    check_docs: bool = True,
) -> tuple[Manifest, list[dict[str, Any]]]:
    """Collective (an allgather, and a broadcast of the manifest when some rank has no copy):
    each rank opens its copy and says what it wants and sees; any failure, a copy of another
    save or step, or ranks in another call or with other options fail every rank alike.
    Returns the manifest and every rank's declaration. Every rank calls, in order: the
    allgather of the declarations, then (when some rank has no copy) the broadcast of the
    manifest from the first rank that has one. ``root`` is a directory, or, where ``src``
    reads objects of a bucket, the URL that names them in messages. ``host``: the node
    this rank runs on (declared as ``"node"``: ranks of one node share their reads of replicas);
    by default ``node``, else the host name. ``check_docs=False``: the ``zarr.json`` documents
    are left to the caller (``doc_share``), which checks them beside its reads."""
    own = _open_own(root, src, expect_step, node, (comm.rank, comm.size), check_docs)
    info = comm.allgather_json(
        {
            "key": ["load", expect_step, seq],
            "error": own.error,
            "absent": own.absent,
            "wants": {
                k: (None if v is None else [list(v[0]), list(v[1])])
                for k, v in (wants or {}).items()
            },
            "save_id": own.manifest.save_id if own.manifest else None,
            "manifest_bytes": len(own.data),
            "visible": own.visible,
            "host": socket.gethostname(),
            "node": host or node or socket.gethostname(),
            "options": [rules.rank_map_json(read.rank_map), read.per_rank, read.replicas],
        }
    )
    present = _agreed(info, expect_step)
    manifest = own.manifest
    if len(present) < comm.size:
        manifest = _share_manifest(comm, info, present, own.data, manifest)
    assert manifest is not None
    if any(i["options"] != info[0]["options"] for i in info):
        raise UsageError("every rank must pass the same rank_map, per_rank and replicas options")
    return manifest, info


def _open_own(
    root: Path | str,
    src: Files,
    expect_step: int | None,
    node: str | None,
    share: tuple[int, int],
    check_docs: bool = True,
) -> _Own:
    """Local: open this rank's copy; any failure is kept for the vote, never raised (a rank
    leaving would leave its peers waiting in the allgather). A node's directory is its own
    copy, whose documents each of its ranks checks; the one copy in a bucket has its
    documents checked by every rank its ``share`` (rank, ranks) of them, not each all."""
    own = _Own()
    try:
        if isinstance(root, Path):
            own.data = read_manifest_bytes(root)
        else:  # committed objects: the commit object said the manifest is there
            own.data = src.read(MANIFEST_NAME, MANIFEST_MAX_BYTES + 1)
        own.manifest = parse_manifest(own.data, f"{root}/{MANIFEST_NAME}")
        if check_docs:  # this node's zarr.json copies too (FORMAT.md §10)
            check_documents(src, own.manifest, doc_share(root, share))
        if expect_step is not None and own.manifest.step != expect_step:
            own.error = RankFailure(
                "",
                f"{root} holds step {own.manifest.step}, not {expect_step} (a misplaced copy)",
                "load-open",
                kind="damage",
            ).to_json()
        else:
            own.visible = _visible_nodes(src, own.manifest, node)
    except NotACheckpointError as exc:
        own.absent = f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # any failure is voted on below, never a rank leaving
        own.error = RankFailure.of(exc, "load-open").to_json()
    return own


def doc_share(root: Path | str, share: tuple[int, int]) -> tuple[int, int]:
    """Which ``zarr.json`` documents this rank checks, ``(i, n)``: every one of its node's
    directory, or its ``share`` (rank, ranks) of the one copy in a bucket."""
    return (0, 1) if isinstance(root, Path) else share


def _agreed(info: list[dict[str, Any]], expect_step: int | None) -> list[int]:
    """Local, the same verdict on every rank (from the gathered declarations): the ranks that
    hold a copy; raises :class:`LoadFailedError` on every rank for any failure, a rank in
    another call, no copy anywhere, or copies of different saves."""
    present = [r for r, i in enumerate(info) if i["absent"] is None]
    failures: dict[int, RankFailure | str] = {
        r: RankFailure.from_json(i["error"]) for r, i in enumerate(info) if i["error"]
    }
    for r, i in enumerate(info):
        if i["key"] != info[0]["key"]:
            failures[r] = RankFailure(
                "OutOfStepError",
                f"is in {i['key']}, rank 0 in {info[0]['key']}",
                "load-open",
                kind="collective",
            )
    if not present:
        failures = {r: _absent(i["absent"]) for r, i in enumerate(info)}
    if not failures and len({info[r]["save_id"] for r in present}) != 1:
        failures = {r: _absent(f"has save {info[r]['save_id']}") for r in present}
    if failures:
        raise LoadFailedError(failures, operation="load", step=expect_step)
    return present


def _share_manifest(
    comm: Comm,
    info: list[dict[str, Any]],
    present: list[int],
    data: bytes,
    manifest: Manifest | None,
) -> Manifest | None:
    """Collective (a broadcast, every rank): ranks without a copy take the manifest of the
    first rank that has one (its data reaches them over the Comm like any other rank's that
    cannot open a file)."""
    buf = (
        np.frombuffer(data, np.uint8).copy()
        if comm.rank == present[0]
        else np.empty(info[present[0]]["manifest_bytes"], np.uint8)
    )
    comm.bcast_buffer(buf, present[0])
    if manifest is None:
        manifest = parse_manifest(buf.tobytes(), f"rank {present[0]}'s {MANIFEST_NAME}")
    return manifest


def _absent(message: str) -> RankFailure:
    """A rank's copy is absent or of another save: damage, to every rank (another copy or an
    older step may do)."""
    return RankFailure("", message, "load-open", kind="damage")
