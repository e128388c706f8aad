"""The ``ckptfmt`` command line: inspect, verify, exit statuses, error messages."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from ckptfmt_cli import render
from ckptfmt_cli.exits import EXIT_STATUSES, ExitStatus, exit_status
from click.testing import Result
from kit.cli import run_cli as run
from kit.faults import flip_bit
from kit.files import seal_if_sealed
from rich.console import Console

import ckptfmt
from ckptfmt import WriteOptions, errors

ARRAYS = {
    "model/layer0/weight": np.arange(24, dtype=np.float32).reshape(4, 6),
    "model/layer0/bias": (np.arange(6) / 3).astype(ml_dtypes.bfloat16),
    "optim/state/count": np.arange(10, dtype=np.int64),
    "rng": np.array([1, 2, 3], dtype=np.uint8),
    "empty": np.zeros((0, 3), dtype=np.float16),
}


def state() -> dict[str, Any]:
    return {
        "model": {
            "layer0": {"weight": ARRAYS["model/layer0/weight"], "bias": ARRAYS["model/layer0/bias"]}
        },
        "optim": {
            "state": {"count": ARRAYS["optim/state/count"]},
            "lr": 0.125,
            "name": "adamw",
            "betas": [0.9, 0.999],
        },
        "rng": ARRAYS["rng"],
        "empty": ARRAYS["empty"],
        "epoch": 3,
        "loss": float("nan"),
    }


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    # small shards so that tensors span several files
    ckptfmt.save(
        state(), path, step=42, write=WriteOptions(chunk_bytes=16, shard_bytes=32, fsync=False)
    )
    return path


def shard_files(root: Path, tensor: str) -> list[Path]:
    return sorted(p for p in (root / tensor / "c").rglob("*") if p.is_file())


# --- inspect ---------------------------------------------------------------------------------


def test_inspect_table_names_every_tensor_and_value(ckpt: Path) -> None:
    result = run("inspect", ckpt)
    assert result.exit_code == 0, result.output
    out = result.stdout
    for name in ARRAYS:
        assert name in out
    for dtype in ("float32", "bfloat16", "int64", "uint8", "float16"):
        assert dtype in out
    assert "(4, 6)" in out and "(0, 3)" in out
    for name, shown in (
        ("optim/lr", "0.125"),
        ("optim/name", "'adamw'"),
        ("epoch", "3"),
        ("loss", "nan"),
        ("optim/betas", "[0.9, 0.999]"),
    ):
        line = next(line for line in out.splitlines() if f" {name} " in line)
        assert shown in line
    assert "42" in out  # the step
    assert "none recorded" in out  # no redundancy levels yet


def test_inspect_json_has_shapes_dtypes_and_bytes(ckpt: Path) -> None:
    result = run("inspect", "--json", ckpt)
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    manifest = ckptfmt.open(ckpt).manifest
    assert doc["step"] == 42
    assert doc["save_id"] == manifest.save_id
    assert doc["format_version"] == 2
    assert doc["levels"] == []
    assert doc["world"]["size"] == 1
    assert [n["ranks"] for n in doc["world"]["nodes"]] == [[0]]

    tensors = {t["name"]: t for t in doc["tensors"]}
    assert set(tensors) == set(ARRAYS)
    for name, arr in ARRAYS.items():
        t = tensors[name]
        assert t["shape"] == list(arr.shape), name
        assert t["dtype"] == ckptfmt.open(ckpt)[name].entry.dtype
        assert t["bytes"] == arr.nbytes, name
        on_disk = shard_files(ckpt, name) if arr.size else []
        assert t["files"] == len(on_disk), name
        assert t["stored_bytes"] == sum(p.stat().st_size for p in on_disk), name
        assert t["regions"] == (1 if arr.size else 0)
        assert t["writer_ranks"] == ([0] if arr.size else [])
        assert "region_details" not in t
    assert tensors["model/layer0/bias"]["dtype"] == "bfloat16"
    assert tensors["model/layer0/weight"]["files"] > 1  # the small shards did split it

    values = {v["name"]: v for v in doc["values"]}
    assert values["optim/lr"] == {
        "name": "optim/lr",
        "type": "float",
        "per_rank": False,
        "repr": "0.125",
    }
    assert values["loss"]["repr"] == "nan"
    assert values["optim/name"]["type"] == "str"

    all_files = [p for name in ARRAYS for p in shard_files(ckpt, name) if ARRAYS[name].size]
    assert doc["totals"] == {
        "tensors": len(ARRAYS),
        "values": 5,
        "bytes": sum(a.nbytes for a in ARRAYS.values()),
        "stored_bytes": sum(p.stat().st_size for p in all_files),
        "files": len(all_files),
    }


def test_inspect_regions_lists_offsets_ranks_and_files(ckpt: Path) -> None:
    doc = json.loads(run("inspect", "--json", "--regions", ckpt).stdout)
    weight = next(t for t in doc["tensors"] if t["name"] == "model/layer0/weight")
    (region,) = weight["region_details"]
    assert region["offset"] == [0, 0] and region["shape"] == [4, 6] and region["rank"] == 0
    listed = [f["path"] for f in region["files"]]
    assert sorted(ckpt / p for p in listed) == shard_files(ckpt, "model/layer0/weight")
    for f in region["files"]:
        assert (ckpt / f["path"]).stat().st_size == f["size"]

    table = run("inspect", "--regions", ckpt).stdout
    for p in listed:
        assert p in table


def test_inspect_shows_writer_ranks_and_nodes_of_a_multi_rank_checkpoint(ckpt: Path) -> None:
    # as three ranks on two nodes would have written it: the weight's shard rows split between
    # ranks 0 and 2
    doc = json.loads((ckpt / "ckptfmt.json").read_bytes())
    doc["world"] = {
        "size": 3,
        "ranks": [{"rank": 0, "node": "n0"}, {"rank": 1, "node": "n0"}, {"rank": 2, "node": "n1"}],
    }
    entry = next(e for e in doc["entries"] if e["name"] == ["model", "layer0", "weight"])
    (region,) = entry["regions"]
    rows = entry["shard_shape"][0]
    per_row = len(region["files"]) // -(-4 // rows)  # files per row of shards
    entry["regions"] = [
        {"offset": [0, 0], "shape": [rows, 6], "rank": 0, "files": region["files"][:per_row]},
        {
            "offset": [rows, 0],
            "shape": [4 - rows, 6],
            "rank": 2,
            "files": region["files"][per_row:],
        },
    ]
    (ckpt / "ckptfmt.json").write_bytes(seal_if_sealed(doc))

    out = json.loads(run("inspect", "--json", ckpt).stdout)
    assert out["world"] == {
        "size": 3,
        "nodes": [{"node": "n0", "ranks": [0, 1]}, {"node": "n1", "ranks": [2]}],
    }
    weight = next(t for t in out["tensors"] if t["name"] == "model/layer0/weight")
    assert weight["regions"] == 2 and weight["writer_ranks"] == [0, 2]
    table = run("inspect", ckpt).stdout
    assert "3 rank(s) on 2 node(s): n0 [0-1], n1 [2]" in table
    assert (
        next(line for line in table.splitlines() if "model/layer0/weight" in line)
        .rstrip(" │")
        .endswith("0,2")
    )
    assert run("verify", ckpt).exit_code == ExitStatus.OK


def test_inspect_does_not_render_markup_or_escapes_from_values(tmp_path: Path) -> None:
    path = tmp_path / "c"
    ckptfmt.save(
        {"note": "[bold red]x\x1b[2J", "w": np.zeros(2)}, path, write=WriteOptions(fsync=False)
    )
    out = run("inspect", path).stdout
    assert "[bold red]x" in out
    assert "\x1b" not in out
    assert "\\x1b[2J" in out


# --- verify ----------------------------------------------------------------------------------


def test_verify_healthy_exits_0(ckpt: Path) -> None:
    result = run("verify", ckpt)
    assert result.exit_code == ExitStatus.OK, result.output
    assert "healthy" in result.stdout
    assert "DAMAGED" not in result.stdout

    doc = json.loads(run("verify", "--json", ckpt).stdout)
    assert doc["healthy"] is True and doc["problems"] == []
    assert doc["files_checked"] == sum(
        len(shard_files(ckpt, n)) for n, a in ARRAYS.items() if a.size
    )


def test_verify_names_the_flipped_file_and_its_tensor(ckpt: Path) -> None:
    victim = shard_files(ckpt, "model/layer0/weight")[1]
    rel = victim.relative_to(ckpt).as_posix()
    flip_bit(victim, 0, 3)

    result = run("verify", ckpt)
    assert result.exit_code == ExitStatus.DAMAGED
    line = next(line for line in result.stdout.splitlines() if rel in line)
    assert "model/layer0/weight" in line and "checksum" in line
    assert "DAMAGED" in result.stdout

    result = run("verify", "--json", ckpt)
    assert result.exit_code == ExitStatus.DAMAGED
    doc = json.loads(result.stdout)
    assert doc["healthy"] is False
    assert doc["problems"] == [
        {
            "file": rel,
            "kind": "checksum",
            "reason": doc["problems"][0]["reason"],
            "tensors": ["model/layer0/weight"],
        }
    ]
    assert "CRC32C" in doc["problems"][0]["reason"]
    assert doc["damaged_tensors"] == ["model/layer0/weight"]


def test_verify_reports_a_deleted_shard_as_missing(ckpt: Path) -> None:
    victim = shard_files(ckpt, "optim/state/count")[0]
    rel = victim.relative_to(ckpt).as_posix()
    victim.unlink()

    result = run("verify", ckpt)
    assert result.exit_code == ExitStatus.DAMAGED
    line = next(line for line in result.stdout.splitlines() if rel in line)
    assert "missing" in line and "optim/state/count" in line

    doc = json.loads(run("verify", "--json", ckpt).stdout)
    assert [(p["file"], p["kind"], p["tensors"]) for p in doc["problems"]] == [
        (rel, "missing", ["optim/state/count"])
    ]


def test_verify_reports_a_directory_in_place_of_a_shard_as_damaged(ckpt: Path) -> None:
    victim = shard_files(ckpt, "rng")[0]
    victim.unlink()
    victim.mkdir()
    result = run("verify", ckpt)
    assert result.exit_code == ExitStatus.DAMAGED, result.output
    assert victim.relative_to(ckpt).as_posix() in result.stdout


def test_verify_quiet_prints_nothing_but_keeps_the_status(ckpt: Path) -> None:
    assert run("verify", "-q", ckpt).stdout == ""
    flip_bit(shard_files(ckpt, "rng")[0], 0, 3)
    result = run("verify", "--quiet", ckpt)
    assert result.exit_code == ExitStatus.DAMAGED
    assert result.stdout == ""


def test_verify_warns_about_unexpected_files_but_stays_healthy(ckpt: Path) -> None:
    (ckpt / "model" / "stray.bin").write_bytes(b"?")
    result = run("verify", ckpt)
    assert result.exit_code == ExitStatus.OK
    assert "warning" in result.stdout
    assert "model/stray.bin" in result.stdout


def test_verify_escapes_control_characters_in_file_names(ckpt: Path) -> None:
    (ckpt / "evil\x1b]0;owned\x07[red]x").write_bytes(b"")
    out = run("verify", ckpt).stdout
    assert "\x1b" not in out and "\x07" not in out
    assert "evil\\x1b]0;owned\\x07[red]x" in out


def test_verify_shows_progress_on_a_terminal(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    buffer = io.StringIO()
    term = Console(file=buffer, force_terminal=True, width=120)
    monkeypatch.setattr(render, "stderr_terminal", lambda: term)
    total = sum(f.size for _, f in ckptfmt.open(ckpt).manifest.files())
    result = run("verify", ckpt)
    assert result.exit_code == ExitStatus.OK
    assert "verifying" in buffer.getvalue()
    assert f"{total}/{total} bytes" in buffer.getvalue()  # the bar reached the end

    buffer.seek(0)
    buffer.truncate()
    assert run("verify", "--quiet", ckpt).exit_code == ExitStatus.OK
    assert buffer.getvalue() == ""


# --- errors and exit statuses ----------------------------------------------------------------


def assert_one_line_error(result: Result, status: int, *needles: str) -> None:
    assert result.exit_code == status, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ")
    for needle in needles:
        assert needle in lines[0]


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_nonexistent_path_exits_3(tmp_path: Path, command: str) -> None:
    result = run(command, tmp_path / "nope")
    assert_one_line_error(
        result, ExitStatus.UNREADABLE, "not a readable checkpoint", "no such directory"
    )


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_directory_without_manifest_exits_3(tmp_path: Path, command: str) -> None:
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "data.bin").write_bytes(b"x")
    result = run(command, tmp_path / "foreign")
    assert_one_line_error(result, ExitStatus.UNREADABLE, "no ckptfmt.json")


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_garbage_manifest_exits_3_without_traceback(ckpt: Path, command: str) -> None:
    (ckpt / "ckptfmt.json").write_bytes(b'{"format": "ckptfmt", \x00 garbage')
    result = run(command, ckpt)
    assert_one_line_error(result, ExitStatus.UNREADABLE, "invalid manifest", "not JSON")


def test_an_unsupported_format_version_exits_3(ckpt: Path) -> None:
    doc = json.loads((ckpt / "ckptfmt.json").read_bytes())
    doc["format_version"] = 99
    (ckpt / "ckptfmt.json").write_bytes(seal_if_sealed(doc))
    result = run("verify", ckpt)
    assert_one_line_error(result, ExitStatus.UNREADABLE, "format version 99")


def test_a_file_the_core_cannot_read_is_one_line_not_a_traceback(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def denied(path: object, progress: object = None) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(ckptfmt, "verify", denied)
    result = run("verify", ckpt)
    assert_one_line_error(result, ExitStatus.UNREADABLE, "cannot read", "Permission denied")


def test_interrupt_is_not_reported_as_damage(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(path: object, progress: object = None) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(ckptfmt, "verify", interrupted)
    result = run("verify", ckpt)
    assert result.exit_code == ExitStatus.INTERRUPTED


def test_an_unknown_option_exits_2(ckpt: Path) -> None:
    for args in (["inspect", "--bogus", str(ckpt)], ["verify"], ["frobnicate"], ["--nope"]):
        result = run(*args)
        assert result.exit_code == ExitStatus.USAGE, args
        assert "Usage:" in result.stderr


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (errors.ChecksumError("a/c/0", "file", 1, 2, ["a"]), ExitStatus.DAMAGED),
        # a DamagedError and a FileNotFoundError: damage wins
        (errors.MissingFileError("a/c/0", ["a"]), ExitStatus.DAMAGED),
        (errors.SizeMismatchError("a/c/0", 1, 2), ExitStatus.DAMAGED),
        (errors.InvalidNameError("x", "bad"), ExitStatus.USAGE),
        (errors.UsageError("bad"), ExitStatus.USAGE),
        (errors.NotACheckpointError("p", "why"), ExitStatus.UNREADABLE),
        (errors.ManifestError("why"), ExitStatus.UNREADABLE),
        (errors.FormatVersionError(9, [1]), ExitStatus.UNREADABLE),
        (errors.CkptError("other"), ExitStatus.UNREADABLE),
        (PermissionError("denied"), ExitStatus.UNREADABLE),
        (ValueError("a bug"), None),
    ],
)
def test_exit_status_of_each_error_family(exc: BaseException, status: ExitStatus | None) -> None:
    assert exit_status(exc) == status


@pytest.mark.parametrize("args", [["--help"], ["inspect", "--help"], ["verify", "-h"]])
def test_help_shows_the_exit_status_table(args: list[str]) -> None:
    result = run(*args)
    assert result.exit_code == 0
    assert "Exit statuses" in result.stdout
    lines = result.stdout.splitlines()
    for status, text in EXIT_STATUSES:
        assert any(line.split()[:1] == [str(int(status))] and text[:20] in line for line in lines)


def test_version() -> None:
    result = run("--version")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"ckptfmt {ckptfmt.__version__}"


# --- as a real process -----------------------------------------------------------------------


def ckptfmt_command() -> list[str]:
    script = Path(sys.executable).with_name("ckptfmt")
    return [str(script)] if script.exists() else [sys.executable, "-m", "ckptfmt_cli"]


def test_the_installed_script_runs(ckpt: Path) -> None:
    proc = subprocess.run(
        [*ckptfmt_command(), "inspect", "--json", str(ckpt)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert {t["name"] for t in json.loads(proc.stdout)["tensors"]} == set(ARRAYS)

    victim = shard_files(ckpt, "model/layer0/bias")[0]
    flip_bit(victim, victim.stat().st_size - 1, 3)  # in the shard index, this time
    proc = subprocess.run(
        [*ckptfmt_command(), "verify", str(ckpt)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1
    assert victim.relative_to(ckpt).as_posix() in proc.stdout


def test_python_dash_m_exits_3_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "ckptfmt.json").write_text("[1, 2")
    proc = subprocess.run(
        [sys.executable, "-m", "ckptfmt_cli", "verify", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("Error: ") and "invalid manifest" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
