"""A ckptfmt checkpoint is a zarr v3 hierarchy: zarr-python (in a process that never imports
ckptfmt itself) and TensorStore read every tensor with the right shape, dtype and bytes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from kit.arrays import iter_tensors, make_state, raw_bytes
from kit.zarr_reader import zarr_read

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.dtypes import of_array


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(raw_bytes(a)).hexdigest()


GRIDS = {"small": {"chunk_bytes": 24, "shard_bytes": 96}, "default": {}}


@pytest.fixture(scope="module", params=sorted(GRIDS))
def ckpt(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, np.ndarray]]:
    state = make_state(3)
    root = tmp_path_factory.mktemp("interop") / "c"
    ckptfmt.save(state, root, write=WriteOptions(fsync=False, **GRIDS[request.param]))
    return root, dict(iter_tensors(state))


def test_zarr_python_reads_every_tensor(
    tmp_path: Path, ckpt: tuple[Path, dict[str, np.ndarray]]
) -> None:
    root, tensors = ckpt
    got = zarr_read(tmp_path, root)
    assert sorted(got) == sorted(tensors)
    for name, arr in tensors.items():
        g = got[name]
        assert g["shape"] == g["array_shape"] == list(arr.shape), name
        assert g["dtype"] == of_array(arr.dtype).name, name
        assert g["byteorder"] in "<=|", name  # little-endian
        assert g["sha256"] == sha(arr), name
    # the corner cases are part of the state
    assert got["scalar"]["shape"] == [] and got["empty_t"]["shape"] == [3, 0, 2]
    assert {"bfloat16", "float8_e4m3fn", "float8_e5m2", "complex128", "bool"} <= {
        g["dtype"] for g in got.values()
    }


def test_tensorstore_reads_every_tensor(ckpt: tuple[Path, dict[str, np.ndarray]]) -> None:
    ts = pytest.importorskip("tensorstore")
    root, tensors = ckpt
    for name, arr in tensors.items():
        store = ts.open(
            {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(root / name)}},
            read=True,
        ).result()
        data = np.asarray(store.read().result())
        assert store.dtype.name == of_array(arr.dtype).name, name
        assert tuple(store.shape) == arr.shape, name
        assert data.shape == arr.shape, name
        assert raw_bytes(data) == raw_bytes(arr), name


def test_tensorstore_reads_a_slice(ckpt: tuple[Path, dict[str, np.ndarray]]) -> None:
    ts = pytest.importorskip("tensorstore")
    root, tensors = ckpt
    arr = tensors["model/layer.0/weight"]
    store = ts.open(
        {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": str(root / "model/layer.0/weight")},
        },
        read=True,
    ).result()
    assert raw_bytes(np.asarray(store[2:7, 1:5, 1].read().result())) == raw_bytes(arr[2:7, 1:5, 1])


def test_zarr_python_reads_zero_d_and_empty(tmp_path: Path) -> None:
    root = tmp_path / "c"
    state = {
        "zero_d": np.array(-0.0, np.float32),
        "bf": np.array(1.25, np.float64),
        "empty": np.zeros((0, 4), np.int64),
        "empty3": np.zeros((2, 0, 1), np.complex64),
    }
    ckptfmt.save(state, root, write=WriteOptions(fsync=False))
    got = zarr_read(tmp_path, root)
    assert sorted(got) == sorted(state)
    for name, arr in state.items():
        assert got[name]["shape"] == list(arr.shape), name
        assert got[name]["dtype"] == str(arr.dtype), name
        assert got[name]["sha256"] == sha(arr), name
