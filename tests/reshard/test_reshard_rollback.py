"""reshard to a ``{node}`` template commits one directory per node; when one node's commit
fails, the nodes already committed take their previous checkpoint back (``spec/reshard.md``
§4). These tests inject the failures (the commit's rename refused, the rollback's too) into
real directories and check what every node holds afterwards."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.errors import CkptError
from ckptfmt.maintenance.reshard import reshard
from ckptfmt.storage import commit

STATE = {"model": {"w": np.arange(4096, dtype=np.float32).reshape(64, 64)}, "step": 3}
NODES = ["n0", "n1", "n2"]
WRITE = WriteOptions(fsync=False, overwrite=True)


def save_ids(template: str, nodes: list[str] = NODES) -> dict[str, str]:
    return {
        n: json.loads(Path(template.replace("{node}", n), "ckptfmt.json").read_text())["save_id"]
        for n in nodes
    }


def test_a_rollback_that_fails_on_one_node_still_rolls_back_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three nodes: n2's commit fails (EBUSY), and so does the rollback of n1 (EIO). n0 is still
    rolled back (its previous checkpoint in place), and the error says both what failed (n2's
    commit) and which node could not be rolled back (n1, which holds the new save), as one
    error of ckptfmt's tree; not the rollback's bare OSError with n0 left on the new save."""
    src = tmp_path / "src"
    ckptfmt.save(STATE, src, step=3)
    template = str(tmp_path / "dst" / "{node}")
    reshard(src, template, 3, nodes=NODES, write=WRITE)
    before = save_ids(template)
    real_publish, real_unpublish = commit.publish, commit.unpublish

    def publish(staging: Path, final: Path, *args: Any, **kwargs: Any) -> Any:
        if final.name == "n2":
            raise OSError(errno.EBUSY, "Device or resource busy", str(final))
        return real_publish(staging, final, *args, **kwargs)

    def unpublish(staging: Path, final: Path, *args: Any, **kwargs: Any) -> None:
        if final.name == "n1":
            raise OSError(errno.EIO, "Input/output error", str(final))
        real_unpublish(staging, final, *args, **kwargs)

    monkeypatch.setattr(commit, "publish", publish)
    monkeypatch.setattr(commit, "unpublish", unpublish)
    with pytest.raises(CkptError) as info:
        reshard(src, template, 3, nodes=NODES, write=WRITE)
    msg = str(info.value)
    assert "n2" in msg and "busy" in msg.lower(), msg
    assert str(tmp_path / "dst" / "n1") in msg and "rolled back" in msg, msg
    after = save_ids(template)
    assert after["n0"] == before["n0"]  # rolled back although n1's rollback failed
    assert after["n2"] == before["n2"]  # never committed
    assert after["n1"] != before["n1"]  # the new save, as the error says


@pytest.mark.parametrize("exchange", [True, False])
def test_a_commit_that_fails_half_way_leaves_that_node_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    """n1's commit fails between its two renames: after the exchange of the new tree with the
    old one (the old one, now at the staging name, could not be renamed aside), or, without
    an exchange, after the old tree was renamed aside (the new one could not take its place).
    n1 keeps its previous checkpoint, in place, like n0 (rolled back): it used to end with the
    new save while n0 had the old one, its previous checkpoint deleted as the failed draft
    (exchange), or with no checkpoint at its path at all (two renames)."""
    src = tmp_path / "src"
    ckptfmt.save(STATE, src, step=3)
    template = str(tmp_path / "dst" / "{node}")
    nodes = NODES[:2]
    reshard(src, template, 2, nodes=nodes, write=WRITE)
    before = save_ids(template, nodes)
    if not exchange:
        monkeypatch.setattr(commit, "exchange", lambda a, b: False)
    real_rename = os.rename

    def rename(a: Any, b: Any, *args: Any, **kwargs: Any) -> None:
        # the second rename of n1's commit: the old tree aside, or the new one into place
        second = ".n1.old-" in str(b) if exchange else Path(b).name == "n1"
        if ".n1.tmp-" in str(a) and second:
            raise OSError(errno.EIO, "Input/output error", str(a))
        real_rename(a, b, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(CkptError, match="input/output error"):
        reshard(src, template, 2, nodes=nodes, write=WRITE)
    monkeypatch.undo()
    assert save_ids(template, nodes) == before
    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == nodes  # nothing left beside
