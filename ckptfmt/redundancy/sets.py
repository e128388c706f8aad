"""Redundancy sets: which ranks protect each other (``spec/redundancy.md``, "Sets").

A set holds at most one rank per failure domain (node), so losing a node costs each set at most
one member. The rule is SCR/redset's: group the ranks by node (nodes in order of their first rank),
number each rank by its position inside its node, take the ranks with the same position across the
nodes and cut that group into sets of at least ``set_size`` (sizes differ by at most one). A group
smaller than ``set_size`` is one set; a group smaller than ``min_size`` is spread over the sets
already formed that hold no rank of the same node (smallest set first).
"""

from __future__ import annotations

from collections.abc import Sequence

from ckptfmt.errors import UsageError


def make_sets(nodes: Sequence[str], set_size: int, min_size: int) -> list[list[int]]:
    """Group the ranks ``0..len(nodes)-1`` into redundancy sets; ``nodes[r]`` is rank r's node.

    Returns the sets, each a sorted list of ranks, ordered by their lowest rank. Deterministic:
    the same ``nodes`` give the same sets on every rank. Raises :class:`UsageError` when a set
    of ``min_size`` distinct nodes cannot be formed for some rank (e.g. fewer nodes than
    ``min_size``).
    """
    if min_size < 1 or set_size < min_size:
        raise UsageError(f"need 1 <= min_size <= set_size, got min_size={min_size}, "
                         f"set_size={set_size}")
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    depth = max((len(r) for r in by_node.values()), default=0)
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
        for s in range(n_sets):
            size = base + (1 if s < extra else 0)
            sets.append(group[start:start + size])
            start += size
    for rank in leftovers:
        fits = [s for s in sets if all(nodes[r] != nodes[rank] for r in s)]
        if not fits:
            raise UsageError(
                f"cannot place rank {rank} (node {nodes[rank]!r}) in a redundancy set of at least "
                f"{min_size} ranks on distinct nodes: the job has {len(by_node)} node(s) and "
                f"every set with room already holds a rank of that node")
        min(fits, key=len).append(rank)
    for s in sets:
        s.sort()
    sets.sort(key=lambda s: s[0])
    return sets
