"""Collective load of one checkpoint by any number of ranks: every rank gets what it wants,
reading only the inner chunks it needs from its own directory and receiving the rest.

Every rank calls :func:`load_collective` with the directory it can see (its node's level-1 copy,
or the shared level-3 copy) and what it wants of each tensor (the whole tensor, or a box). The
job may have another size than the one that saved (``spec/reshard.md``):

1. Each rank reads and checks the manifest and finds out which saved nodes' files its directory
   holds (given by ``node`` for a level-1 copy; else one file per saved node is looked up). The
   ranks exchange that, their wanted boxes and their options (one all-gather). A rank whose
   directory holds no checkpoint at all (a node new to the job) gets the manifest from the first
   rank that has one and all its data over the Comm.
2. Every rank computes the same plan (``ckptfmt.plan``): for each tensor the inner chunks each
   rank needs, and who reads them (``reshard.route``): a rank reads its own chunks where its
   directory holds the file, and one rank that holds it reads and sends them where it does not
   (with ``replicas="node"``, the default, ranks of one node that want the same part of a
   file are served by one of them, which reads it once and sends it to the others; with
   ``replicas="bcast"``, a file every rank needs whole is read by one rank and broadcast).
   If some needed file is held by no current rank, every rank raises
   :class:`UnreachableNodesError` naming the saved nodes (the caller then tries the level-3
   copy). Per-rank entries follow the rules of ``reshard.per_rank`` (an explicit error, or a
   warning when dropping was asked for).
3. Each rank reads its chunks (verified; concurrently, a few threads per host).
4. Broadcasts and sends in one global order, the same on every rank (so no rank waits for a
   transfer that another rank has not reached).
5. Damage found by any rank is voted on at the end, so no rank is left waiting; then every
   rank raises :class:`LoadFailedError`.

Step 1 is ``load_open``'s; steps 2 to 4 are ``load_read``'s; this module runs them and
assembles the state.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ckptfmt.container.reader import document_checks
from ckptfmt.errors import LoadFailedError as LoadFailedError  # re-exported
from ckptfmt.errors import PerRankWarning
from ckptfmt.errors import UnreachableNodesError as UnreachableNodesError  # re-exported
from ckptfmt.format.zarr_meta import document_paths
from ckptfmt.manifest.codec import MANIFEST_NAME
from ckptfmt.manifest.limits import display
from ckptfmt.manifest.model import GroupEntry, Manifest, PerRankValueEntry, TensorEntry, ValueEntry
from ckptfmt.parallel.collective.boundary import Boundary
from ckptfmt.parallel.collective.load_open import doc_share, open_copies
from ckptfmt.parallel.collective.load_read import (
    LoadPlan,
    add_presence_checks,
    allocate,
    files_read,
    plan_load,
    read_local,
    transfer,
)
from ckptfmt.plan import per_rank as rules
from ckptfmt.plan.options import ReadOptions
from ckptfmt.plan.reads import Box
from ckptfmt.storage.files import Files, Inside
from ckptfmt.storage.progress import current_meter
from ckptfmt.transport.comm import Comm
from ckptfmt.tree.state import Blob, Container, unflatten

Into = Mapping[str, np.ndarray] | Callable[[dict[str, Any]], Mapping[str, np.ndarray]]
"""Where a load may read straight into (``load_collective``'s ``into``)."""
Pickled = Literal["refuse", "load", "keep"]


def load_collective(
    comm: Comm,
    path: str | os.PathLike[str],
    wants: Mapping[str, Box | None] | None = None,
    expect_step: int | None = None,
    *,
    node: str | None = None,
    read: ReadOptions = ReadOptions(),
    seq: int | None = None,
    into: Into | None = None,
    trust_pickle: bool = False,
    source: Files | None = None,
    host: str | None = None,
    own_only: Collection[int] = (),
    check_first: Callable[[], None] | None = None,
) -> tuple[dict[str, Any], Manifest]:
    """Collective: load the checkpoint every rank sees at ``path`` (its own copy), with any
    number of ranks.

    ``wants`` maps tensor names ('/'-joined) to a box ``(offset, shape)`` or None (the whole
    tensor); tensors not named are loaded whole. ``node``: the directory is this node's level-1
    copy (it holds the files of the saved ranks of ``node``); without it, which saved nodes'
    files the directory holds is looked up (one file per node). ``read``
    (:class:`~ckptfmt.plan.options.ReadOptions`, the same on every rank) says how per-rank
    entries follow a change in the number of ranks, whether a file every rank needs is read
    once and broadcast, and how many threads read per host. Returns the nested state (boxes
    as arrays of the box's shape, per-rank entries as this rank's own item) and the manifest.
    ``into`` ('/'-joined name -> array): destinations to read straight into, each used when it
    is C-contiguous, writeable and of exactly the box's shape and the saved dtype (else a fresh
    array is allocated, as without it): a tensor is then written once on the way in, and the
    returned state holds the caller's array. A load that fails part-way may have written into
    them (what the caller accepts by passing them; the ``zarr.json`` documents are then checked
    beside the reads, as without destinations). ``into`` may instead be a callable, called
    on this rank once the load is planned and before anything is read, with the skeleton of
    what the load returns (the nested state, its arrays of the box's shape and dtype without
    their data, its encoded entries as ``Blob``): it returns the destinations (a restore that
    lands only where applying the state would write, ``tree.apply.landing_targets``); what it
    raises fails the load on every rank. ``trust_pickle``: unpickle the entries a save
    stored pickled (else :class:`PickleRefusedError` naming the first, nothing unpickled).
    The chunks this rank reads and what it receives are counted on the caller's progress meter
    (``ckptfmt.storage.progress.metering``), if it opened one; the caller finishes it.
    ``source``: read the checkpoint through it instead of the directory ``path`` (a committed
    checkpoint in a bucket, ``storage.objects.source.ObjectInside``, which every rank sees
    whole; ``path`` is then its URL, for messages). Each rank then has at least the source's
    ``reads_in_flight`` reads going, whatever ``read.threads`` says for a local disk.
    ``host``: the node this rank runs on (by default ``node``, else the host name): with
    ``read.replicas="node"`` (the default), what several ranks of one node want alike is read
    by one of them and sent to the others, so each node reads replicated state once.
    ``own_only`` (the same on every rank): saved ranks whose files only the rank of the same
    number reads, whatever node it shares with others (a restore's rebuild holds them in that
    rank's memory: ``engine.member_files``). ``check_first``: run on this rank once the load is
    planned, before anything is read; what it raises (damage it found) fails the load on every
    rank with nothing read (``MemberFiles.verify``: a rebuilt member checked before it lands).
    """
    root: Path | str = Path(path).absolute() if source is None else os.fspath(path)
    src: Files = Inside(Path(root)) if source is None else source
    # the documents are checked on the read threads, beside the data, unless the load lands in
    # the caller's arrays all or nothing (a callable ``into``: a restore's landing, which must
    # find every fault before anything is read); without destinations nothing lands before the
    # reads' vote, and with a mapping the caller accepted that a failed load may have written
    docs = None if callable(into) else doc_share(root, (comm.rank, comm.size))
    manifest, info = open_copies(
        comm, root, src, wants, expect_step, node, read, seq, host, docs is None
    )
    loaded, mine = _read_everything(
        comm, src, manifest, info, read, seq, wants, into, own_only, check_first, docs
    )
    pickled: Pickled = "load" if trust_pickle else "refuse"
    return _assemble(manifest, loaded, mine, wants, pickled), manifest


def _read_everything(
    comm: Comm,
    src: Files,
    manifest: Manifest,
    info: list[dict[str, Any]],
    read: ReadOptions,
    seq: int | None,
    wants: Mapping[str, Box | None] | None,
    into: Into | None,
    own_only: Collection[int] = (),
    check_first: Callable[[], None] | None = None,
    docs: tuple[int, int] | None = None,
) -> tuple[dict[str, np.ndarray], int | None]:
    """Collective (the boundary's votes and the transfers): resolve the per-rank entries, plan
    who reads what, allocate (voted on before any exchange), read this rank's chunks and move
    the pieces between ranks (voted on). Returns every tensor this rank gets ('/'-joined name
    -> array) and the saved rank whose per-rank items it takes (None: none)."""
    # a per-rank tensor that every rank names in ``wants`` is loaded as plain boxes
    named = set.intersection(*(set(i["wants"]) for i in info))
    resolution = rules.resolve(
        [display(e.name) for e in manifest.entries if _is_per_rank(e, named)],
        manifest.world_size,
        comm.size,
        read.rank_map,
        read.per_rank,
    )
    if resolution.warning:
        warnings.warn(resolution.warning, PerRankWarning, stacklevel=3)
    sees = [
        {
            w
            for w, ri in enumerate(manifest.ranks)
            if (ri.node in set(i["visible"]) and w not in own_only) or (w == r and w in own_only)
        }
        for r, i in enumerate(info)
    ]
    share = [i["node"] for i in info] if read.replicas == "node" else None
    plans = plan_load(manifest, info, resolution.sources, sees, read.replicas == "bcast", share)
    same_host = sum(1 for i in info if i["host"] == info[comm.rank]["host"])
    b = Boundary(comm, "load", manifest.step, error=LoadFailedError, seq=seq)
    errors: list[BaseException] = []
    lock = threading.Lock()
    mine = resolution.sources[comm.rank]
    # a bucket's pace is set by the requests in flight, not by a disk's queue
    threads = max(1, read.threads // same_host, src.reads_in_flight)
    with b.guard("load-allocate"):
        if check_first is not None:
            check_first()
        targets = (
            into(_skeleton(manifest, plans, comm.rank, mine, wants)) if callable(into) else into
        )
        bufs = allocate(comm.rank, src, plans, errors, lock, targets or {}, threads)
        current_meter().expect(bufs.work(comm.rank, plans))
        # open_copies read the manifest and (each rank its share) every zarr.json
        covered = files_read(plans) | {MANIFEST_NAME} | set(document_paths(manifest))
        checks = src.presence_checks(covered, comm.rank, comm.size)
        if docs is not None and info[comm.rank]["absent"] is None:  # its share, checked here
            # a local document is read in microseconds, a bucket's in a round trip each
            batch = 32 if src.reads_in_flight <= 1 else 1
            checks += document_checks(src, manifest, docs, batch)
        add_presence_checks(bufs, checks, errors, lock)
    b.vote("load-allocate")
    with b.guard("load-read"):
        read_local(bufs, threads)
    bufs.jobs.clear()  # their read scratch with them: not held through the exchanges
    transfer(comm, plans, bufs)
    if errors:
        b.fail(errors[0], "load-read")
    b.vote("load-read")
    return bufs.outs, mine


def _skeleton(
    manifest: Manifest,
    plans: list[LoadPlan],
    me: int,
    mine: int | None,
    wants: Mapping[str, Box | None] | None,
) -> dict[str, Any]:
    """What the load will return on rank ``me``, its arrays of the right shape and dtype but
    holding no memory (``into``'s callback), its encoded entries as ``Blob``."""
    empty = {p.name: np.broadcast_to(np.empty((), p.geo.dtype), p.boxes[me][1]) for p in plans}
    return _assemble(manifest, empty, mine, wants, "keep")


def _assemble(
    manifest: Manifest,
    loaded: Mapping[str, np.ndarray],
    mine: int | None,
    wants: Mapping[str, Box | None] | None,
    pickled: Pickled = "refuse",
) -> dict[str, Any]:
    """The nested state of this rank, in the manifest's order: boxes and whole tensors,
    values, groups, and its own per-rank items (from saved rank ``mine``); pickled entries
    as ``tree.state.unflatten`` is told."""
    leaves: list[tuple[tuple[str, ...], Any]] = []
    for e in manifest.entries:
        if isinstance(e, TensorEntry):
            if e.encoding:
                leaves.append((e.name, Blob(loaded[display(e.name)], e.encoding)))  # type: ignore[arg-type]
            elif not e.per_rank or display(e.name) in (wants or {}):
                leaves.append((e.name, loaded[display(e.name)]))
            elif mine is not None:
                leaves.append((e.name, loaded[display(e.name)].reshape(e.shape[1:])))
        elif isinstance(e, ValueEntry):
            leaves.append((e.name, e.value))
        elif isinstance(e, GroupEntry):
            leaves.append((e.name, Container(e.container) if e.container else {}))  # type: ignore[arg-type]
        elif mine is not None:
            leaves.append((e.name, e.values[mine]))
    return unflatten(leaves, pickled=pickled)


def _is_per_rank(e: object, named: set[str]) -> bool:
    """Whether ``e`` is loaded as each rank's own item (and so follows the per-rank rules): a
    per-rank value, or a per-rank tensor that not every rank asks a box of."""
    if isinstance(e, PerRankValueEntry):
        return True
    return isinstance(e, TensorEntry) and e.per_rank and display(e.name) not in named
