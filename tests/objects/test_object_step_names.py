"""Step names on a bucket are found as in a directory (``spec/PROTOCOL.md`` §4), against the
tests' real S3 server: the same checkpoints saved by ``ckptfmt.save`` under a directory and under
a bucket prefix give the same answer to ``ckptfmt.latest``, ``ckptfmt list`` and a manager's
``latest()``/``steps()``: ``step-1`` written by hand counts for a search, steps are ordered by
number, ``step-0000000002`` beside ``step-2`` wins, a step with no checkpoint is skipped; a
manager sees only the exact names it writes, on both."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit.cli import run_cli
from kit.managers import NO_FSYNC, node_manager
from kit.s3 import S3

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.storage.steps import list_step_dirs, pick_steps

SMALL = WriteOptions(chunk_bytes=4096, shard_bytes=32768, fsync=False)


def _save_both(tmp_path: Path, s3: S3, names: Iterable[str]) -> tuple[str, str]:
    """Save under ``names`` (each its own values: the number in the name, then the name's
    length) in a directory and in a bucket prefix; return both roots."""
    local, url = str(tmp_path / "run"), f"{s3.url}/run"
    for name in names:
        state = {"w": np.array([int(name.rsplit("-", 1)[1]), len(name)], np.float32)}
        ckptfmt.save(state, f"{local}/{name}", write=SMALL)
        ckptfmt.save(state, f"{url}/{name}", write=SMALL)
    return local, url


def _latest_both(local: str, url: str) -> tuple[Any, Any]:
    """``ckptfmt.latest`` of both roots, as ``(step, last name, values)`` each."""
    out = []
    for root in (local, url):
        ref = ckptfmt.latest(root)
        if ref is None:
            out.append(None)
            continue
        name = str(ref.path).rstrip("/").rsplit("/", 1)[-1]
        out.append((ref.step, name, ckptfmt.load(str(ref.path))["w"].tolist()))
    return out[0], out[1]


def test_latest_finds_hand_named_steps_as_in_a_directory(tmp_path: Path, s3: S3) -> None:
    """The issue's case: ``one/step-1`` and ``one/step-2`` saved by ``ckptfmt.save``."""
    local, url = _save_both(tmp_path, s3, ["step-1", "step-2"])
    on_disk, on_bucket = _latest_both(local, url)
    assert on_disk == on_bucket == (2, "step-2", [2, 6])
    ref = ckptfmt.latest(url)
    assert ref is not None and str(ref.path) == f"{url}/step-2"


def test_steps_are_ordered_by_number_not_by_name(tmp_path: Path, s3: S3) -> None:
    local, url = _save_both(tmp_path, s3, ["step-9", "step-10", "step-0000000003"])
    on_disk, on_bucket = _latest_both(local, url)
    assert on_disk == on_bucket == (10, "step-10", [10, 7])


@pytest.mark.parametrize(
    ("names", "wins"),
    [
        (["step-2", "step-0000000002", "step-1"], "step-0000000002"),  # the exact name
        (["step-2", "step-02", "step-1"], "step-02"),  # no exact name: the first in order
    ],
)
def test_two_names_of_one_step_resolve_alike(
    tmp_path: Path, s3: S3, names: list[str], wins: str
) -> None:
    local, url = _save_both(tmp_path, s3, names)
    on_disk, on_bucket = _latest_both(local, url)
    assert on_disk == on_bucket == (2, wins, [2, len(wins)])


def test_a_step_without_a_checkpoint_is_skipped_alike(tmp_path: Path, s3: S3) -> None:
    """``step-3`` holds objects but no commit (a save that died), as a directory holds files but
    no manifest: the latest is step 2 on both."""
    local, url = _save_both(tmp_path, s3, ["step-1", "step-2"])
    (tmp_path / "run" / "step-3").mkdir()
    (tmp_path / "run" / "step-3" / "zarr.json").write_text("{}")
    s3.server.client().put_object(
        Bucket=s3.bucket, Key=f"run/step-3/{'0' * 32}/zarr.json", Body=b"{}"
    )
    on_disk, on_bucket = _latest_both(local, url)
    assert on_disk == on_bucket == (2, "step-2", [2, 6])


def test_list_shows_the_same_steps(tmp_path: Path, s3: S3) -> None:
    local, url = _save_both(tmp_path, s3, ["step-1", "step-2", "step-0000000002", "step-10"])
    on_disk = ckptfmt.list_levels(local)["steps"]
    on_bucket = ckptfmt.list_levels(url)["steps"]
    assert list(on_disk) == list(on_bucket) == ["1", "2", "10"]
    assert {s: e["level3"] for s, e in on_bucket.items()} == dict.fromkeys(on_bucket, "flushed")
    assert {s: e["level3"] for s, e in on_disk.items()} == dict.fromkeys(on_disk, "flushed")
    shown = run_cli("list", "--json", url)
    assert shown.exit_code == 0, shown.output
    assert '"10"' in shown.output and '"1"' in shown.output


def test_a_manager_sees_the_same_steps_on_both(tmp_path: Path, s3: S3) -> None:
    """A manager's level 3 holding hand-saved ``step-1``/``step-2`` and the manager's own step
    5: on a directory and on a bucket, ``latest()`` and ``steps()`` name step 5 alone (a
    manager's retention and restore look at the exact names it writes, PROTOCOL.md §4)."""
    local, url = _save_both(tmp_path, s3, ["step-1", "step-2"])
    seen = []
    for shared, where in ((local, tmp_path / "d"), (url, tmp_path / "b")):
        where.mkdir()
        mgr = node_manager(where, shared=None, shared_dir=shared, write=NO_FSYNC)
        try:
            seen.append((mgr.latest(), mgr.steps()))
            mgr.save(5, {"w": np.ones(3, np.float32)})
            mgr.wait()
            ref = mgr.latest()
            assert ref is not None
            seen.append((ref.step, mgr.steps()))
        finally:
            mgr.close(flush=False)
    on_disk, on_bucket = seen[:2], seen[2:]
    assert (
        on_disk
        == on_bucket
        == [
            (None, {}),
            (5, {5: {"level1": True, "level3": True}}),
        ]
    )
    assert [s for s, _ in list_step_dirs(Path(local), loose=True)] == [1, 2, 5]
    ref = ckptfmt.latest(url)  # a search sees every name: the manager's step is the newest
    assert ref is not None and ref.step == 5


def test_pick_steps_is_the_one_rule() -> None:
    names = ["step-2", "step-0000000002", "step-02", "step-1", "step-x", ".step-3.tmp", "step-"]
    assert pick_steps(names) == [(2, "step-0000000002")]
    assert pick_steps(names, loose=True) == [(1, "step-1"), (2, "step-0000000002")]
    assert pick_steps(["step-02", "step-2"], loose=True) == [(2, "step-02")]
    assert pick_steps(["step-00000000002"]) == []  # 11 digits, a leading zero: not exact
    assert pick_steps(["step-12345678901"]) == [(12345678901, "step-12345678901")]
    assert pick_steps(["step-\u0662"], loose=True) == []  # digits are ASCII digits
