"""The README's demo runs to the end (its own checks decide the exit status)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.mpi
def test_demo_runs_and_its_checks_pass(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo.py"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "bitwise identical: True" in done.stdout
    assert "ChecksumError" in done.stdout  # the flipped bit was caught by load
    assert "restored step 8 from level 3" in done.stdout
