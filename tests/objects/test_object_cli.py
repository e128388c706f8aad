"""The ``ckptfmt`` command on ``s3://`` URLs, against the tests' real S3 server: inspect, verify
(healthy, and a damaged object named), list, export to and from a bucket, import into one, and
gc removing exactly the save prefixes no commit names."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from kit.arrays import raw_bytes
from kit.cli import run_cli as run
from kit.s3 import S3

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.storage.objects.commit import COMMIT_NAME

SMALL = WriteOptions(chunk_bytes=4096, shard_bytes=32768, fsync=False)


def _model(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "layer.0.weight": rng.standard_normal((32, 48), dtype=np.float32),
        "layer.0.bias": rng.standard_normal(48, dtype=np.float32),
    }


def test_inspect_and_verify_a_url(s3: S3) -> None:
    url = f"{s3.url}/run/ckpt"
    manifest = ckptfmt.save({"model": _model()}, url, step=5, write=SMALL)
    shown = run("inspect", "--json", url)
    assert shown.exit_code == 0, shown.output
    doc = json.loads(shown.output)
    assert doc["step"] == 5 and manifest.save_id in doc["path"]
    assert {t["name"] for t in doc["tensors"]} == {"model/layer.0.weight", "model/layer.0.bias"}
    ok = run("verify", "--json", "-q", url)
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["healthy"]

    ref = next(f for _, f in manifest.files())
    key = f"run/ckpt/{manifest.save_id}/{ref.path}"
    client = s3.server.client()
    body = bytearray(client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    body[10] ^= 1
    client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(body))
    bad = run("verify", url)
    assert bad.exit_code == 1, bad.output
    assert ref.path in bad.output
    client.delete_object(Bucket=s3.bucket, Key=key)
    gone = run("verify", "--json", "-q", url)
    assert gone.exit_code == 1
    problems = json.loads(gone.output)["problems"]
    assert [(p["file"], p["kind"]) for p in problems] == [(ref.path, "missing")]

    client.delete_object(Bucket=s3.bucket, Key=f"run/ckpt/{COMMIT_NAME}")
    none = run("verify", url)
    assert none.exit_code == 3, none.output
    assert COMMIT_NAME in none.output


def test_list_a_bucket_root(s3: S3) -> None:
    root = f"{s3.url}/run"
    for step in (10, 20):
        ckptfmt.save({"w": np.full(3, step)}, f"{root}/step-{step:010d}", step=step, write=SMALL)
    shown = run("list", "--json", root)
    assert shown.exit_code == 0, shown.output
    steps = json.loads(shown.output)["steps"]
    assert sorted(int(s) for s in steps) == [10, 20]


def test_export_from_a_bucket_to_a_bucket_and_import_back(s3: S3, tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.numpy")
    model = _model(3)
    src = f"{s3.url}/ckpt"
    ckptfmt.save({"model": model}, src, write=SMALL)

    local = run("export", "-q", src, tmp_path / "hf")  # read from the bucket
    assert local.exit_code == 0, local.output
    got = safetensors.load_file(str(tmp_path / "hf" / "model.safetensors"))
    for name, arr in model.items():
        assert raw_bytes(got[name]) == raw_bytes(arr)

    out = f"{s3.url}/exported/hf"
    remote = run("export", "--json", src, out)  # written to the bucket
    assert remote.exit_code == 0, remote.output
    assert json.loads(remote.output)["destination"] == out
    assert "exported/hf/model.safetensors" in s3.keys("exported/")
    again = run("export", "-q", src, out)
    assert again.exit_code == 2 and "already" in again.output

    back = f"{s3.url}/imported"
    imported = run("import", "-q", out, back)  # a Hugging Face directory in a bucket, into one
    assert imported.exit_code == 0, imported.output
    assert f"imported/{COMMIT_NAME}" in s3.keys("imported/")
    loaded = ckptfmt.load(back)
    for name, arr in model.items():
        assert raw_bytes(loaded["model"][name]) == raw_bytes(arr)
    refused = run("import", "-q", out, back)
    assert refused.exit_code == 2 and "overwrite" in refused.output


def test_gc_removes_exactly_the_uncommitted_prefixes(s3: S3) -> None:
    root = f"{s3.url}/run"
    kept = ckptfmt.save({"w": np.ones(4)}, f"{root}/step-0000000001", step=1, write=SMALL)
    lost = ckptfmt.save({"w": np.zeros(4)}, f"{root}/step-0000000002", step=2, write=SMALL)
    client = s3.server.client()
    client.delete_object(Bucket=s3.bucket, Key=f"run/step-0000000002/{COMMIT_NAME}")
    stray = "run/step-0000000001/" + "ab" * 16 + "/w/c/0"  # a crashed save beside a committed one
    client.put_object(Bucket=s3.bucket, Key=stray, Body=b"x")
    before = set(s3.keys("run/"))
    done = run("gc", "--json", root)
    assert done.exit_code == 0, done.output
    doc = json.loads(done.output)
    assert sorted(doc["removed"]) == sorted(
        [f"{root}/step-0000000001/{'ab' * 16}", f"{root}/step-0000000002/{lost.save_id}"]
    )
    after = set(s3.keys("run/"))
    assert before - after == {k for k in before if lost.save_id in k or "ab" * 16 in k}
    assert all(kept.save_id in k or k.endswith(COMMIT_NAME) for k in after)
    assert ckptfmt.load(f"{root}/step-0000000001")["w"].tolist() == [1, 1, 1, 1]
    assert run("gc", "/tmp/not-a-url").exit_code == 2
