"""The Lightning ``CheckpointIO`` and the Hugging Face ``CheckpointOptions`` pass one
``ManagerSettings`` to their manager as it is (issue 35): every setting (level 3 a bucket, on
the tests' S3 server) reaches the manager without the integration naming it, the keyword
spelling makes the same object, what the Trainer decides itself (``keep_shared`` from its
``save_total_limit``, ``on_error``) is refused when the settings say otherwise, and an invalid
setting raises the very error ``ManagerSettings`` raises."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from kit.s3 import S3
from kit.settings import INVALID, changed_settings, given_fields, left_to

pytest.importorskip("pytorch_lightning")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import ckptfmt_torch.lightning
from _hf_worker import model_and_args
from ckptfmt_torch.hf import CheckpointOptions, Trainer

import ckptfmt
from ckptfmt import ManagerSettings, WriteOptions
from ckptfmt.errors import CkptError, UsageError
from ckptfmt.transport.comm import SingleComm

pytestmark = pytest.mark.torch


def every_setting(tmp_path: Path, s3: S3) -> ManagerSettings:
    endpoint = {"endpoint_url": s3.server.endpoint, "allow_http": "true"}
    return changed_settings(tmp_path, f"{s3.url}/run", **endpoint)


def test_lightning_passes_every_setting_unchanged(tmp_path: Path, s3: S3) -> None:
    given = every_setting(tmp_path, s3)
    by_keywords = ckptfmt_torch.lightning.CheckpointIO(**given_fields(given))
    assert by_keywords.settings == given
    io = ckptfmt_torch.lightning.CheckpointIO(settings=given)
    io.connect(SingleComm())  # what DDPStrategy calls on every rank: the manager is made
    try:
        assert io._manager is not None and io._manager.settings is given
    finally:
        io.close()


def test_lightning_refuses_what_would_be_ignored() -> None:
    with pytest.raises(UsageError, match=r"settings\.write"):
        ckptfmt_torch.lightning.CheckpointIO(
            settings=ManagerSettings(local_dir="l1"), write=WriteOptions(fsync=False)
        )
    with pytest.raises(UsageError, match="give a local_dir"):  # no level: no manager
        ckptfmt_torch.lightning.CheckpointIO(flush_every=2)


def test_hf_passes_every_setting_but_the_trainers_own(tmp_path: Path, s3: S3) -> None:
    given = left_to(every_setting(tmp_path, s3), "keep_shared", "on_error")
    assert CheckpointOptions(**given_fields(given)).settings == given
    for limit, keep in ((None, 0), (2, 3)):  # save_total_limit, and the one in flight on top
        model, args, data = model_and_args(tmp_path / "out", limit=limit)
        options = CheckpointOptions(settings=given)
        trainer = Trainer(model=model, args=args, train_dataset=data, ckptfmt=options)
        manager = trainer._manager(str(tmp_path / "out"))  # what the first save makes
        try:
            want = dataclasses.replace(given, keep_shared=keep, on_error="raise")
            assert manager.settings == want
        finally:
            manager.close(flush=False)
    model, args, data = model_and_args(tmp_path / "out", limit=2)
    options = CheckpointOptions(settings=ManagerSettings(keep_shared=5))
    with pytest.raises(UsageError, match=r"keep_shared=5.*save_total_limit"):
        Trainer(model=model, args=args, train_dataset=data, ckptfmt=options)


def test_hf_keyword_spelling_keeps_its_meaning() -> None:
    assert not CheckpointOptions().managed and not CheckpointOptions(async_save=False).managed
    assert CheckpointOptions(async_save=True).settings == ManagerSettings(async_save=True)
    synchronous = CheckpointOptions(local_dir="l1", write=WriteOptions(fsync=False)).settings
    assert synchronous == ManagerSettings(
        local_dir="l1", async_save=False, write=WriteOptions(fsync=False)
    )
    assert CheckpointOptions(settings=ManagerSettings()).settings == ManagerSettings()


@pytest.mark.parametrize("bad", INVALID, ids=lambda b: ",".join(b))
def test_an_invalid_setting_raises_what_the_settings_raise(bad: dict[str, Any]) -> None:
    with pytest.raises(UsageError) as made:
        ManagerSettings(**bad)
    with pytest.raises(UsageError) as lightning:
        ckptfmt_torch.lightning.CheckpointIO(**bad)
    with pytest.raises(UsageError) as hf:
        CheckpointOptions(**bad)
    assert str(lightning.value) == str(hf.value) == str(made.value)


NUL_PATHS = [
    ("local_dir", {"local_dir": "l1/a\0b"}),
    ("local_dir", {"local_dir": Path("l1") / "a\0b" / "{node}"}),
    ("shared_dir", {"shared_dir": "l3/a\0b"}),
    ("shared_dir", {"local_dir": "l1", "shared_dir": "s3://bucket/a\0b"}),
    ("node", {"local_dir": "l1/{node}", "node": "n\0"}),
]


@pytest.mark.parametrize(("name", "given"), NUL_PATHS, ids=[str(g) for _, g in NUL_PATHS])
def test_a_nul_in_a_path_argument_is_a_usage_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, given: dict[str, Any]
) -> None:
    """A NUL character in a level's path (a directory or a bucket's URL) or in the node's name
    (which fills ``{node}``): the manager, the Lightning ``CheckpointIO`` and the HF
    ``CheckpointOptions`` raise ckptfmt's ``UsageError`` naming the argument, before anything
    is made, instead of the OS's bare ``ValueError`` (the node's: a warning at each save, and
    no checkpoint)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as made:
        ckptfmt.CheckpointManager(comm=SingleComm(), **given)
    with pytest.raises(UsageError) as lightning:
        ckptfmt_torch.lightning.CheckpointIO(**given)
    with pytest.raises(UsageError) as hf:
        CheckpointOptions(**given)
    for err in (made.value, lightning.value, hf.value):
        assert isinstance(err, CkptError) and f"{name}=" in str(err) and "NUL" in str(err)
    assert list(tmp_path.iterdir()) == []
