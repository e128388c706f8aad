"""The restore order, a pure function of what each rank sees (in-process, no communicator):
newest step first, level 1 before level 3, a copy some rank cannot see still tried on level 1
(its node's part may be rebuilt from parity) but refused on level 3 (no redundancy there)."""

from __future__ import annotations

from pathlib import Path

from ckptfmt.parallel.manager.restore_order import Candidate, View, candidates
from ckptfmt.storage.steps import step_dir_name

L1, L3 = Path("/local/n"), Path("/shared")
ROOTS = {1: L1, 3: L3}


def view(node: str, l1: list[int], l3: list[int]) -> View:
    return {"node": node, "l1": l1, "l3": l3}


def order(cs: list[Candidate]) -> list[tuple[int, int, bool]]:
    """(step, level, tried) of each candidate, in order."""
    return [(c.step, c.level, not c.refused) for c in cs]


def test_nothing_saved_is_an_empty_order() -> None:
    assert candidates([view("a", [], []), view("b", [], [])], ROOTS) == []


def test_level_1_comes_before_level_3_for_the_same_step() -> None:
    views = [view("a", [5], [5]), view("b", [5], [5])]
    got = candidates(views, ROOTS)
    assert got == [
        Candidate(5, 1, L1 / step_dir_name(5)),
        Candidate(5, 3, L3 / step_dir_name(5)),
    ]
    step, level, path, refused = got[0]  # a tuple: (step, level, path) and why not
    assert (step, level, path, refused) == (5, 1, L1 / step_dir_name(5), "")


def test_newest_step_first_whichever_level_holds_it() -> None:
    views = [view("a", [3, 7], [2, 5]), view("b", [3, 7], [2, 5])]
    assert order(candidates(views, ROOTS)) == [
        (7, 1, True),
        (5, 1, False),  # flushed only: no rank has it on level 1
        (5, 3, True),
        (3, 1, True),
        (2, 1, False),
        (2, 3, True),
    ]


def test_a_level_1_copy_some_ranks_lack_is_tried_it_may_be_rebuilt() -> None:
    """Node b lost its level-1 copy of step 8: the ranks try it anyway (the load and the
    rebuild from the save's redundancy find out whether it can be made whole)."""
    views = [view("a", [8], []), view("b", [], []), view("c", [8], [])]
    [c] = candidates(views, ROOTS)
    assert (c.step, c.level, c.refused) == (8, 1, "")


def test_a_level_3_copy_some_ranks_cannot_see_is_refused_with_the_nodes() -> None:
    """Level 3 has no redundancy: a step some rank does not see there cannot be made whole."""
    views = [view("a", [], [4]), view("b", [], []), view("c", [], [4])]
    got = candidates(views, ROOTS)
    assert order(got) == [(4, 1, False), (4, 3, False)]
    assert got[0].refused == "no committed copy on node(s) a, b, c (ranks 0, 1, 2)"
    assert got[1].refused == "no committed copy on node(s) b (ranks 1)"


def test_a_step_never_flushed_is_no_level_3_candidate() -> None:
    views = [view("a", [6], []), view("b", [6], [])]
    assert order(candidates(views, ROOTS)) == [(6, 1, True)]


def test_a_missing_level_is_skipped() -> None:
    views = [view("a", [], [9]), view("b", [], [9])]
    assert candidates(views, {1: None, 3: L3}) == [Candidate(9, 3, L3 / step_dir_name(9))]
    views = [view("a", [9], []), view("b", [9], [])]
    assert candidates(views, {1: L1, 3: None}) == [Candidate(9, 1, L1 / step_dir_name(9))]


def test_every_rank_computes_the_same_order() -> None:
    """The order depends on the gathered views only (the same on every rank), not on which
    rank asks: rank-local roots only change the paths."""
    views = [view("a", [1, 4], [1]), view("b", [4], [1]), view("c", [1], [1])]
    a = candidates(views, {1: Path("/local/a"), 3: L3})
    b = candidates(views, {1: Path("/local/b"), 3: L3})
    assert order(a) == order(b) == [(4, 1, True), (1, 1, True), (1, 3, True)]
