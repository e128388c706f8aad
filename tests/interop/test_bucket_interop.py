"""``ckptfmt export`` and ``ckptfmt import`` with a bucket as OUT, against the tests' real S3
server: the output is written through the bucket straight from the tensors, with no local
copy (``tempfile`` pointed at a directory that does not exist, so any use of it fails), bit for
bit; an export into a bucket is the same bytes as one into a directory; an import over a
checkpoint in a bucket whose commit is refused or whose process is killed before it leaves the
old checkpoint whole; a failed export into an empty prefix leaves nothing there.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from kit import REPO
from kit.arrays import raw_bytes
from kit.cli import run_cli as run
from kit.s3 import S3
from kit.s3_proxy import S3Proxy

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.interop import hf
from ckptfmt.storage.objects import COMMIT_NAME, Bucket, read_commit

safetensors = pytest.importorskip("safetensors.numpy")

SMALL = WriteOptions(chunk_bytes=1 << 16, shard_bytes=1 << 20, fsync=False)
BIG = 5_000_000  # float32 elements: 20 MB, above the one-PUT limit (16 MiB): put in parts


def _model(seed: int, big: int = BIG) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "embed.weight": rng.standard_normal(big, dtype=np.float32),
        "layer.0.weight": rng.standard_normal((64, 96), dtype=np.float32),
        "layer.0.bias": rng.standard_normal(96).astype(np.float16),
        "steps": rng.integers(0, 1 << 40, 33, dtype=np.int64),
    }


NO_TMP = (
    "import sys, tempfile\n"
    "tempfile.tempdir = sys.argv.pop(1)\n"
    "from ckptfmt_cli.main import main\n"
    "sys.argv[0] = 'ckptfmt'\n"
    "main()\n"
)


def run_without_tmp(s3: S3, gone: Path, *args: str | os.PathLike[str]) -> tuple[int, str]:
    """The ``ckptfmt`` command in a process of its own whose ``tempfile`` directory does not
    exist (set, so no fallback to ``/tmp``): anything that makes a temporary file or directory
    there fails. Returns its exit status and output."""
    assert not gone.exists()
    cmd = [sys.executable, "-c", NO_TMP, str(gone), *map(str, args)]
    env = {**os.environ, **s3.env, "TMPDIR": str(gone)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert not gone.exists()
    return done.returncode, done.stdout + done.stderr


def _objects(s3: S3, prefix: str) -> dict[str, bytes]:
    client = s3.server.client()
    return {
        key.removeprefix(prefix): client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
        for key in s3.keys(prefix)
    }


def _dir_files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in root.iterdir()}


def test_export_to_a_bucket_is_the_directory_export_without_local_space(
    s3: S3, tmp_path: Path
) -> None:
    model = _model(1)
    src = tmp_path / "ckpt"
    ckptfmt.save({"model": model}, src, step=9, write=SMALL)
    local = run("export", "-q", "--max-shard-size", "20MB", src, tmp_path / "hf")
    assert local.exit_code == 0, local.output
    want = _dir_files(tmp_path / "hf")
    assert len(want) == 3 and hf.INDEX in want  # two shards, one of them above the PUT limit
    assert max(len(b) for b in want.values()) > 16 << 20

    out = f"{s3.url}/exported/hf"
    status, output = run_without_tmp(
        s3, tmp_path / "no-tmp", "export", "--json", "--max-shard-size", "20MB", src, out
    )
    assert status == 0, output
    assert json.loads(output)["destination"] == out
    assert _objects(s3, "exported/hf/") == want  # bit for bit, the index included

    back = safetensors.load(_objects(s3, "exported/hf/")["model-00001-of-00002.safetensors"])
    assert raw_bytes(back["embed.weight"]) == raw_bytes(model["embed.weight"])

    # cast on the way: the same bytes as the cast export into a directory
    cast = run("export", "-q", "--dtype", "bfloat16", src, tmp_path / "hf16")
    assert cast.exit_code == 0, cast.output
    remote = run("export", "-q", "--dtype", "bfloat16", src, f"{s3.url}/hf16")
    assert remote.exit_code == 0, remote.output
    assert _objects(s3, "hf16/") == _dir_files(tmp_path / "hf16")


def test_an_export_overwrite_in_a_bucket_replaces_the_old_export_and_its_stale_shards(
    s3: S3, tmp_path: Path
) -> None:
    src = tmp_path / "ckpt"
    ckptfmt.save({"model": _model(2, big=4096)}, src, write=SMALL)
    out = f"{s3.url}/hf"
    assert run("export", "-q", "--max-shard-size", "10000", src, out).exit_code == 0
    assert len(s3.keys("hf/")) == 4  # three shards and the index
    refused = run("export", "-q", src, out)
    assert refused.exit_code == 2 and "already" in refused.output

    again = run("export", "-q", "--overwrite", src, out)  # one file now
    assert again.exit_code == 0, again.output
    assert s3.keys("hf/") == ["hf/model.safetensors"]
    assert run("export", "-q", src, tmp_path / "one").exit_code == 0
    assert _objects(s3, "hf/") == _dir_files(tmp_path / "one")

    ckptfmt.save({"w": np.ones(3)}, f"{s3.url}/ckpt", write=SMALL)  # a checkpoint, not an export
    foreign = run("export", "-q", "--overwrite", src, f"{s3.url}/ckpt")
    assert foreign.exit_code == 2 and COMMIT_NAME in foreign.output
    assert read_commit(Bucket.at(f"{s3.url}/ckpt")) is not None


def test_a_failed_export_into_an_empty_prefix_leaves_nothing_there(s3: S3, tmp_path: Path) -> None:
    src = tmp_path / "ckpt"
    ckptfmt.save({"model": _model(3)}, src, write=SMALL)
    shards = sorted(p for p in src.rglob("*") if p.is_file() and "embed.weight" in str(p))
    victim = shards[len(shards) // 2]
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0xFF
    victim.write_bytes(bytes(data))
    done = run("export", "-q", "--max-shard-size", "1MB", src, f"{s3.url}/hf")
    assert done.exit_code == 1, done.output
    assert s3.keys("hf/") == []


def test_import_into_a_bucket_without_local_space_and_back_bit_exact(
    s3: S3, tmp_path: Path
) -> None:
    model = _model(4, big=9_000_000)  # 36 MB: streamed in parts by the save
    src = tmp_path / "model.safetensors"
    safetensors.save_file(model, str(src))
    out = f"{s3.url}/imported"
    status, output = run_without_tmp(
        s3, tmp_path / "no-tmp", "import", "--json", "--step", "3", src, out
    )
    assert status == 0, output
    assert json.loads(output)["destination"] == out
    assert f"imported/{COMMIT_NAME}" in s3.keys("imported/")
    loaded = ckptfmt.load(out)
    for name, arr in model.items():
        assert raw_bytes(loaded["model"][name]) == raw_bytes(arr), name
    assert ckptfmt.open(out).manifest.step == 3

    # and out again, into a bucket: the file of the directory export, bit for bit
    status, output = run_without_tmp(s3, tmp_path / "no-tmp", "export", "-q", out, f"{s3.url}/hf")
    assert status == 0, output
    back = safetensors.load(_objects(s3, "hf/")[hf.SINGLE])
    assert {k: raw_bytes(v) for k, v in back.items()} == {k: raw_bytes(v) for k, v in model.items()}


def test_import_for_two_ranks_into_a_bucket(s3: S3, tmp_path: Path) -> None:
    model = _model(5, big=4096)
    src = tmp_path / "model.safetensors"
    safetensors.save_file(model, str(src))
    out = f"{s3.url}/two"
    done = run("import", "-q", "--ranks", "2", "--rows", "model/embed.weight", src, out)
    assert done.exit_code == 0, done.output
    opened = ckptfmt.open(out)
    assert opened.manifest.world_size == 2
    loaded = ckptfmt.load(out)
    for name, arr in model.items():
        assert raw_bytes(loaded["model"][name]) == raw_bytes(arr), name
    refused = run("import", "-q", "--ranks", "2", src, out)
    assert refused.exit_code == 2 and "overwrite" in refused.output


def _old_and_new(s3: S3, tmp_path: Path) -> tuple[str, dict[str, np.ndarray], Path]:
    """A checkpoint of :func:`_model` (seed 6) at ``<bucket>/ckpt`` and a safetensors file of
    another model (seed 7) to import over it."""
    old = _model(6, big=3_000_000)
    url = f"{s3.url}/ckpt"
    ckptfmt.save({"model": old}, url, write=SMALL)
    new = tmp_path / "new.safetensors"
    safetensors.save_file(_model(7, big=3_000_000), str(new))
    return url, old, new


def _loads_as(url: str, model: dict[str, np.ndarray]) -> None:
    loaded = ckptfmt.load(url)
    assert {k: raw_bytes(v) for k, v in loaded["model"].items()} == {
        k: raw_bytes(v) for k, v in model.items()
    }


@pytest.mark.parametrize("status", [403, 412])
def test_an_import_over_a_bucket_checkpoint_whose_commit_is_refused_keeps_the_old(
    s3: S3, s3_proxy: S3Proxy, tmp_path: Path, status: int
) -> None:
    url, old, new = _old_and_new(s3, tmp_path)
    s3_proxy.refuse(100, status, method="PUT", path_contains=COMMIT_NAME)
    done = run("import", "-q", "--overwrite", new, url)
    assert done.exit_code != 0, done.output
    assert s3_proxy.faults["refuse"] >= 1
    s3_proxy.clear()
    _loads_as(url, old)
    again = run("import", "-q", "--overwrite", new, url)
    assert again.exit_code == 0, again.output
    _loads_as(url, _model(7, big=3_000_000))
    commit = read_commit(Bucket.at(url))
    assert commit is not None
    want = {f"ckpt/{COMMIT_NAME}"} | {f"ckpt/{commit.save_id}/{o.key}" for o in commit.objects}
    assert set(s3.keys("ckpt/")) == want  # the old save's objects and the refused one's: gone


STOPS = {
    "a data upload": dict(method="PUT"),
    "the commit put": dict(method="PUT", path_contains=COMMIT_NAME),
}


@pytest.mark.parametrize("stop", list(STOPS))
def test_an_import_over_a_bucket_checkpoint_killed_before_its_commit_keeps_the_old(
    s3: S3, s3_proxy: S3Proxy, tmp_path: Path, stop: str
) -> None:
    """The ``ckptfmt import --overwrite`` process killed (SIGKILL) while the proxy holds one of
    its requests: the old checkpoint still loads, bit for bit."""
    url, old, new = _old_and_new(s3, tmp_path)
    s3_proxy.stall(1, **STOPS[stop])
    env = s3_proxy.env({**os.environ, **s3.env})
    cmd = [sys.executable, "-m", "ckptfmt_cli", "import", "-q", "--overwrite", str(new), url]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        end = time.monotonic() + 90
        while s3_proxy.faults["stall"] == 0 and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.02)
        held = s3_proxy.faults["stall"] > 0
        proc.send_signal(signal.SIGKILL)
        out = proc.communicate(timeout=30)[0].decode(errors="replace")
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        s3_proxy.clear()
    assert held, f"the import never reached the stop (status {proc.returncode}):\n{out[-3000:]}"
    _loads_as(url, old)


def test_the_api_takes_a_url_or_a_store_for_out(s3: S3, tmp_path: Path) -> None:
    """``export_safetensors`` to a URL reports its progress as into a directory;
    ``import_safetensors`` into a :class:`MemoryStore` writes through it (no directory)."""
    from ckptfmt.interop import export_safetensors, import_safetensors
    from ckptfmt.storage.store import MemoryStore

    model = _model(8, big=300_000)
    src = tmp_path / "ckpt"
    ckptfmt.save({"model": model}, src, write=SMALL)
    seen: list[ckptfmt.Progress] = []
    report = export_safetensors(src, f"{s3.url}/hf", max_shard_size="1MB", progress=seen.append)
    assert report.destination == f"{s3.url}/hf" and len(report.files) == 3  # and the index
    assert seen[-1].final and seen[-1].done == seen[-1].total == report.total_size
    assert {p.op for p in seen} == {"export"}

    export_safetensors(src, tmp_path / "hf", max_shard_size="1MB")
    store = MemoryStore()
    done = import_safetensors(tmp_path / "hf", store, step=4)
    assert done.destination == store.where
    loaded = ckptfmt.load(store)
    for name, arr in model.items():
        assert raw_bytes(loaded["model"][name]) == raw_bytes(arr), name
    with pytest.raises(ckptfmt.CkptError, match="overwrite"):
        import_safetensors(tmp_path / "hf", store)
