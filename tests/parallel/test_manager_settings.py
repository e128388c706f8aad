"""One settings object (issue 35): ``ManagerSettings`` holds every setting of a
``CheckpointManager``, checked once when made; the manager takes it as it is, and its keywords
are another spelling of the same object. The integrations' side: tests/adapters/keras/
test_keras_settings.py and tests/adapters/torch/test_settings_torch.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from kit.s3 import S3
from kit.settings import INVALID, changed_settings, given_fields

from ckptfmt import CheckpointManager, ExitPolicy, ManagerSettings, WriteOptions
from ckptfmt.errors import UsageError
from ckptfmt.parallel.manager.telemetry import SaveReport
from ckptfmt.redundancy.config import Policy
from ckptfmt.storage.steps import list_step_dirs
from ckptfmt.transport.comm import SingleComm


def endpoint(s3: S3) -> dict[str, str]:
    return {"endpoint_url": s3.server.endpoint, "allow_http": "true"}


def test_every_setting_reaches_the_manager_as_given(tmp_path: Path, s3: S3) -> None:
    """Every field other than its default (level 3 a bucket): the manager holds the very object,
    the keyword spelling makes an equal one, and the manager acts on them."""
    settings = changed_settings(tmp_path, f"{s3.url}/run", **endpoint(s3))
    reports: list[SaveReport] = []
    settings = dataclasses.replace(settings, on_save=reports.append, keep_local=1)
    with CheckpointManager(settings=settings, comm=SingleComm()) as mgr:
        assert mgr.settings is settings
        mgr.save(1, {"w": np.arange(4.0)})  # async_save=False: done when it returns
        mgr.save(2, {"w": np.arange(4.0) + 1})
        assert [r.step for r in reports] == [1, 2]
        assert [s for s, _ in list_step_dirs(tmp_path / "l1" / "n0")] == [2]  # keep_local=1
        assert mgr.steps() == {2: {"level1": True, "level3": True}}  # the policy's flush
        assert mgr.flush_every == 3 and mgr.write.chunk_bytes == 1 << 12 and mgr.incremental
    keywords = given_fields(settings)
    with CheckpointManager(comm=SingleComm(), **keywords) as mgr:
        assert mgr.settings == settings


def test_keywords_replace_fields_of_the_settings_given(tmp_path: Path) -> None:
    base = ManagerSettings(local_dir=tmp_path / "l1", write=WriteOptions(fsync=False))
    assert base.local_dir == str(tmp_path / "l1")  # one spelling of a path
    with CheckpointManager(settings=base, flush_every=4, at_exit=ExitPolicy(False, 0, False)) as m:
        assert m.settings == dataclasses.replace(
            base, flush_every=4, at_exit=ExitPolicy(False, 0, False)
        )
    assert ManagerSettings.of(base) is base
    with pytest.raises(UsageError, match="ManagerSettings"):
        ManagerSettings.of({"local_dir": "x"})  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="ManagerSettings"):
        CheckpointManager(settings="x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fsync"):  # not a field: Python's own error, naming it
        ManagerSettings.of(base, fsync=False)


@pytest.mark.parametrize("bad", INVALID, ids=lambda b: ",".join(b))
def test_an_invalid_setting_is_one_usage_error(tmp_path: Path, bad: dict[str, object]) -> None:
    """Checked in ManagerSettings alone: the manager's keywords raise the very same error, and
    nothing is made on disk."""
    with pytest.raises(UsageError) as made:
        ManagerSettings(**bad)  # type: ignore[arg-type]
    with pytest.raises(UsageError) as managed:
        CheckpointManager(shared_dir=tmp_path / "l3", **bad)
    assert str(managed.value) == str(made.value)
    assert type(managed.value) is type(made.value)
    assert not (tmp_path / "l3").exists()


def test_settings_are_frozen_and_read_their_policy_file_once(tmp_path: Path) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps([{"every": 1, "redundancy": "xor"}, {"every": 4, "flush": True}]))
    settings = ManagerSettings(local_dir=tmp_path / "l1", redundancy=policy)
    policy.unlink()
    assert isinstance(settings.redundancy, Policy) and settings.flush_period == 0
    assert settings == ManagerSettings(local_dir=tmp_path / "l1", redundancy=settings.policy)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.keep_local = 9  # type: ignore[misc]
    with pytest.raises(UsageError, match="give a local_dir"):
        ManagerSettings(redundancy="xor")
    with pytest.raises(UsageError, match="give a local_dir"):
        ManagerSettings().need_a_level()


def test_a_setting_an_integration_decides_is_refused_when_given_otherwise() -> None:
    decided = ManagerSettings().decided_by("Owner", shared_dir="/b", keep_shared=0)
    assert (decided.shared_dir, decided.keep_shared) == ("/b", 0)
    same = ManagerSettings(shared_dir="/b").decided_by("Owner", shared_dir=Path("/b"))
    assert same.shared_dir == "/b"
    with pytest.raises(UsageError, match=r"keep_shared=5: Owner sets it itself \(to 0\)"):
        ManagerSettings(keep_shared=5).decided_by("Owner", keep_shared=0)
