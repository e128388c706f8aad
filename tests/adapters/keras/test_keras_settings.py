"""``BackupAndRestore`` passes one ``ManagerSettings`` to its manager as it is (issue 35): every
setting reaches the manager of a real ``fit`` without the callback naming it, its level 3 is
``backup_dir`` (a different one in the settings is refused), and an invalid setting raises the
very error ``ManagerSettings`` raises."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
from kit.keras import compiled, xy
from kit.settings import INVALID, changed_settings, given_fields, left_to

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
keras = pytest.importorskip("keras")

import ckptfmt_keras as ck  # noqa: E402

from ckptfmt import CheckpointManager, ManagerSettings  # noqa: E402
from ckptfmt.errors import UsageError  # noqa: E402
from ckptfmt.storage.steps import list_step_dirs  # noqa: E402

pytestmark = pytest.mark.tf


def fit_with(cb: ck.BackupAndRestore) -> CheckpointManager:
    """One epoch of a small model under ``cb``; the manager it made (seen during the fit)."""
    model = compiled(keras.Sequential([keras.Input((8,)), keras.layers.Dense(6)]))
    seen: list[Any] = []
    probe = keras.callbacks.LambdaCallback(on_epoch_end=lambda *_: seen.append(cb.manager))
    x, y = xy(16)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[cb, probe])
    assert isinstance(seen[0], CheckpointManager)
    return seen[0]


def test_every_setting_reaches_the_manager_unchanged(tmp_path: Path) -> None:
    given = left_to(changed_settings(tmp_path), "shared_dir")  # level 3 is backup_dir
    backup = tmp_path / "backup"
    want = dataclasses.replace(given, shared_dir=backup)
    by_object = ck.BackupAndRestore(backup, settings=given, delete_checkpoint=False)
    by_keywords = ck.BackupAndRestore(backup, delete_checkpoint=False, **given_fields(given))
    assert by_object.settings == by_keywords.settings == want
    manager = fit_with(by_object)
    assert manager.settings == want
    assert [s for s, _ in list_step_dirs(tmp_path / "l1" / "n0")] == [2]  # local_dir, node


def test_backup_dir_is_level_3_and_double_checkpoint_the_retention() -> None:
    assert ck.BackupAndRestore("d").settings == ManagerSettings(
        shared_dir="d", keep_local=1, keep_shared=1
    )
    two = ck.BackupAndRestore("d", double_checkpoint=True, keep_local=3).settings
    assert (two.keep_local, two.keep_shared) == (3, 2)
    mine = ManagerSettings(local_dir="l1")  # the settings' own retention, as given
    assert ck.BackupAndRestore("d", settings=mine).settings.keep_local == mine.keep_local
    assert ck.BackupAndRestore("d", settings=ManagerSettings(shared_dir="d")).settings
    with pytest.raises(UsageError, match=r"shared_dir='elsewhere'.*backup_dir"):
        ck.BackupAndRestore("d", settings=ManagerSettings(shared_dir="elsewhere"))


@pytest.mark.parametrize("bad", INVALID, ids=lambda b: ",".join(b))
def test_an_invalid_setting_raises_what_the_settings_raise(bad: dict[str, Any]) -> None:
    with pytest.raises(UsageError) as made:
        ManagerSettings(**bad)
    with pytest.raises(UsageError) as callback:
        ck.BackupAndRestore("d", **bad)
    assert str(callback.value) == str(made.value)
    with pytest.raises(TypeError, match="fsync"):
        ck.BackupAndRestore("d", fsync=False)
