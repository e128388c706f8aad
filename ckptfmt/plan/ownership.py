"""Who writes what: the deterministic ownership plan of a parallel save (a pure function).

Every rank declares what it holds of each tensor: the whole tensor (a data-parallel replica) or a
region (global offset and shape, as FSDP or tensor parallelism produce). :func:`make_plan` turns
all ranks' declarations into the same plan on every rank:

* Tensors some rank holds whole are deduplicated and cut on the default shard grid; their shard
  cells are spread over the holders so that every rank writes its even share to within one shard.
  When every rank holds every such tensor (plain data parallelism) the cells are cut into
  contiguous runs by cumulative bytes (the linear partition: a cell goes to the rank whose share
  its midpoint falls in), so each rank writes few, large regions; otherwise each cell, largest
  first, goes to the least-loaded holder.
* Tensors held only in regions get a shard grid whose lines include every holder boundary (the
  shard extent on each axis divides the gcd of the boundaries), so each shard lies inside one
  holder's region and that holder writes it (the least loaded, when regions are replicated).

The plan is recorded in the manifest: each region with its writer rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ckptfmt.dtypes import by_name
from ckptfmt.errors import UsageError
from ckptfmt.manifest.grid import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_SHARD_BYTES,
    cells,
    choose_grid,
    grid_shape,
)
from ckptfmt.manifest.limits import MAX_CHUNK_BYTES, MAX_CHUNKS_PER_SHARD

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape)


@dataclass(frozen=True)
class Holding:
    """What one rank holds of one tensor: ``region`` is None for the whole tensor."""

    name: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    region: Box | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": list(self.name),
            "dtype": self.dtype,
            "shape": list(self.shape),
        }
        if self.region is not None:
            out["offset"], out["region_shape"] = list(self.region[0]), list(self.region[1])
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Holding:
        region = None
        if "offset" in d:
            region = (tuple(d["offset"]), tuple(d["region_shape"]))
        return cls(tuple(d["name"]), d["dtype"], tuple(d["shape"]), region)


@dataclass(frozen=True)
class PlannedRegion:
    """A grid-aligned box of a tensor and the rank that writes its shard files."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    writer: int


@dataclass(frozen=True)
class TensorPlan:
    name: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    shard_shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    regions: tuple[PlannedRegion, ...]


@dataclass(frozen=True)
class SavePlan:
    tensors: tuple[TensorPlan, ...]
    world_size: int

    def bytes_per_rank(self) -> list[int]:
        out = [0] * self.world_size
        for t in self.tensors:
            item = by_name(t.dtype).itemsize
            for r in t.regions:
                out[r.writer] += math.prod(r.shape) * item
        return out

    def for_rank(self, rank: int) -> list[tuple[TensorPlan, PlannedRegion]]:
        return [(t, r) for t in self.tensors for r in t.regions if r.writer == rank]


def make_plan(
    declarations: Sequence[Sequence[Holding]],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> SavePlan:
    """The plan for ``declarations[rank]`` = what that rank holds. Deterministic."""
    world = len(declarations)
    order: list[tuple[str, ...]] = []
    holders: dict[tuple[str, ...], list[tuple[int, Holding]]] = {}
    for rank, decl in enumerate(declarations):
        for h in decl:
            if h.name not in holders:
                holders[h.name] = []
                order.append(h.name)
            holders[h.name].append((rank, h))
    for name in order:
        first = holders[name][0][1]
        for rank, h in holders[name]:
            if (h.dtype, h.shape) != (first.dtype, first.shape):
                raise UsageError(
                    f"ranks disagree on tensor {'/'.join(name)!r}: rank {holders[name][0][0]} "
                    f"has {first.dtype}{list(first.shape)}, rank {rank} {h.dtype}{list(h.shape)}"
                )
    load = [0] * world
    replicated = [n for n in order if any(h.region is None for _, h in holders[n])]
    sharded = [n for n in order if n not in set(replicated)]
    plans: dict[tuple[str, ...], TensorPlan] = {}
    _plan_replicated(replicated, holders, world, load, chunk_bytes, shard_bytes, plans)
    for name in sharded:
        plans[name] = _plan_sharded(name, holders[name], load, chunk_bytes, shard_bytes)
    return SavePlan(tuple(plans[n] for n in order), world)


def _plan_replicated(
    names: list[tuple[str, ...]],
    holders: dict[tuple[str, ...], list[tuple[int, Holding]]],
    world: int,
    load: list[int],
    chunk_bytes: int,
    shard_bytes: int,
    plans: dict[tuple[str, ...], TensorPlan],
) -> None:
    grids = {}
    units: list[tuple[tuple[str, ...], tuple[int, ...], int, list[int]]] = []
    for name in names:
        h = holders[name][0][1]
        item = by_name(h.dtype).itemsize
        shard, chunk = choose_grid(h.shape, item, chunk_bytes, shard_bytes)
        grids[name] = (h, shard, chunk)
        full = sorted(r for r, x in holders[name] if x.region is None)
        if math.prod(h.shape) == 0:
            continue
        for cell in cells((0,) * len(shard), grid_shape(h.shape, shard)):
            lo, hi = _cell_box(cell, shard, h.shape)
            units.append((name, cell, math.prod(b - a for a, b in zip(lo, hi)) * item, full))
    assignment: dict[tuple[tuple[str, ...], tuple[int, ...]], int] = {}
    everyone = list(range(world))
    if all(u[3] == everyone for u in units):
        total = sum(u[2] for u in units) or 1
        cum = 0
        for name, cell, nbytes, _ in units:  # linear partition by cumulative bytes
            rank = min(world - 1, (2 * cum + nbytes) * world // (2 * total))
            assignment[(name, cell)] = rank
            load[rank] += nbytes
            cum += nbytes
    else:
        for name, cell, nbytes, full in sorted(units, key=lambda u: -u[2]):
            rank = min(full, key=lambda r: (load[r], r))
            assignment[(name, cell)] = rank
            load[rank] += nbytes
    for name in names:
        h, shard, chunk = grids[name]
        regions = _merge_runs(
            h.shape,
            shard,
            [
                (cell, assignment[(name, cell)])
                for cell in cells((0,) * len(shard), grid_shape(h.shape, shard))
            ]
            if math.prod(h.shape)
            else [],
        )
        plans[name] = TensorPlan(name, h.dtype, h.shape, shard, chunk, tuple(regions))


def _cell_box(
    cell: Sequence[int], shard: Sequence[int], shape: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    lo = tuple(c * h for c, h in zip(cell, shard))
    hi = tuple(min(a + h, s) for a, h, s in zip(lo, shard, shape))
    return lo, hi


def _merge_runs(
    shape: Sequence[int], shard: Sequence[int], owned: list[tuple[tuple[int, ...], int]]
) -> list[PlannedRegion]:
    """Regions from cells in C order: consecutive cells along the last grid axis that has more
    than one cell, with the same writer and equal other indices, merge into one box."""
    if not shape:  # 0-d: one region with no extent
        return [PlannedRegion((), (), owned[0][1])] if owned else []
    grid = grid_shape(shape, shard)
    axis = max((a for a, g in enumerate(grid) if g > 1), default=len(grid) - 1)
    out: list[PlannedRegion] = []
    run: list[tuple[tuple[int, ...], int]] = []

    def flush() -> None:
        if run:
            lo, _ = _cell_box(run[0][0], shard, shape)
            _, hi = _cell_box(run[-1][0], shard, shape)
            out.append(PlannedRegion(lo, tuple(b - a for a, b in zip(lo, hi)), run[0][1]))
            run.clear()

    for cell, writer in owned:
        last = run[-1] if run else None
        if last is not None and not (
            writer == last[1]
            and all(c == p for i, (c, p) in enumerate(zip(cell, last[0])) if i != axis)
            and cell[axis] == last[0][axis] + 1
        ):
            flush()
        run.append((cell, writer))
    flush()
    return out


def _largest_divisor_at_most(n: int, cap: int) -> int:
    best = 1
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            for x in (d, n // d):
                if best < x <= cap:
                    best = x
    return best


def _plan_sharded(
    name: tuple[str, ...],
    held: list[tuple[int, Holding]],
    load: list[int],
    chunk_bytes: int,
    shard_bytes: int,
) -> TensorPlan:
    h0 = held[0][1]
    shape, item = h0.shape, by_name(h0.dtype).itemsize
    nd = len(shape)
    boxes = [(rank, h.region) for rank, h in held if h.region is not None]
    for rank, (off, rs) in boxes:
        if (
            len(off) != nd
            or len(rs) != nd
            or any(o < 0 or s < 0 or o + s > d for o, s, d in zip(off, rs, shape))
        ):
            raise UsageError(f"rank {rank}'s region of {'/'.join(name)!r} is outside the tensor")
    shard = []
    for a in range(nd):
        g = 0  # grid lines needed at every interior holder boundary, not at the array's end
        for _, (off, rs) in boxes:
            for b in (off[a], off[a] + rs[a]):
                if 0 < b < shape[a]:
                    g = math.gcd(g, b)
        shard.append(max(1, g or shape[a]))
    # shards larger than the target are cut further along the first axis that allows it
    while math.prod(shard) * item > shard_bytes:
        axis = next((a for a in range(nd) if shard[a] > 1), None)
        if axis is None:
            break
        want = max(1, shard_bytes // (item * math.prod(shard) // shard[axis]))
        smaller = _largest_divisor_at_most(shard[axis], want)
        if smaller == shard[axis]:
            break
        shard[axis] = smaller
        if smaller > 1 or math.prod(shard) * item <= shard_bytes:
            break
    shard_t = tuple(shard)
    _, chunk0 = choose_grid(shard_t, item, chunk_bytes, shard_bytes)
    chunk = tuple(_largest_divisor_at_most(s, c) for s, c in zip(shard_t, chunk0))
    if math.prod(s // c for s, c in zip(shard_t, chunk)) > MAX_CHUNKS_PER_SHARD:
        chunk = shard_t  # awkward extents: one chunk per shard rather than a huge index
        if math.prod(chunk) * item > MAX_CHUNK_BYTES:
            raise UsageError(
                f"cannot grid {'/'.join(name)!r}: its holders' boundaries allow no chunk within "
                f"the limits; use a smaller shard_bytes"
            )
    owned = []
    for cell in cells((0,) * nd, grid_shape(shape, shard_t)) if math.prod(shape) else []:
        lo, hi = _cell_box(cell, shard_t, shape)
        inside = [
            rank
            for rank, (off, rs) in boxes
            if all(o <= a and b <= o + s for a, b, o, s in zip(lo, hi, off, rs))
        ]
        if not inside:
            raise UsageError(
                f"no rank holds the part of {'/'.join(name)!r} at {list(lo)}..{list(hi)}"
            )
        nbytes = math.prod(b - a for a, b in zip(lo, hi)) * item
        writer = min(inside, key=lambda r: (load[r], r))
        load[writer] += nbytes
        owned.append((cell, writer))
    regions = _merge_runs(shape, shard_t, owned)
    return TensorPlan(name, h0.dtype, shape, shard_t, chunk, tuple(regions))
