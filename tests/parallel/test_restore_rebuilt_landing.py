"""A restore that rebuilt a lost node's level-1 data loads it from memory straight into the
caller's arrays, with or without ``into``, and stays all or nothing: every rank's member data
is checked against its CRCs before any of it lands (``MemberFiles.verify``), and a state the
restore refuses is refused before anything is written into it. Four simulated nodes, one rank
a thread each, XOR over all four."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit.faults import flip
from kit.level1 import NODES4, rows_of, save_level1, whole

from ckptfmt import CheckpointManager, ExitPolicy, ReadOptions, Shard, WriteOptions
from ckptfmt.errors import (
    ChecksumError,
    LoadFailedError,
    PickleRefusedError,
    StateMismatchError,
)
from ckptfmt.parallel.collective import load_read
from ckptfmt.parallel.collective.load import load_collective
from ckptfmt.parallel.collective.rebuild import rebuild_in_memory
from ckptfmt.redundancy.record import member_files
from ckptfmt.storage.steps import step_dir_name
from ckptfmt.transport.threads import run_threads

ROWS = 64  # per rank


def _rows(rank: int) -> np.ndarray:
    return np.random.default_rng(rank).standard_normal((ROWS, 96)).astype(np.float32)


def _state(rank: int, blank: bool) -> dict[str, Any]:
    w = np.zeros((ROWS, 96), np.float32) if blank else _rows(rank)
    b = np.zeros(16) if blank else np.arange(16.0)
    return {"model": {"w": Shard(w, (ROWS * rank, 0), (ROWS * 4, 96)), "b": b}, "step": 0}


def _manager(root: Path, comm: Any) -> CheckpointManager:
    return CheckpointManager(
        local_dir=str(root / "{node}"),
        comm=comm,
        node=NODES4[comm.rank],
        redundancy={"scheme": "xor", "set_size": 4},
        write=WriteOptions(fsync=False, chunk_bytes=4096, shard_bytes=16384),
        async_save=False,
        at_exit=ExitPolicy(flush=False, sigterm=False),
    )


def _refusal(root: Path, comm: Any, state: dict[str, Any], error: type[Exception]) -> str:
    """The message of the ``error`` a restore of ``state`` raises ("" if it raised none)."""
    with _manager(root, comm) as mgr:
        try:
            mgr.restore(state)
        except error as exc:
            return str(exc)
    return ""


@pytest.fixture
def lost(tmp_path: Path) -> Path:
    """Step 3 saved by 4 ranks on 4 nodes, node n1's copy then deleted."""
    root = tmp_path / "l1"

    def save(comm: Any) -> None:
        with _manager(root, comm) as mgr:
            state = _state(comm.rank, blank=False)
            state["step"] = 3
            mgr.save(3, state)

    run_threads(4, save)
    shutil.rmtree(root / "n1" / step_dir_name(3))
    return root


def test_a_rebuilt_node_lands_in_the_callers_arrays_bit_exact(lost: Path) -> None:
    def body(comm: Any) -> tuple[bool, bool, list[str]]:
        state = _state(comm.rank, blank=True)
        mine = state["model"]["w"].data
        with _manager(lost, comm) as mgr:
            report = mgr.restore(state)  # without into: all or nothing
        assert report.step == 3 and report.state is not None and state["step"] == 3
        exact = np.array_equal(mine, _rows(comm.rank)) and np.array_equal(
            state["model"]["b"], np.arange(16.0)
        )
        return exact, report.state["model"]["w"] is mine, report.rebuilt

    for exact, landed, rebuilt in run_threads(4, body):
        assert exact
        assert landed  # read from the rebuild's memory into the caller's array: no copy
        assert rebuilt and "data of rank(s) 1" in rebuilt[0]


def test_a_state_the_restore_refuses_is_not_written_after_a_rebuild(lost: Path) -> None:
    def body(comm: Any) -> tuple[str, bool]:
        state = _state(comm.rank, blank=True)
        state["model"]["extra"] = np.zeros(4)  # not in the checkpoint: refused (strict)
        raised = _refusal(lost, comm, state, StateMismatchError)
        untouched = not state["model"]["w"].data.any() and not state["model"]["b"].any()
        return raised, untouched and state["step"] == 0

    for raised, untouched in run_threads(4, body):
        assert "model/extra" in raised
        assert untouched


def test_rebuilt_bytes_that_fail_their_crcs_are_never_landed(tmp_path: Path) -> None:
    """A rebuild that made wrong bytes (one flipped in the lost rank's member, as a wrong parity
    would) fails the load on every rank before anything is read: the member is checked first
    (``MemberFiles.verify`` as ``check_first``), so the arrays offered to land in stay as they
    were, on the rank that rebuilt and on the others."""
    root = tmp_path / "saved"
    save_level1(root, "xor", NODES4, set_size=4)
    shutil.rmtree(root / "n1")

    def body(comm: Any) -> tuple[BaseException | None, bool]:
        node = NODES4[comm.rank]
        rebuilt = rebuild_in_memory(comm, root / node, node, fsync=False)
        assert rebuilt.report.lost_data == [1]
        if comm.rank == 1:
            rebuilt.bufs.data[5] ^= 0x10  # inside the first chunk of its first data file
        memory = rebuilt.files(comm.rank)
        embed = np.zeros((30, 7), np.float32)
        try:
            load_collective(
                comm,
                root / node,
                {},
                node=node,
                into={"model/embed": embed},
                source=memory,
                own_only=[1],
                check_first=memory.verify,
            )
        except LoadFailedError as exc:
            return exc, not embed.any()
        return None, not embed.any()

    results = run_threads(4, body)
    for err, untouched in results:
        assert isinstance(err, LoadFailedError), err
        assert err.failed_ranks == (1,)
        assert untouched
    assert isinstance(results[1][0].cause, ChecksumError), repr(results[1][0].cause)  # type: ignore[union-attr]


class _Opaque:
    """An object a save can only store pickled."""


def test_a_pickled_object_in_a_list_is_refused_before_a_rebuilt_step_lands(
    tmp_path: Path,
) -> None:
    """A checkpoint holding a pickled object inside a list, restored after a rebuild without
    ``trust_pickle``: refused with the caller's arrays as they were (the pickled entry is found
    in the skeleton before anything lands, wherever in the tree it is)."""
    root = tmp_path / "l1"

    def save(comm: Any) -> None:
        with _manager(root, comm) as mgr:
            state = _state(comm.rank, blank=False)
            state["objs"] = [_Opaque(), 1]
            mgr.save(3, state, objects="pickle")

    run_threads(4, save)
    shutil.rmtree(root / "n1" / step_dir_name(3))

    def body(comm: Any) -> tuple[str, bool]:
        state = _state(comm.rank, blank=True)
        state["objs"] = [None, 0]
        raised = _refusal(root, comm, state, PickleRefusedError)
        untouched = not state["model"]["w"].data.any() and not state["model"]["b"].any()
        return raised, untouched and state["objs"] == [None, 0]

    for raised, untouched in run_threads(4, body):
        assert "objs/0" in raised
        assert untouched


def test_each_rank_reads_its_own_member_only_never_a_neighbours_files(tmp_path: Path) -> None:
    """4 ranks on 2 nodes (XOR sets {0, 2} and {1, 3}), node n1 lost; each rank wants the rows
    its neighbour saved (0 and 1 swap, 2 and 3). Once the rebuild has read every member, rank
    1's data files on the surviving node are damaged on disk: rank 0, which could read them
    there itself, would fail the load after data had landed. Read as the restore reads (every
    rank its own member, from memory: ``own_only`` all ranks; rank 1 sends rank 0 its rows),
    every rank's rows land bit-exact and nobody reads those files."""
    nodes = ["n0", "n0", "n1", "n1"]
    root = tmp_path / "saved"
    save_level1(root, "xor", nodes, set_size=2)
    shutil.rmtree(root / "n1")
    rebuilt_all = threading.Barrier(4)

    def body(comm: Any) -> tuple[bool, bool]:
        node = nodes[comm.rank]
        rebuilt = rebuild_in_memory(comm, root / node, node, fsync=False)
        rebuilt_all.wait()
        if comm.rank == 0:  # rank 1's files, under rank 0's feet: damage after the rebuild
            for _, ref in member_files(rebuilt.manifest, 1):
                flip(root / "n0" / ref.path, 5)
        rebuilt_all.wait()
        memory = rebuilt.files(comm.rank)
        start, count = rows_of(comm.rank ^ 1, 4)  # the neighbour's rows
        w = np.zeros((count, 5), np.float32)
        loaded, _ = load_collective(
            comm,
            root / node,
            {"model/w": ((start, 0), (count, 5))},
            node=node,
            into={"model/w": w},
            source=memory,
            own_only=range(4),
            check_first=memory.verify,
        )
        landed = loaded["model"]["w"] is w
        return landed, np.array_equal(w, whole(4)["model/w"][start : start + count])

    for landed, exact in run_threads(4, body):
        assert landed and exact


def test_an_allocation_failure_for_scratch_fails_before_a_rebuilt_step_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor whose last inner chunk is partial is read through scratch (the chunk's bytes
    are not one run of the destination). That scratch is allocated with every other buffer,
    before the load's allocation vote: a ``MemoryError`` there (injected: every uint8 buffer the
    load's reads ask for) fails the restore on every rank with the caller's arrays as they were.
    Allocated as each read job starts, as it was, it failed after ``model/w`` had landed."""
    root = tmp_path / "l1"
    edge = (37, 96)  # 37 rows: no chunk height but 37 divides it, and 37 rows exceed a chunk

    def save(comm: Any) -> None:
        with _manager(root, comm) as mgr:
            state = _state(comm.rank, blank=False)
            state["model"]["z_edge"] = np.full(edge, comm.rank + 1.0, np.float32)
            mgr.save(3, state)

    run_threads(4, save)
    shutil.rmtree(root / "n1" / step_dir_name(3))
    asked: list[int] = []
    real_empty = np.empty

    def empty(shape: Any, dtype: Any = float, *args: Any, **kwargs: Any) -> np.ndarray:
        if np.dtype(dtype) == np.uint8:
            asked.append(int(np.prod(shape)))
            raise MemoryError("injected: no memory for a read's scratch")
        return real_empty(shape, dtype, *args, **kwargs)

    monkeypatch.setattr(load_read, "np", _NumpyWith(empty))

    def body(comm: Any) -> tuple[BaseException | None, bool]:
        state = _state(comm.rank, blank=True)
        state["model"]["z_edge"] = np.zeros(edge, np.float32)
        with _manager(root, comm) as mgr:
            try:
                mgr.restore(state, read=ReadOptions(threads=1))  # w read first, then z_edge
            except (LoadFailedError, MemoryError) as exc:
                err: BaseException | None = exc
            else:
                err = None
        arrays = (state["model"]["w"].data, state["model"]["b"], state["model"]["z_edge"])
        return err, not any(a.any() for a in arrays) and state["step"] == 0

    for err, untouched in run_threads(4, body):
        assert err is not None and "injected" in repr(err) + repr(err.__cause__)
        assert untouched
    assert asked  # the fault was met: each rank's edge chunk needed scratch


class _NumpyWith:
    """``numpy`` as a module sees it, but with ``empty`` replaced (a fault injected)."""

    def __init__(self, empty: Any) -> None:
        self.empty = empty

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)
