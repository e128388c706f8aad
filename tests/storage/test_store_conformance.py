"""One conformance suite for every write-side store (``ckptfmt.storage.store``), as zarr-python
runs one suite over its stores: a directory (staging directory + rename), a bucket on the tests'
real S3 server (objects + create-only commit object) and memory (a dict swapped in). A new store
is one module and one case of the ``store`` fixture below (``docs/stores.md``).

Each test drives a store through its verbs (prepare/join a draft, set/get/list/delete members,
stage the manifest, publish, discard/unpublish/abort) and reads the result back through the read
side (``Store.files()``, the ``Files`` the readers take), bit for bit; the torn writes (a draft
never committed, aborted, a second writer's members) are never visible."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from kit.s3 import S3

from ckptfmt.errors import DestinationExistsError, MissingFileError, NotACheckpointError
from ckptfmt.manifest.codec import MANIFEST_NAME
from ckptfmt.storage.objects import Bucket
from ckptfmt.storage.store import DirectoryStore, MemoryStore, Store, parse_location
from ckptfmt.storage.store.bucket import SINGLE_PUT_MAX, BucketStore
from ckptfmt.storage.store.directory import in_memory

MakeStore = Callable[[str], Store]


@pytest.fixture(params=["directory", "bucket", "memory"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> MakeStore:
    """A factory of stores of one kind, each at its own name (``ckpt-a``, ...)."""
    if request.param == "directory":
        return lambda name: DirectoryStore(tmp_path / name)
    if request.param == "bucket":
        s3: S3 = request.getfixturevalue("s3")
        return lambda name: BucketStore(Bucket.at(f"{s3.url}/run/{name}"))
    memories: dict[str, MemoryStore] = {}
    return lambda name: memories.setdefault(name, MemoryStore(name))


@pytest.fixture
def store(make_store: MakeStore) -> Store:
    return make_store("ckpt")


def _manifest(tag: str) -> bytes:
    return b'{"step": 7, "tag": "%s"}' % tag.encode()


def _commit(store: Store, members: dict[str, bytes], tag: str, overwrite: bool = False) -> str:
    save_id = os.urandom(16).hex()
    draft = store.prepare(save_id, overwrite)
    for rel, data in members.items():
        assert draft.set(rel, [data[:3], memoryview(data)[3:]], fsync=False) == len(data)
    draft.stage_manifest(_manifest(tag), [draft.written()], fsync=False)
    draft.discard(draft.publish(fsync=False))
    return save_id


def _read(store: Store, rel: str, size: int) -> bytes:
    with store.files().open_exact(rel, size) as handle:
        return handle.pread(size, 0)


MEMBERS = {
    "zarr.json": b'{"zarr_format": 3}',
    "model/w/c/0/0": np.arange(1000, dtype=np.float32).tobytes(),
    "model/w/c/0/1": bytes(range(256)) * 3,
}


def test_commit_then_read_back(store: Store) -> None:
    assert not store.is_committed()
    with pytest.raises(NotACheckpointError):
        store.files()
    _commit(store, MEMBERS, "one")
    assert store.is_committed()
    files = store.files()
    assert files.read(MANIFEST_NAME, 1 << 20) == _manifest("one")
    for rel, data in MEMBERS.items():
        assert _read(store, rel, len(data)) == data
        files.check_size(rel, len(data))
    with pytest.raises(MissingFileError):
        files.open_exact("model/w/c/9/9", 4)


def test_read_into_and_ranges(store: Store) -> None:
    data = MEMBERS["model/w/c/0/0"]
    _commit(store, MEMBERS, "one")
    with store.files().open_exact("model/w/c/0/0", len(data)) as handle:
        assert handle.pread(8, 100) == data[100:108]
        out = np.zeros(16, np.uint8)
        handle.read_into([memoryview(out)[:6], memoryview(out)[6:]], 40)
        assert out.tobytes() == data[40:56]


def test_existing_refused_unless_overwrite(store: Store) -> None:
    _commit(store, MEMBERS, "one")
    with pytest.raises(DestinationExistsError):
        store.prepare(os.urandom(16).hex(), overwrite=False)
    assert store.files().read(MANIFEST_NAME, 1 << 20) == _manifest("one")


def test_overwrite_keeps_old_whole_until_publish(store: Store) -> None:
    _commit(store, MEMBERS, "old")
    new = {"zarr.json": b'{"zarr_format": 3, "new": 1}', "x/c/0": b"n" * 5000}
    draft = store.prepare(os.urandom(16).hex(), overwrite=True)
    for rel, data in new.items():
        draft.set(rel, [data], fsync=False)
    draft.stage_manifest(_manifest("new"), [draft.written()], fsync=False)
    # everything written and the manifest staged: the old checkpoint is still the one there
    assert store.files().read(MANIFEST_NAME, 1 << 20) == _manifest("old")
    for rel, data in MEMBERS.items():
        assert _read(store, rel, len(data)) == data
    replaced = draft.publish(fsync=False)
    assert store.files().read(MANIFEST_NAME, 1 << 20) == _manifest("new")
    draft.discard(replaced)
    assert _read(store, "x/c/0", 5000) == new["x/c/0"]
    with pytest.raises(MissingFileError):
        store.files().open_exact("model/w/c/0/0", len(MEMBERS["model/w/c/0/0"]))


def test_torn_write_is_never_visible(store: Store) -> None:
    """A draft that never reaches its publish (the writer died, or failed and aborted) changes
    nothing a reader sees: no checkpoint where there was none, the old one where there was."""
    draft = store.prepare(os.urandom(16).hex(), overwrite=False)
    draft.set("zarr.json", [b"{}"], fsync=False)
    draft.stage_manifest(_manifest("torn"), [draft.written()], fsync=False)
    assert not store.is_committed()  # staged, never published: a crash here leaves nothing
    draft.abort()
    assert not store.is_committed()
    _commit(store, MEMBERS, "old")
    torn = store.prepare(os.urandom(16).hex(), overwrite=True)
    torn.set("model/w/c/0/0", [b"half"], fsync=False)
    assert store.files().read(MANIFEST_NAME, 1 << 20) == _manifest("old")
    torn.abort()
    for rel, data in MEMBERS.items():
        assert _read(store, rel, len(data)) == data


def test_unpublish_puts_the_old_one_back(store: Store) -> None:
    _commit(store, MEMBERS, "old")
    draft = store.prepare(os.urandom(16).hex(), overwrite=True)
    draft.set("zarr.json", [b"{}"], fsync=False)
    draft.stage_manifest(_manifest("new"), [draft.written()], fsync=False)
    replaced = draft.publish(fsync=False)
    draft.unpublish(replaced, fsync=False)
    assert store.files().read(MANIFEST_NAME, 1 << 20) == _manifest("old")
    for rel, data in MEMBERS.items():
        assert _read(store, rel, len(data)) == data


def test_unpublish_of_a_first_commit_leaves_nothing(store: Store) -> None:
    draft = store.prepare(os.urandom(16).hex(), overwrite=False)
    draft.set("zarr.json", [b"{}"], fsync=False)
    draft.stage_manifest(_manifest("new"), [draft.written()], fsync=False)
    draft.unpublish(draft.publish(fsync=False), fsync=False)
    assert not store.is_committed()


def test_two_writers_one_commit(store: Store) -> None:
    """Writers of one checkpoint (the ranks of a collective save): the committer prepares,
    another joins the same save id, each writes its own members, the committer stages the
    manifest with every writer's record and publishes; all of it reads back."""
    save_id = os.urandom(16).hex()
    mine = store.prepare(save_id, overwrite=False)
    theirs = store.join(save_id)
    mine.set("a/c/0", [b"A" * 300], fsync=False)
    theirs.set("a/c/1", [b"B" * 200], fsync=False)
    assert [r for r, _ in theirs.list()] == ["a/c/0", "a/c/1"]  # one draft, seen by both
    mine.stage_manifest(_manifest("both"), [mine.written(), theirs.written()], fsync=False)
    mine.discard(mine.publish(fsync=False))
    assert _read(store, "a/c/0", 300) == b"A" * 300
    assert _read(store, "a/c/1", 200) == b"B" * 200


def test_list_get_delete_in_a_draft(store: Store) -> None:
    draft = store.prepare(os.urandom(16).hex(), overwrite=False)
    draft.set("a/zarr.json", [b"{}"], fsync=False)
    draft.set("a/c/0", [b"xyz", b"w"], fsync=False)
    draft.set("b", [], fsync=False)
    assert draft.list() == [("a/c/0", 4), ("a/zarr.json", 2), ("b", 0)]
    assert draft.get("a/c/0") == b"xyzw"
    draft.delete(["a/c/0", "absent"])
    assert [r for r, _ in draft.list()] == ["a/zarr.json", "b"]
    draft.stage_manifest(_manifest("x"), [draft.written()], fsync=False)
    draft.discard(draft.publish(fsync=False))
    with pytest.raises(MissingFileError):
        store.files().open_exact("a/c/0", 4)
    assert store.files().read("a/zarr.json", 10) == b"{}"


def test_delete_removes_the_checkpoint(store: Store) -> None:
    _commit(store, MEMBERS, "one")
    store.delete()
    assert not store.is_committed()
    with pytest.raises(NotACheckpointError):
        store.files()
    _commit(store, MEMBERS, "two")  # the place is free again
    assert store.files().read(MANIFEST_NAME, 1 << 20) == _manifest("two")


def test_a_big_member_streams_and_reads_back(store: Store) -> None:
    """A member above a single PUT's size (a bucket sends it in parts, assembled from the
    pieces one part at a time) reads back bit for bit."""
    rng = np.random.default_rng(5)
    big = rng.integers(0, 255, SINGLE_PUT_MAX + 3_000_001, dtype=np.uint8)
    pieces = [memoryview(big)[:1000], memoryview(big)[1000:], b"tail"]
    draft = store.prepare(os.urandom(16).hex(), overwrite=False)
    size = len(big) + 4
    assert draft.set("big/c/0", pieces, fsync=False) == size
    draft.stage_manifest(_manifest("big"), [draft.written()], fsync=False)
    draft.discard(draft.publish(fsync=False))
    assert _read(store, "big/c/0", size) == big.tobytes() + b"tail"


def test_stores_are_independent(make_store: MakeStore) -> None:
    a, b = make_store("a"), make_store("b")
    _commit(a, MEMBERS, "a")
    assert not b.is_committed()
    _commit(b, {"only": b"b"}, "b")
    assert a.files().read(MANIFEST_NAME, 1 << 20) == _manifest("a")
    assert b.files().read("only", 9) == b"b"


def test_parse_location_gives_the_store(tmp_path: Path, s3: S3) -> None:
    assert isinstance(parse_location(tmp_path / "x").store(), DirectoryStore)
    assert isinstance(parse_location(f"{s3.url}/x").store(), BucketStore)
    mem = MemoryStore()
    assert parse_location(mem).store() is mem
    assert parse_location(str(tmp_path / "{node}" / "x")).kind == "spread"
    assert parse_location({"n0": tmp_path}).kind == "spread"


def test_parse_location_refuses_what_is_not_a_store(tmp_path: Path) -> None:
    from ckptfmt.errors import UrlNotSupportedError, UsageError

    with pytest.raises(UrlNotSupportedError):
        parse_location("file:///tmp/x")
    with pytest.raises(UsageError, match="storage_options"):
        parse_location(tmp_path, {"region": "x"})
    with pytest.raises(UsageError, match="one store per node"):
        parse_location(str(tmp_path / "{node}")).store()
    with pytest.raises(UsageError, match="not int"):
        parse_location(3)  # type: ignore[arg-type]


# --- the save path through each store ----------------------------------------------------------


def _state() -> dict[str, object]:
    rng = np.random.default_rng(9)
    return {
        "model": {"w": rng.standard_normal((70, 33)).astype(np.float32), "b": np.arange(7)},
        "step": 12,
        "note": "x",
    }


def test_ckptfmt_save_and_load_through_the_store(store: Store) -> None:
    """``ckptfmt.save`` writes through the store it is given (its shards, documents and
    manifest as members of a draft, then the store's commit), ``load`` and ``open`` read it
    back through the store's read side, bit for bit; an overwrite replaces it whole."""
    import ckptfmt
    from ckptfmt import WriteOptions

    small = WriteOptions(fsync=False, chunk_bytes=1 << 10, shard_bytes=4 << 10)
    state = _state()
    manifest = ckptfmt.save(state, store, step=3, write=small)
    assert store.is_committed()
    back = ckptfmt.load(store)
    np.testing.assert_array_equal(back["model"]["w"], state["model"]["w"])  # type: ignore[index]
    np.testing.assert_array_equal(back["model"]["b"], state["model"]["b"])  # type: ignore[index]
    assert (back["step"], back["note"]) == (12, "x")
    with pytest.raises(DestinationExistsError):
        ckptfmt.save(state, store, write=small)
    state["step"] = 13
    again = ckptfmt.save(state, store, write=WriteOptions(fsync=False, overwrite=True))
    assert again.save_id != manifest.save_id
    assert ckptfmt.load(store)["step"] == 13
    view = ckptfmt.open(store)
    np.testing.assert_array_equal(view["model/w"][5:9], state["model"]["w"][5:9])  # type: ignore[index]


def test_save_to_a_url_writes_nothing_local(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ckptfmt.save`` to a URL puts its files from memory: no scratch directory in TMPDIR."""
    import tempfile

    import ckptfmt

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", None)
    url = f"{s3.url}/direct"
    ckptfmt.save(_state(), url)
    assert list(scratch.iterdir()) == []
    assert ckptfmt.load(url)["step"] == 12


def test_copy_from_links_where_the_store_can(store: Store, tmp_path: Path) -> None:
    """``Draft.copy_from`` (an incremental save's unchanged files) hard-links a committed file
    into a directory's draft; a bucket or memory cannot (False: the caller writes the file), and
    nothing is set then."""
    source = tmp_path / "base-file"
    source.write_bytes(b"unchanged")
    draft = store.prepare(os.urandom(16).hex(), overwrite=False)
    linked = draft.copy_from(source, "a/c/0")
    assert linked == isinstance(store, DirectoryStore)
    if not linked:
        assert draft.list() == []
        draft.set("a/c/0", [source.read_bytes()], fsync=False)
    draft.stage_manifest(_manifest("copy"), [draft.written()], fsync=False)
    draft.discard(draft.publish(fsync=False))
    assert _read(store, "a/c/0", 9) == b"unchanged"
    if linked:
        assert (store.path / "a/c/0").stat().st_ino == source.stat().st_ino  # type: ignore[attr-defined]


def test_sync_then_commit(store: Store) -> None:
    """Members set without an fsync, then ``Draft.sync`` (twice: the second finds nothing to
    do), then a durable commit: the checkpoint reads back bit for bit on every store."""
    draft = store.prepare(os.urandom(16).hex(), overwrite=False)
    for rel, data in MEMBERS.items():
        draft.set(rel, [data], fsync=False)
    draft.sync()
    draft.sync()
    draft.stage_manifest(_manifest("synced"), [draft.written()], fsync=True)
    draft.discard(draft.publish(fsync=True))
    for rel, data in MEMBERS.items():
        assert _read(store, rel, len(data)) == data


def _record_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The paths of the real fsyncs made from now on (each recorded on its way)."""
    synced: list[Path] = []
    real_fsync = os.fsync

    def recorded(fd: int) -> None:
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recorded)
    return synced


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_directory_sync_fsyncs_what_was_set_without_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory's ``sync`` fsyncs exactly the members set with ``fsync=False`` since the last
    one, and ``stage_manifest`` the manifest, what is left unsynced and every directory of the
    tree; a member gone behind the draft's back fails the sync."""
    if in_memory(tmp_path):
        pytest.skip(f"{tmp_path} is on a memory file system, where nothing is fsynced")
    synced = _record_fsyncs(monkeypatch)
    store = DirectoryStore(tmp_path / "ckpt")
    draft = store.prepare(os.urandom(16).hex(), overwrite=False)
    staging = draft.path
    assert staging is not None
    draft.set("a/b/x", [b"x"], fsync=False)
    draft.set("y", [b"y"], fsync=False)
    draft.set("a/z", [b"z"], fsync=True)  # fsynced by set itself
    synced.clear()
    draft.sync()
    assert sorted(synced) == sorted([staging / "a/b/x", staging / "y"])
    synced.clear()
    draft.sync()
    assert synced == []
    draft.set("a/w", [b"w"], fsync=False)  # not synced: stage_manifest makes it durable
    draft.stage_manifest(_manifest("tree"), [], fsync=True)
    tree = [staging, staging / "a", staging / "a/b"]
    assert sorted(synced) == sorted([staging / "a/w", staging / MANIFEST_NAME, *tree])
    draft.set("gone", [b"g"], fsync=False)
    (staging / "gone").unlink()
    with pytest.raises(FileNotFoundError):
        draft.sync()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_directory_on_tmpfs_skips_the_fsyncs(monkeypatch: pytest.MonkeyPatch) -> None:
    """On tmpfs (``/dev/shm``) an fsync does nothing: a draft's ``sync`` and the tree's fsyncs
    at ``stage_manifest`` are skipped, and the commit is whole all the same."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not in_memory(shm):
        pytest.skip("no tmpfs at /dev/shm")
    root = Path(tempfile.mkdtemp(dir=shm))
    try:
        synced = _record_fsyncs(monkeypatch)
        store = DirectoryStore(root / "ckpt")
        draft = store.prepare(os.urandom(16).hex(), overwrite=False)
        for rel, data in MEMBERS.items():
            draft.set(rel, [data], fsync=False)
        draft.sync()
        draft.stage_manifest(_manifest("shm"), [], fsync=True)
        assert synced == []
        draft.discard(draft.publish(fsync=True))
        for rel, data in MEMBERS.items():
            assert _read(store, rel, len(data)) == data
    finally:
        shutil.rmtree(root)
