"""The commit on an object store, against a real S3 server: a checkpoint appears only through its
create-only commit object, which a retried put recognises as its own; the latest pointer never
moves backwards; a commit whose objects are missing or of another size offers no checkpoint; gc
removes exactly the save prefixes no commit names."""

from __future__ import annotations

import json
import os
from pathlib import Path

import crc32c
import jsonschema
import pytest
from kit import REPO
from kit.s3 import S3
from kit.s3_proxy import S3Proxy

from ckptfmt.errors import DestinationExistsError, NotACheckpointError
from ckptfmt.storage.objects import (
    COMMIT_NAME,
    LATEST_NAME,
    Bucket,
    Commit,
    delete_checkpoint,
    drop_replaced,
    find_commit,
    gc,
    missing_objects,
    move_latest,
    new_save_id,
    newest_committed,
    object_problems,
    put_bytes,
    read_commit,
    read_latest,
    upload_files,
    write_commit,
)
from ckptfmt.storage.objects.commit import list_steps, step_bucket
from ckptfmt.storage.steps import step_dir_name


def _files(tmp_path: Path, sizes: dict[str, int]) -> list[tuple[str, Path]]:
    out = []
    for rel, size in sizes.items():
        path = tmp_path / rel.replace("/", "_")
        path.write_bytes(os.urandom(size))
        out.append((rel, path))
    return out


def _save(bucket: Bucket, tmp_path: Path, step: int | None = None) -> Commit:
    save_id = new_save_id()
    refs = upload_files(bucket, save_id, _files(tmp_path, {"w/c/0": 1000, "b/c/0": 10}))
    refs.append(put_bytes(bucket, save_id, "ckptfmt.json", b'{"m": 1}'))
    commit = Commit(save_id, step, refs)
    write_commit(bucket, commit)
    return commit


def test_the_commit_object_lists_every_object_with_size_and_crc(s3: S3, tmp_path: Path) -> None:
    bucket = Bucket.at(f"{s3.url}/run/ckpt")
    commit = _save(bucket, tmp_path)
    body = json.loads(
        s3.server.client()
        .get_object(Bucket=s3.bucket, Key=f"run/ckpt/{COMMIT_NAME}")["Body"]
        .read()
    )
    assert body["format"] == "ckptfmt-commit" and body["version"] == 1
    jsonschema.validate(body, json.loads((REPO / "spec" / "commit.schema.json").read_text()))
    assert body["save_id"] == commit.save_id and body["step"] is None
    keys = [o["key"] for o in body["objects"]]
    assert keys == sorted(keys) == ["b/c/0", "ckptfmt.json", "w/c/0"]
    for o in body["objects"]:
        data = (
            s3.server.client()
            .get_object(Bucket=s3.bucket, Key=f"run/ckpt/{commit.save_id}/{o['key']}")["Body"]
            .read()
        )
        assert (len(data), crc32c.crc32c(data)) == (o["size"], o["crc32c"])
    assert read_commit(bucket) == Commit(commit.save_id, None, sorted(commit.objects))
    assert missing_objects(bucket, commit) == []


def test_no_commit_object_no_checkpoint(s3: S3, tmp_path: Path) -> None:
    bucket = Bucket.at(f"{s3.url}/ckpt")
    upload_files(bucket, new_save_id(), _files(tmp_path, {"a": 5}))
    assert read_commit(bucket) is None


def test_a_retried_commit_wins_and_a_foreign_one_is_refused(s3: S3, tmp_path: Path) -> None:
    bucket = Bucket.at(f"{s3.url}/ckpt")
    commit = _save(bucket, tmp_path)
    # the same commit again: the 412 is read back, the save id is ours, so it is in
    requests = bucket.requests.copy()
    write_commit(bucket, commit)
    assert bucket.requests["PUT"] - requests["PUT"] == 1
    assert bucket.requests["GET"] - requests["GET"] == 1
    other = Commit(new_save_id(), None, commit.objects)
    with pytest.raises(DestinationExistsError, match=commit.save_id) as info:
        write_commit(bucket, other)
    assert info.value.path == f"{s3.url}/ckpt/{COMMIT_NAME}"
    assert read_commit(bucket).save_id == commit.save_id  # type: ignore[union-attr]


def test_missing_or_mis_sized_objects_are_named(s3: S3, tmp_path: Path) -> None:
    bucket = Bucket.at(f"{s3.url}/run")
    commit = _save(step_bucket(bucket, 5), tmp_path / "", step=5)
    u = step_bucket(bucket, 5)
    client = s3.server.client()
    client.delete_object(Bucket=s3.bucket, Key=f"run/{step_dir_name(5)}/{commit.save_id}/b/c/0")
    client.put_object(
        Bucket=s3.bucket, Key=f"run/{step_dir_name(5)}/{commit.save_id}/w/c/0", Body=b"short"
    )
    assert missing_objects(u, commit) == ["b/c/0", "w/c/0"]
    assert object_problems(u, commit) == {
        "b/c/0": "missing",
        "w/c/0": "size 5, the commit says 1000",
    }
    assert newest_committed(bucket) is None
    assert newest_committed(bucket, check=False) is not None


def test_a_malformed_commit_object_is_named(s3: S3) -> None:
    bucket = Bucket.at(f"{s3.url}/ckpt")
    bucket.put(COMMIT_NAME, b'{"format": "ckptfmt-commit", "version": 1, "save_id": "x"}')
    with pytest.raises(NotACheckpointError, match="save_id") as info:
        read_commit(bucket)
    assert info.value.path == f"{s3.url}/ckpt/{COMMIT_NAME}"


def test_the_latest_pointer_never_moves_backwards(s3: S3) -> None:
    root = Bucket.at(f"{s3.url}/run")
    a, b, c = new_save_id(), new_save_id(), new_save_id()
    assert read_latest(root) is None
    assert move_latest(root, 10, a)
    assert read_latest(root) == (10, a)
    assert move_latest(root, 20, b)
    assert not move_latest(root, 15, c)  # a stale writer leaves it
    assert read_latest(root) == (20, b)
    assert not move_latest(root, 20, b)  # its own retry: nothing to do
    assert move_latest(root, 20, c)  # the same step saved again (overwrite)
    assert read_latest(root) == (20, c)


def test_a_pointer_moved_in_between_is_read_again(s3: S3) -> None:
    """Two writers read the pointer; the second's conditional put gets 412, reads again, and
    moves it only when its step is newer."""
    root = Bucket.at(f"{s3.url}/run")
    move_latest(root, 1, new_save_id())
    _, etag = root.get_tagged(LATEST_NAME)
    newer = new_save_id()
    assert move_latest(root, 30, newer)  # the other writer, in between
    # the stale writer's put on the old etag fails with 412 ...
    with pytest.raises(Exception) as info:
        root.put(LATEST_NAME, b'{"step": 2, "save_id": "' + b"0" * 32 + b'"}', if_match=etag)
    assert getattr(info.value, "status", None) == 412
    # ... and move_latest, which rereads, leaves the newer pointer
    assert not move_latest(root, 2, new_save_id())
    assert read_latest(root) == (30, newer)


def test_newest_committed_reads_the_pointer_and_lists_only_without_it(
    s3: S3, tmp_path: Path
) -> None:
    root = Bucket.at(f"{s3.url}/run")
    saves = {step: _save(step_bucket(root, step), tmp_path, step=step) for step in (100, 200)}
    move_latest(root, 200, saves[200].save_id)
    before = root.requests.copy()
    step, commit = newest_committed(root)  # type: ignore[misc]
    assert (step, commit.save_id) == (200, saves[200].save_id)
    assert root.requests["LIST"] == before["LIST"]
    # the pointed step is deleted (retention): the fallback LISTs and finds the older one
    delete_checkpoint(step_bucket(root, 200), everything=True)
    assert s3.keys(f"run/{step_dir_name(200)}") == []
    assert list_steps(root) == [100]
    step, commit = newest_committed(root)  # type: ignore[misc]
    assert (step, commit.save_id) == (100, saves[100].save_id)
    assert newest_committed(root, below=100) is None


def test_an_overwrite_replaces_the_commit_it_found_in_one_put_and_no_other(
    s3: S3, tmp_path: Path
) -> None:
    """Two overwrites found the same checkpoint: the first replaces its commit object on its
    etag (the old objects still there until it drops them); the second is refused, naming the
    save now there; the first put again (a retry whose answer was lost) is read back as in."""
    bucket = Bucket.at(f"{s3.url}/ckpt")
    old = _save(bucket, tmp_path)
    found = find_commit(bucket)
    assert found is not None and found.commit is not None and found.etag
    assert (found.commit.save_id, found.commit.objects) == (old.save_id, sorted(old.objects))
    a, b = new_save_id(), new_save_id()
    first = Commit(a, None, upload_files(bucket, a, _files(tmp_path, {"x": 7})))
    second = Commit(b, None, upload_files(bucket, b, _files(tmp_path, {"y": 9})))
    write_commit(bucket, first, found)
    assert read_commit(bucket).save_id == a  # type: ignore[union-attr]
    assert missing_objects(bucket, old) == []
    with pytest.raises(DestinationExistsError, match=f"changed while this save.*now save {a}"):
        write_commit(bucket, second, found)
    write_commit(bucket, first, found)  # 412, read back: this save is in
    assert drop_replaced(bucket, found, first) == len(old.objects)
    assert drop_replaced(bucket, find_commit(bucket), first) == 0  # never its own objects
    assert sorted(s3.keys("ckpt/")) == sorted([f"ckpt/{COMMIT_NAME}", f"ckpt/{a}/x", f"ckpt/{b}/y"])
    gc(bucket)  # the refused save's objects
    assert sorted(s3.keys("ckpt/")) == sorted([f"ckpt/{a}/x", f"ckpt/{COMMIT_NAME}"])


def test_delete_removes_the_commit_object_first_and_only_its_save(s3: S3, tmp_path: Path) -> None:
    bucket = Bucket.at(f"{s3.url}/ckpt")
    old = _save(bucket, tmp_path)
    # a save beside it that is not committed (retention deletes the checkpoint, not it)
    new_id = new_save_id()
    refs = upload_files(bucket, new_id, _files(tmp_path, {"x": 7}))
    assert delete_checkpoint(bucket) == old.save_id
    assert read_commit(bucket) is None
    assert s3.keys("ckpt/") == [f"ckpt/{new_id}/x"]
    write_commit(bucket, Commit(new_id, None, refs))
    assert read_commit(bucket).save_id == new_id  # type: ignore[union-attr]


def test_gc_removes_exactly_the_uncommitted_prefixes(s3: S3, tmp_path: Path) -> None:
    root = Bucket.at(f"{s3.url}/run")
    kept = _save(step_bucket(root, 1), tmp_path, step=1)
    move_latest(root, 1, kept.save_id)
    crashed = new_save_id()  # a save that never committed, in a step of its own
    upload_files(step_bucket(root, 2), crashed, _files(tmp_path, {"a/b": 3, "c": 4}))
    superseded = new_save_id()  # an older save of step 1 that an overwrite left
    upload_files(step_bucket(root, 1), superseded, _files(tmp_path, {"z": 3}))
    # a committed save whose own tree holds a 32-hex segment keeps it
    odd = Bucket.at(f"{s3.url}/run/odd")
    sid = new_save_id()
    refs = upload_files(odd, sid, _files(tmp_path, {f"t/{new_save_id()}/0": 2}))
    write_commit(odd, Commit(sid, None, refs))
    s3.server.client().put_object(Bucket=s3.bucket, Key="run/notes.txt", Body=b"mine")
    before = set(s3.keys())

    result = gc(root)
    assert sorted(result.removed) == sorted(
        [
            f"{s3.url}/run/{step_dir_name(2)}/{crashed}",
            f"{s3.url}/run/{step_dir_name(1)}/{superseded}",
        ]
    )
    assert result.objects == 3
    gone = {
        f"run/{step_dir_name(2)}/{crashed}/a/b",
        f"run/{step_dir_name(2)}/{crashed}/c",
        f"run/{step_dir_name(1)}/{superseded}/z",
    }
    assert set(s3.keys()) == before - gone
    assert result.note is None
    assert gc(root).removed == []
    assert newest_committed(root) is not None


def test_gc_aborts_unfinished_multipart_uploads(s3: S3) -> None:
    client = s3.server.client()
    up = client.create_multipart_upload(
        Bucket=s3.bucket, Key=f"run/{step_dir_name(3)}/{new_save_id()}/x"
    )
    client.upload_part(
        Bucket=s3.bucket, Key=up["Key"], UploadId=up["UploadId"], PartNumber=1, Body=b"x" * 100
    )
    elsewhere = client.create_multipart_upload(Bucket=s3.bucket, Key="other/y")
    result = gc(Bucket.at(f"{s3.url}/run"))
    assert result.aborted == [up["Key"]]
    left = client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", [])
    assert [u["UploadId"] for u in left] == [elsewhere["UploadId"]]


def test_a_commit_whose_answer_was_lost_is_read_back(
    s3: S3, s3_proxy: S3Proxy, tmp_path: Path
) -> None:
    """The server stores the commit object but its answer is lost. The library does not retry a
    conditional put once sent (it may have acted), so write_commit reads the object back, finds
    its own save id, and the commit stands: no error, one PUT, one commit object."""
    bucket = Bucket.at(f"{s3.url}/ckpt", {"init_backoff": 0.01})
    save_id = new_save_id()
    refs = upload_files(bucket, save_id, _files(tmp_path, {"a": 10}))
    s3_proxy.drop_answer(1, method="PUT", path_contains=COMMIT_NAME)
    write_commit(bucket, Commit(save_id, None, refs))
    assert s3_proxy.faults["drop"] == 1
    commit_puts = [p for m, p in s3_proxy.seen if m == "PUT" and COMMIT_NAME in p]
    assert commit_puts == [f"/{s3.bucket}/ckpt/{COMMIT_NAME}"]
    assert read_commit(bucket).save_id == save_id  # type: ignore[union-attr]


def test_a_commit_put_cut_short_is_put_again(s3: S3, s3_proxy: S3Proxy, tmp_path: Path) -> None:
    """The connection drops in the commit put's body (nothing stored): the read finds no commit
    object, and the put is made again."""
    bucket = Bucket.at(f"{s3.url}/ckpt", {"init_backoff": 0.01})
    save_id = new_save_id()
    refs = upload_files(bucket, save_id, _files(tmp_path, {"a": 10}))
    s3_proxy.reset_mid_body(1, path_contains=COMMIT_NAME)
    write_commit(bucket, Commit(save_id, None, refs))
    assert s3_proxy.faults["reset"] == 1
    assert read_commit(bucket).save_id == save_id  # type: ignore[union-attr]


def test_a_pointer_move_whose_answer_was_lost_is_read_again(s3: S3, s3_proxy: S3Proxy) -> None:
    root = Bucket.at(f"{s3.url}/run", {"init_backoff": 0.01})
    move_latest(root, 1, new_save_id())
    newer = new_save_id()
    s3_proxy.drop_answer(1, method="PUT", path_contains=LATEST_NAME)
    move_latest(root, 2, newer)  # no error: the reread shows the pointer at this save
    assert read_latest(root) == (2, newer) and s3_proxy.faults["drop"] == 1
