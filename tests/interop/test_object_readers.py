"""A checkpoint in a bucket is a plain zarr v3 hierarchy under ``<url>/<save_id>/``: zarr-python
(``zarr.storage.ObjectStore`` over obstore's ``S3Store``) and TensorStore (its ``s3`` kvstore
driver) read it tensor by tensor, bit-exact, in processes whose programs never import ckptfmt,
against the tests' real S3 server; whether ``ckptfmt.save`` wrote it to the URL or a manager's
flush from level 1 put it under its level-3 root. (zarr-python learns the bfloat16 data type from
the package's dtype plugin, which the installed package registers at interpreter start; TensorStore
knows it as it is.)"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from kit.arrays import raw_bytes
from kit.managers import node_manager
from kit.s3 import S3

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.storage.objects import Bucket
from ckptfmt.storage.objects.commit import read_commit
from ckptfmt.storage.steps import step_dir_name

ZARR_READER = textwrap.dedent(
    """
    import hashlib, json, sys
    import numpy as np
    import zarr
    from obstore.store import S3Store
    from zarr.storage import ObjectStore

    bucket, prefix = sys.argv[1], sys.argv[2]
    store = ObjectStore(S3Store(bucket, prefix=prefix), read_only=True)  # AWS_* from the env
    group = zarr.open_group(store, mode="r")
    out = {}
    for name, node in group.members(max_depth=None):
        if isinstance(node, zarr.Array):
            data = np.asarray(node[...])
            out[name] = {
                "shape": list(data.shape),
                "dtype": str(data.dtype),
                "sha256": hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest(),
            }
    out["__slice__"] = hashlib.sha256(
        np.ascontiguousarray(group["model/w"][3:17, 5:40]).tobytes()
    ).hexdigest()
    print(json.dumps(out))
    """
)

TENSORSTORE_READER = textwrap.dedent(
    """
    import hashlib, json, os, sys
    import numpy as np
    import tensorstore as ts

    bucket, prefix, names = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    out = {}
    for name in names + ["model/w"]:
        spec = {
            "driver": "zarr3",
            "kvstore": {
                "driver": "s3",
                "bucket": bucket,
                "path": f"{prefix}/{name}/",
                "endpoint": os.environ["AWS_ENDPOINT_URL"],
                "aws_region": os.environ["AWS_REGION"],
                "aws_credentials": {"type": "environment"},
            },
        }
        store = ts.open(spec, read=True).result()
        if name in out:  # the second "model/w": a slice, read by ranged GETs
            data = np.asarray(store[3:17, 5:40].read().result())
            out["__slice__"] = hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest()
            continue
        data = np.asarray(store.read().result())
        out[name] = {
            "shape": list(data.shape),
            "dtype": store.dtype.name,
            "sha256": hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest(),
        }
    print(json.dumps(out))
    """
)


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(raw_bytes(a)).hexdigest()


def _run(program: str, args: list[str], s3: S3, tmp_path: Path) -> dict[str, Any]:
    assert "ckptfmt" not in program  # the reading program knows nothing of ckptfmt
    work = tmp_path / "elsewhere"
    work.mkdir(exist_ok=True)
    out = subprocess.run(
        [sys.executable, "-c", program, *args],
        cwd=work,
        env={**s3.env, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.fixture(params=["saved", "flushed", "incremental-saved", "incremental-flushed"])
def in_bucket(
    s3: S3, tmp_path: Path, request: pytest.FixtureRequest
) -> tuple[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(11)
    tensors = {
        "model/w": rng.standard_normal((40, 70), dtype=np.float32),
        "model/bf": rng.standard_normal((9, 33)).astype(ml_dtypes.bfloat16),
        "model/i": np.arange(-50, 50, dtype=np.int64).reshape(10, 10),
        "opt/step": np.array(7, np.int32),
    }
    state = {"model": {k[6:]: v for k, v in tensors.items() if k.startswith("model/")}}
    state["opt"] = {"step": tensors["opt/step"]}
    write = WriteOptions(chunk_bytes=512, shard_bytes=4096, fsync=False, content_hash=True)
    if request.param == "saved":
        manifest = ckptfmt.save(state, f"{s3.url}/run/ckpt", write=write)
        return f"run/ckpt/{manifest.save_id}", tensors
    if request.param.startswith("incremental"):
        return _incremental(s3, tmp_path, request.param, state, tensors, write)
    mgr = node_manager(tmp_path, shared=None, shared_dir=f"{s3.url}/run", write=write)
    mgr.save(1, state)
    mgr.close()
    assert mgr.last_save is not None and mgr.last_save.flushed
    commit = read_commit(Bucket.at(f"{s3.url}/run/{step_dir_name(1)}"))
    assert commit is not None
    return f"run/{step_dir_name(1)}/{commit.save_id}", tensors


def test_zarr_python_reads_a_checkpoint_in_a_bucket(
    s3: S3, tmp_path: Path, in_bucket: tuple[str, dict[str, np.ndarray]]
) -> None:
    prefix, tensors = in_bucket
    got = _run(ZARR_READER, [s3.bucket, prefix], s3, tmp_path)
    assert got.pop("__slice__") == _sha(tensors["model/w"][3:17, 5:40])
    assert sorted(got) == sorted(tensors)
    for name, arr in tensors.items():
        assert got[name]["shape"] == list(arr.shape), name
        assert got[name]["dtype"] == str(arr.dtype), name
        assert got[name]["sha256"] == _sha(arr), name


def test_tensorstore_reads_a_checkpoint_in_a_bucket(
    s3: S3, tmp_path: Path, in_bucket: tuple[str, dict[str, np.ndarray]]
) -> None:
    pytest.importorskip("tensorstore")
    prefix, tensors = in_bucket
    got = _run(TENSORSTORE_READER, [s3.bucket, prefix, json.dumps(sorted(tensors))], s3, tmp_path)
    assert got.pop("__slice__") == _sha(tensors["model/w"][3:17, 5:40])
    assert sorted(got) == sorted(tensors)
    for name, arr in tensors.items():
        assert got[name]["shape"] == list(arr.shape), name
        assert got[name]["dtype"] == str(arr.dtype), name
        assert got[name]["sha256"] == _sha(arr), name


def _incremental(
    s3: S3,
    tmp_path: Path,
    how: str,
    state: dict[str, Any],
    tensors: dict[str, np.ndarray],
    write: WriteOptions,
) -> tuple[str, dict[str, np.ndarray]]:
    """A checkpoint saved or flushed incrementally (its unchanged objects copied inside the
    store from the one before), the one before then deleted: its prefix and tensors."""
    later = {**tensors, "model/i": tensors["model/i"] + 1}
    state2 = {"model": {k[6:]: v for k, v in later.items() if k.startswith("model/")}}
    state2["opt"] = state["opt"]
    client = s3.server.client()
    if how == "incremental-saved":
        ckptfmt.save(state, f"{s3.url}/run/base", write=write)
        manifest = ckptfmt.save(
            state2, f"{s3.url}/run/ckpt", write=write, base=f"{s3.url}/run/base"
        )
        gone = "run/base/"
        prefix = f"run/ckpt/{manifest.save_id}"
    else:
        mgr = node_manager(
            tmp_path, shared=None, shared_dir=f"{s3.url}/run", write=write, incremental=True
        )
        mgr.save(1, state)
        mgr.save(2, state2)
        mgr.close()
        assert mgr.last_save is not None and mgr.last_save.bytes_linked.get("3")
        commit = read_commit(Bucket.at(f"{s3.url}/run/{step_dir_name(2)}"))
        assert commit is not None
        gone = f"run/{step_dir_name(1)}/"
        prefix = f"run/{step_dir_name(2)}/{commit.save_id}"
    for key in s3.keys(gone):
        client.delete_object(Bucket=s3.bucket, Key=key)
    assert s3.keys(gone) == []
    return prefix, later
