"""What a new user meets at the command line: messages that name the CLI's flags;
``verify`` of one node's directory of a level-1 checkpoint (what it is, and the ``{node}``
template to use), of a loss within the redundancy (``ckptfmt rebuild`` suggested) and beyond it;
``inspect`` of a ``{node}`` template; an UNRECOVERABLE report that lists only what is lost; a
destination under a file or on a read-only file system; ``list`` without level 1; the top-level
help; URLs; and the reshard of per-rank state (a one-to-many ``--rank-map`` refused,
``--drop-per-rank`` saying exactly what went)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ckptfmt_cli.exits import ExitStatus
from ckptfmt_cli.main import cli
from kit.cli import run_cli as run
from kit.faults import flip
from kit.level1 import NODES8, save_level1

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.errors import CkptError, DestinationUnwritableError, UsageError
from ckptfmt.manifest.codec import parse_manifest
from ckptfmt.redundancy.record import member_files


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("l1") / "xor"
    save_level1(root, "xor")  # 8 ranks on n0..n3, sets [0,2,4,6] and [1,3,5,7]
    return root


@pytest.fixture()
def level1(pristine: Path, tmp_path: Path) -> Path:
    shutil.copytree(pristine, tmp_path / "xor")
    return tmp_path / "xor"


def manifest_of(root: Path) -> ckptfmt.Checkpoint:
    return ckptfmt.open(root / "n0")


def files_of(root: Path, rank: int) -> list[tuple[str, Path]]:
    m = parse_manifest((root / "n0" / "ckptfmt.json").read_bytes())
    return [("/".join(t.name), root / NODES8[rank] / f.path) for t, f in member_files(m, rank)]


# --- verify, inspect, rebuild -------------------------------------------------------------------


def test_verify_of_one_nodes_directory_says_what_it_is(level1: Path) -> None:
    result = run("verify", level1 / "n1")
    assert result.exit_code == ExitStatus.USAGE, result.output
    assert "DAMAGED" not in result.output
    assert "node n1's level-1 copy of step 5" in result.output
    assert f"ckptfmt verify '{level1 / '{node}'}'" in result.output
    # the template it names is the right one: healthy
    assert run("verify", "-q", str(level1 / "{node}")).exit_code == ExitStatus.OK


def test_verify_of_a_directory_holding_every_node_still_verifies(
    level1: Path, tmp_path: Path
) -> None:
    merged = tmp_path / "merged"
    for node in sorted(set(NODES8)):
        shutil.copytree(level1 / node, merged, dirs_exist_ok=True)
    result = run("verify", merged)
    assert result.exit_code == ExitStatus.OK, result.output


def test_verify_within_tolerance_suggests_rebuild(level1: Path) -> None:
    shutil.rmtree(level1 / "n1")  # ranks 2, 3: one member of each xor set
    template = str(level1 / "{node}")
    result = run("verify", template)
    assert result.exit_code == ExitStatus.DAMAGED
    assert f"run `ckptfmt rebuild '{template}'` to repair it" in result.stdout
    assert not (level1 / "n1").exists()  # the hint's dry run wrote nothing
    assert run("rebuild", "--no-fsync", template).exit_code == ExitStatus.OK
    assert run("verify", "-q", template).exit_code == ExitStatus.OK


def test_verify_beyond_tolerance_says_so(level1: Path) -> None:
    shutil.rmtree(level1 / "n1")
    shutil.rmtree(level1 / "n2")  # ranks 2 and 4 of set [0,2,4,6]: two for xor's one
    result = run("verify", str(level1 / "{node}"))
    assert result.exit_code == ExitStatus.DAMAGED
    assert "beyond what the xor redundancy rebuilds" in result.stdout
    assert "to repair it" not in result.stdout


def test_inspect_takes_a_node_template(level1: Path) -> None:
    result = run("inspect", "--json", str(level1 / "{node}"))
    assert result.exit_code == ExitStatus.OK, result.output
    doc = json.loads(result.stdout)
    assert doc["step"] == 5 and doc["world"]["size"] == 8
    assert {t["name"] for t in doc["tensors"]} == {"model/embed", "model/norm", "model/w", "rng"}


def test_inspect_of_a_template_reads_a_good_copy(level1: Path) -> None:
    """``inspect`` of a {node} template reads the good manifest copy most nodes hold: a
    damaged copy on the first node (its checksum fails) no more stops it than a missing one
    does; ``verify`` is what reports that copy."""
    flip(level1 / "n0" / "ckptfmt.json", byte=200)
    result = run("inspect", "--json", str(level1 / "{node}"))
    assert result.exit_code == ExitStatus.OK, result.output
    doc = json.loads(result.stdout)
    assert doc["step"] == 5 and doc["world"]["size"] == 8
    assert doc["path"] != str(level1 / "n0")
    assert run("verify", "-q", str(level1 / "{node}")).exit_code == ExitStatus.DAMAGED


def test_unrecoverable_lists_only_the_tensors_really_lost(level1: Path) -> None:
    """One flipped file on each of two members of one xor set: beyond xor, but only the
    tensors of those two files are lost, not every tensor the two ranks wrote."""
    (name0, f0), (name2, f2) = files_of(level1, 0)[0], files_of(level1, 2)[-1]
    flip(f0)
    flip(f2)
    all_of_them = {n for r in (0, 2) for n, _ in files_of(level1, r)}
    assert {name0, name2} < all_of_them  # the test means something
    template = str(level1 / "{node}")
    result = run("rebuild", template)
    assert result.exit_code == ExitStatus.DAMAGED
    lost_line = next(line for line in result.stdout.splitlines() if "lost tensors:" in line)
    assert sorted(lost_line.split(": ", 1)[1].split(", ")) == sorted({name0, name2})
    doc = json.loads(run("rebuild", "--json", template).stdout)
    assert sorted(doc["lost_tensors"]) == sorted({name0, name2})
    assert doc["lost_ranks"] == [0, 2]


# --- reshard: flags, per-rank state ------------------------------------------------------------


def test_messages_name_the_cli_flags(level1: Path, tmp_path: Path) -> None:
    template = str(level1 / "{node}")
    result = run("reshard", template, tmp_path / "dst", "--ranks", "4", "-q")
    assert result.exit_code == ExitStatus.USAGE
    err = result.stderr
    assert "--rank-map" in err and "--drop-per-rank" in err, err
    assert "rank_map" not in err and "per_rank" not in err and "rank map" not in err, err
    assert run("reshard", template, tmp_path / "dst", "--ranks", "8", "-q").exit_code == 0
    again = run("reshard", template, tmp_path / "dst", "--ranks", "8", "-q")
    assert again.exit_code == ExitStatus.USAGE
    assert "--overwrite" in again.stderr and "overwrite=True" not in again.stderr, again.stderr
    bad = run("reshard", template, tmp_path / "d2", "--ranks", "4", "--rank-map", "9:0")
    assert bad.exit_code == ExitStatus.USAGE and "--rank-map entry 9 -> 0" in bad.stderr


def test_one_to_many_rank_map_is_refused(level1: Path, tmp_path: Path) -> None:
    result = run(
        "reshard", str(level1 / "{node}"), tmp_path / "dst", "--ranks", "9",
        "--rank-map", "0:0,0:8,1:1,2:2,3:3,4:4,5:5,6:6,7:7",
    )  # fmt: skip
    assert result.exit_code == ExitStatus.USAGE
    assert "saved rank 0 is given twice (0:0 and 0:8)" in result.stderr, result.stderr
    assert not (tmp_path / "dst").exists()


def test_drop_per_rank_says_every_rank_lost_it(level1: Path, tmp_path: Path) -> None:
    result = run(
        "reshard", str(level1 / "{node}"), tmp_path / "dst", "--ranks", "10",
        "--rank-map", "identity", "--drop-per-rank", "--json",
    )  # fmt: skip
    assert result.exit_code == ExitStatus.OK, result.output
    report = json.loads(result.stdout)
    assert report["dropped"] == ["rng"]
    warning = report["warning"]
    assert "current rank(s) 8, 9 get none" in warning  # what resolve says ...
    assert "left out for all 10 new rank(s)" in warning  # ... and what really happened
    assert "the items of all 8 saved rank(s) (0-7) are dropped" in warning
    assert "rng" not in ckptfmt.open(tmp_path / "dst")
    text = run(
        "reshard", str(level1 / "{node}"), tmp_path / "dst2", "--ranks", "10",
        "--rank-map", "identity", "--drop-per-rank",
    )  # fmt: skip
    assert "left out for every new rank (the items of all 8 saved ranks dropped): rng" in (
        text.stdout
    )
    assert "left out for all 10 new rank(s)" in text.stderr


# --- destinations -------------------------------------------------------------------------------


def test_parent_that_is_a_file_is_a_ckpt_error(tmp_path: Path, level1: Path) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DestinationUnwritableError, match="is a file"):
        ckptfmt.save({"a": np.ones(2)}, tmp_path / "afile" / "sub" / "ckpt")
    result = run("reshard", str(level1 / "{node}"), tmp_path / "afile" / "dst", "--ranks", "8")
    assert result.exit_code == ExitStatus.USAGE
    assert "is a file, so no directory can be made under it" in result.stderr


def test_read_only_file_system_is_a_ckpt_error(tmp_path: Path) -> None:
    mnt = tmp_path / "ro"
    mnt.mkdir()
    code = (
        "import numpy as np, ckptfmt\n"
        "from ckptfmt.errors import DestinationUnwritableError\n"
        "try:\n"
        f"    ckptfmt.save({{'a': np.ones(2)}}, {str(mnt / 'ckpt')!r})\n"
        "except DestinationUnwritableError as e:\n"
        "    print('REFUSED', e)\n"
    )
    shell = f'mount -t tmpfs -o ro none {mnt} && {sys.executable} -c "$CODE"'
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("no mount namespace here to make a read-only file system in")
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", shell],
        capture_output=True,
        text=True,
        timeout=120,
        env={"CODE": code, "PATH": "/usr/bin:/bin"},
    )
    assert "REFUSED" in proc.stdout and "read-only file system" in proc.stdout, (
        proc.stdout + proc.stderr
    )


def test_urls_are_refused_where_a_path_is_needed(tmp_path: Path) -> None:
    """Object-store URLs go to inspect, verify, list and reshard (tests/objects); a scheme that
    is no object store, and a bucket where a directory is rewritten, are refused."""
    for args in (
        ["inspect", "http://host/x"],
        ["verify", "file:///x"],
        ["rebuild", "s3://bucket/{node}/x"],
        ["list", "ftp://host/x"],
        ["reshard", "http://host/x", tmp_path / "d", "--ranks", "2"],
        ["reshard", tmp_path, "file:///x", "--ranks", "2"],
    ):
        result = run(*args)
        assert result.exit_code == ExitStatus.USAGE, (args, result.output)
        assert "URLs are not supported" in result.stderr, (args, result.stderr)
    assert not Path("s3:").exists()


# --- list, help ----------------------------------------------------------------------------------


def test_list_without_level1_has_no_level1_column(tmp_path: Path) -> None:
    with ckptfmt.CheckpointManager(
        shared_dir=tmp_path / "shared", write=WriteOptions(fsync=False)
    ) as mgr:
        mgr.save(1, {"a": np.ones(3)})
    result = run("list", tmp_path / "shared")
    assert result.exit_code == ExitStatus.OK
    assert "level 1" not in result.stdout and "not visible" not in result.stdout, result.stdout
    assert "flushed" in result.stdout
    doc = json.loads(run("list", "--json", tmp_path / "shared").stdout)
    assert doc["nodes"] == {} and doc["steps"]["1"]["level1"] == {}


def test_list_with_level1_keeps_its_columns(tmp_path: Path) -> None:
    with ckptfmt.CheckpointManager(
        local_dir=tmp_path / "l1",
        shared_dir=tmp_path / "shared",
        node="n0",
        write=WriteOptions(fsync=False),
    ) as mgr:
        mgr.save(1, {"a": np.ones(3)})
    result = run("list", tmp_path / "shared")
    assert "level 1: n0" in result.stdout, result.stdout


@pytest.mark.parametrize(
    "record",
    [
        "{",
        "[]",
        '"x"',
        '{"local_dir": 5, "nodes": ["n0"]}',
        '{"local_dir": "L/{node}", "nodes": "n0"}',
        '{"local_dir": "L/{node}", "nodes": [5]}',
        '{"local_dir": "L/{node}", "nodes": null}',
        '{"local_dir": "L/{node}", "nodes": ["../../etc"]}',
        '{"local_dir": "L/{node}", "nodes": [""]}',
    ],
)
def test_list_with_a_damaged_levels_record_says_so(tmp_path: Path, record: str) -> None:
    """``ckptfmt-levels.json`` hand-edited or torn (not JSON, not an object, a wrong type, a
    node name that cannot fill {node}): one line naming the file and what is wrong, exit 3,
    never a traceback (it used to escape as JSONDecodeError, AttributeError, TypeError) nor a
    listing of directories outside the level-1 template."""
    with ckptfmt.CheckpointManager(
        local_dir=tmp_path / "l1" / "{node}",
        shared_dir=tmp_path / "shared",
        node="n0",
        write=WriteOptions(fsync=False),
    ) as mgr:
        mgr.save(1, {"a": np.ones(3)})
    path = tmp_path / "shared" / "ckptfmt-levels.json"
    path.write_text(record.replace("L/", f"{tmp_path / 'l1'}/"))
    result = run("list", tmp_path / "shared")
    assert result.exit_code == ExitStatus.UNREADABLE, result.output
    assert result.stderr.startswith(f"Error: {path}: ") and result.stderr.count("\n") == 1
    assert "levels record" in result.stderr, result.stderr


CTRL_C_DURING_IMPORT = """
import sys
from importlib.abc import MetaPathFinder

class CtrlC(MetaPathFinder):  # Ctrl-C arriving while the core is imported, at start-up
    def find_spec(self, name, path, target=None):
        if name == "ckptfmt.interop":
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, CtrlC())
sys.argv = ["ckptfmt", "inspect", "x"]
from ckptfmt_cli.main import main  # what the ckptfmt script runs
sys.exit(main())
"""


def test_ctrl_c_while_the_command_starts_is_one_line_and_130() -> None:
    """Ctrl-C in the fraction of a second the command spends importing the core (before any
    command runs) says "interrupted" and exits 130, as during a command; it used to end in
    a traceback through the import machinery (and die by the signal)."""
    proc = subprocess.run(
        [sys.executable, "-c", CTRL_C_DURING_IMPORT], capture_output=True, text=True, timeout=120
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == ExitStatus.INTERRUPTED, proc.stderr
    assert proc.stderr == "Error: interrupted\n"


def test_top_level_help_names_every_command() -> None:
    result = run("--help")
    assert result.exit_code == 0
    head = result.stdout.split("Options:")[0]
    for name in cli.commands:
        assert name in head, f"the description does not name {name!r}"
        assert f"  {name} " in result.stdout, f"{name!r} is not listed"


def test_usage_errors_are_ckpt_errors() -> None:
    assert issubclass(DestinationUnwritableError, CkptError)
    assert issubclass(DestinationUnwritableError, UsageError)
