"""A full file system on purpose: code run in a child process in its own mount namespace
(``unshare``), where a small tmpfs is mounted; the host's mounts are never touched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kit import REPO

UNSHARE = shutil.which("unshare")


def in_full_tmpfs(tmp_path: Path, options: str, code: str) -> dict[str, object]:
    """Run ``code`` with ``MNT`` (a tmpfs mounted with ``options``) in a child process; the
    JSON it prints last."""
    if UNSHARE is None:
        pytest.skip("no unshare(1)")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = tmp_path / "child.py"
    script.write_text(f"import numpy as np\nMNT = {str(mnt)!r}\n" + textwrap.dedent(code))
    args = ["--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        args = ["--user", "--map-root-user", *args]
    shell = f"mount -t tmpfs -o {options} tmpfs {mnt} && exec {sys.executable} {script}"
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'tests'}:{REPO / 'tools'}"}
    probe = subprocess.run([UNSHARE, *args, "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace: {probe.stderr.decode().strip()}")
    proc = subprocess.run(
        [UNSHARE, *args, "sh", "-c", shell],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def run_in_tmpfs_mounts(
    tmp_path: Path, mounts: dict[str, str], argv: list[str], timeout: float = 300
) -> tuple[subprocess.CompletedProcess[str], dict[str, Path]]:
    """Run ``argv`` in a child mount namespace where each ``mounts`` name is a directory under
    ``tmp_path`` with a tmpfs mounted with its options (``{"l1": "size=4m"}``); the finished
    process (checked by the caller) and the directories. The host's mounts are never
    touched; the tmpfs vanish with the namespace."""
    dirs = {name: tmp_path / name for name in mounts}
    shell = []
    for name, options in mounts.items():
        dirs[name].mkdir()
        shell.append(f"mount -t tmpfs -o {options} tmpfs {dirs[name]}")
    return run_in_mount_namespace(shell, argv, timeout), dirs


def run_in_mount_namespace(
    setup: list[str], argv: list[str], timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in a child mount namespace after the shell commands ``setup`` (``mount
    ...``: a tmpfs, or ``mount --bind D D``, which makes the directory ``D`` a mount point that
    no rename can move); the finished process, checked by the caller. The host's mounts are
    never touched."""
    if UNSHARE is None:
        pytest.skip("no unshare(1)")
    args = ["--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        args = ["--user", "--map-root-user", *args]
    probe = subprocess.run([UNSHARE, *args, "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace: {probe.stderr.decode().strip()}")
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'tests'}:{REPO / 'tools'}"}
    return subprocess.run(
        [UNSHARE, *args, "sh", "-c", " && ".join([*setup, 'exec "$@"']), "sh", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )
