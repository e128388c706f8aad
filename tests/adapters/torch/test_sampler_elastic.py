"""``ResumableSampler`` across a change of world size, in one process (every rank's sampler built
with its ``rank``/``num_replicas``): a position saved at N ranks continues at M with every
sample of the epoch seen exactly once across the two stretches (plus only the end-of-epoch
padding), positions that cannot be continued are refused, per-rank positions of earlier
versions still load. The same under ``torchrun`` with real DDP/FSDP2 jobs:
``test_torch_elastic.py``."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from ckptfmt_torch import ResumableSampler  # noqa: E402

from ckptfmt.errors import CkptError, DataPositionError, UsageError  # noqa: E402

pytestmark = pytest.mark.torch


def job(length: int, world: int, **kw: object) -> list[ResumableSampler]:
    return [ResumableSampler(length, num_replicas=world, rank=r, **kw) for r in range(world)]


def take(samplers: list[ResumableSampler], batch: int, steps: int | None) -> list[int]:
    """``steps`` lock-step batches of ``batch`` per rank (None: to the epoch's end) through a
    DataLoader each, as DDP does; the indices every rank saw."""
    seen: list[int] = []
    iters = [
        iter(torch.utils.data.DataLoader(torch.arange(10_000), batch_size=batch, sampler=s))
        for s in samplers
    ]
    done = 0
    while steps is None or done < steps:
        got = [next(it, None) for it in iters]
        if any(g is None for g in got):
            assert all(g is None for g in got)  # every rank runs out at the same step
            break
        for g in got:
            seen += g.tolist()
        done += 1
    return seen


def padding(length: int, consumed: int, world: int) -> int:
    rest = length - consumed
    return -rest % world


@settings(max_examples=120, deadline=None)
@given(
    length=st.integers(1, 60),
    worlds=st.lists(st.integers(1, 5), min_size=2, max_size=4),
    batch=st.integers(1, 3),
    steps=st.lists(st.integers(0, 6), min_size=3, max_size=3),
    shuffle=st.booleans(),
)
def test_every_sample_once_across_world_sizes(
    length: int, worlds: list[int], batch: int, steps: list[int], shuffle: bool
) -> None:
    """A chain of stretches at changing world sizes, each saving its position as JSON and the
    next loading it: the indices over the epoch are the dataset once, plus only the padding of
    the last stretch (``drop_last=False``), and in the global order itself."""
    seen: list[int] = []
    state = None
    pad = 0
    for i, world in enumerate(worlds):
        samplers = job(length, world, shuffle=shuffle, seed=5)
        if state is not None:
            for s in samplers:
                s.load_state_dict(json.loads(state))
        last = i == len(worlds) - 1
        before = samplers[0].consumed
        seen += take(samplers, batch, None if last else steps[i % len(steps)])
        if before < length and (samplers[0].epoch != 0 or samplers[0].consumed >= length):
            pad = padding(length, before, world)  # this stretch reached the epoch's end
        if samplers[0].epoch != 0:
            break
        states = {json.dumps(s.state_dict()) for s in samplers}
        assert len(states) == 1  # the same global position on every rank
        state = states.pop()
    counts = Counter(seen)
    assert set(counts) == set(range(length))
    assert sum(counts.values()) == length + pad
    assert sum(c - 1 for c in counts.values()) == pad


@pytest.mark.parametrize(("n", "m"), [(2, 3), (4, 2), (3, 2), (1, 4)])
def test_global_order_continues(n: int, m: int) -> None:
    """37 samples, per-rank batch 2: 3 steps at N ranks, the rest at M. Read in global order
    (step by step, rank by rank), the indices are the epoch's permutation, then the padding."""
    first = job(37, n, seed=9)
    order = first[0].global_order()
    got = take(first, 2, 3)
    per_step = [got[i : i + 2 * n] for i in range(0, len(got), 2 * n)]
    flat = [x for s in per_step for j in range(2) for x in s[j::2]]  # rank-major -> global
    assert flat == order[: 6 * n]
    second = job(37, m, seed=9)
    for s in second:
        s.load_state_dict(json.loads(json.dumps(first[0].state_dict())))
    assert second[0].state_dict()["consumed"] == 6 * n
    rest = [s.order() for s in second]
    glob = [rest[r][k] for k in range(len(rest[0])) for r in range(m)]
    assert glob[: 37 - 6 * n] == order[6 * n :]
    assert glob[37 - 6 * n :] == order[: len(glob) - (37 - 6 * n)]  # the padding


def test_positions_that_cannot_be_continued_are_refused() -> None:
    s = job(37, 2, seed=9)[0]
    take([s, job(37, 2, seed=9)[1]], 2, 3)
    saved = s.state_dict()
    cases = [
        (ResumableSampler(38, num_replicas=3, rank=0, seed=9), "length=37"),
        (ResumableSampler(37, num_replicas=3, rank=0, seed=8), "seed=9"),
        (ResumableSampler(37, num_replicas=3, rank=0, seed=9, shuffle=False), "shuffle=True"),
        # 12 consumed, aligned batches of 3 x 3 = 9 asked for
        (ResumableSampler(37, num_replicas=3, rank=0, seed=9, batch_size=3), "multiple of"),
    ]
    for fresh, words in cases:
        before = fresh.state_dict()
        with pytest.raises(DataPositionError, match=words) as info:
            fresh.load_state_dict(saved)
        assert isinstance(info.value, CkptError) and isinstance(info.value, UsageError)
        assert fresh.state_dict() == before  # untouched
    with pytest.raises(DataPositionError, match="outside an epoch"):
        ResumableSampler(37, seed=9).load_state_dict({**saved, "consumed": 60})
    with pytest.raises(UsageError, match="not a position"):
        ResumableSampler(37, seed=9).load_state_dict({**saved, "consumed": "12"})
    # aligned and honoured: 12 is a multiple of 3 ranks x batch 2 and of 2 x 2 (and 4 x 3)
    for world, batch in [(3, 2), (2, 2), (4, 3)]:
        ok = ResumableSampler(37, num_replicas=world, rank=0, seed=9, batch_size=batch)
        ok.load_state_dict(saved)
        assert ok.consumed == 12


def test_per_rank_positions_of_earlier_versions_load_at_their_world_size() -> None:
    """``{"epoch", "index"}`` (saved per rank before positions were global): at the same world
    size the rank goes on exactly where it was, and its state is then the global one."""
    ref = job(37, 3, seed=4)
    head = take(ref, 2, 2)
    tail = take(ref, 2, None)
    again = job(37, 3, seed=4)
    for s in again:
        s.load_state_dict({"epoch": 0, "index": 4})
    assert again[0].state_dict()["consumed"] == 12
    assert take(again, 2, None) == tail
    assert len(head) == 12
    with pytest.raises(UsageError, match="not a position"):
        again[0].load_state_dict({"epoch": 0, "index": 99})


@pytest.mark.parametrize("world", [2, 3, 4])
def test_same_world_size_resumes_exactly(world: int) -> None:
    """At the world size that saved, the restored job takes exactly the indices of the
    uninterrupted one, the end-of-epoch padding included (37 is no multiple of 2, 3 or 4)."""
    full = take(job(37, world, seed=1), 2, None)
    for cut in range(1 + -(-37 // world) // 2):
        first = job(37, world, seed=1)
        head = take(first, 2, cut)
        again = job(37, world, seed=1)
        for s in again:
            s.load_state_dict(json.loads(json.dumps(first[0].state_dict())))
        assert head + take(again, 2, None) == full, cut
