"""Who reads which chunks, and what goes over the communicator (a pure function).

Given the read plans of every current rank for one tensor (``plan.plan_reads`` of its wanted
box) and which saved writers' files each current rank can open (its own directory: on level 3
every file, on level 1 the files of its node's writers), :func:`route` decides, the same on every
rank:

1. Each rank that needs part of the file and can open it reads its own chunks itself, and
   nothing else of the file. With ``share`` (ckptfmt's default, ``replicas="node"``), ranks of
   one node (the same ``share`` key) that want the same part of the file (replicas) are served
   by one of them instead: it reads that part once and sends it to the others over the
   communicator, so shared storage is read once per node, not once per rank. In a job of the
   saved size that is the file's writer where it is one of them; otherwise one reader serves
   the group for all files of the tensor (the least loaded when the tensor starts), so that a
   tensor goes to each peer in one message, and the tensors spread over the node's ranks.
2. The ranks that need part of it but cannot open it (another node's level-1 copy) are served by
   one rank that can: it reads the union of their chunks (and its own) once and sends each its
   pieces (and serves the replicas of its own node of case 1 too).
3. With ``broadcast`` (for replicated state on shared storage that many readers would overload,
   and a fast interconnect): a file whose every in-bounds chunk every rank needs is instead read
   whole by one rank that can open it and broadcast to all.

The reader of cases 2 and 3 is, in a job of the saved size, the file's writer rank when it can
open the file (the save's plan already spread the files evenly over the ranks); otherwise a rank
that reads part of the file anyway, else any rank that can open it: the least loaded (bytes
assigned so far; ties: the lowest rank). So a job of another size spreads its reads over all its
ranks, not only over those whose rank numbers wrote.
Files that no current rank can open are reported in ``unseen`` (by writer rank).
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence, Set
from dataclasses import dataclass

from ckptfmt.plan.reads import Box, FileRead, Layout, Piece, plan_reads


@dataclass(frozen=True)
class Delivery:
    """The pieces of one file that a reader packs and sends to ``dest`` (which cannot open it):
    ``dest``'s read plan of the file."""

    dest: int
    read: FileRead

    @property
    def pieces(self) -> tuple[Piece, ...]:
        return self.read.pieces

    @property
    def nelems(self) -> int:
        return sum(p.nelems for p in self.pieces)


@dataclass(frozen=True)
class FileTask:
    """One rank reads chunks ``slots`` of one file once: for its own box (``own``: its read
    plan of the file, None if it needs none of it), for the ranks in ``deliveries``, or for
    everyone (``bcast``: every in-bounds chunk, broadcast). ``slots`` is worked out on first
    use (only the ranks that take part in the task need it)."""

    reader: int
    file: FileRead  # geometry of the file (cell, writer, present chunks)
    own: FileRead | None
    deliveries: tuple[Delivery, ...]
    bcast: bool

    @functools.cached_property
    def slots(self) -> tuple[int, ...]:
        if self.bcast:  # every rank reads the file whole: any rank's plan lists every chunk
            return self.file.slots
        out = set(self.own.slots if self.own else ())
        for d in self.deliveries:
            out.update(d.read.slots)
        return tuple(sorted(out))

    @property
    def whole(self) -> bool:
        return self.bcast or len(self.slots) == self.file.n_present


@dataclass(frozen=True)
class TensorRoute:
    """The route of one tensor: each rank's read plan, the file tasks (file order), and the
    writer ranks of needed files that no current rank can open."""

    reads: tuple[tuple[FileRead, ...], ...]
    tasks: tuple[FileTask, ...]
    unseen: tuple[int, ...]

    def tasks_of(self, rank: int) -> list[FileTask]:
        return [t for t in self.tasks if t.reader == rank]

    def bcast_roots(self) -> list[int]:
        return sorted({t.reader for t in self.tasks if t.bcast})

    def bcast_tasks(self, root: int) -> list[FileTask]:
        return [t for t in self.tasks if t.bcast and t.reader == root]

    def messages(self) -> list[tuple[int, int, list[tuple[FileTask, Delivery]]]]:
        """Point-to-point transfers ``(source, dest, [(task, delivery)])``, ordered by
        ``(source, dest)``, items in file order."""
        out: dict[tuple[int, int], list[tuple[FileTask, Delivery]]] = {}
        for t in self.tasks:
            for d in t.deliveries:
                out.setdefault((t.reader, d.dest), []).append((t, d))
        return [(s, d, items) for (s, d), items in sorted(out.items())]


def route(
    layout: Layout,
    wants: Sequence[Box],
    sees: Sequence[Set[int]],
    load: list[int],
    chunk_nbytes: int,
    same_size: bool = False,
    broadcast: bool = False,
    share: Sequence[Hashable] | None = None,
) -> TensorRoute:
    """Route the reads of one tensor for ``len(wants)`` current ranks.

    ``wants[d]`` is rank d's box; ``sees[d]`` the saved writer ranks whose files rank d can
    open; ``load[d]`` the bytes rank d reads so far (updated); ``same_size``: the job has the
    saved number of ranks (writer ranks read their own files); ``broadcast``: files every rank
    needs whole are read once and broadcast (case 3 above); ``share[d]``: rank d's node, for
    case 1 (None: every rank reads its own part itself). Deterministic.
    """
    size = len(wants)
    cache: dict[Box, tuple[FileRead, ...]] = {}
    for w in wants:
        if w not in cache:  # replicas want the same box: plan it once
            cache[w] = plan_reads(layout, w)
    reads = tuple(cache[w] for w in wants)
    by_key: dict[tuple[int, int], dict[int, FileRead]] = {}
    for d, rs in enumerate(reads):
        for fr in rs:
            by_key.setdefault(fr.key, {})[d] = fr
    tasks: list[FileTask] = []
    unseen: set[int] = set()
    readers: dict[tuple[int, ...], int] = {}  # a group of replicas -> its reader
    for key in sorted(by_key):
        needing = by_key[key]
        any_read = next(iter(needing.values()))
        writer = any_read.writer
        seers = [k for k in range(size) if writer in sees[k]]
        if not seers:
            unseen.add(writer)
            continue
        if (
            broadcast
            and size > 1
            and len(needing) == size
            and all(fr.whole for fr in needing.values())
        ):
            root = _choose(seers, writer if same_size else -1, needing, load)
            load[root] += any_read.n_present * chunk_nbytes
            tasks.append(FileTask(root, any_read, needing[root], (), True))
            continue
        remote = [d for d in sorted(needing) if d not in seers]
        helper = _choose(seers, writer if same_size else -1, needing, load) if remote else None
        mates: list[int] = []  # the helper's replicas on its node, served with the remote ranks
        for group in _replicas([d for d in sorted(needing) if d in seers], needing, share):
            if helper in group:
                mates = [d for d in group if d != helper]
                continue
            if same_size and writer in group:
                reader = writer  # a job of the saved size reads as it wrote
            else:  # one reader for all the tensor's files: one message per peer, not one each
                reader = readers.setdefault(tuple(group), _least_loaded(group, load))
            fr = needing[reader]
            load[reader] += fr.n_chunks * chunk_nbytes
            served = tuple(Delivery(d, needing[d]) for d in group if d != reader)
            tasks.append(FileTask(reader, fr, fr, served, False))
        if helper is not None:
            own = needing.get(helper)
            # the chunks of the union, bounded without listing them (the same on every rank)
            n = sum(needing[d].n_chunks for d in ([helper] if own else []) + remote)
            load[helper] += min(n, any_read.n_present) * chunk_nbytes
            deliveries = tuple(Delivery(d, needing[d]) for d in sorted(mates + remote))
            tasks.append(FileTask(helper, any_read, own, deliveries, False))
    tasks.sort(key=lambda t: (t.file.key, t.reader))
    return TensorRoute(reads, tuple(tasks), tuple(sorted(unseen)))


def _replicas(
    ranks: list[int], needing: dict[int, FileRead], share: Sequence[Hashable] | None
) -> list[list[int]]:
    """``ranks`` (ascending) in groups that one of them reads for: the ranks of one node that
    want the same part of the file (with ``share``), else each rank alone."""
    if share is None:
        return [[d] for d in ranks]
    groups: dict[tuple[Hashable, Box], list[int]] = {}
    for d in ranks:
        fr = needing[d]
        groups.setdefault((share[d], (fr.lo, fr.hi)), []).append(d)
    return list(groups.values())


def _least_loaded(group: list[int], load: list[int]) -> int:
    """The rank of ``group`` with the fewest bytes assigned so far (ties: the lowest)."""
    return min(group, key=lambda k: (load[k], k))


def _choose(seers: list[int], writer: int, needing: dict[int, FileRead], load: list[int]) -> int:
    if writer in seers:
        return writer
    readers = [k for k in seers if k in needing] or seers
    return min(readers, key=lambda k: (load[k], k))
