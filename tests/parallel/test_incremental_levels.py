"""Incremental saves on the levels: level-1 steps whose unchanged files are hard links of the
previous step's keep their own redundancy (a byte flipped in a shared file is seen in every step
that holds it and rebuilt from each step's parity), and an incremental manager's retention,
deletion and flushes (linked on level 3 too) never take data a kept step needs. Every rank is a
thread (``ThreadComm``) on a simulated node."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ckptfmt_cli.exits import ExitStatus
from kit.cli import run_cli as run
from kit.faults import flip
from kit.files import tree_snapshot
from kit.level1 import rank_state

import ckptfmt
from ckptfmt import ExitPolicy, Shard, WriteOptions
from ckptfmt.container.metadata import ManifestMeta
from ckptfmt.parallel.collective.save import save_collective
from ckptfmt.parallel.manager.checkpoint_manager import CheckpointManager
from ckptfmt.redundancy.config import Redundancy
from ckptfmt.redundancy.record import record_of
from ckptfmt.transport.threads import run_threads

NODES = ["n0", "n1"]
W = WriteOptions(fsync=False, chunk_bytes=40, shard_bytes=160, threads=1, content_hash=True)


SCHEMES = {
    "xor": {"scheme": "xor", "set_size": 2},
    "rs": {"scheme": "rs", "set_size": 2, "m": 1},
}


def _save(root: Path, base: Path | None, seed_w: int, scheme: str = "xor") -> None:
    """Both nodes save :func:`rank_state` with ``scheme``'s redundancy into ``root/<node>``,
    rank 0's rows of ``model/w`` changed by ``seed_w``; incremental against ``base/<node>``."""
    red = Redundancy.of(SCHEMES[scheme])

    def body(comm: Any) -> None:
        state = rank_state(comm.rank, comm.size)
        if comm.rank == 0 and seed_w:
            state["model"]["w"].data[:] += seed_w
        save_collective(
            comm,
            state,
            root / NODES[comm.rank],
            step=5,
            node=NODES[comm.rank],
            redundancy=red,
            write=W,
            meta=ManifestMeta(levels={"1": {}}),
            base=None if base is None else base / NODES[comm.rank],
        )

    run_threads(2, body)


def _shared_file(a: Path, b: Path) -> str:
    """A data file of ``b`` that is a hard link of ``a``'s (the same inode)."""
    for node in NODES:
        m = ckptfmt.open(b / node).manifest
        for t, f in m.files():
            if m.ranks[next(r.rank for r in t.regions if f in r.files)].node != node:
                continue
            if (b / node / f.path).stat().st_ino == (a / node / f.path).stat().st_ino:
                return f"{node}/{f.path}"
    raise AssertionError("no file is shared")


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_a_flip_in_a_shared_file_is_seen_in_both_steps_and_rebuilt_from_each_parity(
    tmp_path: Path, scheme: str
) -> None:
    """A bit flipped on disk in a file two steps share (one inode) damages both: each step's
    verify names it, each step loads from its own parity, and ``ckptfmt rebuild`` of one step
    replaces the file in that step only (a new file under a temporary name, renamed over the
    link: a rebuild never writes through a link into another checkpoint), so the other step is
    damaged until it is rebuilt in turn from its own parity."""
    a, b = tmp_path / "a", tmp_path / "b"
    _save(a, None, 0, scheme)
    _save(b, a, 3, scheme)
    for root in (a, b):  # each step's parity covers every one of its files, linked or not
        record = record_of(ckptfmt.open(f"{root}/{{node}}").manifest)
        assert record is not None and record.scheme == scheme
    healthy_a, healthy_b = tree_snapshot(a), tree_snapshot(b)
    whole_a, whole_b = ckptfmt.load(f"{a}/{{node}}"), ckptfmt.load(f"{b}/{{node}}")
    rel = _shared_file(a, b)
    assert (b / rel).stat().st_nlink == 2
    flip(b / rel, 5, 0x10)  # in place: the inode both steps name
    assert (a / rel).read_bytes() == (b / rel).read_bytes() != healthy_a[rel]
    for root in (a, b):
        report = ckptfmt.verify(f"{root}/{{node}}")
        assert not report.healthy
        assert rel.split("/", 1)[1] in str(report.to_json()), report.to_json()
        assert run("verify", f"{root}/{{node}}").exit_code == ExitStatus.DAMAGED
    # a load rebuilds what it needs from the step's own parity (in scratch space)
    for root, whole in ((a, whole_a), (b, whole_b)):
        got = ckptfmt.load(f"{root}/{{node}}")
        assert all(np.array_equal(got["model"][k], whole["model"][k]) for k in whole["model"])
    assert run("rebuild", "--no-fsync", f"{b}/{{node}}").exit_code == ExitStatus.OK
    assert tree_snapshot(b) == healthy_b
    assert (b / rel).stat().st_nlink == 1  # replaced, not written through the link
    assert run("verify", f"{b}/{{node}}").exit_code == ExitStatus.OK
    assert run("verify", f"{a}/{{node}}").exit_code == ExitStatus.DAMAGED
    assert run("rebuild", "--no-fsync", f"{a}/{{node}}").exit_code == ExitStatus.OK
    assert tree_snapshot(a) == healthy_a
    assert run("verify", f"{a}/{{node}}").exit_code == ExitStatus.OK


ROWS = 96


def _state(rank: int, k: int) -> dict[str, Any]:
    """Step ``k`` of a job of two ranks: a frozen replicated table, a sharded weight of which
    only a few rows change per step, and a step counter."""
    frozen = np.random.default_rng(7).standard_normal((256, 32), dtype=np.float32)
    w = np.random.default_rng(8).standard_normal((ROWS, 32), dtype=np.float32)
    for j in range(1, k + 1):
        w[(j * 37) % ROWS] += j
    half = ROWS // 2
    return {
        "frozen": frozen,
        "w": Shard(w[rank * half : (rank + 1) * half].copy(), (rank * half, 0), (ROWS, 32)),
        "k": k,
    }


def _whole(k: int) -> dict[str, Any]:
    parts = [_state(r, k) for r in range(2)]
    return {
        "frozen": parts[0]["frozen"],
        "w": np.concatenate([p["w"].data for p in parts]),
        "k": k,
    }


def _same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return (
        np.array_equal(got["frozen"], want["frozen"])
        and np.array_equal(got["w"], want["w"])
        and got["k"] == want["k"]
    )


def test_an_incremental_managers_retention_and_flushes_keep_what_kept_steps_need(
    tmp_path: Path,
) -> None:
    reports: dict[int, list[Any]] = {0: [], 1: []}
    write = WriteOptions(fsync=False, chunk_bytes=1024, shard_bytes=4096, threads=1)

    def manager(comm: Any, **kw: Any) -> CheckpointManager:
        return CheckpointManager(
            f"{tmp_path}/l1/{{node}}",
            tmp_path / "l3",
            comm=comm,
            node=NODES[comm.rank],
            redundancy={"scheme": "xor", "set_size": 2},
            keep_local=2,
            keep_shared=2,
            incremental=True,
            async_save=False,
            write=write,
            at_exit=ExitPolicy(flush=False, sigterm=False),
            **kw,
        )

    def body(comm: Any) -> None:
        m = manager(comm, on_save=reports[comm.rank].append)
        for k in range(6):
            m.save(k, _state(comm.rank, k))
        m.delete(4)  # the base of step 5 on both levels
        m.close(flush=False)

    run_threads(2, body)
    l1 = {n: tmp_path / "l1" / n for n in NODES}
    l3 = tmp_path / "l3"
    assert sorted(p.name for p in l1["n0"].iterdir()) == ["step-0000000005"]
    assert sorted(p.name for p in l3.glob("step-*")) == ["step-0000000005"]
    for first in (reports[0][0], reports[1][0]):
        assert first.error is None and not first.bytes_linked.get("1")
    for both in zip(reports[0][1:], reports[1][1:]):  # from the second save on: mostly links
        for r in both:
            assert r.error is None and r.flush_error is None and r.flushed, r
            assert r.link_refused == 0
        for level in ("1", "3"):
            linked = sum(r.bytes_linked[level] for r in both)
            written = sum(r.bytes_written[level] for r in both)
            assert linked > 2 * written > 0, both
    step5 = f"{tmp_path}/l1/{{node}}/step-0000000005"
    assert ckptfmt.verify(step5).healthy
    assert ckptfmt.verify(l3 / "step-0000000005").healthy
    assert _same(ckptfmt.load(step5), _whole(5))
    assert _same(ckptfmt.load(l3 / "step-0000000005"), _whole(5))

    def restore(comm: Any) -> Any:
        m = manager(comm)
        try:
            return m.restore(_state(comm.rank, 0)).step
        finally:
            m.close(flush=False)

    assert run_threads(2, restore) == [5, 5]


def test_retention_of_an_incremental_chain_on_one_level_keeps_every_kept_step_whole(
    tmp_path: Path,
) -> None:
    """A manager with level 3 only (its saves are incremental there): after every save the
    steps retention kept load bit for bit, though each one's base was removed."""
    m = CheckpointManager(
        shared_dir=tmp_path / "l3",
        keep_shared=3,
        incremental=True,
        async_save=False,
        write=WriteOptions(fsync=False, chunk_bytes=1024, shard_bytes=4096),
        at_exit=ExitPolicy(flush=False, sigterm=False),
    )
    try:
        for k in range(7):
            whole = _whole(k)
            m.save(k, {"frozen": whole["frozen"], "w": whole["w"], "k": k})
            kept = sorted(int(p.name[5:]) for p in (tmp_path / "l3").glob("step-*"))
            assert kept == list(range(max(0, k - 2), k + 1))
            for s in kept:
                assert _same(ckptfmt.load(tmp_path / "l3" / f"step-{s:010d}"), _whole(s)), s
            assert m.last_save is not None and (k == 0 or m.last_save.bytes_linked["3"] > 0)
    finally:
        m.close(flush=False)


def _save_on(
    root: Path, base: Path | None, nodes: list[str], scheme: str, seed_w: int
) -> list[dict[str, Any]]:
    """Every rank ``r`` saves :func:`rank_state` into ``root/<nodes[r]>`` with ``scheme``'s
    redundancy in sets of two (``nodes`` of four: sets {0, 1} and {2, 3}), rank 0's rows of
    ``model/w`` changed by ``seed_w``, incremental against ``base``; each rank's report."""
    red = Redundancy.of(SCHEMES[scheme])

    def body(comm: Any) -> dict[str, Any]:
        state = rank_state(comm.rank, comm.size)
        if comm.rank == 0 and seed_w:
            state["model"]["w"].data[:] += seed_w
        report: dict[str, Any] = {}
        save_collective(
            comm,
            state,
            root / nodes[comm.rank],
            step=5,
            node=nodes[comm.rank],
            redundancy=red,
            write=W,
            meta=ManifestMeta(levels={"1": {}}),
            base=None if base is None else base / nodes[comm.rank],
            report=report,
        )
        return report

    return run_threads(len(nodes), body)


def _parity_inodes(root: Path, nodes: list[str]) -> list[int]:
    return [(root / n / "ckptfmt-redundancy" / str(r)).stat().st_ino for r, n in enumerate(nodes)]


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_a_set_whose_members_are_all_unchanged_links_its_parity_and_a_changed_set_encodes(
    tmp_path: Path, scheme: str
) -> None:
    """Four nodes, sets {0, 1} and {2, 3}; the incremental step changes rank 0's rows only.
    Set {2, 3} (nothing changed) takes the base's parity files as hard links (the same inodes,
    counted as linked, not written); set {0, 1} encodes anew (new files, other bytes). With the
    base deleted, the step verifies, and losing a node of either set rebuilds it bit for bit
    from the step's own parity (the linked parity files included)."""
    nodes = ["n0", "n1", "n2", "n3"]
    a, b = tmp_path / "a", tmp_path / "b"
    _save_on(a, None, nodes, scheme, 0)
    parity_a = {
        r: (a / n / "ckptfmt-redundancy" / str(r)).read_bytes() for r, n in enumerate(nodes)
    }
    reports = _save_on(b, a, nodes, scheme, 3)
    ino_a, ino_b = _parity_inodes(a, nodes), _parity_inodes(b, nodes)
    assert [x == y for x, y in zip(ino_a, ino_b)] == [False, False, True, True]
    # in a set of two, member 0's parity is member 1's data (one data chunk per stripe), so only
    # member 1's parity (member 0's data) changes; member 0's is encoded anew all the same
    # (reuse is per set)
    now = {r: (b / n / "ckptfmt-redundancy" / str(r)).read_bytes() for r, n in enumerate(nodes)}
    assert [now[r] == parity_a[r] for r in range(4)] == [True, False, True, True]
    size = [len(parity_a[r]) for r in range(4)]
    assert [rep.get("parity_linked_bytes", 0) for rep in reports] == [0, 0, size[2], size[3]]
    assert [rep.get("parity_written_bytes", 0) for rep in reports] == [size[0], size[1], 0, 0]
    assert reports[0]["job_parity_linked_bytes"] == size[2] + size[3]
    record_a = record_of(ckptfmt.open(f"{a}/{{node}}").manifest)
    record_b = record_of(ckptfmt.open(f"{b}/{{node}}").manifest)
    assert record_a is not None and record_b is not None
    assert record_b.sets[1] == record_a.sets[1]  # the linked set: the base's parity record
    healthy = tree_snapshot(b)
    whole = ckptfmt.load(f"{b}/{{node}}")
    for n in nodes:
        shutil.rmtree(a / n)  # the base is gone: the links keep the files
    assert run("verify", f"{b}/{{node}}").exit_code == ExitStatus.OK
    for lost in ("n0", "n3"):  # a node of the changed set, then of the linked one
        shutil.rmtree(b / lost)
        assert run("verify", f"{b}/{{node}}").exit_code == ExitStatus.DAMAGED
        assert run("rebuild", "--no-fsync", f"{b}/{{node}}").exit_code == ExitStatus.OK
        assert tree_snapshot(b) == healthy
        assert run("verify", f"{b}/{{node}}").exit_code == ExitStatus.OK
        got = ckptfmt.load(f"{b}/{{node}}")
        assert all(np.array_equal(got["model"][k], whole["model"][k]) for k in whole["model"])


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_an_unchanged_step_links_every_parity_file_and_rebuilds_without_its_base(
    tmp_path: Path, scheme: str
) -> None:
    """Nothing changed: every data and parity file of the step is a link of the base's; with
    the base deleted, a lost node's step directory is rebuilt bit for bit from the linked
    parity."""
    a, b = tmp_path / "a", tmp_path / "b"
    _save_on(a, None, NODES, scheme, 0)
    reports = _save_on(b, a, NODES, scheme, 0)
    assert _parity_inodes(a, NODES) == _parity_inodes(b, NODES)
    assert all(rep["written_bytes"] == 0 and rep["parity_linked_bytes"] > 0 for rep in reports)
    healthy = tree_snapshot(b)
    whole = ckptfmt.load(f"{b}/{{node}}")
    for n in NODES:
        shutil.rmtree(a / n)
    shutil.rmtree(b / "n1")
    assert run("rebuild", "--no-fsync", f"{b}/{{node}}").exit_code == ExitStatus.OK
    assert tree_snapshot(b) == healthy
    assert run("verify", f"{b}/{{node}}").exit_code == ExitStatus.OK
    got = ckptfmt.load(f"{b}/{{node}}")
    assert all(np.array_equal(got["model"][k], whole["model"][k]) for k in whole["model"])


def test_any_doubt_about_a_sets_base_parity_makes_the_whole_set_encode(tmp_path: Path) -> None:
    """Nothing changed, but one member of set {2, 3} finds no base parity file (deleted): that
    set encodes on both its members (the other member's file, present, is not linked alone),
    set {0, 1} links. A base saved under another scheme lends no parity at all. Each step
    verifies and its parity is that of a full save."""
    nodes = ["n0", "n1", "n2", "n3"]
    a, b, c, full = (tmp_path / x for x in ("a", "b", "c", "full"))
    _save_on(a, None, nodes, "xor", 0)
    _save_on(full, None, nodes, "xor", 0)
    (a / "n2" / "ckptfmt-redundancy" / "2").unlink()
    reports = _save_on(b, a, nodes, "xor", 0)
    same = [x == y for x, y in zip(_parity_inodes(a, ["n0", "n1"]), _parity_inodes(b, nodes))]
    assert same == [True, True]
    assert (b / "n3" / "ckptfmt-redundancy" / "3").stat().st_ino != (
        a / "n3" / "ckptfmt-redundancy" / "3"
    ).stat().st_ino
    assert [rep.get("parity_linked_bytes", 0) > 0 for rep in reports] == [True, True, False, False]
    assert run("verify", f"{b}/{{node}}").exit_code == ExitStatus.OK
    _save_on(c, full, nodes, "rs", 0)
    assert not set(_parity_inodes(c, nodes)) & set(_parity_inodes(full, nodes))
    assert run("verify", f"{c}/{{node}}").exit_code == ExitStatus.OK
    for r, n in enumerate(nodes):
        parity = f"{n}/ckptfmt-redundancy/{r}"
        assert (b / parity).read_bytes() == (full / parity).read_bytes()


@pytest.mark.parametrize("levels", ["shared", "local+shared"])
def test_a_restarted_job_never_links_from_a_step_it_found_damaged(
    tmp_path: Path, levels: str
) -> None:
    """A bit flipped in the frozen table shared by every step of a chain: the restore refuses
    those steps. The restarted job saves the same frozen table again: its steps must not be
    made of the damaged file (a hard link to it would make every new step as unloadable as the
    old ones, for as long as the table stays frozen, though the job held the right bytes). An
    incremental manager takes as base only a step it saved, flushed or restored itself."""
    local = levels == "local+shared"

    def manager() -> CheckpointManager:
        return CheckpointManager(
            local_dir=tmp_path / "l1" if local else None,
            shared_dir=tmp_path / "l3",
            keep_local=3,
            keep_shared=3,
            incremental=True,
            async_save=False,
            write=WriteOptions(fsync=False, chunk_bytes=1024, shard_bytes=4096),
            at_exit=ExitPolicy(flush=False, sigterm=False),
        )

    def state(k: int) -> dict[str, Any]:
        whole = _whole(k)
        return {"frozen": whole["frozen"].copy(), "w": whole["w"].copy(), "k": k}

    m = manager()
    try:
        for k in (1, 2, 3):
            m.save(k, state(k))
    finally:
        m.close(flush=False)
    damaged = tmp_path / ("l1" if local else "l3")
    table = damaged / "step-0000000003" / "frozen" / "c" / "0" / "0"
    assert table.stat().st_nlink == 3  # one file, shared by the three steps
    flip(table, byte=100)

    m = manager()
    try:
        if local:  # step 3 from level 3
            restored = m.restore(state(0))
            assert (restored.step, restored.level) == (3, 3), restored.tried
        else:
            with pytest.warns(ckptfmt.CheckpointWarning, match="refused step 3"):
                assert m.restore(state(0)).step is None
        again = (4, 5) if local else (1, 2)
        for k in again:
            m.save(k, state(k))
        assert m.last_save is not None and m.last_save.error is None
    finally:
        m.close(flush=False)
    for root in [tmp_path / "l3", *([tmp_path / "l1"] if local else [])]:
        for k in again:
            step = root / f"step-{k:010d}"
            assert ckptfmt.verify(step).healthy, step
            assert _same(ckptfmt.load(step), _whole(k)), step
            assert (step / "frozen/c/0/0").stat().st_ino != table.stat().st_ino, step


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_members_saving_against_different_bases_encode_their_set(
    tmp_path: Path, scheme: str
) -> None:
    """Each node's base is its own (``base`` per rank): node n0 saves against step a, node n1
    against step b, in which rank 1's rows had changed. Each member's data is its own base's
    byte for byte, but the two bases' parity files are of different data: linking both would
    give the step parity of no state (rank 0's from a covers rank 1's old rows). A set links
    only when all its members link from one save; this one encodes, verifies, and rebuilds a
    lost node bit for bit."""
    red = Redundancy.of(SCHEMES[scheme])
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"

    def save(root: Path, changed: int, bases: list[Path | None]) -> list[dict[str, Any]]:
        def body(comm: Any) -> dict[str, Any]:
            state = rank_state(comm.rank, comm.size)
            if comm.rank == 1:
                state["model"]["w"].data[:] += changed
            report: dict[str, Any] = {}
            base = bases[comm.rank]
            save_collective(
                comm,
                state,
                root / NODES[comm.rank],
                step=5,
                node=NODES[comm.rank],
                redundancy=red,
                write=W,
                meta=ManifestMeta(levels={"1": {}}),
                base=None if base is None else base / NODES[comm.rank],
                report=report,
            )
            return report

        return run_threads(2, body)

    save(a, 0, [None, None])
    save(b, 3, [a, a])
    reports = save(c, 3, [a, b])  # every member unchanged against its own base
    assert all(r["written_bytes"] == 0 for r in reports)  # the data files are all links
    assert run("verify", f"{c}/{{node}}").exit_code == ExitStatus.OK
    assert [r.get("parity_linked_bytes", 0) for r in reports] == [0, 0]
    healthy = tree_snapshot(c)
    whole = ckptfmt.load(f"{c}/{{node}}")
    shutil.rmtree(c / "n1")
    assert run("rebuild", "--no-fsync", f"{c}/{{node}}").exit_code == ExitStatus.OK
    assert tree_snapshot(c) == healthy
    got = ckptfmt.load(f"{c}/{{node}}")
    assert all(np.array_equal(got["model"][k], whole["model"][k]) for k in whole["model"])


def test_a_restarted_job_links_only_on_the_level_its_restore_read(tmp_path: Path) -> None:
    """The restarted job restores step 3 from level 1: its first save links from it on level 1
    (read and checked by the restore), and its flush writes everything (level 3's copy of step
    3 was not read by this job); the next flush links from the step this job flushed. A bit
    flipped on level 3 in step 3's frozen file since the first job ended is then never passed
    on: every new step on level 3 is whole (linked from the damaged copy, each was damaged)."""

    def manager() -> CheckpointManager:
        return CheckpointManager(
            local_dir=tmp_path / "l1",
            shared_dir=tmp_path / "l3",
            incremental=True,
            async_save=False,
            write=WriteOptions(fsync=False, chunk_bytes=1024, shard_bytes=4096),
            at_exit=ExitPolicy(flush=False, sigterm=False),
        )

    def state(k: int) -> dict[str, Any]:
        whole = _whole(k)
        return {"frozen": whole["frozen"].copy(), "w": whole["w"].copy(), "k": k}

    with manager() as m:
        for k in (1, 2, 3):
            m.save(k, state(k))
    step3 = tmp_path / "l3" / "step-0000000003"
    rotted = [p for p in (step3 / "frozen").rglob("*") if p.is_file() and "/c/" in str(p)]
    assert rotted
    for p in rotted:  # bit rot on level 3 after the job ended (level 1 stays whole)
        flip(p)
    assert not ckptfmt.verify(step3).healthy
    frozen = _whole(0)["frozen"].nbytes
    with manager() as m:
        restored = m.restore(state(0))
        assert (restored.step, restored.level) == (3, 1)
        m.save(4, state(4))
        first = m.last_save
        m.save(5, state(5))
        second = m.last_save
    assert first is not None and first.flushed and second is not None and second.flushed
    assert first.bytes_linked["1"] >= frozen and first.bytes_linked.get("3", 0) == 0, first
    assert second.bytes_linked["1"] >= frozen and second.bytes_linked["3"] >= frozen, second
    for step in (4, 5):
        for level in ("l1", "l3"):
            path = tmp_path / level / f"step-{step:010d}"
            assert ckptfmt.verify(path).healthy, (level, step)
            assert _same(ckptfmt.load(path), _whole(step))
