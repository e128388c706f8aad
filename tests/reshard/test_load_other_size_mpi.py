"""Loading with M ranks what N ranks saved, under a real ``mpiexec`` (``MpiComm``), and the
``ckptfmt reshard`` round trip.

Checkpoints are saved by a ``CheckpointManager`` on N = 4, 3, 2, 1 ranks (level 1 on two
simulated nodes, flushed to level 3); then jobs of M = 2, 3, 4 ranks load them
(4->2, 4->3, 3->2, 2->4, 1->4), from level 3 and from level 1 (each rank its own node's
directory), each rank wanting its own FSDP-like row blocks of this job's size and the replicated
tensors whole. Every rank's data is compared with the expected state here (SHA-256 of the
bytes); every chunk a rank read is compared with the chunks its box needs, recomputed here by
brute force over the manifest; every file a rank opened is checked to lie in its own node's
directory on level 1. Per-rank state: mapped by a rank map, listed in a warning when dropped on
request, an explicit error without a map. The manager restores at another size. ``ckptfmt
reshard`` rewrites the 4-rank checkpoint for 2 ranks (and for 4 ranks on two nodes with xor
redundancy); ``ckptfmt verify`` passes, every tensor is bitwise equal, and loading it each rank
reads only files that it wrote itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _reshard_worker import (
    digest,
    full_tensors,
    loader_of,
    rank_state,
    rng_of,
    wants_of,
)
from kit import REPO
from kit.launch import describe, run_mpi
from kit.reshard import needed
from kit.worker import node_of

import ckptfmt
from ckptfmt.container.reader import read_manifest
from ckptfmt.manifest.model import Manifest

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

WORKER = str(REPO / "tests" / "workers" / "_reshard_worker.py")
STEP = "step-0000000001"
JOB_TIMEOUT = 120


@dataclass
class Runs:
    tmp: Path
    out: Path
    cli2: Any = None  # ckptfmt reshard ... --ranks 2 (finished process)
    cli4: Any = None  # ckptfmt reshard ... --ranks 4 --redundancy xor

    def results(self, task: str, m: int) -> list[dict[str, Any]]:
        got = []
        for r in range(m):
            path = self.out / f"{task}.rank{r}.json"
            assert path.exists(), f"rank {r} wrote no results for {task}"
            res = json.loads(path.read_text())
            assert (res["rank"], res["size"], res["node"]) == (r, m, node_of(r, m))
            got.append(res)
        return got

    def root(self, name: str) -> Path:
        return self.tmp / name


def launch(runs: Runs, n: int, job: str, tasks: list[dict[str, Any]]) -> None:
    plan = runs.tmp / f"{job}.plan.json"
    plan.write_text(json.dumps({"out": str(runs.out), "tasks": tasks}))
    proc = run_mpi(n, WORKER, str(plan), timeout=JOB_TIMEOUT)
    if proc.returncode != 0:
        pytest.fail(f"{job}: exit status {proc.returncode}\n{describe(proc)}", pytrace=False)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckptfmt_cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


# N -> M loads: (task name, saved root, N, level)
LOADS: dict[int, list[tuple[str, str, int, int]]] = {
    2: [("4to2-l3", "s4", 4, 3), ("4to2-l1", "s4", 4, 1), ("3to2-l3", "s3", 3, 3),
        ("3to2-l1", "s3", 3, 1)],
    3: [("4to3-l3", "s4", 4, 3), ("4to3-l1", "s4", 4, 1)],
    4: [("2to4-l3", "s2", 2, 3), ("2to4-l1", "s2", 2, 1), ("1to4-l3", "s1", 1, 3),
        ("1to4-l1", "s1", 1, 1)],
}  # fmt: skip


def load_path(runs: Runs, root: str, level: int) -> str:
    sub = "l1/{node}" if level == 1 else "l3"
    return str(runs.root(root) / sub / STEP)


GRID = ["--rows", "shards/*", "--chunk-bytes", "8192", "--shard-bytes", "65536", "--json"]


def load_task(name: str, path: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "action": "load", "path": path, **kw}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    tmp = tmp_path_factory.mktemp("reshard")
    r = Runs(tmp, tmp / "out")
    r.out.mkdir()
    save = [
        {"name": "save-s4", "action": "save", "root": str(r.root("s4"))},
        {"name": "save-s4p", "action": "save", "root": str(r.root("s4p")), "per_rank": False},
    ]
    launch(r, 4, "save4", save)
    for n in (3, 2, 1):
        launch(
            r,
            n,
            f"save{n}",
            [{"name": f"save-s{n}", "action": "save", "root": str(r.root(f"s{n}"))}],
        )
    # offline rewrites of the 4-rank checkpoint: for 2 ranks, and for 4 on two nodes with xor
    src = str(r.root("s4") / "l3" / STEP)
    two = ["--ranks", "2", "--nodes", "n0,n1", "--rank-map", "identity", "--drop-per-rank"]
    r.cli2 = cli("reshard", src, str(r.root("cli2") / "l3" / STEP), *two, *GRID)
    four = ["--ranks", "4", "--ranks-per-node", "2", "--redundancy", "xor", "--set-size", "2"]
    r.cli4 = cli("reshard", src, str(r.root("cli4") / "l1/{node}" / STEP), *four, *GRID)
    for m, loads in LOADS.items():
        tasks = [
            load_task(
                name,
                load_path(r, root, level),
                pass_node=level == 1,
                rank_map="identity",
                per_rank="drop",
            )
            for name, root, _, level in loads
        ]
        if m == 2:
            tasks.append(load_task("4to2-nomap", load_path(r, "s4", 3)))
            tasks.append(
                load_task(
                    "4to2-map", load_path(r, "s4", 3), rank_map=[[3, 0], [1, 1]], per_rank="drop"
                )
            )
            tasks.append(load_task("cli2-load", load_path(r, "cli2", 3)))
            bcast = {"rank_map": "identity", "per_rank": "drop", "replicas": "bcast"}
            tasks.append(load_task("4to2-bcast", load_path(r, "s4", 3), **bcast))
        if m in (2, 3):
            tasks.append(
                {"name": f"restore-4to{m}", "action": "restore", "root": str(r.root("s4p"))}
            )
        if m == 4:
            tasks.append(load_task("cli4-load", load_path(r, "cli4", 1), pass_node=True))
            for name, root in (("2to4-l3-read", "s2"), ("4to4-l3", "s4"), ("4to4-l3-read", "s4")):
                replicas = "read" if name.endswith("read") else "node"
                tasks.append(
                    load_task(
                        name,
                        load_path(r, root, 3),
                        rank_map="identity",
                        per_rank="drop",
                        replicas=replicas,
                    )
                )
        launch(r, m, f"load{m}", tasks)
    return r  # fmt: skip


# --- expectations ---------------------------------------------------------------------------------


def expected(rank: int, m: int, source: int | None, per_rank: bool = True) -> dict[str, Any]:
    """What rank ``rank`` of ``m`` must hold: its rows, the replicated tensors, the values, and
    the per-rank items of saved rank ``source`` (none: absent)."""
    state = rank_state(rank, m, per_rank=False)
    if per_rank and source is not None:
        state["rng"] = rng_of(source)
        state["loader"] = loader_of(source)
    return digest(state)


def check_digests(results: list[dict[str, Any]], m: int, sources: list[int | None]) -> None:
    for rank, res in enumerate(results):
        assert res["error"] is None, f"rank {rank}: {res['error']}"
        assert res["digest"] == expected(rank, m, sources[rank]), f"rank {rank}: data differ"


def manifest_of(runs: Runs, root: str, level: int) -> Manifest:
    return read_manifest(Path(load_path(runs, root, level).replace("{node}", "n0")))


# --- N -> M loads ---------------------------------------------------------------------------


ALL = [(m, *t) for m, loads in LOADS.items() for t in loads]


@pytest.mark.parametrize(("m", "task", "root", "n", "level"), ALL, ids=[t[1] for t in ALL])
def test_load_at_another_size_is_bit_exact(
    runs: Runs, m: int, task: str, root: str, n: int, level: int
) -> None:
    results = runs.results(task, m)
    check_digests(results, m, [r if r < n else None for r in range(m)])
    for rank, res in enumerate(results):
        texts = " ".join(res["warnings"])
        if n > m:  # identity + drop: the items of the saved ranks m.. are listed as dropped
            dropped = ", ".join(map(str, range(m, n)))
            assert f"saved rank(s) {dropped} are not carried over" in texts, texts
        elif m > n:
            missing = ", ".join(map(str, range(n, m)))
            assert f"current rank(s) {missing} get none" in texts, texts
        assert "rng" in texts and "loader" in texts, f"rank {rank}: no warning naming them"


@pytest.mark.parametrize(
    ("m", "task", "root", "n", "level"),
    [t for t in ALL if t[4] == 3],
    ids=[t[1] for t in ALL if t[4] == 3],
)
def test_level3_each_rank_reads_exactly_its_chunks(
    runs: Runs, m: int, task: str, root: str, n: int, level: int
) -> None:
    """Sharded tensors: each rank reads exactly the inner chunks its rows touch; replicated
    ones (``replicas="node"``, the default): every chunk is read once on each simulated node,
    by one of its ranks (``-read`` and ``-bcast`` tasks below: the other modes)."""
    check_level3_reads(runs, m, task, root, n, level, "node")


def test_level3_replicas_broadcast_read_each_chunk_once(runs: Runs) -> None:
    check_digests(runs.results("4to2-bcast", 2), 2, [0, 1])
    check_level3_reads(runs, 2, "4to2-bcast", "s4", 4, 3, "bcast")


@pytest.mark.parametrize(
    ("task", "root", "n"), [("2to4-l3-read", "s2", 2), ("4to4-l3-read", "s4", 4)]
)
def test_level3_replicas_read_by_every_rank(runs: Runs, task: str, root: str, n: int) -> None:
    """``replicas="read"``: every rank reads every replicated chunk itself (two per node)."""
    check_digests(runs.results(task, 4), 4, [r if r < n else None for r in range(4)])
    check_level3_reads(runs, 4, task, root, n, 3, "read")


def test_level3_same_size_replicas_read_once_per_node(runs: Runs) -> None:
    """The 4-rank checkpoint at its own size on two nodes: the same sharing as N -> M."""
    check_digests(runs.results("4to4-l3", 4), 4, [0, 1, 2, 3])
    check_level3_reads(runs, 4, "4to4-l3", "s4", 4, 3, "node")


HELD = [t for t in ALL if t[4] == 3] + [
    (4, "4to4-l3", "s4", 4, 3),
    *[t for t in ALL if t[4] == 1 and t[3] > 1],  # every node holds a copy
]


@pytest.mark.parametrize(("m", "task", "root", "n", "level"), HELD, ids=[t[1] for t in HELD])
def test_each_rank_reads_at_most_1_1x_what_it_holds(
    runs: Runs, m: int, task: str, root: str, n: int, level: int
) -> None:
    """Issue 38's bound: a rank of an N -> M load reads (chunks with their CRCs, and the
    indexes, as ``record_reads`` counts) at most 1.1x the bytes it ends up holding; the
    replicated tensors, which every rank holds whole, are read once per node."""
    full = full_tensors()
    for rank, res in enumerate(runs.results(task, m)):
        held = sum(a.nbytes for k, a in full.items() if not k.startswith("shards/"))
        for name, (off, shape) in wants_of(rank, m).items():
            held += full[name][off[0] : off[0] + shape[0]].nbytes
        held += rng_of(0).nbytes if rank < n else 0  # its per-rank row (identity map)
        assert 0 < res["bytes_read"] <= 1.1 * held, (rank, res["bytes_read"], held)


def check_level3_reads(
    runs: Runs, m: int, task: str, root: str, n: int, level: int, mode: str
) -> None:
    manifest = manifest_of(runs, root, level)
    whole: set[tuple[str, int]] = set()
    for t in manifest.tensors():
        if not t.path.startswith("shards/") and t.size and not t.per_rank:
            whole |= needed(manifest, t.path, ((0,) * len(t.shape), t.shape))
    everyone: list[tuple[str, int]] = []
    per_node: dict[str, list[tuple[str, int]]] = {}
    for rank, res in enumerate(runs.results(task, m)):
        mine = [(p, s) for _, p, slots in res["reads"] for s in slots]
        assert len(mine) == len(set(mine)), f"rank {rank} read a chunk twice"
        own = {x for x in mine if x[0].startswith(("shards/", "rng/"))}
        want: set[tuple[str, int]] = set()
        for name, box in wants_of(rank, m).items():
            want |= needed(manifest, name, box)
        if rank < n:  # its per-rank row: saved rank ``rank``'s (identity map)
            want |= needed(manifest, "rng", ((rank, 0), (1, 6)))
        assert own == want, (rank, sorted(own ^ want)[:4])
        rest = [x for x in mine if x not in own]
        if mode == "read":
            assert sorted(rest) == sorted(whole), f"rank {rank} did not read its replicas itself"
        everyone += rest
        per_node.setdefault(node_of(rank, m), []).extend(rest)
    if mode == "bcast":
        assert sorted(everyone) == sorted(whole), "replicated chunks: each read once in the job"
    if mode == "node":
        for node, reads in per_node.items():
            assert sorted(reads) == sorted(whole), f"{node}: replicated chunks not read once"


@pytest.mark.parametrize(
    ("m", "task", "root", "n", "level"),
    [t for t in ALL if t[4] == 1],
    ids=[t[1] for t in ALL if t[4] == 1],
)
def test_level1_each_rank_stays_on_its_node(
    runs: Runs, m: int, task: str, root: str, n: int, level: int
) -> None:
    """A rank opens files only in its own node's directory, and reads only chunks that it needs
    or that a rank on another node needs (which cannot open them)."""
    manifest = manifest_of(runs, root, level)
    l1 = runs.root(root) / "l1"
    boxes = [wants_of(r, m) for r in range(m)]

    def users(path: str, slot: int) -> set[int]:
        if path.startswith("rng/"):  # per-rank rows: row r goes to current rank r (identity)
            row = int(path.split("/")[2])
            return {row} if row < m else set()
        if not path.startswith("shards/"):
            return set(range(m))
        name = "/".join(path.split("/")[:2])
        return {r for r in range(m) if (path, slot) in needed(manifest, name, boxes[r][name])}

    for rank, res in enumerate(runs.results(task, m)):
        node = node_of(rank, m)
        others = [str((l1 / x).resolve()) for x in ("n0", "n1") if x != node]
        for p in res["opened"]:
            assert not any(p == o or p.startswith(o + "/") for o in others), (rank, p)
        for root_dir, path, slots in res["reads"]:
            assert root_dir == str((l1 / node / STEP).resolve()), (rank, root_dir)
            for s in slots:
                u = users(path, s)
                assert rank in u or any(node_of(x, m) != node for x in u), (rank, path, s)
        if n == 1 and node == "n1":  # a node new to the job: no copy, everything received
            assert res["reads"] == [] and not (l1 / "n1").exists()


# --- per-rank state -------------------------------------------------------------------------------


def test_per_rank_without_a_map_is_an_explicit_error_on_every_rank(runs: Runs) -> None:
    for res in runs.results("4to2-nomap", 2):
        kind, text = res["error"]
        assert kind == "PerRankError"
        assert "rng" in text and "loader" in text and "0, 1, 2, 3" in text


def test_per_rank_mapped_by_the_callers_map(runs: Runs) -> None:
    results = runs.results("4to2-map", 2)
    check_digests(results, 2, [3, 1])
    for res in results:
        assert any("saved rank(s) 0, 2 are not carried over" in w for w in res["warnings"])


# --- the manager at another size ------------------------------------------------------------------


@pytest.mark.parametrize("m", [2, 3])
def test_manager_restores_at_another_size_from_level1(runs: Runs, m: int) -> None:
    for rank, res in enumerate(runs.results(f"restore-4to{m}", m)):
        assert res["error"] is None, res["error"]
        assert (res["step"], res["level"]) == (1, 1), res["tried"]
        assert res["digest"] == expected(rank, m, None, per_rank=False), f"rank {rank}: differ"


# --- ckptfmt reshard ------------------------------------------------------------------------


def test_cli_reshard_is_verified_and_bitwise_equal(runs: Runs) -> None:
    proc = runs.cli2
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["saved_ranks"], report["ranks"]) == (4, 2)
    assert "saved rank(s) 2, 3 are not carried over" in report["warning"]
    dst = runs.root("cli2") / "l3" / STEP
    check = cli("verify", str(dst))
    assert check.returncode == 0, check.stdout + check.stderr
    src, out = ckptfmt.load(runs.root("s4") / "l3" / STEP), ckptfmt.load(dst)
    full = full_tensors()
    for name, arr in full.items():
        a, b = name.split("/") if "/" in name else (name, None)
        got = out[a][b] if b else out[a]
        was = src[a][b] if b else src[a]
        assert got.dtype == arr.dtype and got.shape == arr.shape
        assert got.tobytes() == arr.tobytes() == was.tobytes(), name
    assert np.array_equal(out["rng"], src["rng"][:2]) and out["loader"] == src["loader"][:2]
    assert out["opt"] == src["opt"] and out["group"] == {}
    m = read_manifest(dst)
    assert m.world_size == 2 and [r.node for r in m.ranks] == ["n0", "n1"]
    assert m.writer["resharded_from"]["world_size"] == 4


def test_after_reshard_each_rank_reads_only_what_it_wrote(runs: Runs) -> None:
    """The 2-rank rewrite loaded by 2 ranks: every chunk of a sharded tensor that a rank reads
    lies in a file of a region that rank is the writer of (its own data, as after a save)."""
    m = read_manifest(runs.root("cli2") / "l3" / STEP)
    writer = {f.path: r.rank for t in m.tensors() for r in t.regions for f in r.files}
    results = runs.results("cli2-load", 2)
    check_digests(results, 2, [0, 1])
    for rank, res in enumerate(results):
        for _, path, _ in res["reads"]:
            if path.startswith("shards/") or path.startswith("rng/"):
                assert writer[path] == rank, (rank, path)


def test_cli_reshard_with_redundancy_for_level1(runs: Runs) -> None:
    proc = runs.cli4
    assert proc.returncode == 0, proc.stderr
    template = runs.root("cli4") / "l1" / "{node}" / STEP
    check = cli("verify", str(template), "--json")
    assert check.returncode == 0, check.stdout + check.stderr
    m = read_manifest(runs.root("cli4") / "l1" / "n0" / STEP)
    assert m.levels["1"]["redundancy"]["scheme"] == "xor"
    assert [r.node for r in m.ranks] == ["n0", "n0", "n1", "n1"]
    writer = {f.path: r.rank for t in m.tensors() for r in t.regions for f in r.files}
    results = runs.results("cli4-load", 4)
    check_digests(results, 4, [0, 1, 2, 3])
    for rank, res in enumerate(results):
        for _, path, _ in res["reads"]:
            if path.startswith("shards/"):
                assert writer[path] == rank, (rank, path)
            assert m.ranks[writer[path]].node == node_of(rank, 4)
