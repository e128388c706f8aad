"""What an offline reshard keeps of the source and how the new ranks hold it: the entries
carried over (per-rank ones only where every new rank gets an item), the tensors held in row
blocks, and each new rank's holdings (``reshard``'s module docstring)."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

from ckptfmt.errors import UsageError
from ckptfmt.manifest.limits import display
from ckptfmt.manifest.model import Entry, Manifest, PerRankValueEntry, TensorEntry
from ckptfmt.plan.options import PerRankMode
from ckptfmt.plan.ownership import Holding
from ckptfmt.plan.per_rank import RankMap, resolve
from ckptfmt.plan.reads import Box


def dropped_text(
    entries: Sequence[str], saved: int, ranks: int, sources: Sequence[int | None]
) -> str:
    """What leaving per-rank entries out of a rewrite loses, exactly: a per-rank entry holds
    one item for every rank (``spec/FORMAT.md`` §12), so when some new rank has no source the
    entries go for every new rank, and with them the items of every saved rank."""
    without = [r for r, s in enumerate(sources) if s is None]
    shown = ", ".join(entries[:20]) + (f" (+{len(entries) - 20} more)" if len(entries) > 20 else "")
    return (
        f"left out for all {ranks} new rank(s), since new rank(s) "
        f"{_span(without)} would get no item (a per-rank entry holds one item for every rank): "
        f"{shown}; the items of all {saved} saved rank(s) ({_span(list(range(saved)))}) are "
        "dropped, and every new rank starts them afresh"
    )


def _span(ranks: Sequence[int]) -> str:
    if ranks and list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks[:32])) + (
        f" (+{len(ranks) - 32} more)" if len(ranks) > 32 else ""
    )


def rows_of(n_rows: int, rank: int, size: int) -> tuple[int, int]:
    """``(start, count)`` of rank ``rank``'s row block (``numpy.array_split``'s split)."""
    base, extra = divmod(n_rows, size)
    return rank * base + min(rank, extra), base + (rank < extra)


def check_nodes(nodes: Sequence[str], ranks: int) -> list[str]:
    if len(nodes) != ranks:
        raise UsageError(f"{len(nodes)} node names for {ranks} ranks")
    for n in nodes:
        if not n or "/" in n or n in (".", "..") or n != n.strip():
            raise UsageError(f"invalid node name {n!r}")
    return list(nodes)


@dataclass(frozen=True)
class Selection:
    """What of the source the destination holds, and how the new ranks hold it."""

    kept: list[Entry]  # the entries carried over, in order
    by_rows: list[str]  # tensors held in row blocks
    sources: tuple[int | None, ...]  # per new rank: the saved rank whose per-rank items it gets
    dropped: list[str]  # per-rank entries left out
    warning: str | None


def select(
    manifest: Manifest, ranks: int, rows: Sequence[str], rank_map: RankMap, per_rank: PerRankMode
) -> Selection:
    """The entries the destination keeps (per-rank ones only where every new rank gets an
    item, or refused: ``plan.per_rank.resolve``) and those held in row blocks."""
    entries = manifest.entries
    per_rank_names = [
        display(e.name)
        for e in entries
        if isinstance(e, PerRankValueEntry) or (isinstance(e, TensorEntry) and e.per_rank)
    ]
    res = resolve(per_rank_names, manifest.world_size, ranks, rank_map, per_rank)
    keep_per_rank = all(s is not None for s in res.sources)
    dropped = [] if keep_per_rank else per_rank_names
    warning = res.warning
    if dropped:  # say exactly what is gone: every rank's item, not only the unmapped ranks'
        warning = f"{warning}; {dropped_text(dropped, manifest.world_size, ranks, res.sources)}"
    kept = [e for e in entries if keep_per_rank or display(e.name) not in set(per_rank_names)]
    by_rows = sorted(
        display(e.name)
        for e in kept
        if isinstance(e, TensorEntry)
        and not e.per_rank
        and e.shape
        and any(fnmatch.fnmatchcase(display(e.name), p) for p in rows)
    )
    return Selection(kept, by_rows, res.sources, dropped, warning)


def declarations(entries: Sequence[Entry], ranks: int, by_rows: set[str]) -> list[list[Holding]]:
    """What each new rank would hold of each tensor."""
    out: list[list[Holding]] = [[] for _ in range(ranks)]
    for e in entries:
        if not isinstance(e, TensorEntry):
            continue
        for k in range(ranks):
            if e.per_rank:
                shape = (ranks, *e.shape[1:])
                box: Box | None = ((k, *(0,) * (len(shape) - 1)), (1, *shape[1:]))
                out[k].append(Holding(e.name, e.dtype, shape, box))
                continue
            box = None
            if display(e.name) in by_rows:
                start, count = rows_of(e.shape[0], k, ranks)
                box = ((start, *(0,) * (len(e.shape) - 1)), (count, *e.shape[1:]))
            out[k].append(Holding(e.name, e.dtype, e.shape, box))
    return out
