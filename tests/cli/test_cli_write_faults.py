"""The writing commands (``reshard``, ``export``) when the destination fails under them, run as
a user runs them: ``python -m ckptfmt_cli`` in a child process (in a mount namespace of its own
where the fault is a mount), real files, one line on stderr, no traceback, and no destination
left half written or mixed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ckptfmt_cli.exits import ExitStatus
from kit.faults import flip
from kit.full_disk import run_in_mount_namespace
from kit.level1 import NODES4, save_level1

import ckptfmt
from ckptfmt.interop import export_safetensors

STATE = {
    "model": {"w": np.arange(4096, dtype=np.float32).reshape(64, 64), "b": np.ones(7, np.int16)},
    "step": 3,
}
CLI = [sys.executable, "-m", "ckptfmt_cli"]


def save_ids(template: str, nodes: list[str]) -> dict[str, str]:
    """The save id each node's directory of ``template`` holds."""
    return {
        n: json.loads(Path(template.replace("{node}", n), "ckptfmt.json").read_text())["save_id"]
        for n in nodes
    }


def test_reshard_that_fails_on_one_node_leaves_every_node_as_it_was(tmp_path: Path) -> None:
    """reshard to a {node} template commits one directory per node; when the second node's
    commit fails (its directory is a mount point: the rename is refused, EBUSY), the node
    already committed gets its previous checkpoint back (spec/reshard.md §4: on any failure no
    directory is committed), so DST is never a mix of the old save and the new one; the message
    names the destination and says what the file system refused."""
    src = tmp_path / "src"
    ckptfmt.save(STATE, src, step=3)
    template = str(tmp_path / "dst" / "{node}")
    args = ["reshard", str(src), template, "--ranks", "2", "--ranks-per-node", "1", "-q"]
    first = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)
    assert first.returncode == ExitStatus.OK, first.stderr
    before = save_ids(template, ["n0", "n1"])
    n1 = tmp_path / "dst" / "n1"
    proc = run_in_mount_namespace([f"mount --bind {n1} {n1}"], [*CLI, *args, "--overwrite"])
    assert proc.returncode == ExitStatus.UNREADABLE, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("Error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert str(n1) in proc.stderr and "device or resource busy" in proc.stderr, proc.stderr
    assert "cannot read" not in proc.stderr
    assert save_ids(template, ["n0", "n1"]) == before  # n0 rolled back, n1 untouched
    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == ["n0", "n1"]  # no leftovers
    check = subprocess.run([*CLI, "verify", "-q", template], capture_output=True, timeout=120)
    assert check.returncode == ExitStatus.OK


BIG = {"model": {"w": np.arange(1 << 20, dtype=np.float32)}}  # 4 MiB: more than the tmpfs


@pytest.mark.parametrize("to", ["safetensors", "torch"])
def test_export_to_a_full_file_system_names_out_and_leaves_nothing(tmp_path: Path, to: str) -> None:
    """export onto a file system without room for OUT (a 1 MiB tmpfs): one line naming OUT and
    that it could not be written (no space left), exit 3, nothing at OUT or beside it. With
    --to torch, torch.save's own error used to escape as a traceback (RuntimeError from its zip
    writer, exit 1: "damaged"); with safetensors the line named no path."""
    if to == "torch":
        pytest.importorskip("torch")
    src = tmp_path / "src"
    ckptfmt.save(BIG, src, step=1)
    out = tmp_path / "full" / ("out.pt" if to == "torch" else "out")
    argv = [*CLI, "export", "-q", "--to", to, str(src), str(out)]
    (tmp_path / "full").mkdir()
    proc = run_in_mount_namespace([f"mount -t tmpfs -o size=1m tmpfs {tmp_path / 'full'}"], argv)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == ExitStatus.UNREADABLE, proc.stdout + proc.stderr
    assert proc.stderr.startswith("Error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert str(out) in proc.stderr and "no space left on device" in proc.stderr, proc.stderr
    assert "cannot write" in proc.stderr and "cannot read" not in proc.stderr
    assert list((tmp_path / "full").iterdir()) == []  # the tmpfs is gone: the mount point


@pytest.mark.parametrize("command", ["export", "export-torch", "reshard", "import"])
def test_a_file_size_limit_is_a_write_error(tmp_path: Path, command: str) -> None:
    """A file larger than the process may write (``ulimit -f``: the write fails with EFBIG)
    is said to be a write that failed, naming where, never "cannot read" (which reads as an
    unreadable SRC); nothing is left at OUT."""
    if command == "export-torch":
        pytest.importorskip("torch")
    src = tmp_path / "src"
    ckptfmt.save(BIG, src, step=1)
    if command == "import":
        export_safetensors(src, tmp_path / "hf")
        shutil.rmtree(src)
        src = tmp_path / "hf"
    out = tmp_path / ("out.pt" if command == "export-torch" else "out")
    args = {
        "export": ["export", str(src), str(out)],
        "export-torch": ["export", "--to", "torch", str(src), str(out)],
        "reshard": ["reshard", str(src), str(out), "--ranks", "2"],
        "import": ["import", str(src), str(out)],
    }[command]
    shell = 'ulimit -f 1024 && exec "$@"'  # 1024 blocks of 512 bytes (POSIX sh): 512 KiB
    proc = subprocess.run(
        ["sh", "-c", shell, "sh", *CLI, *args, "-q"], capture_output=True, text=True, timeout=120
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == ExitStatus.UNREADABLE, proc.stdout + proc.stderr
    assert proc.stderr.startswith("Error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "cannot write" in proc.stderr and "file too large" in proc.stderr.lower()
    assert "cannot read" not in proc.stderr
    assert str(out) in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]


def test_rebuild_on_a_read_only_file_system_is_no_lost_data(tmp_path: Path) -> None:
    """A level-1 checkpoint that redundancy can repair, on a file system mounted read-only:
    rebuild cannot write, which is a storage error (exit 3) naming where and why, not
    "UNRECOVERABLE ... lost tensors" (exit 1: damaged beyond what the redundancy rebuilds),
    which would have a user give up a checkpoint that rebuilds once it can be written."""
    template = save_level1(tmp_path / "l1", "xor", NODES4)
    damaged = next((tmp_path / "l1" / "n1" / "model" / "w" / "c").rglob("*"))
    damaged = damaged if damaged.is_file() else next(damaged.rglob("*"))
    flip(damaged)
    root = tmp_path / "l1"
    setup = [f"mount --bind {root} {root}", f"mount -o remount,bind,ro {root}"]
    proc = run_in_mount_namespace(setup, [*CLI, "rebuild", "-q", template])
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == ExitStatus.UNREADABLE, proc.stdout + proc.stderr
    assert proc.stderr.startswith("Error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "read-only file system" in proc.stderr and str(damaged.parent) in proc.stderr
    assert "UNRECOVERABLE" not in proc.stdout + proc.stderr and "lost" not in proc.stderr
    fixed = subprocess.run([*CLI, "rebuild", "-q", template], capture_output=True, timeout=120)
    assert fixed.returncode == ExitStatus.OK  # writable again: it was repairable all along


@pytest.mark.parametrize(
    "command", ["export", "export-torch", "import", "import-nodes", "reshard", "reshard-nodes"]
)
def test_a_failed_write_leaves_no_directory_it_made(tmp_path: Path, command: str) -> None:
    """OUT under directories that do not exist yet (``kept/new/deeper/``, ``kept`` there
    before): the write fails part way (``ulimit -f``: EFBIG), and every directory the command
    made is gone again, ``kept`` (which it did not make) stays; it used to leave the empty
    ``new/deeper/`` behind."""
    if command == "export-torch":
        pytest.importorskip("torch")
    src = tmp_path / "src"
    ckptfmt.save(BIG, src, step=1)
    if command.startswith("import"):
        export_safetensors(src, tmp_path / "hf")
        src = tmp_path / "hf"
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "mine").write_text("not the tool's")
    deep = kept / "new" / "deeper"
    out = str(deep / ("out.pt" if command == "export-torch" else "out"))
    template = str(deep / "{node}" / "ckpt")
    args = {
        "export": ["export", str(src), out],
        "export-torch": ["export", "--to", "torch", str(src), out],
        "import": ["import", str(src), out],
        "import-nodes": ["import", str(src), template, "--ranks", "2", "--ranks-per-node", "1"],
        "reshard": ["reshard", str(src), out, "--ranks", "2"],
        "reshard-nodes": ["reshard", str(src), template, "--ranks", "2", "--ranks-per-node", "1"],
    }[command]
    shell = 'ulimit -f 1024 && exec "$@"'  # 512 KiB: less than one of BIG's files
    proc = subprocess.run(
        ["sh", "-c", shell, "sh", *CLI, *args, "-q"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == ExitStatus.UNREADABLE, proc.stdout + proc.stderr
    assert "file too large" in proc.stderr.lower() and "Traceback" not in proc.stderr
    assert sorted(p.name for p in kept.iterdir()) == ["mine"]
