"""An overwrite of a checkpoint directory killed at each step of its commit leaves the old or the
new checkpoint at the path, whole and bit for bit (``spec/PROTOCOL.md`` §1).

The overwrite runs the collective save behind ``ckptfmt.save`` in a process of its own, which
kills itself (SIGKILL) at a named point of the commit (``kit.overwrite``,
``tests/workers/_overwrite_worker.py``). With ``RENAME_EXCHANGE`` (Linux) the path never lacks
a checkpoint; where the file system cannot exchange, a crash between the two renames leaves the
path empty for a moment and the next save or ``clean_leftovers`` puts the old one back.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from kit import REPO
from kit.arrays import assert_state_equal
from kit.files import leftovers
from kit.launch import with_kit_path
from kit.overwrite import save, state

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.errors import DestinationExistsError
from ckptfmt.storage import commit

WORKER = "tests/workers/_overwrite_worker.py"
OLD, NEW = 1, 2


def _can_exchange() -> bool:
    """Whether the file system of the tests' temporary directories swaps two directories."""
    with tempfile.TemporaryDirectory() as tmp:
        a, b = Path(tmp) / "a", Path(tmp) / "b"
        a.mkdir()
        b.mkdir()
        (a / "mark").touch()
        return commit.exchange(a, b) and (b / "mark").exists()


needs_exchange = pytest.mark.skipif(not _can_exchange(), reason="no RENAME_EXCHANGE here")


def _killed_at(path: Path, point: str, *extra: str) -> None:
    proc = subprocess.run(
        [sys.executable, WORKER, "fs", str(path), str(NEW), point, *extra],
        cwd=REPO,
        env=with_kit_path(dict(os.environ)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, f"not killed at {point}: {proc.returncode}\n{proc.stderr[-3000:]}"


def _leaves(path: Path, seed: int) -> None:
    """``path`` loads as ``seed``'s state; after ``clean_leftovers`` still, with nothing left."""
    assert_state_equal(ckptfmt.load(path), state(seed))
    commit.clean_leftovers(path.parent)
    assert leftovers(path.parent) == []
    assert_state_equal(ckptfmt.load(path), state(seed))


@needs_exchange
@pytest.mark.parametrize(
    ("point", "expect"), [("committing", OLD), ("swapped", NEW), ("committed", NEW)]
)
def test_an_overwrite_killed_at_each_step_leaves_the_old_or_the_new(
    tmp_path: Path, point: str, expect: int
) -> None:
    path = tmp_path / "ckpt"
    save("fs", str(path), OLD, overwrite=False)
    _killed_at(path, point)
    _leaves(path, expect)


@pytest.mark.parametrize(
    ("point", "expect"), [("committing", OLD), ("aside", OLD), ("committed", NEW)]
)
def test_without_exchange_the_old_one_comes_back_after_a_crash_between_the_renames(
    tmp_path: Path, point: str, expect: int
) -> None:
    path = tmp_path / "ckpt"
    save("fs", str(path), OLD, overwrite=False)
    _killed_at(path, point, "noexchange")
    if point == "aside":  # the one moment the path is empty: the old one is beside it
        assert not path.exists()
        assert [p.name[:10] for p in tmp_path.iterdir() if ".old-" in p.name] == [".ckpt.old-"]
        # the next save to the path takes it back before it decides: a checkpoint is there
        with pytest.raises(DestinationExistsError, match="already there"):
            ckptfmt.save({"x": 1}, path, write=WriteOptions(fsync=False))
    _leaves(path, expect)


def test_recover_takes_the_newest_aside_copy_and_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    for seed, sid in ((OLD, "a" * 32), (NEW, "b" * 32)):  # the newer one written last
        save("fs", str(tmp_path / "elsewhere"), seed, overwrite=False)
        (tmp_path / "elsewhere").rename(tmp_path / f".ckpt.old-{sid}")
    (tmp_path / f".ckpt.old-{'c' * 32}").mkdir()  # not committed: never taken back
    assert commit.recover(path) == tmp_path / f".ckpt.old-{'b' * 32}"
    assert_state_equal(ckptfmt.load(path), state(NEW))
    assert commit.recover(path) is None  # the path is there: nothing to undo
    commit.clean_leftovers(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


@pytest.mark.parametrize("can_exchange", [True, False])
def test_a_rolled_back_overwrite_puts_the_old_one_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, can_exchange: bool
) -> None:
    """The multi-node commit rolls a published overwrite back when another node failed
    (``unpublish``): the old checkpoint is at the path again, the new one gone."""
    if can_exchange and not _can_exchange():
        pytest.skip("no RENAME_EXCHANGE here")
    if not can_exchange:
        monkeypatch.setattr(commit, "exchange", lambda a, b: False)
    path, sid = tmp_path / "ckpt", "d" * 32
    save("fs", str(path), OLD, overwrite=False)
    staging = commit.staging_dir(path, sid)
    save("fs", str(tmp_path / "new"), NEW, overwrite=False)
    (tmp_path / "new").rename(staging)
    old = commit.publish(staging, path, sid, fsync=False)
    assert old == tmp_path / f".ckpt.old-{sid}"
    assert_state_equal(ckptfmt.load(path), state(NEW))
    assert_state_equal(ckptfmt.load(old), state(OLD))
    commit.unpublish(staging, path, old, fsync=False)
    assert_state_equal(ckptfmt.load(path), state(OLD))
    assert leftovers(tmp_path) == []
