"""The writing commands (``reshard``, ``export``) when the destination fails under them, run as
a user runs them: ``python -m ckptfmt_cli`` in a child process (in a mount namespace of its own
where the fault is a mount), real files, one line on stderr, no traceback, and no destination
left half written or mixed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from ckptfmt_cli.exits import ExitStatus
from kit.full_disk import run_in_mount_namespace

import ckptfmt

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
