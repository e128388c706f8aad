"""Real level-1 checkpoints with redundancy, made in this process: the collective save of
several simulated nodes, every rank a thread (``ckptfmt.transport.ThreadComm``), no MPI.

``save_level1(root, redundancy, nodes)`` saves :func:`rank_state` of every rank ``r`` into
``root/<nodes[r]>`` and returns the ``{node}`` template; :func:`whole` is what all the nodes'
files together hold (tensor name -> array), :func:`merge` gathers the nodes' files in one
directory (where ``ckptfmt.load`` reads them all), :func:`copy` copies one of several pristine
saves for a test to damage.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ckptfmt import PerRank, Shard
from ckptfmt.container.metadata import ManifestMeta
from ckptfmt.format.options import WriteOptions
from ckptfmt.parallel.collective.save import save_collective
from ckptfmt.redundancy.config import Redundancy
from ckptfmt.transport.threads import run_threads
from kit.arrays import random_array

NODES8 = ["n0", "n0", "n1", "n1", "n2", "n2", "n3", "n3"]  # sets [0,2,4,6], [1,3,5,7] (size 4)
NODES4 = ["n0", "n1", "n2", "n3"]
ROWS = 23  # the sharded tensor's rows: uneven over any number of ranks


def _bits(seed: Any, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    return random_array(np.random.default_rng(seed), dtype, shape)


def whole(size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor of the save, whole."""
    return {
        "model/embed": _bits([seed, 1], np.float32, (30, 7)),
        "model/norm": _bits([seed, 2], ml_dtypes.bfloat16, (45,)),
        "model/w": _bits([seed, 3], np.float32, (ROWS, 5)),
        "rng": np.stack([_bits([seed, 4, r], np.uint8, (11,)) for r in range(size)]),
    }


def rows_of(rank: int, size: int) -> tuple[int, int]:
    base, extra = divmod(ROWS, size)
    return rank * base + min(rank, extra), base + (rank < extra)


def rank_state(rank: int, size: int, seed: int = 0) -> dict[str, Any]:
    g = whole(size, seed)
    start, count = rows_of(rank, size)
    return {
        "model": {
            "embed": g["model/embed"],
            "norm": g["model/norm"],
            "w": Shard(g["model/w"][start : start + count].copy(), (start, 0), (ROWS, 5)),
        },
        "rng": PerRank(g["rng"][rank]),
        "step": 5,
    }


def save_level1(
    root: Path,
    redundancy: Any,
    nodes: list[str] = NODES8,
    seed: int = 0,
    set_size: int = 4,
) -> str:
    """Save to ``root/<node>`` (small shards: several files per rank) with ``redundancy`` (a
    scheme id, a mapping, or None: none); the ``{node}`` template."""
    red = None
    if redundancy is not None:
        spec = {"scheme": redundancy} if isinstance(redundancy, str) else dict(redundancy)
        red = Redundancy.of({"set_size": set_size, **spec})

    def body(comm: Any) -> None:
        save_collective(
            comm,
            rank_state(comm.rank, comm.size, seed),
            root / nodes[comm.rank],
            step=5,
            node=nodes[comm.rank],
            redundancy=red,
            write=WriteOptions(fsync=False, chunk_bytes=40, shard_bytes=160, threads=1),
            meta=ManifestMeta(levels={"1": {}}),
        )

    run_threads(len(nodes), body)
    return str(root / "{node}")


def merge(root: Path, nodes: list[str], dest: Path) -> Path:
    """Every node's files of the save at ``root`` in one directory ``dest``."""
    for node in sorted(set(nodes)):
        shutil.copytree(root / node, dest, dirs_exist_ok=True)
    return dest


def copy(saved: dict[str, Path], name: str, tmp_path: Path) -> tuple[Path, str]:
    """A copy of the pristine save ``saved[name]`` under ``tmp_path`` (for a test to damage) and
    its ``{node}`` template."""
    root = tmp_path / name
    shutil.copytree(saved[name], root)
    return root, str(root / "{node}")
