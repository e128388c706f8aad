"""Read planning for another layout (``ckptfmt.plan``), in process, with hypothesis.

``plan_reads(layout, box)``: for random shapes (0-d, empty, edge chunks), grids, region layouts
(random guillotine partitions of the shard grid, and the plans of uneven FSDP-like splits) and
wanted boxes (random ones, and partitions of the tensor among the ranks of another job), every
wanted element is covered by exactly one piece, no piece lies outside the box, every piece is
part of a chunk that intersects the box (nothing needless is read), and each piece names the
right file, cell, writer and index slot. The checks recompute the geometry independently of
``ckptfmt.plan`` (numpy's ravel_multi_index, itertools over the grid), and the data check
fills a destination from simulated chunks (padded as on disk) and compares it with the source.

``route(...)``: executed in memory by simulated ranks (reads, broadcasts and sends), every rank
ends up with exactly its box, each element delivered once; a rank reads only files its directory
holds, only chunks that it or a rank that cannot open the file needs (or, broadcast, chunks
every rank needs), and no chunk twice; files nobody can open are reported.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptfmt.errors import PerRankError, UsageError
from ckptfmt.plan.ownership import Holding, make_plan
from ckptfmt.plan.per_rank import resolve, sources
from ckptfmt.plan.reads import Layout, SavedRegion, plan_reads
from ckptfmt.plan.route import route

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --- strategies ----------------------------------------------------------------------------------


@st.composite
def grids(draw: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(shape, shard_shape, chunk_shape): 0 to 3 axes, extents 0..9 (0 now and then)."""
    nd = draw(st.integers(0, 3))
    shape = tuple(draw(st.integers(0, 9) | st.integers(1, 9)) for _ in range(nd))
    chunk = tuple(draw(st.integers(1, 4)) for _ in range(nd))
    shard = tuple(c * draw(st.integers(1, 3)) for c in chunk)
    return shape, shard, chunk


def _guillotine(draw: Any, lo: list[int], hi: list[int], writers: int, depth: int) -> list[Any]:
    """A random partition of the cell box [lo, hi) into boxes, each with a writer."""
    axes = [a for a in range(len(lo)) if hi[a] - lo[a] > 1]
    if depth == 0 or not axes or draw(st.booleans()):
        return [(tuple(lo), tuple(hi), draw(st.integers(0, writers - 1)))]
    a = draw(st.sampled_from(axes))
    cut = draw(st.integers(lo[a] + 1, hi[a] - 1))
    left_hi, right_lo = list(hi), list(lo)
    left_hi[a], right_lo[a] = cut, cut
    return _guillotine(draw, lo, left_hi, writers, depth - 1) + _guillotine(
        draw, right_lo, hi, writers, depth - 1
    )


@st.composite
def layouts(draw: Any) -> Layout:
    """A stored tensor: a grid and a random partition of its cells into writer regions."""
    shape, shard, chunk = draw(grids())
    writers = draw(st.integers(1, 5))
    if not shape:
        return Layout((), (), (), (SavedRegion((), (), draw(st.integers(0, writers - 1)), 1),))
    if math.prod(shape) == 0:
        return Layout(shape, shard, chunk, ())
    grid = [cdiv(s, h) for s, h in zip(shape, shard)]
    regions = []
    for lo, hi, w in _guillotine(draw, [0] * len(grid), grid, writers, 6):
        off = tuple(a * h for a, h in zip(lo, shard))
        end = tuple(min(b * h, s) for b, h, s in zip(hi, shard, shape))
        n_files = math.prod(b - a for a, b in zip(lo, hi))
        regions.append(SavedRegion(off, tuple(e - o for o, e in zip(off, end)), w, n_files))
    order = draw(st.permutations(range(len(regions))))  # manifest order is any order
    return Layout(shape, shard, chunk, tuple(regions[i] for i in order))


def split(n: int, counts: list[int]) -> list[tuple[int, int]]:
    """``(start, count)`` for consecutive parts of ``n`` with the given relative sizes (all of
    ``n`` to the last part if every size is 0)."""
    if not any(counts):
        counts = [*counts[:-1], 1]
    total = sum(counts)
    bounds = [round(n * sum(counts[:i]) / total) for i in range(len(counts) + 1)]
    return [(a, b - a) for a, b in itertools.pairwise(bounds)]


@st.composite
def fsdp_layouts(draw: Any) -> Layout:
    """The plan ckptfmt's writer makes for a tensor held in uneven row blocks (FSDP), with
    tiny size targets so that grids are small."""
    rows = draw(st.integers(1, 13))
    rest = tuple(draw(st.lists(st.integers(1, 5), max_size=2)))
    shape = (rows, *rest)
    n = draw(st.integers(1, 5))
    parts = split(rows, draw(st.lists(st.integers(0, 4), min_size=n, max_size=n)))
    decl = [
        [Holding(("t",), "float32", shape, ((s, *(0,) * len(rest)), (c, *rest)))] for s, c in parts
    ]
    item = 4
    plan = make_plan(decl, chunk_bytes=item * draw(st.integers(1, 8)), shard_bytes=item * 24)
    t = plan.tensors[0]
    regions = tuple(
        SavedRegion(
            r.offset,
            r.shape,
            r.writer,
            math.prod(cdiv(s, h) for s, h in zip(r.shape, t.shard_shape)),
        )
        for r in t.regions
    )
    return Layout(t.shape, t.shard_shape, t.chunk_shape, regions)


@st.composite
def boxes(draw: Any, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    lo, ext = [], []
    for s in shape:
        a = draw(st.integers(0, s))
        b = draw(st.integers(a, s))
        lo.append(a)
        ext.append(b - a)
    return tuple(lo), tuple(ext)


@st.composite
def partitions(draw: Any, shape: tuple[int, ...]) -> list[Any]:
    """The boxes of ``m`` ranks of another job: uneven blocks along one axis, some empty."""
    m = draw(st.integers(1, 5))
    if not shape:
        return [((), ())] * m
    axis = draw(st.integers(0, len(shape) - 1))
    out = []
    for start, count in split(
        shape[axis], draw(st.lists(st.integers(0, 4), min_size=m, max_size=m))
    ):
        lo = [0] * len(shape)
        ext = list(shape)
        lo[axis], ext[axis] = start, count
        out.append((tuple(lo), tuple(ext)))
    return out


# --- the checks ----------------------------------------------------------------------------------


def source(shape: tuple[int, ...]) -> np.ndarray:
    """Distinct non-zero values: a misplaced or missing element shows."""
    return np.arange(1, math.prod(shape) + 1, dtype=np.int64).reshape(shape)


def stored_chunk(g: np.ndarray, chunk_lo: tuple[int, ...], chunk: tuple[int, ...]) -> np.ndarray:
    """The chunk as stored: the array's elements, zero past its edge."""
    out = np.zeros(chunk, dtype=g.dtype)
    hi = tuple(min(a + c, s) for a, c, s in zip(chunk_lo, chunk, g.shape))
    out[tuple(slice(0, b - a) for a, b in zip(chunk_lo, hi))] = g[
        tuple(slice(a, b) for a, b in zip(chunk_lo, hi))
    ]
    return out


def check_geometry(layout: Layout, box: Any, reads: Any) -> None:
    """Each read names the file, cell, writer and slots that hold its pieces (recomputed)."""
    shard, chunk, shape = layout.shard_shape, layout.chunk_shape, layout.shape
    keys = [fr.key for fr in reads]
    assert len(set(keys)) == len(keys), "a file planned twice"
    assert keys == sorted(keys), "files not in manifest order"
    for fr in reads:
        reg = layout.regions[fr.region]
        assert fr.writer == reg.rank
        cells = list(
            itertools.product(
                *(range(o // h, cdiv(o + n, h)) for o, n, h in zip(reg.offset, reg.shape, shard))
            )
        )
        assert len(cells) == reg.n_files
        assert cells[fr.file] == fr.cell
        per = tuple(h // c for h, c in zip(shard, chunk))
        origin = tuple(i * h for i, h in zip(fr.cell, shard))
        present = sum(
            1
            for inner in itertools.product(*(range(p) for p in per))
            if all(o + i * c < s for o, i, c, s in zip(origin, inner, chunk, shape))
        )
        assert fr.n_present == present
        slots = [p.slot for p in fr.pieces]
        assert slots == sorted(set(slots)), "slots not ascending or repeated"
        assert fr.slots == tuple(slots), "slots (made without pieces) differ from the pieces'"
        check_rows_into(fr, box, chunk)
        for p in fr.pieces:
            inner = tuple((a - o) // c for a, o, c in zip(p.chunk_lo, origin, chunk))
            assert all((a - o) % c == 0 for a, o, c in zip(p.chunk_lo, origin, chunk))
            assert all(0 <= i < q for i, q in zip(inner, per)), "chunk outside its shard"
            want_slot = int(np.ravel_multi_index(inner, per)) if per else 0
            assert p.slot == want_slot
            assert all(n > 0 for n in p.shape), "an empty piece (a needless read)"
            assert all(
                c <= a and a + n <= c + k for a, n, c, k in zip(p.lo, p.shape, p.chunk_lo, chunk)
            ), "piece outside its chunk"
            assert all(
                o <= a and a + n <= o + e for a, n, o, e in zip(p.lo, p.shape, box[0], box[1])
            ), "piece outside the wanted box"


def check_rows_into(fr: Any, box: Any, chunk: tuple[int, ...]) -> None:
    """Where ``rows_into`` says the chunks go back to back in the box's array, each piece is a
    whole chunk and lies there (recomputed from the pieces); where it says no, some piece is
    not a whole chunk or the chunks are not the box's full rows."""
    first = fr.rows_into(box[0], box[1])
    n = math.prod(chunk)
    full_rows = box[1] and tuple(chunk[1:]) == tuple(box[1][1:])
    fits = full_rows and all(
        p.shape == tuple(chunk) and p.lo[1:] == tuple(box[0][1:]) for p in fr.pieces
    )
    assert (first is not None) == bool(fits and fr.pieces)
    if first is None:
        return
    for k, p in enumerate(fr.pieces):
        at = int(np.ravel_multi_index([a - o for a, o in zip(p.lo, box[0])], box[1]))
        assert at == first + k * n, "a chunk not where rows_into puts it"


def test_rows_into_row_blocks_of_another_split() -> None:
    """A rank of 2 reading the 4-rank row blocks of a 976 x 8 tensor: each file's chunks are
    whole rows of its box, back to back; a box narrower than the chunks or a cut chunk is not."""
    layout = Layout(
        (976, 8),
        (244, 8),
        (4, 8),
        tuple(SavedRegion((244 * r, 0), (244, 8), r, 1) for r in range(4)),
    )
    a, b = plan_reads(layout, ((0, 0), (488, 8)))
    assert a.rows_into((0, 0), (488, 8)) == 0 and b.rows_into((0, 0), (488, 8)) == 244 * 8
    assert a.slots == tuple(range(61))
    (c,) = plan_reads(layout, ((2, 0), (100, 8)))  # starts inside a chunk
    assert c.rows_into((2, 0), (100, 8)) is None
    (d,) = plan_reads(layout, ((0, 0), (4, 4)))  # half the width
    assert d.rows_into((0, 0), (4, 4)) is None


def fill(layout: Layout, box: Any, reads: Any, g: np.ndarray) -> np.ndarray:
    """Execute the plan on simulated chunks; check coverage (each element once)."""
    out = np.zeros(box[1], dtype=g.dtype)
    hits = np.zeros(box[1], dtype=np.int64)
    for fr in reads:
        for p in fr.pieces:
            c = stored_chunk(g, p.chunk_lo, layout.chunk_shape)
            out[p.dst(box[0])] = c[p.src()]
            hits[p.dst(box[0])] += 1
    assert (hits == 1).all(), "an element covered twice or never"
    return out


def expect(g: np.ndarray, box: Any) -> np.ndarray:
    return g[tuple(slice(o, o + n) for o, n in zip(*box))] if g.ndim else g


@SETTINGS
@given(st.data())
def test_every_wanted_element_is_read_exactly_once(data: st.DataObject) -> None:
    layout = data.draw(layouts() | fsdp_layouts())
    box = data.draw(boxes(layout.shape))
    reads = plan_reads(layout, box)
    check_geometry(layout, box, reads)
    g = source(layout.shape)
    assert np.array_equal(fill(layout, box, reads, g), expect(g, box))


@SETTINGS
@given(st.data())
def test_a_partition_among_new_ranks_reads_every_chunk_it_needs(data: st.DataObject) -> None:
    """M ranks of another job, each wanting its block: together they cover the tensor once, and
    the chunks read are exactly those that intersect some rank's block."""
    layout = data.draw(layouts() | fsdp_layouts())
    parts = data.draw(partitions(layout.shape))
    g = source(layout.shape)
    total = Counter[tuple[Any, ...]]()
    for box in parts:
        reads = plan_reads(layout, box)
        check_geometry(layout, box, reads)
        assert np.array_equal(fill(layout, box, reads, g), expect(g, box))
        for fr in reads:
            total.update((fr.key, p.slot) for p in fr.pieces)
    present = sum(
        layout.present_slots(c)
        for r in layout.regions
        for c in itertools.product(
            *(
                range(o // h, cdiv(o + n, h))
                for o, n, h in zip(r.offset, r.shape, layout.shard_shape)
            )
        )
    )
    assert len(total) == (present if layout.regions else 0), "a chunk nobody reads"


def test_zero_d_and_empty_tensors() -> None:
    zero_d = Layout((), (), (), (SavedRegion((), (), 2, 1),))
    (fr,) = plan_reads(zero_d, ((), ()))
    assert (fr.region, fr.file, fr.cell, fr.writer, fr.slots, fr.whole) == (0, 0, (), 2, (0,), True)
    empty = Layout((0, 5), (1, 5), (1, 5), ())
    assert plan_reads(empty, ((0, 0), (0, 5))) == ()
    some = Layout((4, 5), (2, 5), (1, 5), (SavedRegion((0, 0), (4, 5), 0, 2),))
    assert plan_reads(some, ((1, 0), (0, 5))) == ()  # a rank that holds no rows reads nothing


@pytest.mark.parametrize(
    "box", [((0,), (5,)), ((-1,), (2,)), ((3,), (2,)), ((0, 0), (1, 1)), ((0,), (-1,))]
)
def test_a_box_outside_the_tensor_is_a_usage_error(box: Any) -> None:
    layout = Layout((4,), (2,), (1,), (SavedRegion((0,), (4,), 0, 2),))
    with pytest.raises(UsageError):
        plan_reads(layout, box)


def test_whole_files_and_partial_files() -> None:
    """A box that touches every chunk of a shard reads the file whole (its data CRC is then
    checked); a chunk the box cuts is read whole and only part of it used."""
    layout = Layout((8, 6), (4, 6), (2, 6), (SavedRegion((0, 0), (8, 6), 0, 2),))
    (a, b) = plan_reads(layout, ((0, 0), (7, 6)))
    assert a.whole and a.slots == (0, 1)
    assert b.whole and b.slots == (0, 1) and b.pieces[1].shape == (1, 6)
    (part,) = plan_reads(layout, ((0, 0), (2, 6)))
    assert not part.whole and part.slots == (0,)
    (c,) = plan_reads(layout, ((5, 2), (1, 3)))
    assert c.slots == (0,) and c.pieces[0].lo == (5, 2) and c.pieces[0].chunk_lo == (4, 0)


# --- routing -------------------------------------------------------------------------------------


def simulate(
    layout: Layout,
    wants: list[Any],
    sees: list[set[int]],
    g: np.ndarray,
    same_size: bool = False,
    broadcast: bool = False,
    share: list[int] | None = None,
) -> Any:
    """Run a route in memory: reads from simulated chunks, broadcasts, sends."""
    itemsize = 8
    nb = math.prod(layout.chunk_shape) * itemsize
    load = [0] * len(wants)
    r = route(layout, wants, sees, load, nb, same_size, broadcast, share)
    outs = [np.zeros(w[1], dtype=g.dtype) for w in wants]
    hits = [np.zeros(w[1], dtype=np.int64) for w in wants]
    reads_by_rank: Counter[tuple[int, Any, int]] = Counter()
    for t in r.tasks:
        assert t.file.writer in sees[t.reader], "a rank reads a file its directory lacks"
        chunks = {}
        for s in t.slots:
            reads_by_rank[(t.reader, t.file.key, s)] += 1
        # the chunk contents by slot, from any rank's plan of this file (or the task's own)
        for fr in [*r.reads[t.reader], *(x for rs in r.reads for x in rs)]:
            if fr.key == t.file.key:
                for p in fr.pieces:
                    chunks[p.slot] = stored_chunk(g, p.chunk_lo, layout.chunk_shape)
        assert set(t.slots) <= set(chunks)
        needed: set[int] = set(t.own.slots if t.own else ())
        for dl in t.deliveries:
            if t.file.writer in sees[dl.dest]:  # only a replica on the reader's node
                assert share is not None and share[dl.dest] == share[t.reader], (
                    "sent to a rank that can read it itself"
                )
                assert t.own is not None and (dl.read.lo, dl.read.hi) == (t.own.lo, t.own.hi)
            needed |= {p.slot for p in dl.pieces}
            for p in dl.pieces:
                outs[dl.dest][p.dst(wants[dl.dest][0])] = chunks[p.slot][p.src()]
                hits[dl.dest][p.dst(wants[dl.dest][0])] += 1
        if t.bcast:
            assert len(t.slots) == t.file.n_present and not t.deliveries
            for d, rs in enumerate(r.reads):
                (fr,) = [x for x in rs if x.key == t.file.key]
                assert fr.whole, "broadcast to a rank that needs only part of the file"
                for p in fr.pieces:
                    outs[d][p.dst(wants[d][0])] = chunks[p.slot][p.src()]
                    hits[d][p.dst(wants[d][0])] += 1
        else:
            assert set(t.slots) == needed, "a chunk read that nobody needs"
            if t.own:
                assert t.own == next(x for x in r.reads[t.reader] if x.key == t.file.key)
                for p in t.own.pieces:
                    outs[t.reader][p.dst(wants[t.reader][0])] = chunks[p.slot][p.src()]
                    hits[t.reader][p.dst(wants[t.reader][0])] += 1
    assert max(reads_by_rank.values(), default=1) == 1, "a rank reads one chunk twice"
    return r, outs, hits


@SETTINGS
@given(st.data())
def test_route_delivers_each_rank_its_box_once(data: st.DataObject) -> None:
    layout = data.draw(layouts() | fsdp_layouts())
    kind = data.draw(st.sampled_from(["partition", "random", "replicated"]))
    if kind == "partition":
        wants = data.draw(partitions(layout.shape))
    elif kind == "random":
        wants = data.draw(st.lists(boxes(layout.shape), min_size=1, max_size=5))
    else:
        wants = [((0,) * len(layout.shape), layout.shape)] * data.draw(st.integers(1, 5))
    writers = sorted({r.rank for r in layout.regions})
    sees = [
        set(data.draw(st.lists(st.sampled_from(writers), unique=True))) if writers else set()
        for _ in wants
    ]
    if data.draw(st.booleans()):  # level 3: every rank sees every file
        sees = [set(writers) for _ in wants]
    g = source(layout.shape)
    broadcast = data.draw(st.booleans())
    nodes = data.draw(st.integers(1, 3))
    share = [d % nodes for d in range(len(wants))] if data.draw(st.booleans()) else None
    same_size = data.draw(st.booleans())
    r, outs, hits = simulate(layout, wants, sees, g, same_size, broadcast, share)
    if not broadcast:  # a rank that can open a file reads what it needs of it itself, or
        # (share) one replica on its node reads it for all of them, once
        assert not any(t.bcast for t in r.tasks)
        readers = {(t.reader, t.file.key) for t in r.tasks if t.own is not None}
        served = {(dl.dest, t.file.key): t.reader for t in r.tasks for dl in t.deliveries}
        for d, rs in enumerate(r.reads):
            for fr in rs:
                if fr.writer not in sees[d]:
                    continue
                if share is None:
                    assert (d, fr.key) in readers, "a rank that can open a file did not read it"
                else:
                    assert ((d, fr.key) in readers) != ((d, fr.key) in served), (d, fr.key)
                    twins = [
                        e
                        for e, es in enumerate(r.reads)
                        if share[e] == share[d] and fr.writer in sees[e]
                        for x in es
                        if x.key == fr.key and (x.lo, x.hi) == (fr.lo, fr.hi)
                    ]
                    reading = [e for e in twins if (e, fr.key) in readers]
                    assert len(reading) == 1, "replicas of one node: not read once there"
    needed = {fr.writer for rs in r.reads for fr in rs}
    visible = set().union(*sees)
    assert set(r.unseen) == needed - visible
    if not r.unseen:
        for d, w in enumerate(wants):
            assert (hits[d] == 1).all(), f"rank {d}: an element delivered twice or never"
            assert np.array_equal(outs[d], expect(g, w))
    for h in hits:
        assert h.max(initial=0) <= 1


def test_replicas_at_level3_read_each_file_once_and_broadcast() -> None:
    layout = Layout(
        (8, 3), (2, 3), (1, 3), tuple(SavedRegion((2 * i, 0), (2, 3), i, 1) for i in range(4))
    )
    whole = ((0, 0), (8, 3))
    r = route(layout, [whole, whole], [{0, 1, 2, 3}] * 2, [0, 0], 24, broadcast=True)
    assert all(t.bcast and t.whole for t in r.tasks)
    assert [t.reader for t in r.tasks] == [0, 1, 0, 1]  # the least loaded, in file order


def test_replicas_read_for_themselves_by_default() -> None:
    """Without broadcast every rank that can open a file reads it itself (no bytes over the
    communicator); a rank that cannot is sent its pieces by one that can."""
    layout = Layout(
        (8, 3), (2, 3), (1, 3), tuple(SavedRegion((2 * i, 0), (2, 3), i, 1) for i in range(4))
    )
    whole = ((0, 0), (8, 3))
    r = route(layout, [whole] * 3, [{0, 1, 2, 3}] * 3, [0] * 3, 24)
    assert not r.messages() and sorted((t.file.key, t.reader) for t in r.tasks) == [
        ((f, 0), d) for f in range(4) for d in range(3)
    ]
    r = route(layout, [whole] * 3, [{0, 1}, {0, 1}, {2, 3}], [0] * 3, 24)
    # ranks 0 and 1 see the files of writers 0 and 1, rank 2 those of 2 and 3: each file goes
    # to the ranks that cannot open it from one that can (the least loaded; ties: the lowest)
    sent = [(s, d, len(items)) for s, d, items in r.messages()]
    assert sent == [(0, 2, 2), (2, 0, 2), (2, 1, 2)]
    assert not any(t.bcast for t in r.tasks)


def test_a_job_of_another_size_spreads_its_reads_over_all_ranks() -> None:
    """2 writers, 4 current ranks, replicas: the reading is not left to ranks 0 and 1; at
    the saved size the writers read their own files (as the save's plan spread them)."""
    regions = tuple(SavedRegion((4 * i, 0), (4, 3), i // 2, 2) for i in range(4))
    layout = Layout((16, 3), (2, 3), (1, 3), regions)
    whole = ((0, 0), (16, 3))
    r = route(layout, [whole] * 4, [{0, 1}] * 4, [0] * 4, 24, broadcast=True)
    assert sorted(t.reader for t in r.tasks) == [0, 0, 1, 1, 2, 2, 3, 3]
    r = route(layout, [whole] * 2, [{0, 1}] * 2, [0] * 2, 24, same_size=True, broadcast=True)
    assert [(t.file.writer, t.reader) for t in r.tasks] == [
        (w, w) for w in (0, 0, 0, 0, 1, 1, 1, 1)
    ]


def test_level1_reads_stay_on_the_node_and_are_sent_across() -> None:
    """4 saved ranks on nodes a, a, b, b; 2 current ranks: rank 0 on a, rank 1 on b. Rank 0
    wants rows 0..5 (parts of the files of writers 0, 1, 2), rank 1 rows 5..8."""
    layout = Layout(
        (8, 3), (2, 3), (1, 3), tuple(SavedRegion((2 * i, 0), (2, 3), i, 1) for i in range(4))
    )
    sees = [{0, 1}, {2, 3}]
    r = route(layout, [((0, 0), (5, 3)), ((5, 0), (3, 3))], sees, [0, 0], 24)
    for t in r.tasks:
        assert t.file.writer in sees[t.reader]
    (sent,) = [t for t in r.tasks if t.deliveries]
    assert (sent.reader, sent.file.writer, sent.deliveries[0].dest) == (1, 2, 0)
    assert sent.slots == (0, 1) and sent.deliveries[0].pieces[0].lo == (4, 0)
    assert [(s, d) for s, d, _ in r.messages()] == [(1, 0)]


def test_files_no_rank_sees_are_reported() -> None:
    layout = Layout(
        (4,), (2,), (1,), (SavedRegion((0,), (2,), 0, 1), SavedRegion((2,), (2,), 1, 1))
    )
    r = route(layout, [((0,), (4,))], [{0}], [0], 8)
    assert r.unseen == (1,)


# --- per-rank rules ------------------------------------------------------------------------------


def test_per_rank_sources() -> None:
    assert sources(4, 4, None) == (0, 1, 2, 3)
    assert sources(4, 2, None) == (None, None)
    assert sources(4, 2, "identity") == (0, 1)
    assert sources(2, 4, "identity") == (0, 1, None, None)
    assert sources(4, 2, {3: 0, 1: 1}) == (3, 1)
    for bad in ({0: 0, 1: 0}, {4: 0}, {0: 2}, {-1: 0}, "reverse", {True: 0}):
        with pytest.raises(UsageError):
            sources(4, 2, bad)  # type: ignore[arg-type]


def test_per_rank_entries_are_never_dropped_silently() -> None:
    assert resolve([], 4, 2, None).warning is None  # nothing per-rank: nothing to say
    assert resolve(["rng"], 4, 4, None).warning is None
    with pytest.raises(PerRankError) as exc:
        resolve(["rng", "loader/pos"], 4, 2, None)
    assert exc.value.entries == ("rng", "loader/pos")
    assert exc.value.dropped == (0, 1, 2, 3) and exc.value.missing == (0, 1)
    assert "rng" in str(exc.value) and "loader/pos" in str(exc.value)
    with pytest.raises(PerRankError) as exc:
        resolve(["rng"], 4, 2, "identity")
    assert exc.value.dropped == (2, 3) and exc.value.missing == ()
    res = resolve(["rng"], 4, 2, "identity", "drop")
    assert res.sources == (0, 1)
    assert res.warning is not None and "rng" in res.warning and "2, 3" in res.warning
    res = resolve(["rng"], 2, 4, "identity", "drop")
    assert res.sources == (0, 1, None, None)
    assert res.warning is not None and "current rank(s) 2, 3 get none" in res.warning
    with pytest.raises(UsageError):
        resolve(["rng"], 4, 4, None, "ignore")
