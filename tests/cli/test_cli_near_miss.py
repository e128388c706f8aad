"""The command line given a near miss, as a user types it: a Hugging Face ``checkpoint-N/``
(whose ckptfmt checkpoint is ``checkpoint-N/ckptfmt``), a root of step directories, or a
``Trainer``'s ``output_dir``. ``inspect``, ``verify`` and ``export`` say where the checkpoint
is (and ``ckptfmt list ROOT`` for a root of steps), and what they suggest then works;
``ckptfmt.load``/``open`` carry the same hint in their ``NotACheckpointError``."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pytest
from kit.cli import run_cli
from kit.managers import make_manager
from kit.s3 import S3

import ckptfmt
from ckptfmt.errors import NotACheckpointError
from ckptfmt.storage.steps import step_dir_name

STATE = {"model": {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}}
COMMANDS = [("inspect",), ("verify",), ("export", "OUT")]


def _args(command: tuple[str, ...], path: Path | str, tmp_path: Path) -> list[str]:
    return [
        a if a != "OUT" else str(tmp_path / "out") for a in (command[0], str(path), *command[1:])
    ]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_an_hf_checkpoint_dir_points_at_its_ckptfmt_dir(
    tmp_path: Path, command: tuple[str, ...]
) -> None:
    ck = tmp_path / "checkpoint-4"
    ckptfmt.save(STATE, ck / "ckptfmt", step=4)
    (ck / "trainer_state.json").write_text("{}")
    result = run_cli(*_args(command, ck, tmp_path))
    assert result.exit_code == 3, result.output
    assert "torn before commit, or not ours" in result.output
    assert f"its ckptfmt checkpoint is {ck / 'ckptfmt'}" in result.output
    assert "give that path" in result.output
    fixed = run_cli(*_args(command, ck / "ckptfmt", tmp_path))  # as the hint says
    assert fixed.exit_code == 0, fixed.output


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("layout", ["manager", "save"])
def test_a_root_of_steps_suggests_ckptfmt_list_and_the_newest(
    tmp_path: Path, command: tuple[str, ...], layout: str
) -> None:
    root = tmp_path / "run"
    if layout == "manager":
        with make_manager(tmp_path, local=None, shared="run") as mgr:
            for n in (1, 2):
                mgr.save(n, STATE)
        newest = root / "step-0000000002"
    else:  # ckptfmt.save with names given by hand
        for n in (1, 2):
            ckptfmt.save(STATE, root / f"step-{n}", step=n)
        newest = root / "step-2"
    result = run_cli(*_args(command, root, tmp_path))
    assert result.exit_code == 3, result.output
    text = " ".join(result.output.split())  # as one line, whatever the terminal wrapped
    assert "it holds the checkpoints of 2 step(s)" in text
    assert f"the newest committed, {newest};" in text
    suggested = f"ckptfmt list {shlex.quote(str(root))}"
    assert f"`{suggested}` lists them" in text
    listed = run_cli(*shlex.split(suggested)[1:], "--json")  # the command it suggests
    assert listed.exit_code == 0 and set(json.loads(listed.output)["steps"]) == {"1", "2"}
    fixed = run_cli(*_args(command, newest, tmp_path))
    assert fixed.exit_code == 0, fixed.output
    assert ckptfmt.latest(root).path == newest  # the Python call it names


def test_an_hf_output_dir_points_at_the_newest_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    for n in (4, 12, 8):
        ckptfmt.save(STATE, out / f"checkpoint-{n}" / "ckptfmt", step=n)
    result = run_cli("verify", out)
    assert result.exit_code == 3
    text = " ".join(result.output.split())
    assert "Hugging Face Trainer checkpoints (checkpoint-4, checkpoint-8, checkpoint-12)" in text
    assert f"the newest is {out / 'checkpoint-12' / 'ckptfmt'}" in text
    assert run_cli("verify", out / "checkpoint-12" / "ckptfmt").exit_code == 0


def test_load_and_open_carry_the_same_hint(tmp_path: Path) -> None:
    ck = tmp_path / "checkpoint-4"
    ckptfmt.save(STATE, ck / "ckptfmt", step=4)
    for call in (ckptfmt.load, ckptfmt.open):
        with pytest.raises(NotACheckpointError) as info:
            call(ck)
        assert info.value.hint.startswith(f"its ckptfmt checkpoint is {ck / 'ckptfmt'}")
        assert info.value.hint in str(info.value)
    assert np.array_equal(ckptfmt.load(ck / "ckptfmt")["model"]["w"], STATE["model"]["w"])
    plain = tmp_path / "nothing"
    plain.mkdir()
    with pytest.raises(NotACheckpointError) as info:
        ckptfmt.load(plain)
    assert info.value.hint == "" and str(info.value).endswith("or not ours)")


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_a_bucket_root_of_steps_suggests_ckptfmt_list_and_the_newest(
    tmp_path: Path, s3: S3, command: tuple[str, ...]
) -> None:
    root = f"{s3.url}/run"
    with make_manager(tmp_path, shared=None, shared_dir=root, node="n0") as mgr:
        for n in (1, 2):
            mgr.save(n, STATE)
    result = run_cli(*_args(command, root, tmp_path))
    assert result.exit_code == 3, result.output
    text = " ".join(result.output.split())
    newest = f"{root}/{step_dir_name(2)}"
    assert f"such as the newest, {newest};" in text
    assert f"`ckptfmt list {root}` lists them" in text
    listed = run_cli("list", root, "--json")  # the command it suggests, as JSON to check
    assert listed.exit_code == 0 and set(json.loads(listed.output)["steps"]) == {"1", "2"}
    assert run_cli(*_args(command, newest, tmp_path)).exit_code == 0
