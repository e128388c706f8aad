"""Per-rank state when the number of ranks changes (``spec/reshard.md`` §3; a pure function).

A per-rank entry (a ``per_rank`` tensor, row r for rank r, or a per-rank value) holds one item
per saved rank: an RNG stream, a data-loader position. Loaded by a job of another size, each
current rank takes the item of at most one saved rank, its *source*, given by a **rank map**
(saved rank -> current rank, injective) that only the caller can define: the library cannot know
whether two ranks may share an RNG stream (they must not) or how a sampler's positions combine.

* No map: the identity when the sizes are equal; otherwise nothing is mapped.
* ``"identity"``: saved rank i -> current rank i for i below both sizes.
* A mapping ``{saved: current}``.

When the checkpoint has per-rank entries and some saved rank's item is not carried over, or some
current rank gets none, :func:`resolve` raises :class:`PerRankError` listing the entries and the
ranks, unless the caller chose ``unmapped="drop"``: then it returns a warning text listing the
same, and a current rank without a source gets no value for those entries (never another rank's
item, never a default).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptfmt.errors import PerRankError, UsageError
from ckptfmt.errors.usage import describe_per_rank

RankMap = Mapping[int, int] | str | None
UNMAPPED = ("error", "drop")


def rank_map_json(rank_map: RankMap) -> Any:
    """The rank map as JSON (so that every rank can check that all passed the same)."""
    if rank_map is None or isinstance(rank_map, str):
        return rank_map
    return sorted([int(k), int(v)] for k, v in rank_map.items())


def sources(saved: int, current: int, rank_map: RankMap) -> tuple[int | None, ...]:
    """For each current rank, the saved rank whose per-rank items it takes (None: none).

    Raises :class:`UsageError` for a map that is not an injective map of saved ranks
    ``0..saved-1`` to current ranks ``0..current-1``."""
    if rank_map is None:
        pairs = {i: i for i in range(saved)} if saved == current else {}
    elif isinstance(rank_map, str):
        if rank_map != "identity":
            raise UsageError(f"rank map {rank_map!r}: give 'identity' or a mapping")
        pairs = {i: i for i in range(min(saved, current))}
    else:
        pairs = {}
        for k, v in rank_map.items():
            if (
                isinstance(k, bool)
                or isinstance(v, bool)
                or not (isinstance(k, int) and isinstance(v, int))
            ):
                raise UsageError(f"rank map entry {k!r}: {v!r} is not saved rank -> current rank")
            if not 0 <= k < saved or not 0 <= v < current:
                raise UsageError(
                    f"rank map entry {k} -> {v}: saved ranks are 0..{saved - 1}, current "
                    f"ranks 0..{current - 1}"
                )
            pairs[k] = v
        if len(set(pairs.values())) != len(pairs):
            raise UsageError(
                "rank map sends two saved ranks to one current rank (each current rank takes "
                "the per-rank state of at most one saved rank)"
            )
    out: list[int | None] = [None] * current
    for k, v in pairs.items():
        out[v] = k
    return tuple(out)


@dataclass(frozen=True)
class Resolution:
    """What happens to the per-rank entries: each current rank's source, and the warning text
    when entries were dropped on request (None when everything is carried over)."""

    sources: tuple[int | None, ...]
    warning: str | None


def resolve(
    entries: Sequence[str], saved: int, current: int, rank_map: RankMap, unmapped: str = "error"
) -> Resolution:
    """Apply the rules to the per-rank ``entries`` of a checkpoint of ``saved`` ranks loaded by
    ``current`` ranks. Raises :class:`PerRankError` (or :class:`UsageError` for a bad map or
    option)."""
    if unmapped not in UNMAPPED:
        raise UsageError(f"unmapped per-rank entries: give one of {list(UNMAPPED)}")
    src = sources(saved, current, rank_map)
    if not entries:
        return Resolution(src, None)
    carried = {s for s in src if s is not None}
    dropped = [r for r in range(saved) if r not in carried]
    missing = [r for r in range(current) if src[r] is None]
    if not dropped and not missing:
        return Resolution(src, None)
    if unmapped == "error":
        raise PerRankError(entries, saved, current, dropped, missing)
    return Resolution(
        src, describe_per_rank(entries, saved, current, dropped, missing) + " (dropped)"
    )
