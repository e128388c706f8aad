"""A checkpoint saved by N ranks in this process (every rank a thread), for the tests that load
or rewrite it with another number of ranks, and the chunks a box of a tensor needs, found by
brute force over the manifest's geometry (what the read planner must match).

The state: tensors split by rows over the ranks (``ROWS``, uneven over any number of ranks),
replicated tensors, a 0-d and an empty tensor, values and an empty group; ranks ``r`` of ``n``
on simulated node ``node_of(r, n)`` (level 1: one directory per node).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

import ckptfmt
from ckptfmt import PerRank, Shard
from ckptfmt.format.options import WriteOptions
from ckptfmt.manifest.model import Manifest
from ckptfmt.parallel.collective.save import save_collective
from ckptfmt.transport.threads import run_threads
from kit.arrays import random_array
from kit.worker import node_of

SHARD_BYTES = 8 << 10
CHUNK_BYTES = 1 << 10
ROWS = {
    "w13": (np.float32, (13, 70)),
    "w10": (ml_dtypes.bfloat16, (10, 3, 50)),
    "w3": (np.int16, (3, 40)),
}


def full_state() -> dict[str, Any]:
    """What every tensor holds, whole."""
    rng = np.random.default_rng(7)
    out: dict[str, Any] = {name: random_array(rng, dt, shape) for name, (dt, shape) in ROWS.items()}
    out["rep"] = random_array(rng, np.float32, (40, 100))
    out["rep16"] = random_array(rng, ml_dtypes.bfloat16, (777,))
    out["scalar"] = random_array(rng, np.float64, ())
    out["empty"] = np.zeros((0, 4), np.float32)
    return out


def rows_of(n_rows: int, rank: int, size: int) -> tuple[int, int]:
    """``(start, count)`` as np.array_split: the first ``n_rows % size`` ranks get one more."""
    base, extra = divmod(n_rows, size)
    return rank * base + min(rank, extra), base + (rank < extra)


def rank_state(rank: int, size: int) -> dict[str, Any]:
    full = full_state()
    shards = {}
    for name in ROWS:
        start, count = rows_of(full[name].shape[0], rank, size)
        off = (start,) + (0,) * (full[name].ndim - 1)
        shards[name] = Shard(full[name][start : start + count].copy(), off, full[name].shape)
    return {
        "shards": shards,
        "model": {"rep": full["rep"], "rep16": full["rep16"], "scalar": full["scalar"]},
        "empty": full["empty"],
        "opt": {"step": 3, "lr": 0.5},
        "group": {},
    }


def save(tmp: Path, n: int, level: int, extra: Any = None) -> Path:
    """Save the state with ``n`` thread-ranks; return the step path (level 1: a template)."""

    def body(comm: Any) -> Manifest:
        node = node_of(comm.rank, comm.size)
        state = rank_state(comm.rank, comm.size)
        if extra:
            state.update(extra(comm.rank))
        where = tmp / (f"l1/{node}" if level == 1 else "l3") / "step-1"
        m, _ = save_collective(
            comm,
            state,
            where,
            step=1,
            node=node,
            group=node if level == 1 else "shared",
            write=WriteOptions(
                fsync=False, threads=1, chunk_bytes=CHUNK_BYTES, shard_bytes=SHARD_BYTES
            ),
        )
        return m

    run_threads(n, body)
    return tmp / ("l1/{node}" if level == 1 else "l3") / "step-1"


def per_rank_extra(rank: int) -> dict[str, Any]:
    return {
        "rng": PerRank(np.arange(6, dtype=np.uint32) + 100 * rank),
        "loader": PerRank({"epoch": 1, "index": 10 * rank}),
    }


def needed(manifest: Manifest, name: str, box: Any) -> set[tuple[str, int]]:
    """(file, slot) of every in-bounds inner chunk that intersects ``box`` (brute force)."""
    t = next(e for e in manifest.tensors() if "/".join(e.name) == name)
    if not t.shape:
        return {(t.regions[0].files[0].path, 0)}
    out = set()
    lo, ext = box
    per = [h // c for h, c in zip(t.shard_shape, t.chunk_shape)]
    for r in t.regions:
        cells = itertools.product(
            *(range(o // h, -(-(o + n) // h)) for o, n, h in zip(r.offset, r.shape, t.shard_shape))
        )
        for cell, f in zip(cells, r.files):
            for slot, inner in enumerate(itertools.product(*(range(p) for p in per))):
                c_lo = [
                    i * h + k * c for i, h, k, c in zip(cell, t.shard_shape, inner, t.chunk_shape)
                ]
                if any(a >= s for a, s in zip(c_lo, t.shape)):
                    continue
                if all(
                    a < o + n and o < a + c and n > 0
                    for a, c, o, n in zip(c_lo, t.chunk_shape, lo, ext)
                ):
                    out.add((f.path, slot))
    return out


def check_resharded(dst: str | Path) -> dict[str, Any]:
    """The resharded checkpoint at ``dst`` (a directory or a bucket's URL) verifies clean and
    holds :func:`full_state` bit for bit; the loaded state, for more checks."""
    report = ckptfmt.verify(dst)
    assert report.healthy, [p.to_json() for p in report.problems]
    got = ckptfmt.load(dst)
    full = full_state()
    for name in ROWS:
        assert got["shards"][name].tobytes() == full[name].tobytes(), name
        assert got["shards"][name].dtype == full[name].dtype
    for name in ("rep", "rep16", "scalar"):
        assert got["model"][name].tobytes() == full[name].tobytes(), name
    assert got["opt"] == {"step": 3, "lr": 0.5}
    return got
