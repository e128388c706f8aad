"""Redundancy sets: which ranks protect each other (``spec/redundancy.md``, "Sets").

A set holds at most one rank per failure domain (node), so losing a node costs each set at most
one member. With R ranks, ``c_max`` the most ranks on one node, sets are formed by:

1. *Index rule* (SCR/redset's): nodes in order of their first rank, each rank numbered by its
   position inside its node; the ranks with the same position form a group, cut into
   ``max(1, len // set_size)`` sets of contiguous ranks whose sizes differ by at most one. A group
   smaller than ``min_size`` is spread instead: each of its ranks joins the smallest set formed so
   far that holds no rank of its node (first such set on ties).
2. *Deal rule*, only when 1 leaves a rank with no set to join: the ranks listed node by node
   (nodes in order of their first rank, ranks ascending) are dealt round-robin into
   ``n = max(c_max, R // set_size)`` sets; a node's ranks are consecutive and at most ``n``, so
   they land in distinct sets, and every set gets at least ``min(set_size, R // c_max)`` ranks.
3. It is impossible exactly when ``R < c_max * min_size`` (there must be ``c_max`` sets of
   ``min_size``); :class:`UsageError` then.
"""

from __future__ import annotations

from collections.abc import Sequence

from ckptfmt.errors import UsageError


def make_sets(nodes: Sequence[str], set_size: int, min_size: int) -> list[list[int]]:
    """Group the ranks ``0..len(nodes)-1`` into redundancy sets; ``nodes[r]`` is rank r's node.

    Returns the sets, each a sorted list of ranks, ordered by their lowest rank. Deterministic:
    the same ``nodes`` give the same sets on every rank. Raises :class:`UsageError` when the
    ranks cannot be split into sets of at least ``min_size`` distinct nodes (e.g. fewer nodes
    than ``min_size``).
    """
    if min_size < 1 or set_size < min_size:
        raise UsageError(
            f"need 1 <= min_size <= set_size, got min_size={min_size}, set_size={set_size}"
        )
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    c_max = max((len(r) for r in by_node.values()), default=0)
    if len(nodes) < c_max * min_size:
        busiest = max(by_node, key=lambda n: len(by_node[n]))
        raise UsageError(
            f"cannot form redundancy sets of at least {min_size} ranks on distinct nodes: "
            f"node {busiest!r} has {c_max} ranks, so {c_max} sets are needed, but the job has "
            f"{len(nodes)} ranks on {len(by_node)} node(s)"
        )
    sets = _index_rule(nodes, by_node, c_max, set_size, min_size)
    if sets is None:
        n_sets = max(c_max, len(nodes) // set_size)
        dealt = [r for ranks in by_node.values() for r in ranks]
        sets = [dealt[i::n_sets] for i in range(n_sets)]
    for members in sets:
        members.sort()
    sets.sort(key=lambda members: members[0])
    return sets


def _index_rule(
    nodes: Sequence[str], by_node: dict[str, list[int]], depth: int, set_size: int, min_size: int
) -> list[list[int]] | None:
    sets: list[list[int]] = []
    leftovers: list[int] = []
    for g in range(depth):
        group = [ranks[g] for ranks in by_node.values() if g < len(ranks)]
        if len(group) < min_size:
            leftovers.extend(group)
            continue
        n_sets = max(1, len(group) // set_size)
        base, extra = divmod(len(group), n_sets)
        start = 0
        for i in range(n_sets):
            size = base + (1 if i < extra else 0)
            sets.append(group[start : start + size])
            start += size
    for rank in leftovers:
        fits = [s for s in sets if all(nodes[r] != nodes[rank] for r in s)]
        if not fits:
            return None
        min(fits, key=len).append(rank)
    return sets
