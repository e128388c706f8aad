"""The restore order: which copies a restore tries, in which order, from what each rank sees.

A pure function of the views every rank gathered (each rank's node and the committed steps it
sees on level 1, its node's directory, and on level 3), so every rank computes the same order
without another message. Newest step first; within a step, level 1 before level 3 (level 1 is
local and fast; its lost parts may be rebuilt from the save's redundancy, level 3 has none).

A copy not every rank sees is still tried on level 1 when some rank sees it (the ranks without
it may be new to the job, or their node's part may be rebuilt from parity: the load and the
rebuild find out), and is refused on level 3 (a shared directory some rank cannot see has no
redundancy to make up for it). A step on no rank's level 1 is refused there; a step on no
rank's level 3 was never flushed and is no candidate on that level.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol, TypedDict

from ckptfmt.storage.steps import step_dir_name

__all__ = ["Candidate", "View", "candidates"]


class View(TypedDict):
    """What one rank sees: its node, and the committed steps on level 1 (``l1``: its node's
    directory) and on level 3 (``l3``)."""

    node: str
    l1: list[int]
    l3: list[int]


class StepRoot(Protocol):
    """A level's root: ``root / "step-<n>"`` is where a step is (a ``Path``; on level 3 also a
    ``parallel.levels.shared.SharedLevel``, whose steps may be bucket prefixes)."""

    def __truediv__(self, name: str, /) -> Any: ...


class Candidate(NamedTuple):
    """One copy in the restore order: ``step`` on ``level`` at ``path`` (what its level's root
    gives for the step's name: a directory, or a bucket prefix). ``refused``, when not empty,
    says why no rank tries it (it is listed for the report)."""

    step: int
    level: int
    path: Any
    refused: str = ""


def candidates(views: Sequence[View], roots: Mapping[int, StepRoot | None]) -> list[Candidate]:
    """The restore order for ``views`` (one per rank, by rank) and the levels' ``roots``
    (``{1: this rank's level-1 directory, 3: the shared directory}``, None where the manager
    has no such level): newest step first, level 1 before level 3."""
    steps = sorted({s for v in views for s in [*v["l1"], *v["l3"]]}, reverse=True)
    out: list[Candidate] = []
    for step in steps:
        for level in (1, 3):
            root = roots.get(level)
            if root is None:
                continue
            lacking = [
                r for r, v in enumerate(views) if step not in (v["l1"] if level == 1 else v["l3"])
            ]
            if level == 3 and len(lacking) == len(views):
                continue  # never flushed: not a candidate on this level
            refused = ""
            if lacking and (level == 3 or len(lacking) == len(views)):
                nodes = sorted({views[r]["node"] for r in lacking})
                refused = (
                    f"no committed copy on node(s) {', '.join(nodes)} "
                    f"(ranks {', '.join(map(str, lacking))})"
                )
            out.append(Candidate(step, level, root / step_dir_name(step), refused))
    return out
