"""The Keras adapter through a manager whose level 3 is a bucket (the tests' S3 server): a
trained model and its optimizer flushed to the bucket come back bit for bit into a model built
alike, once level 1 is gone (``ckptfmt_keras.to_state`` / ``restore``), and ``BackupAndRestore``
with the bucket's URL as its ``backup_dir``."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
from kit.keras import compiled, xy
from kit.managers import NO_EXIT_HOOKS
from kit.s3 import S3
from kit.s3_proxy import S3Proxy

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
keras = pytest.importorskip("keras")

import ckptfmt_keras as ck  # noqa: E402

from ckptfmt import CheckpointManager, WriteOptions  # noqa: E402
from ckptfmt.errors import CredentialsError  # noqa: E402

pytestmark = [pytest.mark.tf, pytest.mark.slow]


def build(seed: int) -> Any:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", name="h"),
            keras.layers.Dense(6, name="out"),
        ],
        name="mlp",
    )


def arrays_of(model: Any) -> dict[str, bytes]:
    out = {f"m:{k}": a.tobytes() for k, a in ck.to_arrays(model).items()}
    out.update({f"o:{k}": a.tobytes() for k, a in ck.to_arrays(model.optimizer).items()})
    return out


def test_a_keras_model_restores_from_the_bucket_through_the_manager(tmp_path: Path, s3: S3) -> None:
    def manager() -> CheckpointManager:
        return CheckpointManager(
            tmp_path / "l1",
            f"{s3.url}/keras",
            write=WriteOptions(fsync=False),
            at_exit=NO_EXIT_HOOKS,
        )

    model = compiled(build(1))
    x, y = xy(32)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    with manager() as mgr:
        mgr.save(8, ck.to_state(model, counters={"step": 8}))
    shutil.rmtree(tmp_path / "l1")

    other = compiled(build(2))
    other.fit(x[:8], y[:8], batch_size=8, epochs=1, shuffle=False, verbose=0)  # other values
    assert arrays_of(other) != arrays_of(model)
    with manager() as mgr:
        report = ck.restore(other, mgr)
    assert (report.step, report.level) == (8, 3)
    assert report.state is not None and report.state["counters"] == {"step": 8}
    assert arrays_of(other) == arrays_of(model)


def test_backup_and_restore_keeps_its_backup_in_the_bucket(
    tmp_path: Path, s3: S3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``BackupAndRestore`` with a bucket's URL as ``backup_dir``: the backups go to the bucket
    (not to a directory ``./s3:/...`` that a ``Path`` folding the ``//`` names), a second
    ``fit`` resumes from them, and the ``fit`` that ends deletes every object of its backup."""
    monkeypatch.chdir(tmp_path)
    x, y = xy(32)
    url = f"{s3.url}/keras"

    def fit(model: Any, epochs: int, delete: bool) -> ck.BackupAndRestore:
        cb = ck.BackupAndRestore(
            url,
            delete_checkpoint=delete,
            local_dir=tmp_path / "l1",
            write=WriteOptions(fsync=False),
            at_exit=NO_EXIT_HOOKS,
        )
        model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=[cb])
        return cb

    first = compiled(build(1))
    fit(first, 2, delete=False)
    assert s3.keys("keras/") and not (tmp_path / "s3:").exists()
    shutil.rmtree(tmp_path / "l1")  # only the bucket's copy is left

    second = compiled(build(2))
    cb = fit(second, 2, delete=True)  # both epochs done: restores, trains nothing
    assert cb.last_restore is not None and cb.last_restore.level == 3
    assert cb.restored_counters is not None and cb.restored_counters["epoch"] == 2
    assert arrays_of(second) == arrays_of(first)
    assert s3.keys("keras/") == [] and not (tmp_path / "s3:").exists()


def test_delete_checkpoint_removes_only_what_the_backup_wrote(tmp_path: Path, s3: S3) -> None:
    """``delete_checkpoint`` at the end of ``fit`` removes the checkpoints, from level 1 and
    from the bucket, and nothing else: a ``local_dir`` on a node's scratch disk and a bucket
    prefix that also hold the user's own files keep them, byte for byte (Keras's callback
    removes its whole directory; ckptfmt's level 1 is a directory of the user's choosing)."""
    x, y = xy(32)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    data = os.urandom(4096)
    (scratch / "dataset.bin").write_bytes(data)
    (scratch / "shards").mkdir()
    (scratch / "shards" / "0.bin").write_bytes(data[:100])
    s3.put("keras/dataset.bin", data)
    s3.put("keras/step-notes/x.txt", b"not a step")
    s3.put("keras/step-0000000099/mine.txt", b"under a step's name, not a save's")

    cb = ck.BackupAndRestore(
        f"{s3.url}/keras",
        save_freq=2,
        delete_checkpoint=True,
        local_dir=scratch,
        flush_every=1,
        write=WriteOptions(fsync=False),
        at_exit=NO_EXIT_HOOKS,
    )
    model = compiled(build(1))
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[cb])

    assert sorted(p.name for p in scratch.iterdir()) == ["dataset.bin", "shards"]
    assert (scratch / "dataset.bin").read_bytes() == data
    assert (scratch / "shards" / "0.bin").read_bytes() == data[:100]
    assert s3.keys("keras/") == [
        "keras/dataset.bin",
        "keras/step-0000000099/mine.txt",
        "keras/step-notes/x.txt",
    ]
    assert s3.get("keras/dataset.bin") == data


def test_delete_checkpoint_keeps_a_directory_with_the_users_files(tmp_path: Path) -> None:
    """A local ``backup_dir`` that holds the user's files: the checkpoints go, the files and
    the directory stay; ``local_dir`` of the backup alone is removed whole."""
    x, y = xy(32)
    backup, local = tmp_path / "backup", tmp_path / "l1"
    backup.mkdir()
    (backup / "notes.txt").write_text("mine")
    cb = ck.BackupAndRestore(
        backup,
        save_freq=2,
        local_dir=local / "{node}",
        flush_every=1,
        write=WriteOptions(fsync=False),
        at_exit=NO_EXIT_HOOKS,
    )
    model = compiled(build(1))
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[cb])
    assert [p.name for p in backup.iterdir()] == ["notes.txt"]
    assert (backup / "notes.txt").read_text() == "mine"
    assert list(local.iterdir()) == []


def test_delete_checkpoint_that_fails_still_closes_the_manager(
    tmp_path: Path, s3: S3, s3_proxy: S3Proxy
) -> None:
    """The bucket refuses every request from ``on_train_end`` on: ``fit`` raises the deletion's
    error (ckptfmt's, naming the bucket), and the manager is closed all the same (its saver
    thread ended, nothing of it left running). It was closed only after a deletion that
    succeeded, and the callback forgets its manager first: nothing could close it after."""
    x, y = xy(32)

    class Refuse(keras.callbacks.Callback):  # type: ignore[misc]
        def on_train_end(self, logs: Any = None) -> None:
            s3_proxy.refuse(10_000)

    before = {t.ident for t in threading.enumerate() if t.name.startswith("ckptfmt-saver")}
    cb = ck.BackupAndRestore(
        f"{s3.url}/keras",
        save_freq=2,
        delete_checkpoint=True,
        local_dir=tmp_path / "l1",
        flush_every=1,
        write=WriteOptions(fsync=False),
        at_exit=NO_EXIT_HOOKS,
    )
    model = compiled(build(1))
    with pytest.raises(CredentialsError, match="keras"):
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[Refuse(), cb])
    s3_proxy.clear()
    savers = [
        t
        for t in threading.enumerate()
        if t.name.startswith("ckptfmt-saver") and t.ident not in before
    ]
    assert savers == []
    assert s3.keys("keras/")  # the deletion did not happen: the checkpoints are still there
