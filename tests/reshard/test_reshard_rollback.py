"""reshard to a ``{node}`` template commits one directory per node; when one node's commit
fails, the nodes already committed take their previous checkpoint back (``spec/reshard.md``
§4). These tests inject the failures (the commit's rename refused, the rollback's too) into
real directories and check what every node holds afterwards."""

from __future__ import annotations

import errno
import json
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


def save_ids(template: str) -> dict[str, str]:
    return {
        n: json.loads(Path(template.replace("{node}", n), "ckptfmt.json").read_text())["save_id"]
        for n in NODES
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
