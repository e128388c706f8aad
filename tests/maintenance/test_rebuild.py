"""Rebuild repairs damaged metadata copies: a node's damaged ``ckptfmt.json`` or
``zarr.json`` is written anew from the copy whose checksum holds (the majority where good copies
disagree, which the output says), offline (``ckptfmt rebuild``) and at restore
(``rebuild_collective``, every rank a thread). After each repair every file is byte-identical to
what the save wrote, and ``verify`` says healthy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from ckptfmt_cli.exits import ExitStatus
from kit.cli import run_cli as run
from kit.faults import flip
from kit.files import seal_if_sealed, tree_snapshot
from kit.level1 import NODES4, copy, rank_state, save_level1

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.maintenance.repair import rebuild
from ckptfmt.parallel.collective.rebuild import rebuild_collective
from ckptfmt.transport.threads import run_threads

NODES2 = ["n0", "n1"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("saved")
    out = {}
    for name, nodes, size in (("two", NODES2, 2), ("four", NODES4, 4)):
        save_level1(base / name, "xor", nodes, set_size=size)
        out[name] = base / name
    return out


@pytest.mark.parametrize("node", NODES2)
@pytest.mark.parametrize("rel", ["ckptfmt.json", "zarr.json", "model/zarr.json", "rng/zarr.json"])
def test_offline_rebuild_rewrites_a_damaged_copy(
    saved: dict[str, Path], tmp_path: Path, node: str, rel: str
) -> None:
    root, template = copy(saved, "two", tmp_path)
    healthy = tree_snapshot(root)
    path = root / node / rel
    flip(path, len(path.read_bytes()) // 2, 0x04)
    assert run("verify", template).exit_code == ExitStatus.DAMAGED
    result = run("rebuild", "--no-fsync", template)
    assert result.exit_code == ExitStatus.OK, result.output
    assert f"{root / node}: {rel}" in result.output  # each file it rewrote
    assert tree_snapshot(root) == healthy
    assert run("verify", template).exit_code == ExitStatus.OK


def test_a_flip_in_a_redundancy_field_of_one_copy(saved: dict[str, Path], tmp_path: Path) -> None:
    """It used to make both rebuild and verify exit 3 (invalid manifest), although the other
    node holds a good copy."""
    root, template = copy(saved, "two", tmp_path)
    healthy = tree_snapshot(root)
    path = root / "n0" / "ckptfmt.json"
    data = path.read_bytes()
    at = data.index(b'"chunk": ') + len(b'"chunk": ')  # a digit of a set's chunk size
    flip(path, at, 0x01)
    assert run("verify", template).exit_code == ExitStatus.DAMAGED
    doc = json.loads(run("rebuild", "--dry-run", "--json", template).stdout)
    assert doc["status"] == "repairable"
    assert doc["damaged_metadata"] == [f"{root / 'n0'}: ckptfmt.json"]
    # a dry run: nothing written
    assert tree_snapshot(root) == {**healthy, "n0/ckptfmt.json": path.read_bytes()}
    result = run("rebuild", "--no-fsync", template)
    assert result.exit_code == ExitStatus.OK, result.output
    assert tree_snapshot(root) == healthy
    assert run("verify", template).exit_code == ExitStatus.OK


def test_the_majority_of_disagreeing_good_copies_is_taken(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    """A copy whose checksum holds but that differs from the others (here: another step,
    resealed) is outvoted 3 to 1, and the output says so."""
    root, template = copy(saved, "four", tmp_path)
    healthy = tree_snapshot(root)
    odd = root / "n1" / "ckptfmt.json"
    doc: dict[str, Any] = json.loads(odd.read_bytes())
    doc["step"] = 6
    odd.write_bytes(seal_if_sealed(doc))
    assert ckptfmt.open(root / "n1").step == 6  # a good copy on its own
    assert run("verify", template).exit_code == ExitStatus.DAMAGED
    result = run("rebuild", "--no-fsync", template)
    assert result.exit_code == ExitStatus.OK, result.output
    assert "disagree" in result.output and "majority" in result.output
    assert f"{root / 'n1'}: ckptfmt.json" in result.output
    assert tree_snapshot(root) == healthy


def test_data_and_metadata_damage_together(saved: dict[str, Path], tmp_path: Path) -> None:
    root, template = copy(saved, "two", tmp_path)
    healthy = tree_snapshot(root)
    flip(root / "n0" / "ckptfmt.json", 200)
    shard = next(p for p in sorted((root / "n1" / "model" / "w" / "c").rglob("*")) if p.is_file())
    flip(shard, 3)
    report = rebuild(template, write=WriteOptions(fsync=False))
    assert report.lost_data == [1] and f"{root / 'n0'}: ckptfmt.json" in report.metadata
    assert tree_snapshot(root) == healthy


def test_damaged_copies_everywhere_are_not_guessed(saved: dict[str, Path], tmp_path: Path) -> None:
    """No copy whose checksum holds: nothing is written, the damage is reported (exit 1)."""
    root, template = copy(saved, "two", tmp_path)
    for node in NODES2:
        flip(root / node / "ckptfmt.json", 100)
    before = tree_snapshot(root)
    result = run("rebuild", "--no-fsync", template)
    assert result.exit_code == ExitStatus.DAMAGED, result.output
    assert "CRC32C mismatch" in result.output
    assert tree_snapshot(root) == before


# --- at restore: the collective rebuild ------------------------------------------------------


def collective(root: Path, nodes: list[str]) -> list[Any]:
    def body(comm: Any) -> Any:
        node = nodes[comm.rank]
        return rebuild_collective(comm, root / node, node, fsync=False)[0]

    return run_threads(len(nodes), body)


@pytest.mark.parametrize("node", NODES2)
def test_restore_rebuild_rewrites_damaged_copies(
    saved: dict[str, Path], tmp_path: Path, node: str
) -> None:
    root, _ = copy(saved, "two", tmp_path)
    healthy = tree_snapshot(root)
    other = NODES2[1 - NODES2.index(node)]
    flip(root / node / "ckptfmt.json", 300)
    flip(root / other / "model" / "w" / "zarr.json", 40)
    reports = collective(root, NODES2)
    want = {f"{root / node}: ckptfmt.json", f"{root / other}: model/w/zarr.json"}
    assert all(set(r.metadata) == want and r.repaired for r in reports)
    assert tree_snapshot(root) == healthy


def test_restore_takes_the_majority(saved: dict[str, Path], tmp_path: Path) -> None:
    root, _ = copy(saved, "four", tmp_path)
    healthy = tree_snapshot(root)
    odd = root / "n2" / "ckptfmt.json"
    doc: dict[str, Any] = json.loads(odd.read_bytes())
    doc["levels"]["1"]["note"] = "forged"  # a good checksum, same save, other bytes
    odd.write_bytes(seal_if_sealed(doc))
    reports = collective(root, NODES4)
    assert reports[0].metadata == [f"{root / 'n2'}: ckptfmt.json"]
    assert "majority" in reports[0].notes[0]
    assert tree_snapshot(root) == healthy


def test_restore_through_the_manager_repairs_and_loads(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    """CheckpointManager.restore: the load refuses the damaged copy, the rebuild writes it
    anew, the second load restores the state bit for bit."""
    from ckptfmt import CheckpointManager

    root, _ = copy(saved, "two", tmp_path)
    healthy = tree_snapshot(root)
    local = tmp_path / "local"
    for node in NODES2:  # the manager's layout: <local>/<node>/step-0000000005
        (local / node).mkdir(parents=True)
        shutil.copytree(root / node, local / node / "step-0000000005")
    flip(local / "n1" / "step-0000000005" / "ckptfmt.json", 500)
    flip(local / "n0" / "step-0000000005" / "zarr.json", 20)

    def body(comm: Any) -> Any:
        mgr = CheckpointManager(
            local_dir=str(local / "{node}"),
            shared_dir=str(tmp_path / "shared"),
            comm=comm,
            node=NODES2[comm.rank],
            write=WriteOptions(fsync=False),
            redundancy={"scheme": "xor", "set_size": 2},
        )
        try:
            report = mgr.restore()
            return report.step, report.state, report
        finally:
            mgr.close(flush=False)

    results = run_threads(2, body)
    for rank, (step, state, report) in enumerate(results):
        assert step == 5, report
        assert any("metadata" in line for line in report.rebuilt), report
        want = rank_state(rank, 2)
        assert (state["model"]["embed"] == want["model"]["embed"]).all()
    for node in NODES2:
        got = tree_snapshot(local / node / "step-0000000005")
        assert got == {k.split("/", 1)[1]: v for k, v in healthy.items() if k.startswith(node)}
