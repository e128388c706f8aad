"""``load_collective`` with another number of ranks than saved, in process (ranks are threads,
``ckptfmt.transport.ThreadComm``; ``test_load_other_size_mpi.py`` runs the same under a real
``mpiexec``).

Saved by N thread-ranks with ``save_collective`` (data-parallel and FSDP-like uneven row blocks,
bfloat16 and 0-d and empty tensors, values, an empty group), loaded by M: every rank gets its
box bit-exactly; on level 3 a rank reads exactly the inner chunks its box touches (replicated
tensors: each chunk once, by one rank, broadcast); on level 1 (one directory per simulated node)
a rank reads only in its own node's directory, only chunks that it or a rank of another node
needs; a saved node no current rank sees is named in the error; per-rank entries follow the
rules of ``spec/reshard.md`` (mapped, an explicit error, or a warning listing what was dropped).
The chunks a box needs are recomputed by brute force over the manifest's geometry
(``kit.reshard.needed``).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit.reshard import ROWS, full_state, needed, per_rank_extra, rows_of, save
from kit.worker import node_of

from ckptfmt.container.reader import read_manifest
from ckptfmt.errors import PerRankError, PerRankWarning, UsageError
from ckptfmt.format.chunk_reads import ReadLog, record_reads
from ckptfmt.manifest.model import Manifest, TensorEntry
from ckptfmt.parallel.collective.load import LoadFailedError, UnreachableNodesError, load_collective
from ckptfmt.plan.options import ReadOptions
from ckptfmt.transport.threads import run_threads


def wants_of(rank: int, size: int) -> dict[str, Any]:
    full = full_state()
    out = {}
    for name in ROWS:
        start, count = rows_of(full[name].shape[0], rank, size)
        out[f"shards/{name}"] = (
            (start,) + (0,) * (full[name].ndim - 1),
            (count, *full[name].shape[1:]),
        )
    return out


def load(path: Path, m: int, **kw: Any) -> tuple[list[Any], ReadLog]:
    def body(comm: Any) -> Any:
        node = node_of(comm.rank, comm.size)
        where = Path(str(path).replace("{node}", node))
        opts = dict(kw)
        given: dict[str, Any] = {"node": node} if opts.pop("pass_node", False) else {}
        if opts.pop("pass_host", False):
            given["host"] = node
        read = ReadOptions(**opts, threads=1)
        return load_collective(comm, where, wants_of(comm.rank, comm.size), read=read, **given)

    with record_reads() as log:
        out = run_threads(m, body)
    return out, log


def check_loaded(results: list[Any], m: int) -> None:
    full = full_state()
    for rank, (state, _) in enumerate(results):
        for name in ROWS:
            start, count = rows_of(full[name].shape[0], rank, m)
            got = state["shards"][name]
            assert got.dtype == full[name].dtype
            assert got.tobytes() == full[name][start : start + count].tobytes(), (rank, name)
        for name in ("rep", "rep16", "scalar"):
            assert state["model"][name].tobytes() == full[name].tobytes(), (rank, name)
            assert state["model"][name].shape == full[name].shape
        assert state["empty"].shape == (0, 4)
        assert state["opt"] == {"step": 3, "lr": 0.5} and state["group"] == {}


def reads_by_rank(log: ReadLog) -> dict[int, list[tuple[str, str, int]]]:
    """rank -> [(root, file, slot)] from the log (thread names ``rank<r>``)."""
    out: dict[int, list[tuple[str, str, int]]] = {}
    for thread, root, path, slots in log.reads:
        assert thread.startswith("rank"), f"a read outside a rank's thread: {thread}"
        out.setdefault(int(thread[4:]), []).extend((root, path, s) for s in slots)
    return out


def whole_box(t: TensorEntry) -> Any:
    return ((0,) * len(t.shape), t.shape)


PAIRS = [(4, 2), (4, 3), (2, 4), (1, 4), (3, 2), (2, 2)]


def replicated_chunks(manifest: Manifest) -> set[tuple[str, int]]:
    whole: set[tuple[str, int]] = set()
    for t in manifest.tensors():
        if not t.path.startswith("shards/") and t.size:
            whole |= needed(manifest, t.path, whole_box(t))
    return whole


@pytest.mark.parametrize("replicas", ["node", "read", "bcast"])
@pytest.mark.parametrize(("n", "m"), PAIRS)
def test_level3_each_rank_reads_exactly_the_chunks_of_its_box(
    tmp_path: Path, n: int, m: int, replicas: str
) -> None:
    """Each rank reads exactly the chunks its rows touch; of the replicated tensors, by default
    (``replicas="node"``) each chunk is read once on each node (two simulated ones), with
    ``replicas="read"`` every rank reads every chunk itself, with ``replicas="bcast"`` each
    chunk is read once in the whole job (and broadcast)."""
    path = save(tmp_path, n, 3)
    results, log = load(path, m, replicas=replicas, pass_host=True)
    check_loaded(results, m)
    manifest = read_manifest(path)
    got = reads_by_rank(log)
    whole = replicated_chunks(manifest)
    everyone: list[tuple[str, int]] = []
    per_node: dict[str, list[tuple[str, int]]] = {}
    for rank in range(m):
        mine = [(f, s) for _, f, s in got.get(rank, [])]
        assert len(mine) == len(set(mine)), f"rank {rank} read a chunk twice"
        sharded = {x for x in mine if x[0].startswith("shards/")}
        want = set()
        for name, box in wants_of(rank, m).items():
            want |= needed(manifest, name, box)
        assert sharded == want, (
            f"rank {rank}: read {sorted(sharded - want)[:3]}, missed {sorted(want - sharded)[:3]}"
        )
        rest = [x for x in mine if not x[0].startswith("shards/")]
        if replicas == "read" or m == 1:
            assert sorted(rest) == sorted(whole), f"rank {rank} did not read its replicas itself"
        everyone += rest
        per_node.setdefault(node_of(rank, m), []).extend(rest)
    if replicas == "bcast":
        assert sorted(everyone) == sorted(whole), "a replicated chunk read twice in the job"
    if replicas == "node":
        for node, reads in per_node.items():
            assert sorted(reads) == sorted(whole), f"{node}: replicated chunks not read once"
        for rank in range(m):  # each rank of a node of two reads a share of them
            rest = [x for _, x, _ in got.get(rank, []) if not x.startswith("shards/")]
            if sum(node_of(r, m) == node_of(rank, m) for r in range(m)) > 1:
                assert rest, f"rank {rank} left every replicated file to its node's other rank"


@pytest.mark.parametrize(("n", "m"), PAIRS)
def test_level1_reads_stay_on_the_node(tmp_path: Path, n: int, m: int) -> None:
    path = save(tmp_path, n, 1)
    results, log = load(path, m, pass_node=True)
    check_loaded(results, m)
    manifest = read_manifest(Path(str(path).replace("{node}", "n0")))
    wants = [wants_of(r, m) for r in range(m)]
    for rank, reads in reads_by_rank(log).items():
        node = node_of(rank, m)
        own_dir = str((tmp_path / "l1" / node / "step-1").resolve())
        for root, f, s in reads:
            assert root == own_dir, f"rank {rank} on {node} read in {root}"
            # needed by this rank, or by a rank of another node (which cannot read it)
            users = [
                r
                for r in range(m)
                if any(
                    (f, s) in needed(manifest, name, box)
                    for name, box in wants[r].items()
                    if f.startswith(name + "/")
                )
                or not f.startswith("shards/")
            ]
            assert rank in users or any(node_of(u, m) != node for u in users), (rank, f, s)


def test_level1_without_node_finds_the_files_itself(tmp_path: Path) -> None:
    path = save(tmp_path, 4, 1)
    results, _ = load(path, 2)  # no node=: each rank looks up which nodes' files it holds
    check_loaded(results, 2)


def test_unreachable_node_is_named(tmp_path: Path) -> None:
    """4 ranks on n0, n0, n1, n1 saved to level 1; one rank restarts on n0 alone."""
    path = save(tmp_path, 4, 1)
    with pytest.raises(UnreachableNodesError) as exc:
        load(path, 1, pass_node=True)
    assert exc.value.nodes == ("n1",) and exc.value.writers == (2, 3)
    assert isinstance(exc.value, LoadFailedError) and "n1" in str(exc.value)


def test_damage_on_a_partial_read_is_found_and_voted(tmp_path: Path) -> None:
    path = save(tmp_path, 2, 3)
    manifest = read_manifest(path)
    t = next(e for e in manifest.tensors() if e.path == "shards/w13")
    victim = path / t.regions[-1].files[-1].path
    raw = bytearray(victim.read_bytes())
    raw[0] ^= 1  # first chunk of the last file of w13 (rows the last rank of 3 wants)
    victim.write_bytes(bytes(raw))
    with pytest.raises(LoadFailedError) as exc:
        load(path, 3)
    assert "shards/w13" in str(exc.value) and "CRC32C" in str(exc.value)


# --- per-rank state ------------------------------------------------------------------------------


def test_per_rank_entries_same_size_are_each_ranks_own(tmp_path: Path) -> None:
    path = save(tmp_path, 3, 3, per_rank_extra)
    results, _ = load(path, 3)
    for rank, (state, _) in enumerate(results):
        assert np.array_equal(state["rng"], np.arange(6, dtype=np.uint32) + 100 * rank)
        assert state["loader"] == {"epoch": 1, "index": 10 * rank}


def test_per_rank_entries_without_a_map_are_an_explicit_error(tmp_path: Path) -> None:
    path = save(tmp_path, 4, 3, per_rank_extra)
    with pytest.raises(PerRankError) as exc:
        load(path, 2)
    assert set(exc.value.entries) == {"rng", "loader"}
    assert exc.value.dropped == (0, 1, 2, 3) and exc.value.missing == (0, 1)


def test_per_rank_entries_mapped(tmp_path: Path) -> None:
    path = save(tmp_path, 4, 3, per_rank_extra)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results, _ = load(path, 2, rank_map={3: 0, 1: 1}, per_rank="drop")
    check_loaded(results, 2)
    for rank, old in ((0, 3), (1, 1)):
        state = results[rank][0]
        assert np.array_equal(state["rng"], np.arange(6, dtype=np.uint32) + 100 * old)
        assert state["loader"] == {"epoch": 1, "index": 10 * old}
    texts = [str(w.message) for w in caught if issubclass(w.category, PerRankWarning)]
    assert len(texts) == 2 and all("rng" in t and "loader" in t and "0, 2" in t for t in texts)


def test_per_rank_entries_dropped_only_on_request_and_listed(tmp_path: Path) -> None:
    path = save(tmp_path, 2, 3, per_rank_extra)
    with pytest.raises(PerRankError):
        load(path, 4, rank_map="identity")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results, _ = load(path, 4, rank_map="identity", per_rank="drop")
    check_loaded(results, 4)
    for rank in range(4):
        state = results[rank][0]
        if rank < 2:
            assert state["loader"] == {"epoch": 1, "index": 10 * rank}
        else:
            assert "rng" not in state and "loader" not in state
    texts = [str(w.message) for w in caught if issubclass(w.category, PerRankWarning)]
    assert texts and all("current rank(s) 2, 3 get none" in t for t in texts)


def test_read_options_are_checked_and_must_agree(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="per_rank is 'error' or 'drop'"):
        ReadOptions(per_rank="keep")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="replicas is 'node', 'read' or 'bcast'"):
        ReadOptions(replicas="all")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="threads must be an int >= 1"):
        ReadOptions(threads=0)
    path = save(tmp_path, 2, 3)
    raised: list[BaseException] = []

    def body(comm: Any) -> None:
        read = ReadOptions(replicas="bcast" if comm.rank else "read")
        try:
            load_collective(comm, path, read=read)
        except UsageError as exc:
            raised.append(exc)

    run_threads(2, body)
    assert len(raised) == 2  # every rank is told, none left waiting
    assert all("every rank must pass the same" in str(e) for e in raised)


@pytest.mark.parametrize("replicas", ["node", "read", "bcast"])
def test_each_rank_counts_on_its_meter_the_work_it_expected(tmp_path: Path, replicas: str) -> None:
    """The progress a rank reports: the chunks it reads and the bytes it receives (packed,
    straight into its rows, or broadcast) add up to the total it announced before starting."""
    from ckptfmt.storage.progress import metering

    path = save(tmp_path, 2, 3)

    def body(comm: Any) -> tuple[int, int]:
        with metering("load", lambda p: None) as meter:
            load_collective(
                comm,
                path,
                wants_of(comm.rank, comm.size),
                read=ReadOptions(replicas=replicas, threads=1),  # type: ignore[arg-type]
                host=node_of(comm.rank, comm.size),
            )
            return meter.done, meter.total

    for done, total in run_threads(4, body):
        assert done == total > 0
