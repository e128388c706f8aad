"""The writing commands given a destination they cannot use: one line, a usage status, the
path named, nothing written, never the "cannot read: [Errno 17]" of a ``mkdir`` under a file
(which read as an unreadable SRC, exit 3); and an ``export --overwrite`` never deletes a
directory it did not write."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from ckptfmt_cli.exits import ExitStatus
from kit.cli import run_cli

import ckptfmt
from ckptfmt import WriteOptions


@pytest.fixture
def src(tmp_path: Path) -> Path:
    state = {"model": {"w": np.arange(960, dtype=np.float32).reshape(24, 40)}}
    ckptfmt.save(state, tmp_path / "src", step=1, write=WriteOptions(fsync=False))
    return tmp_path / "src"


@pytest.mark.parametrize(
    "args",
    [
        ["export", "{src}", "{file}/sub"],
        ["export", "--to", "torch", "{src}", "{file}/sub.pt"],
        ["import", "{hf}", "{file}/{{node}}", "--ranks", "2", "--ranks-per-node", "1"],
        ["import", "{hf}", "{file}/sub"],
        ["reshard", "{src}", "{file}/{{node}}", "--ranks", "2", "--ranks-per-node", "1"],
    ],
    ids=["export", "export-torch", "import-nodes", "import", "reshard-nodes"],
)
def test_a_destination_under_a_file_is_a_usage_error(
    tmp_path: Path, src: Path, args: list[str]
) -> None:
    if "torch" in args:
        pytest.importorskip("torch")
    hf = tmp_path / "hf"
    assert run_cli("export", src, hf, "-q").exit_code == 0
    blocker = tmp_path / "afile"
    blocker.write_text("mine")
    argv = [a.format(src=src, file=blocker, hf=hf) for a in args]
    got = run_cli(*argv, "-q")
    assert got.exit_code == ExitStatus.USAGE, got.output
    assert got.output.startswith("Error: ") and got.output.count("\n") == 1, got.output
    assert f"{blocker} is a file" in got.output and "cannot read" not in got.output
    assert blocker.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "hf", "src"]


def test_export_overwrite_never_deletes_a_directory_in_out(tmp_path: Path, src: Path) -> None:
    """A directory in OUT named like an export's shard (``model-data.safetensors/``) is not an
    export's file: ``--overwrite`` refuses OUT instead of deleting it with the old export."""
    out = tmp_path / "out"
    assert run_cli("export", src, out, "-q").exit_code == 0
    mine = out / "model-data.safetensors"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    got = run_cli("export", src, out, "--overwrite", "-q")
    assert got.exit_code == ExitStatus.USAGE, got.output
    assert "model-data.safetensors" in got.output
    assert (mine / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "args",
    [
        ["export", "{src}", "{src}/hf"],
        ["export", "--to", "torch", "{src}", "{src}/deeper/model.pt"],
        ["import", "{hf}", "{src}/imported"],
        ["import", "{hf}", "{src}/{{node}}", "--ranks", "2", "--ranks-per-node", "1"],
        ["reshard", "{src}", "{src}/r", "--ranks", "2"],
        ["reshard", "{src}", "{src}/l1/{{node}}", "--ranks", "2", "--ranks-per-node", "1"],
    ],
    ids=["export", "export-torch", "import", "import-nodes", "reshard", "reshard-nodes"],
)
def test_a_destination_inside_a_checkpoint_is_refused(
    tmp_path: Path, src: Path, args: list[str]
) -> None:
    """OUT inside the checkpoint SRC (or any committed checkpoint): refused, nothing written.
    It used to be written there, and the next overwrite of the checkpoint (``reshard SRC SRC
    --overwrite``, a manager's save of the step) deleted it with the old tree."""
    if "torch" in args:
        pytest.importorskip("torch")
    hf = tmp_path / "hf"
    assert run_cli("export", src, hf, "-q").exit_code == 0
    before = sorted(p.relative_to(src) for p in src.rglob("*"))
    got = run_cli(*[a.format(src=src, hf=hf) for a in args], "-q")
    assert got.exit_code == ExitStatus.USAGE, got.output
    assert f"inside the checkpoint {src}" in got.output and got.output.count("\n") == 1
    assert sorted(p.relative_to(src) for p in src.rglob("*")) == before
