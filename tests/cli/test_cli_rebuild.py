"""``ckptfmt rebuild``: exit statuses 0/1/2/3, what it says, --dry-run, --json, --node, and that
a repair beyond the tolerance writes nothing. The checkpoints are real level-1 saves of 8 ranks
on 4 simulated nodes (``kit.level1``: the collective save on thread ranks)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from ckptfmt_cli.exits import ExitStatus
from kit.cli import run_cli as run
from kit.faults import flip
from kit.files import seal_if_sealed, tree
from kit.level1 import NODES8, copy, merge, save_level1

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.manifest.codec import parse_manifest
from ckptfmt.redundancy.record import member_files


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One pristine save per scheme (copied by each test before damaging it)."""
    base = tmp_path_factory.mktemp("saved")
    out = {}
    for name, red in (("xor", "xor"), ("rs2", {"scheme": "rs", "m": 2}), ("none", None)):
        save_level1(base / name, red)
        out[name] = base / name
    return out


def data_file(root: Path, rank: int, which: int = 0) -> Path:
    manifest = parse_manifest((root / NODES8[rank] / "ckptfmt.json").read_bytes())
    return root / NODES8[rank] / member_files(manifest, rank)[which][1].path


def tensors_of(root: Path, ranks: set[int]) -> list[str]:
    manifest = parse_manifest((root / "n1" / "ckptfmt.json").read_bytes())
    return sorted(
        {"/".join(t.name) for t in manifest.tensors() for r in t.regions if r.rank in ranks}
    )


# --- 0: healthy afterwards ------------------------------------------------------------------------


def test_healthy_nothing_to_do(saved: dict[str, Path], tmp_path: Path) -> None:
    root, template = copy(saved, "xor", tmp_path)
    before = tree(root)
    result = run("rebuild", template)
    assert result.exit_code == ExitStatus.OK, result.output
    assert result.stdout.startswith("healthy, nothing to do")
    assert "xor redundancy" in result.stdout
    doc = json.loads(run("rebuild", "--json", template).stdout)
    assert doc["status"] == "healthy" and doc["lost_data_ranks"] == doc["files_written"] == []
    assert doc["scheme"] == "xor" and doc["step"] == 5 and doc["bytes_read"] > 0
    assert tree(root) == before


def test_lost_node_is_recreated(saved: dict[str, Path], tmp_path: Path) -> None:
    root, template = copy(saved, "rs2", tmp_path)
    healthy = {k: v[0] for k, v in tree(root).items()}
    shutil.rmtree(root / "n1")
    flip(data_file(root, 6))  # and a bit of rank 6's data on n3: two nodes of rs m=2
    result = run("rebuild", "--no-fsync", template)
    assert result.exit_code == ExitStatus.OK, result.output
    out = result.stdout
    assert out.startswith("repaired: ")
    assert "lost: data of rank(s) 2, 3, 6; parity of rank(s) 2, 3 (node(s) n1, n3)" in out
    assert f"recreated: {root / 'n1'}" in out
    assert f"{root / 'n3'}: {data_file(root, 6).relative_to(root / 'n3').as_posix()}" in out
    assert "healthy now" in out
    assert {k: v[0] for k, v in tree(root).items()} == healthy
    assert run("verify", "-q", template).exit_code == ExitStatus.OK


def test_json_report(saved: dict[str, Path], tmp_path: Path) -> None:
    root, template = copy(saved, "xor", tmp_path)
    shutil.rmtree(root / "n2")
    result = run("rebuild", "--json", "--no-fsync", template)
    assert result.exit_code == ExitStatus.OK, result.output
    doc = json.loads(result.stdout)
    assert set(doc) == {
        "path", "status", "dry_run", "step", "scheme", "lost_data_ranks", "lost_parity_ranks",
        "lost_nodes", "damaged_metadata", "notes", "recreated", "files_written", "bytes_read",
        "seconds",
    }  # fmt: skip
    assert doc["path"] == template and doc["status"] == "repaired" and doc["dry_run"] is False
    assert doc["lost_data_ranks"] == [4, 5] and doc["lost_parity_ranks"] == [4, 5]
    assert doc["lost_nodes"] == ["n2"] and doc["recreated"] == [str(root / "n2")]
    assert doc["damaged_metadata"] == []
    written = {f.split(": ", 1)[1] for f in doc["files_written"]}
    assert {"ckptfmt-redundancy/4", "ckptfmt-redundancy/5"} <= written
    assert all(f.startswith(f"{root / 'n2'}: ") for f in doc["files_written"])


def test_node_mapping_and_one_directory(saved: dict[str, Path], tmp_path: Path) -> None:
    root, _ = copy(saved, "xor", tmp_path)
    flip(data_file(root, 3))
    args = [f"--node={n}={root / n}" for n in ("n0", "n1", "n2", "n3")]
    result = run("rebuild", "--json", "--no-fsync", *args)
    assert result.exit_code == ExitStatus.OK, result.output
    doc = json.loads(result.stdout)
    assert doc["lost_data_ranks"] == [3] and doc["path"] == "the node directories"
    assert run("verify", "-q", *args).exit_code == ExitStatus.OK

    one = merge(root, NODES8, tmp_path / "one")
    (one / "ckptfmt-redundancy" / "0").unlink()
    result = run("rebuild", "--json", "--no-fsync", one)
    assert result.exit_code == ExitStatus.OK, result.output
    assert json.loads(result.stdout)["lost_parity_ranks"] == [0]
    assert (one / "ckptfmt-redundancy" / "0").is_file()


# --- --dry-run writes nothing ---------------------------------------------------------------------


def test_dry_run_writes_nothing(saved: dict[str, Path], tmp_path: Path) -> None:
    root, template = copy(saved, "rs2", tmp_path)
    shutil.rmtree(root / "n3")
    flip(data_file(root, 0))
    (root / "n1" / "ckptfmt-redundancy" / "3").unlink()
    before = tree(tmp_path)
    result = run("rebuild", "--dry-run", template)
    assert result.exit_code == ExitStatus.OK, result.output
    assert result.stdout.startswith("would repair (dry run, nothing written): ")
    assert f"to recreate: {root / 'n3'}" in result.stdout
    doc = json.loads(run("rebuild", "--dry-run", "--json", template).stdout)
    assert doc["status"] == "repairable" and doc["dry_run"] is True
    assert doc["lost_data_ranks"] == [0, 6, 7] and doc["lost_parity_ranks"] == [3, 6, 7]
    assert doc["recreated"] == [str(root / "n3")] and doc["files_written"] == []
    assert tree(tmp_path) == before  # not a byte, not a directory, not a timestamp
    assert not (root / "n3").exists()
    assert run("rebuild", "--no-fsync", template).exit_code == ExitStatus.OK  # it was right
    assert run("verify", "-q", template).exit_code == ExitStatus.OK


# --- 1: beyond the tolerance, nothing written -----------------------------------------------------


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
def test_beyond_tolerance_exits_1_and_writes_nothing(
    saved: dict[str, Path], tmp_path: Path, dry_run: bool
) -> None:
    root, template = copy(saved, "xor", tmp_path)
    shutil.rmtree(root / "n0")  # set [0,2,4,6] loses rank 0 and, below, rank 4: two of xor's one
    flip(data_file(root, 4))
    (root / "n3" / "ckptfmt-redundancy" / "7").unlink()  # set [1,3,5,7]: rank 1 and 7's parity
    before = tree(tmp_path)
    extra = ["--dry-run"] if dry_run else []
    result = run("rebuild", *extra, template)
    assert result.exit_code == ExitStatus.DAMAGED, result.output
    out = result.stdout
    assert out.startswith(f"UNRECOVERABLE: {template}: nothing was written")
    assert "set 0 (ranks [0, 2, 4, 6])" in out and "set 1 (ranks [1, 3, 5, 7])" in out
    assert "lost ranks: 0, 1, 4" in out and "lost nodes: n0, n2" in out
    assert f"lost tensors: {', '.join(tensors_of(root, {0, 1, 4}))}" in out
    doc = json.loads(run("rebuild", "--json", *extra, template).stdout)
    assert doc["status"] == "unrecoverable" and doc["written"] is False
    assert doc["lost_ranks"] == [0, 1, 4] and doc["lost_nodes"] == ["n0", "n2"]
    assert doc["lost_tensors"] == tensors_of(root, {0, 1, 4})
    assert tree(tmp_path) == before  # atomic: no file replaced, no directory made


def test_no_redundancy_damaged_exits_1(saved: dict[str, Path], tmp_path: Path) -> None:
    root, template = copy(saved, "none", tmp_path)
    assert run("rebuild", template).stdout.startswith("healthy, nothing to do")
    flip(data_file(root, 5))
    before = tree(root)
    result = run("rebuild", template)
    assert result.exit_code == ExitStatus.DAMAGED
    assert "no redundancy" in result.stdout and "lost ranks: 5" in result.stdout
    assert tree(root) == before


# --- 2: usage -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["PATH", "--node", "n0=/x"],
        ["--node", "n0"],
        ["--node", "=dir"],
        ["--node", "n0=/a", "--node", "n0=/b"],
        ["--frobnicate", "PATH"],
    ],
    ids=["nothing", "both", "no-equals", "no-name", "twice", "unknown-option"],
)
def test_usage_errors_exit_2(saved: dict[str, Path], tmp_path: Path, args: list[str]) -> None:
    root, template = copy(saved, "xor", tmp_path)
    before = tree(root)
    result = run("rebuild", *[template if a == "PATH" else a for a in args])
    assert result.exit_code == ExitStatus.USAGE, result.output
    assert "Error" in result.stderr
    assert tree(root) == before


def test_mapping_without_every_node_exits_2(saved: dict[str, Path], tmp_path: Path) -> None:
    root, _ = copy(saved, "xor", tmp_path)
    result = run("rebuild", f"--node=n0={root / 'n0'}", f"--node=n1={root / 'n1'}")
    assert result.exit_code == ExitStatus.USAGE
    assert "no directory given for node(s) n2, n3" in result.stderr


# --- 3: not a readable checkpoint -----------------------------------------------------------------


def test_not_a_checkpoint_exits_3(saved: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "empty", tmp_path / "absent", str(tmp_path / "absent" / "{node}")):
        result = run("rebuild", target)
        assert result.exit_code == ExitStatus.UNREADABLE, (target, result.output)
        assert "not a readable checkpoint" in result.stderr
    root, template = copy(saved, "xor", tmp_path)
    for node in ("n0", "n1", "n2", "n3"):  # every copy torn: no manifest anywhere
        (root / node / "ckptfmt.json").unlink()
    assert run("rebuild", template).exit_code == ExitStatus.UNREADABLE
    assert run("rebuild", "--dry-run", "--json", template).exit_code == ExitStatus.UNREADABLE


def test_invalid_record_exits_3(saved: dict[str, Path], tmp_path: Path) -> None:
    root, template = copy(saved, "xor", tmp_path)
    for node in ("n0", "n1", "n2", "n3"):
        path = root / node / "ckptfmt.json"
        doc: dict[str, Any] = json.loads(path.read_text())
        doc["levels"]["1"]["redundancy"]["sets"][0]["chunk"] += 1
        path.write_bytes(seal_if_sealed(doc))  # as a writer would: the checksum holds
    result = run("rebuild", template)
    assert result.exit_code == ExitStatus.UNREADABLE
    assert "/levels/1/redundancy/sets/0" in result.stderr
    assert ckptfmt.open(root / "n0").manifest.step == 5  # the rest of the manifest still reads


def test_help_lists_the_rebuild_statuses() -> None:
    out = run("rebuild", "--help").stdout
    assert "--dry-run" in out and "--node NAME=DIR" in out and "{node}" in out
    assert "For rebuild:" in out and "Exit statuses (every command)" in out
    assert "rebuild" in run("--help").stdout


# --- zarr documents, and what a failed write leaves ---------------------------------------------


@pytest.mark.parametrize("name", ["xor", "none"])
def test_damaged_zarr_documents_are_written_anew(
    saved: dict[str, Path], tmp_path: Path, name: str
) -> None:
    root, template = copy(saved, name, tmp_path)
    healthy = {k: v[0] for k, v in tree(root).items()}
    (root / "n1" / "model" / "w" / "zarr.json").unlink()
    (root / "n2" / "zarr.json").write_text("{}")
    (root / "n3" / "model" / "zarr.json").write_text('{"zarr_format": 3, "node_type": "array"}')
    assert run("verify", "-q", template).exit_code == ExitStatus.DAMAGED
    doc = json.loads(run("rebuild", "--dry-run", "--json", template).stdout)
    assert doc["status"] == "repairable" and doc["lost_data_ranks"] == []
    assert doc["damaged_metadata"] == [
        f"{root / 'n1'}: model/w/zarr.json",
        f"{root / 'n2'}: zarr.json",
        f"{root / 'n3'}: model/zarr.json",
    ]
    result = run("rebuild", "--no-fsync", template)
    assert result.exit_code == ExitStatus.OK, result.output
    assert "zarr documents missing or damaged (3), written anew from the manifest" in result.stdout
    assert {k: v[0] for k, v in tree(root).items()} == healthy  # the very bytes the save wrote
    assert run("verify", "-q", template).exit_code == ExitStatus.OK


def test_a_failed_write_leaves_no_temporary_file(saved: dict[str, Path], tmp_path: Path) -> None:
    from ckptfmt.errors import UnrecoverableDamageError
    from ckptfmt.maintenance.repair import rebuild

    root, template = copy(saved, "xor", tmp_path)
    victim = data_file(root, 2)
    victim.unlink()
    victim.mkdir()  # a directory where the file was: the rename onto it fails
    with pytest.raises(UnrecoverableDamageError, match="cannot write the rebuilt files"):
        rebuild(template, write=WriteOptions(fsync=False))
    assert [p.name for p in victim.parent.iterdir()] == [victim.name]


@pytest.mark.parametrize("bad", ["", ".", "..", "../outside", "n3/deeper"])
def test_a_node_name_that_leaves_the_template_is_refused(
    saved: dict[str, Path], tmp_path: Path, bad: str
) -> None:
    """A node's name fills the {node} of the path given, so a manifest edited to name node n3
    ``..``, ``../outside`` or ``""`` (PROTOCOL.md §5 forbids them) would have rebuild recreate
    "the lost node" outside the checkpoint, or take the template's parent (every node's
    directory) for n3's torn copy and remove it. Refused as an invalid manifest (exit 3) by
    every command given the template; nothing written, nothing removed."""
    root, template = copy(saved, "xor", tmp_path / "ckpt")
    for node in ("n0", "n1", "n2", "n3"):
        path = root / node / "ckptfmt.json"
        doc: dict[str, Any] = json.loads(path.read_text())
        for r in doc["world"]["ranks"]:
            r["node"] = bad if r["node"] == "n3" else r["node"]
        path.write_bytes(seal_if_sealed(doc))  # as a hostile writer would: the checksum holds
    shutil.rmtree(root / "n3")  # the node "lost"
    before = tree(tmp_path)
    for command in (["rebuild"], ["rebuild", "--dry-run"], ["verify"], ["inspect"]):
        result = run(*command, template)
        assert result.exit_code == ExitStatus.UNREADABLE, (command, result.output)
        assert "/world/ranks/6/node" in result.stderr, result.stderr
        assert f"node name {bad!r}" in result.stderr, result.stderr
    assert tree(tmp_path) == before  # nothing outside, nothing of the other nodes touched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_link_leading_out_of_a_node_directory_is_not_written_through(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    """A node's ``model`` directory replaced by a symbolic link to a directory outside the
    checkpoint (which holds a copy of it): readers do not read through it (its files count as
    missing, FORMAT.md §14), and rebuild must not write through it either: it used to rewrite
    every file and zarr.json it found lost there, in the directory the link leads to. It exits
    1 naming the link, and nothing outside changes."""
    root, template = copy(saved, "xor", tmp_path / "ckpt")
    outside = tmp_path / "outside"
    (root / "n1" / "model").rename(outside)
    (root / "n1" / "model").symlink_to(outside)
    (outside / "unrelated.txt").write_text("not the checkpoint's")
    before = tree(outside)
    result = run("rebuild", template)
    assert result.exit_code == ExitStatus.DAMAGED, result.output
    assert f"{root / 'n1' / 'model'}" in result.output, result.output
    assert "symbolic link" in result.output and str(outside) in result.output, result.output
    assert tree(outside) == before  # not one file written there (bytes and times)
