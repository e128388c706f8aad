"""``torch.distributed.checkpoint`` through ckptfmt's storage plugin in one process: a model and
its Adam state (bfloat16) round-trip bit for bit through ``dcp.save``/``dcp.async_save`` with
``Writer`` and ``dcp.load`` with ``Reader``; checkpoints of ``ckptfmt_torch.save`` (in a
directory or a bucket) and of the manager load through ``dcp.load``, and the plugin's through
``ckptfmt_torch.load``; an object DCP pickles loads only when ``torch.load(weights_only=True)``
accepts it or the reader is told to trust it; a damaged shard fails the load naming the file; a
save that fails leaves nothing behind; an asynchronous save still writing when the script ends
is finished, as DCP's own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import ckptfmt_torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from ckptfmt_torch import dcp_save  # noqa: E402
from ckptfmt_torch.dcp import Reader, Writer  # noqa: E402
from kit.files import leftover_dirs, leftovers  # noqa: E402
from kit.managers import node_manager  # noqa: E402
from kit.s3 import S3  # noqa: E402
from kit.s3_proxy import S3Proxy  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402

import ckptfmt  # noqa: E402
from ckptfmt.errors import (  # noqa: E402
    ChecksumError,
    NotACheckpointError,
    PickleRefusedError,
    UnsupportedDtypeError,
    UrlNotSupportedError,
    UsageError,
)
from ckptfmt.storage.store.directory import in_memory  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning"),
]


class Opaque:
    """An object only a trusted unpickling may build."""

    def __init__(self, x: int) -> None:
        self.x = x


def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model = model.to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * seed, betas=(0.9, 0.99))
    model(torch.randn(5, 4, dtype=torch.bfloat16)).square().sum().backward()
    opt.step()
    return model, opt


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(bits(a), bits(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b and type(a) is type(b))


def dcp_state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


@pytest.mark.parametrize("asynchronous", [False, True])
def test_round_trip_bit_exact(tmp_path: Path, asynchronous: bool) -> None:
    model, opt = trained(1)
    path = tmp_path / "step-100"
    state = dcp_state(model, opt, 100)
    if asynchronous:
        dcp.async_save(state, storage_writer=Writer(path, step=100)).result()
    else:
        dcp.save(state, storage_writer=Writer(path, step=100))
    report = ckptfmt.verify(path)
    assert not report.problems and report.manifest.step == 100
    assert ckptfmt.open(path)["model/0.weight"].shape == (8, 4)  # named by state-dict path

    other, other_opt = trained(2)
    target = dcp_state(other, other_opt, 0)
    dcp.load(target, storage_reader=Reader(path))
    assert same(target, dcp_state(model, opt, 100))  # the tuple betas included


def test_a_path_with_no_checkpoint_is_refused_as_ckptfmts_error_in_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One process: a missing directory, or one with no checkpoint, given as the reader's path
    or as ``checkpoint_id``: :class:`NotACheckpointError` naming it, not DCP's
    ``CheckpointException`` around it. Several ranks (``WORLD_SIZE``): left to the load, which
    DCP fails on every rank together (a rank refusing alone would leave the others waiting)."""
    ckptfmt_torch.save({"w": torch.ones(3)}, tmp_path / "c")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a checkpoint")
    target = {"w": torch.zeros(3)}
    for bad in (tmp_path / "missing", tmp_path / "other"):
        with pytest.raises(NotACheckpointError, match=re.escape(str(bad))):
            dcp.load(target, storage_reader=Reader(bad))
        with pytest.raises(NotACheckpointError, match=re.escape(str(bad))):
            dcp.load(target, storage_reader=Reader(tmp_path / "c"), checkpoint_id=bad)
    assert torch.equal(target["w"], torch.zeros(3))  # nothing loaded
    dcp.load(target, storage_reader=Reader(tmp_path / "c"))
    assert torch.equal(target["w"], torch.ones(3))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(CheckpointException, match=re.escape(str(tmp_path / "missing"))):
        dcp.load(target, storage_reader=Reader(tmp_path / "missing"))


def test_ckptfmt_torch_checkpoint_loads_through_dcp(tmp_path: Path) -> None:
    model, opt = trained(1)
    ckptfmt_torch.save({"model": model, "optim": opt, "step": 7}, tmp_path / "c")
    other, other_opt = trained(2)
    target = dcp_state(other, other_opt, 0)
    dcp.load(target, storage_reader=Reader(tmp_path / "c"))
    want = dcp_state(model, opt, 7)
    assert same(target["model"], want["model"]) and target["step"] == 7
    assert same(target["optim"]["state"], want["optim"]["state"])
    assert target["optim"]["param_groups"][0]["lr"] == 0.01


def test_checkpoint_in_a_bucket_loads_through_dcp(s3: S3) -> None:
    """A checkpoint in a bucket (the tests' S3 server), by its URL: every tensor read from its
    objects, bit for bit (not from a directory named after the URL, which does not exist)."""
    model, opt = trained(1)
    url = f"{s3.url}/c"
    ckptfmt_torch.save({"model": model, "optim": opt, "step": 7}, url)
    other, other_opt = trained(2)
    target = dcp_state(other, other_opt, 0)
    dcp.load(target, storage_reader=Reader(url))
    want = dcp_state(model, opt, 7)
    assert same(target["model"], want["model"]) and target["step"] == 7
    assert same(target["optim"]["state"], want["optim"]["state"])


def test_manager_checkpoint_loads_through_dcp(tmp_path: Path) -> None:
    """A ``TrainingState`` saved by the manager: DCP loads it through the stateful, its RNG
    stream (a per-rank entry) included."""
    model, opt = trained(1)
    with node_manager(tmp_path, flush_every=1) as mgr:
        mgr.save(10, ckptfmt_torch.to_state({"train": ckptfmt_torch.TrainingState(model, opt)}))
        mgr.wait()
    after_save = torch.rand(4)  # the stream right after the save's state was taken
    ref = ckptfmt.latest(tmp_path / "l3")
    assert ref is not None and ref.step == 10
    other, other_opt = trained(2)
    dcp.load(
        {"train": ckptfmt_torch.TrainingState(other, other_opt)}, storage_reader=Reader(ref.path)
    )
    assert same(other.state_dict(), model.state_dict())
    assert same(other_opt.state_dict(), opt.state_dict())
    assert torch.equal(torch.rand(4), after_save)


def test_training_state_round_trip(tmp_path: Path) -> None:
    """A ``TrainingState`` through DCP's stateful protocol: its RNG streams (``PerRank``) are
    stored as per-rank entries, not pickles, and come back without trusting anything."""
    model, opt = trained(1)
    dcp.save(
        {"train": ckptfmt_torch.TrainingState(model, opt)}, storage_writer=Writer(tmp_path / "c")
    )
    after_save = torch.rand(4)
    entries = {"/".join(e.name): e for e in ckptfmt.open(tmp_path / "c").manifest.entries}
    assert getattr(entries["train/rng/torch"], "per_rank", False)
    other, other_opt = trained(2)
    dcp.load(
        {"train": ckptfmt_torch.TrainingState(other, other_opt)},
        storage_reader=Reader(tmp_path / "c"),
    )
    assert same(other.state_dict(), model.state_dict())
    assert same(other_opt.state_dict(), opt.state_dict())
    assert torch.equal(torch.rand(4), after_save)


def test_plugin_checkpoint_loads_with_ckptfmt_torch(tmp_path: Path) -> None:
    model, opt = trained(1)
    dcp.save(dcp_state(model, opt, 3), storage_writer=Writer(tmp_path / "c", step=3))
    other, _ = trained(2)
    state: dict[str, Any] = {"model": other, "step": 0}
    manifest = ckptfmt_torch.load(state, tmp_path / "c")
    assert manifest.step == 3 and state["step"] == 3
    assert same(other.state_dict(), model.state_dict())


def test_pickled_object_needs_trust(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(3), "obj": Opaque(4)}, storage_writer=Writer(tmp_path / "c"))
    assert "obj" in ckptfmt.open(tmp_path / "c").manifest.writer["dcp_bytes"]  # type: ignore[operator]
    target: dict[str, Any] = {"w": torch.zeros(3), "obj": None}
    with pytest.raises(CheckpointException) as info:
        dcp.load(target, storage_reader=Reader(tmp_path / "c"))
    (err,) = (e for e, _stack in info.value.failures.values())
    assert isinstance(err, PickleRefusedError) and "test_dcp.Opaque" in str(err)
    assert target["obj"] is None
    dcp.load(target, storage_reader=Reader(tmp_path / "c", trust_pickle=True))
    assert isinstance(target["obj"], Opaque) and target["obj"].x == 4


def test_damaged_shard_names_the_file(tmp_path: Path) -> None:
    model, opt = trained(1)
    path = tmp_path / "c"
    dcp.save(dcp_state(model, opt, 1), storage_writer=Writer(path))
    shard = path / "model" / "0.weight" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[3] ^= 0x10
    shard.write_bytes(bytes(data))
    other, other_opt = trained(2)
    with pytest.raises(CheckpointException) as info:
        dcp.load(dcp_state(other, other_opt, 0), storage_reader=Reader(path))
    (err,) = (e for e, _stack in info.value.failures.values())
    assert isinstance(err, ChecksumError)
    assert "model/0.weight/c/0/0" in str(err)


def test_failed_save_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "c"
    state = {"ok": torch.ones(4), "bad": torch.ones(2, dtype=torch.complex32)}
    with pytest.raises(CheckpointException) as info:
        dcp.save(state, storage_writer=Writer(path))
    (err,) = (e for e, _stack in info.value.failures.values())
    assert isinstance(err, UnsupportedDtypeError)
    assert not path.exists()
    assert leftovers(tmp_path) == [] and leftover_dirs(tmp_path) == []


def test_targets_read_into_or_copied(tmp_path: Path) -> None:
    """Contiguous CPU targets of the saved dtype are read into directly; others (another dtype,
    a transposed view) get the values as ``Tensor.copy_`` gives them, as DCP's own reader."""
    g = torch.Generator().manual_seed(3)
    saved = {"a": torch.randn(6, 4, generator=g), "b": torch.randn(5, 3, generator=g)}
    dcp.save(saved, storage_writer=Writer(tmp_path / "c"))
    a = torch.zeros(6, 4, dtype=torch.float64)
    b = torch.zeros(3, 5).t()  # not contiguous
    dcp.load({"a": a, "b": b}, storage_reader=Reader(tmp_path / "c"))
    assert torch.equal(a, saved["a"].double()) and torch.equal(b, saved["b"])


def test_dcp_plan_caching_is_refused_saying_so(tmp_path: Path) -> None:
    """The writer's declarations travel in DCP's plans: with DCP's plan caching a save that
    would reuse a cached plan (the second of a layout) fails naming the option, and leaves
    nothing; the first is a checkpoint like any other."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    state = {"w": torch.arange(12.0).reshape(3, 4), "step": 1}
    planner = DefaultSavePlanner(enable_plan_caching=True)
    dcp.save(state, storage_writer=Writer(tmp_path / "a"), planner=planner)
    assert not ckptfmt.verify(tmp_path / "a").problems
    with pytest.raises(CheckpointException) as info:
        dcp.save(state, storage_writer=Writer(tmp_path / "b"), planner=planner)
    (err,) = (e for e, _stack in info.value.failures.values())
    assert "enable_plan_caching" in str(err)
    assert not (tmp_path / "b").exists() and leftover_dirs(tmp_path) == []


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_every_file_and_directory_is_durable_before_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer fsyncs its files together rather than one by one, but still every file and
    every directory of the checkpoint before the rename that commits it (the real fsyncs,
    recorded on their way)."""
    if in_memory(tmp_path):
        pytest.skip(f"{tmp_path} is on a memory file system, where nothing is fsynced")
    synced: set[Path] = set()
    at_commit: dict[str, Any] = {}
    real_fsync, real_rename = os.fsync, os.rename
    target = (tmp_path / "ckpt").resolve()

    def fsync(fd: int) -> None:
        real_fsync(fd)
        synced.add(Path(os.readlink(f"/proc/self/fd/{fd}")))

    def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if Path(dst).resolve() == target:
            at_commit.update(staging=Path(src).resolve(), synced=set(synced))
        real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    model, opt = trained(1)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.save(state, storage_writer=Writer(target))
    staging = at_commit["staging"]
    tree = {staging / p.relative_to(target) for p in target.rglob("*")} | {staging}
    assert len(tree) > 20
    assert sorted(tree - at_commit["synced"]) == []


SAVE_AND_END = """
import sys
import torch
import torch.distributed.checkpoint as dcp
from ckptfmt_torch.dcp import Writer
g = torch.Generator().manual_seed(7)
state = {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(8)}
future = dcp.async_save(state, storage_writer=Writer(sys.argv[1], step=3))
print(future.done())
"""  # the script's last line: nothing waits for the save


def test_an_async_save_still_writing_when_the_script_ends_is_committed(tmp_path: Path) -> None:
    """A script that ends right after ``dcp.async_save`` (its final checkpoint, say): the
    interpreter finishes the save in flight before it exits, as it does DCP's own writer's, and
    the checkpoint holds every tensor bit for bit, with nothing left beside it. (Python refuses
    new work to thread pools once the main thread has ended: the save's writes must not need
    it.)"""
    path = tmp_path / "c"
    done = subprocess.run(
        [sys.executable, "-c", SAVE_AND_END, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]  # still writing when the script ended
    g = torch.Generator().manual_seed(7)
    want = {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(8)}
    got = {k: torch.zeros(256, 1024) for k in want}
    dcp.load(got, storage_reader=Reader(path))
    assert same(got, want)
    assert ckptfmt.open(path).manifest.step == 3
    assert leftovers(tmp_path) == [] and leftover_dirs(tmp_path) == []


class PausedPlanner(DefaultSavePlanner):
    """DCP's default planner, paused in ``finish_plan`` (after the writer made the staging
    directory, before any shard is written) until ``go`` is set: the save is in flight for as
    long as the test wants. ``fail``: it raises there instead (a planner's failure between the
    writer's hooks, which the writer never hears of)."""

    def __init__(self, go: threading.Event | None = None, fail: bool = False) -> None:
        super().__init__()
        self.go, self.fail, self.paused = go, fail, threading.Event()

    def finish_plan(self, new_plan: Any) -> Any:
        self.paused.set()
        if self.fail:
            raise RuntimeError("the planner failed")
        if self.go is not None and not self.go.wait(60):
            raise RuntimeError("not let go")
        return super().finish_plan(new_plan)


def test_overlapping_async_saves_on_one_writer_are_made_one_after_the_other(
    tmp_path: Path,
) -> None:
    """Two ``dcp.async_save`` calls on one ``Writer`` with the first still in flight (paused
    after its staging directory is made): the second waits for the first and both checkpoints
    commit, each bit for bit at its own path, nothing left beside them (DCP's own
    ``FileSystemWriter`` mixes the two; ckptfmt's failed both, leaving a staging directory)."""
    g = torch.Generator().manual_seed(11)
    first = {"w": torch.randn(64, 32, generator=g), "step": 1}
    second = {"w": torch.randn(64, 32, generator=g), "v": torch.randn(7, generator=g), "step": 2}
    writer = Writer(tmp_path / "a")
    go = threading.Event()
    planner = PausedPlanner(go)
    a = dcp.async_save(first, storage_writer=writer, checkpoint_id=tmp_path / "a", planner=planner)
    assert planner.paused.wait(60)
    b = dcp.async_save(second, storage_writer=writer, checkpoint_id=tmp_path / "b")
    time.sleep(0.5)  # the second save, left to run, reaches the writer meanwhile
    assert not b.done()  # it waits for the first
    go.set()
    a.result(timeout=120)
    b.result(timeout=120)
    for path, saved in ((tmp_path / "a", first), (tmp_path / "b", second)):
        got = {
            k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in saved.items()
        }
        dcp.load(got, storage_reader=Reader(path))
        assert same(got, saved)
        assert not ckptfmt.verify(path).problems
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
    assert leftovers(tmp_path) == [] and leftover_dirs(tmp_path) == []


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_save_failing_between_the_writers_hooks_leaves_nothing_once_the_writer_saves_again(
    tmp_path: Path, asynchronous: bool
) -> None:
    """A save that DCP fails after the writer made its staging directory (the planner raises in
    ``finish_plan``; the writer's ``finish`` is never called): the writer's next save removes
    that staging directory, neither waits for the failed save nor is refused, and commits."""
    state = {"w": torch.arange(12.0).reshape(3, 4), "step": 1}
    writer = Writer(tmp_path / "a")
    save = dcp.async_save if asynchronous else dcp.save
    with pytest.raises(CheckpointException):
        done = save(state, storage_writer=writer, planner=PausedPlanner(fail=True))
        if asynchronous:
            done.result(timeout=60)
    assert leftover_dirs(tmp_path)  # the failed save's staging directory, as DCP left it
    done = dcp.async_save(state, storage_writer=writer, checkpoint_id=tmp_path / "b")
    done.result(timeout=60)
    got = {"w": torch.zeros(3, 4), "step": 0}
    dcp.load(got, storage_reader=Reader(tmp_path / "b"))
    assert same(got, state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]
    assert leftovers(tmp_path) == [] and leftover_dirs(tmp_path) == []


@pytest.mark.parametrize(
    ("path", "error", "said"),
    [
        ("s3://bucket/run/step-1", UrlNotSupportedError, "'s3://bucket/run/step-1'"),
        ("gs://bucket/step-1", UrlNotSupportedError, "'gs://bucket/step-1'"),
        ("file:///tmp/step-1", UrlNotSupportedError, "file://"),
        ("ckpt/a\0b", UsageError, "NUL"),
        ("ckpt/{node}/step-1", UsageError, "give one directory"),
    ],
)
def test_a_path_the_writer_cannot_write_is_refused_as_given_before_dcp_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str, error: type, said: str
) -> None:
    """A bucket's URL (the writer writes a directory; ``ckptfmt_torch.save`` writes buckets), a
    NUL or a ``{node}`` template, given to ``Writer`` or as ``dcp.save``'s ``checkpoint_id``:
    ckptfmt's error naming the path as given, before DCP starts and nothing made (a ``Path``
    folded ``s3://`` into a local ``s3:/``; a NUL failed inside the save with the OS's bare
    ``ValueError``). ``Reader`` refuses a NUL and a ``file://`` URL as it is made."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error, match=re.escape(said)):
        Writer(path)
    with pytest.raises(error, match=re.escape(said)):
        dcp.save({"w": torch.ones(3)}, storage_writer=Writer("ok"), checkpoint_id=path)
    if "NUL" in said or path.startswith("file:"):
        with pytest.raises(error, match=re.escape(said)):
            Reader(path)
    assert list(tmp_path.iterdir()) == []


PROCESS_SAVE = """
import os, sys, socket
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from ckptfmt_torch.dcp import Writer
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
g = torch.Generator().manual_seed(5)
state = {"w": torch.randn(64, 16, generator=g), "step": 9}
writer, kind = Writer(sys.argv[1], step=9), AsyncCheckpointerType.PROCESS
dcp.async_save(state, storage_writer=writer, async_checkpointer_type=kind).result()
dist.destroy_process_group()
"""


def test_a_process_based_async_save_takes_the_writer(tmp_path: Path) -> None:
    """``dcp.async_save(async_checkpointer_type=PROCESS)`` sends the writer to DCP's saving
    process (pickled): the writer pickles (its turn-taking starts afresh there) and the
    checkpoint is committed bit for bit, nothing left beside it."""
    path = tmp_path / "c"
    done = subprocess.run(
        [sys.executable, "-c", PROCESS_SAVE, str(path)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    g = torch.Generator().manual_seed(5)
    want = {"w": torch.randn(64, 16, generator=g), "step": 9}
    got = {"w": torch.zeros(64, 16), "step": 0}
    dcp.load(got, storage_reader=Reader(path))
    assert same(got, want)
    assert leftovers(tmp_path) == [] and leftover_dirs(tmp_path) == []


def test_a_failed_metadata_read_fails_the_load_not_retried_without_collectives(
    s3: S3, s3_proxy: S3Proxy
) -> None:
    """The reader's first ``read_metadata`` refused (403 on the commit object): the load fails
    with ckptfmt's ``CredentialsError`` naming the object. DCP retries a reader whose
    ``read_metadata`` takes keyword arguments as "rank-local metadata" and, when that read
    succeeds, loads *without collectives* on that rank alone, while the other ranks load with
    them (a hang or a mismatched load in a job of several ranks); ckptfmt's manifest is one for
    every rank, so the reader takes no such retry."""
    url = f"{s3.url}/c"
    g = torch.Generator().manual_seed(4)
    saved = {"w": torch.randn(8, 4, generator=g)}
    ckptfmt_torch.save(saved, url)
    s3_proxy.refuse(1, method="GET", path_contains="ckptfmt-commit.json")
    target = {"w": torch.zeros(8, 4)}
    with pytest.raises(CheckpointException) as info:
        dcp.load(target, storage_reader=Reader(url))
    ((err, _stack),) = info.value.failures.values()
    assert "ckptfmt-commit.json" in str(err) and "credentials refused" in str(err), err
    assert torch.equal(target["w"], torch.zeros(8, 4))  # nothing loaded
    dcp.load(target, storage_reader=Reader(url))  # the store answers again: it loads
    assert same(target, saved)


def test_a_save_after_a_failed_one_on_the_same_thread_drops_its_staging_when_frame_ids_repeat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer tells saves apart by DCP's outermost frame (its id and code), and a freed
    frame's id is reused: the next save on the same thread may show the same key. Made so on
    purpose here (every DCP frame seen with one id): a save after one DCP failed between the
    writer's hooks still removes that save's staging directory and commits, and each hook of
    one save still finds the writer held (sync saves, then an async one)."""
    real = dcp_save._save_frame

    def one_id() -> Any:
        key = real()
        return None if key is None else (1, key[1])

    monkeypatch.setattr(dcp_save, "_save_frame", one_id)
    state = {"w": torch.arange(12.0).reshape(3, 4), "step": 1}
    writer = Writer(tmp_path / "a")
    with pytest.raises(CheckpointException):
        dcp.save(state, storage_writer=writer, planner=PausedPlanner(fail=True))
    assert leftover_dirs(tmp_path)  # the failed save's staging directory, as DCP left it
    dcp.save(state, storage_writer=writer, checkpoint_id=tmp_path / "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]
    with pytest.raises(CheckpointException):
        dcp.save(
            state,
            storage_writer=writer,
            checkpoint_id=tmp_path / "c",
            planner=PausedPlanner(fail=True),
        )
    dcp.save(state, storage_writer=writer)  # no checkpoint_id: set_up_storage_writer is first
    dcp.async_save(state, storage_writer=writer, checkpoint_id=tmp_path / "d").result(timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "c", "d"]
    for name in ("b", "c", "d"):
        got = {"w": torch.zeros(3, 4), "step": 0}
        dcp.load(got, storage_reader=Reader(tmp_path / name))
        assert same(got, state)
    assert leftovers(tmp_path) == [] and leftover_dirs(tmp_path) == []
