"""``ckptfmt reshard`` in place onto the ``{node}`` template it reads, to fewer nodes: once the
new save is committed on every new node, the old save's other nodes' directories are removed
(they used to stay: their disk lost, and the old save's copies outvoting the new one's in the
manifest vote a reader of the template takes). A kill (SIGKILL, a process of its own) after the
last node's commit, at each step of that cleanup, never leaves the template unreadable or
reading as the old save; the next reshard onto it removes what the kill left. And a commit
whose last rename is done but whose directory cannot be fsynced (EIO) is reported, not rolled
back into a mix of old and new nodes."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from kit.arrays import assert_bit_equal, random_array
from kit.cli import run_cli
from kit.crash import kill_cli, steps

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.errors import CkptError, NotDurableError
from ckptfmt.interop import tensors_of
from ckptfmt.maintenance.nodes import node_dirs
from ckptfmt.maintenance.reshard import reshard
from ckptfmt.storage import commit

NODES3 = ["n0", "n1", "n2"]


@pytest.fixture
def src(tmp_path: Path) -> Path:
    rng = np.random.default_rng(5)
    state = {
        "model": {
            "w": random_array(rng, np.float32, (24, 40)),
            "b": random_array(rng, np.int16, (9,)),
        },
        "step": 4,
    }
    ckptfmt.save(state, tmp_path / "src", step=4, write=WriteOptions(chunk_bytes=512, fsync=False))
    return tmp_path / "src"


def _three_nodes(src: Path, template: str) -> None:
    got = run_cli(
        "reshard", src, template, "--ranks", "3", "--ranks-per-node", "1", "-q", "--overwrite"
    )
    assert got.exit_code == 0, got.output


def _in_place_to_two(template: str, ranks: int = 2) -> list[str]:
    """``ckptfmt reshard`` of ``template`` onto itself for ``ranks`` ranks, one per node."""
    return [
        "reshard", template, template, "--ranks", str(ranks), "--ranks-per-node", "1",
        "--overwrite", "-q",
    ]  # fmt: skip


def _reads_as(template: str, src: Path, world: int) -> None:
    """``template`` reads as the save of ``world`` ranks, every tensor bit for bit the source's
    (``verify`` checks every CRC too)."""
    manifest, _, dirs = node_dirs(template)
    assert manifest.world_size == world and sorted(dirs) == [f"n{i}" for i in range(world)]
    _, got = tensors_of(template, strip="")
    _, want = tensors_of(src, strip="")
    assert [n for n, _ in got] == [n for n, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert_bit_equal(a, b)
    assert run_cli("verify", template, "-q").exit_code == 0


def test_reshard_in_place_to_fewer_nodes_removes_the_old_nodes(tmp_path: Path, src: Path) -> None:
    template = str(tmp_path / "l1" / "{node}")
    _three_nodes(src, template)
    got = run_cli(*_in_place_to_two(template))
    assert got.exit_code == 0, got.output
    assert sorted(p.name for p in (tmp_path / "l1").iterdir()) == ["n0", "n1"]
    _reads_as(template, src, 2)


def test_only_the_replaced_save_is_removed(tmp_path: Path, src: Path) -> None:
    """A directory of the template that holds another checkpoint (not the one replaced) is not
    the reshard's to remove; a nested template's emptied node directory goes with its node."""
    template = str(tmp_path / "l1" / "{node}" / "ckpt")
    _three_nodes(src, template)
    other = tmp_path / "l1" / "x9" / "ckpt"
    ckptfmt.save({"v": np.arange(3)}, other, write=WriteOptions(fsync=False))
    assert run_cli(*_in_place_to_two(template)).exit_code == 0
    assert sorted(p.name for p in (tmp_path / "l1").iterdir()) == ["n0", "n1", "x9"]
    assert_bit_equal(ckptfmt.load(other)["v"], np.arange(3))
    _reads_as(template, src, 2)


def test_a_copy_of_a_node_and_a_save_beside_the_template_stay(tmp_path: Path, src: Path) -> None:
    """The reshard to fewer nodes removes the old layout's node directories only: a user's
    copy of a node's directory under another name (``cp -r n2 n2-backup``, the same save) and
    the staging directory of a save running beside the template to another name
    (``.other.tmp-*``) are not the old layout's, and stay byte for byte."""
    root = tmp_path / "l1"
    template = str(root / "{node}")
    _three_nodes(src, template)
    shutil.copytree(root / "n2", root / "n2-backup")
    staging = root / f".other.tmp-{'cd' * 16}"
    staging.mkdir()
    (staging / "part").write_bytes(b"a save in flight")
    before = {
        p.relative_to(root): p.read_bytes() for p in (root / "n2-backup").rglob("*") if p.is_file()
    }
    got = run_cli(
        "reshard", src, template, "--ranks", "2", "--ranks-per-node", "1", "--overwrite", "-q"
    )
    assert got.exit_code == 0, got.output
    assert sorted(p.name for p in root.iterdir()) == [staging.name, "n0", "n1", "n2-backup"]
    after = {
        p.relative_to(root): p.read_bytes() for p in (root / "n2-backup").rglob("*") if p.is_file()
    }
    assert after == before
    assert (staging / "part").read_bytes() == b"a save in flight"
    shutil.rmtree(root / "n2-backup")  # the template's reader takes every directory for a node
    _reads_as(template, src, 2)


@pytest.mark.parametrize("ranks", [2, 1])
def test_a_kill_in_the_cleanup_never_loses_the_new_save(
    tmp_path: Path, src: Path, ranks: int
) -> None:
    """From 3 nodes to 2, or to 1: then, killed before the old nodes are removed, the template
    holds two directories of the old save and one of the new, which a reader must not take for
    the old save by majority (the new save records the one it rewrote)."""
    root = tmp_path / "l1"
    template = str(root / "{node}")
    new_nodes = [f"n{i}" for i in range(ranks)]
    _three_nodes(src, template)
    whole = kill_cli(0, root, *_in_place_to_two(template, ranks))
    assert whole.returncode == 0, whole.stderr
    lines = [ln for ln in whole.stderr.splitlines() if ln.startswith("step: ")]
    total = steps(whole)
    # the commit's steps touch the new nodes; the cleanup's the old nodes the new save lacks
    old = [f"n{i}" for i in range(ranks, 3)]
    first_cleanup = next(i for i, ln in enumerate(lines) if any(n in ln for n in old))
    assert first_cleanup == 2 * ranks and total == first_cleanup + len(old), lines
    for n in range(first_cleanup, total + 1):  # killed after the last commit step, and on
        _three_nodes(src, template)
        killed = kill_cli(n, root, *_in_place_to_two(template, ranks))
        assert killed.returncode == -9, f"step {n}: {killed.returncode}\n{killed.stderr}"
        _reads_as(template, src, ranks)  # the new save, whatever the kill left
        again = run_cli(*_in_place_to_two(template, ranks))  # the next reshard finishes
        assert again.exit_code == 0, again.output
        assert sorted(p.name for p in root.iterdir()) == new_nodes, n
        _reads_as(template, src, ranks)


def test_a_commit_that_cannot_be_fsynced_is_not_rolled_back_into_a_mix(
    tmp_path: Path, src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directory fsync after n1's rename fails (EIO): n1 is on the new save (the rename was
    done), so the reshard does not roll n0 back to the old one (a mix of two saves); every node
    is on the new save, and the error says that it may not be on disk and where."""
    root = tmp_path / "l1"
    template = str(root / "{node}")
    nodes = ["n0", "n1"]
    reshard(src, template, 2, nodes=nodes, write=WriteOptions(fsync=False))
    before = {n: json.loads((root / n / "ckptfmt.json").read_text())["save_id"] for n in nodes}
    real, calls = commit.fsync_dir, []

    def fsync_dir(path: Path) -> None:
        if Path(path) == root:
            calls.append(path)
            if len(calls) == 2:  # after n1's rename
                raise OSError(errno.EIO, "Input/output error", str(path))
        real(path)

    monkeypatch.setattr(commit, "fsync_dir", fsync_dir)
    with pytest.raises(CkptError) as info:
        reshard(src, template, 2, nodes=nodes, write=WriteOptions(overwrite=True, chunk_bytes=1024))
    monkeypatch.undo()
    after = {n: json.loads((root / n / "ckptfmt.json").read_text())["save_id"] for n in nodes}
    assert after["n0"] == after["n1"] != before["n0"], (before, after)
    _reads_as(template, src, 2)
    assert isinstance(info.value, NotDurableError), info.value
    msg = str(info.value)
    assert str(root / "n1") in msg and "input/output error" in msg and "power loss" in msg, msg
    # what it kept (the replaced copies) the next reshard onto the template removes
    assert (
        run_cli(
            "reshard",
            template,
            template,
            "--ranks",
            "2",
            "--ranks-per-node",
            "1",
            "--overwrite",
            "-q",
        ).exit_code
        == 0
    )
    assert sorted(p.name for p in root.iterdir()) == nodes


def test_the_cli_reports_a_commit_that_cannot_be_fsynced_in_one_line(
    tmp_path: Path, src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = commit.fsync_dir

    def fsync_dir(path: Path) -> None:
        if Path(path) == tmp_path:
            raise OSError(errno.EIO, "Input/output error", str(path))
        real(path)

    monkeypatch.setattr(commit, "fsync_dir", fsync_dir)
    got = run_cli("reshard", src, tmp_path / "out", "--ranks", "2", "-q")
    assert got.exit_code == 3, got.output
    assert got.output.startswith("Error: ") and got.output.count("\n") == 1, got.output
    assert "may not survive a power loss" in got.output
    monkeypatch.undo()
    assert_bit_equal(ckptfmt.load(tmp_path / "out")["model"]["w"], ckptfmt.load(src)["model"]["w"])


def test_a_reshard_killed_before_its_commit_leaves_nothing_after_the_next(
    tmp_path: Path, src: Path
) -> None:
    """A reshard to 3 nodes killed after the first node's rename leaves the other nodes'
    staging directories (each a node's share of the checkpoint); a later reshard onto the
    template for 1 node (which never saves to those nodes again, so no save of theirs clears
    them) removes them, and the node the kill committed."""
    root = tmp_path / "l1"
    template = str(root / "{node}")
    args = ["reshard", src, template, "--ranks", "3", "--ranks-per-node", "1", "-q"]
    killed = kill_cli(1, root, *args)
    assert killed.returncode == -9, killed.stderr
    assert len([p for p in root.iterdir() if ".tmp-" in p.name]) == 2
    one = ["reshard", src, template, "--ranks", "1", "--overwrite", "-q"]
    assert run_cli(*one).exit_code == 0
    assert sorted(p.name for p in root.iterdir()) == ["n0"]
    _reads_as(template, src, 1)
