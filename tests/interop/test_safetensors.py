"""``ckptfmt export`` / ``ckptfmt import`` with safetensors and the Hugging Face layout, no
framework: every file written is read back by the ``safetensors`` library bit for bit; sharding,
names, casts, streaming memory, atomic output, level-1 sources rebuilt from parity on the fly
(the source untouched), and every kind of bad input refused with nothing written."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as stnp
from ckptfmt_cli.exits import ExitStatus
from kit import REPO
from kit.arrays import assert_bit_equal, random_array
from kit.cli import run_cli as run
from kit.faults import flip
from kit.files import leftovers, tree
from kit.level1 import NODES4, merge, save_level1, whole
from safetensors import safe_open

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.errors import (
    ChecksumError,
    DestinationExistsError,
    ForeignFormatError,
    UnrecoverableDamageError,
    UnsupportedDtypeError,
    UsageError,
)
from ckptfmt.interop import export as export_module
from ckptfmt.interop import export_safetensors, import_safetensors
from ckptfmt.interop.hf import parse_size, plan_shards
from ckptfmt.manifest.codec import parse_manifest
from ckptfmt.redundancy.record import member_files

NUMPY_DTYPES = [
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
    np.uint64, np.float16, np.float32, np.float64, np.complex64,
]  # fmt: skip
ML_DTYPES = [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]


def raw_file(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """A safetensors file decoded by hand from its header: name -> (dtype code, shape, bytes)
    (for the dtypes the library's numpy side cannot hold: bfloat16, float8)."""
    blob = path.read_bytes()
    (n,) = struct.unpack_from("<Q", blob)
    header = json.loads(blob[8 : 8 + n])
    header.pop("__metadata__", None)
    return {
        k: (
            v["dtype"],
            v["shape"],
            blob[8 + n + v["data_offsets"][0] : 8 + n + v["data_offsets"][1]],
        )
        for k, v in header.items()
    }


def model_state(rng: np.random.Generator) -> dict[str, Any]:
    model: dict[str, Any] = {
        f"t{i}.{np.dtype(dt).name}": random_array(rng, dt, (3, 5))
        for i, dt in enumerate(NUMPY_DTYPES)
    }
    model |= {f"ml.{np.dtype(dt).name}": random_array(rng, dt, (17,)) for dt in ML_DTYPES}
    model["scalar"] = np.float32(2.5)
    model["empty"] = np.zeros((0, 4), np.float32)
    model["layers.0.weight"] = random_array(rng, np.float32, (64, 48))
    return {"model": model, "optim": {"m": np.ones(4, np.float32)}, "step": 7}


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    state = model_state(np.random.default_rng(0))
    ckptfmt.save(
        state,
        tmp_path / "ckpt",
        step=7,
        write=WriteOptions(chunk_bytes=512, shard_bytes=2048, fsync=False),
    )
    return tmp_path / "ckpt", state


# --- export ---------------------------------------------------------------------------------------


def test_export_one_file_every_dtype_bit_exact(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    src, state = saved
    report = export_safetensors(src, tmp_path / "hf", write=WriteOptions(fsync=False))
    assert report.files == ["model.safetensors"]
    assert sorted(os.listdir(tmp_path / "hf")) == ["model.safetensors"]
    model = state["model"]
    assert report.names == {f"model/{k}": k for k in model}  # model/ stripped, optim left out
    path = tmp_path / "hf" / "model.safetensors"
    with safe_open(path, "numpy") as f:  # the safetensors library itself
        assert f.metadata()["format"] == "pt"
        assert f.metadata()["ckptfmt_step"] == "7"
        numpy_side = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("ml.")}  # noqa: SIM118
    raw = raw_file(path)
    assert set(raw) == set(model)
    for k, want in model.items():
        want = np.asarray(want)
        if want.dtype in [np.dtype(d) for d in ML_DTYPES]:
            code, shape, data = raw[k]
            assert shape == list(want.shape) and data == want.tobytes()
            assert (
                code
                == {"bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}[
                    want.dtype.name
                ]
            )
        else:
            assert_bit_equal(numpy_side[k], want)
    assert report.total_size == sum(np.asarray(v).nbytes for v in model.values())


def test_export_shards_index_and_stable_order(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    src, state = saved
    model = {k: np.asarray(v) for k, v in state["model"].items()}
    limit = 300
    report = export_safetensors(
        src, tmp_path / "a", max_shard_size=limit, write=WriteOptions(fsync=False)
    )
    names = sorted(os.listdir(tmp_path / "a"))
    shards = [n for n in names if n.endswith(".safetensors")]
    n = len(shards)
    assert n > 2 and names == sorted([*shards, "model.safetensors.index.json"])
    assert shards == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in model.values())
    assert list(index["weight_map"]) == list(model)  # the checkpoint's order
    # greedy in order: every shard holds what the index says, within the limit unless alone
    want = plan_shards([v.nbytes for v in model.values()], limit)
    keys = list(model)
    for k, group in enumerate(want, start=1):
        file = f"model-{k:05d}-of-{n:05d}.safetensors"
        assert [keys[i] for i in group] == [t for t, f in index["weight_map"].items() if f == file]
        raw = raw_file(tmp_path / "a" / file)
        assert set(raw) == {keys[i] for i in group}
        assert sum(len(r[2]) for r in raw.values()) <= limit or len(group) == 1
        for i in group:
            assert raw[keys[i]][2] == model[keys[i]].tobytes()
    # the same checkpoint exported again: the same bytes
    export_safetensors(src, tmp_path / "b", max_shard_size=limit, write=WriteOptions(fsync=False))
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert report.files == [*shards, "model.safetensors.index.json"]


def test_every_tensor_is_aligned_to_its_itemsize(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    export_safetensors(saved[0], tmp_path / "hf", write=WriteOptions(fsync=False))
    blob = (tmp_path / "hf" / "model.safetensors").read_bytes()
    (n,) = struct.unpack_from("<Q", blob)
    assert (8 + n) % 8 == 0
    for k, v in json.loads(blob[8 : 8 + n]).items():
        if k != "__metadata__":
            size = {"F64": 8, "I64": 8, "U64": 8, "C64": 8, "F32": 4, "I32": 4, "U32": 4}.get(
                v["dtype"], 1
            )
            assert v["data_offsets"][0] % min(size, 8) == 0, k


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size(123) == 123
    for bad in ("5XB", "", "-1", "0"):
        with pytest.raises(UsageError):
            parse_size(bad)


def test_names_rows_rename_and_clashes(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    src, state = saved
    r = export_safetensors(
        src,
        tmp_path / "a",
        rows=["model/layers.*", "optim/*"],
        renames=["layers.=model.layers."],
        write=WriteOptions(fsync=False),
    )
    assert r.names == {"model/layers.0.weight": "model.layers.0.weight", "optim/m": "optim.m"}
    got = stnp.load_file(tmp_path / "a" / "model.safetensors")
    assert_bit_equal(got["model.layers.0.weight"], state["model"]["layers.0.weight"])
    assert_bit_equal(got["optim.m"], state["optim"]["m"])
    with pytest.raises(UsageError, match="both become"):
        export_safetensors(
            src,
            tmp_path / "b",
            rows=["model/t1.*", "model/t2.*"],
            renames=["t1.int8=same", "t2.int16=same"],
        )
    with pytest.raises(UsageError, match="no tensor matches"):
        export_safetensors(src, tmp_path / "c", rows=["nothing/*"])
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_cast_floating_only(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    src, state = saved
    r = export_safetensors(src, tmp_path / "a", dtype="bfloat16", write=WriteOptions(fsync=False))
    raw = raw_file(tmp_path / "a" / "model.safetensors")
    model = state["model"]
    for k, v in model.items():
        v = np.asarray(v)
        code, _, data = raw[k]
        if v.dtype.kind == "f" or v.dtype in [np.dtype(d) for d in ML_DTYPES]:
            assert code == "BF16"
            with np.errstate(over="ignore", invalid="ignore"):  # random bits: inf, NaN
                want = v.astype(ml_dtypes.bfloat16)
            assert data == want.tobytes(), k  # round to nearest even
        else:
            assert data == v.tobytes(), k  # integers, bool, complex: never cast
    assert sorted(r.not_cast) == sorted(
        f"model/{k}" for k, v in model.items() if np.asarray(v).dtype.kind in "biuc"
    )
    floats = {"float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"}  # not bfloat16
    assert r.cast == "bfloat16"
    assert r.cast_tensors == sum(1 for v in model.values() if np.asarray(v).dtype.name in floats)
    with safe_open(tmp_path / "a" / "model.safetensors", "numpy") as f:
        assert "bfloat16" in f.metadata()["ckptfmt_cast"]
    with pytest.raises(UsageError):
        export_safetensors(src, tmp_path / "b", dtype="int8")


def test_complex128_is_refused(tmp_path: Path) -> None:
    ckptfmt.save(
        {"model": {"c": np.zeros(3, np.complex128)}},
        tmp_path / "ck",
        write=WriteOptions(fsync=False),
    )
    with pytest.raises(UnsupportedDtypeError):
        export_safetensors(tmp_path / "ck", tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and leftovers(tmp_path) == []


def _peak_rss_growth(fn: Any) -> int:
    """How far this process's peak resident set grew over its current size while ``fn`` ran
    (``/proc/self/clear_refs`` resets the peak; mapped output pages count while mapped)."""

    def status(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) << 10
        raise AssertionError(key)

    # heap pages freed by earlier tests stay resident and would hide what ``fn`` allocates:
    # hand them back first (glibc)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS:")
    fn()
    return status("VmHWM:") - before


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux /proc needed")
def test_export_streams_within_about_one_shard(tmp_path: Path) -> None:
    """48 MiB of tensors exported in 4 MiB shards: the peak memory stays near one shard (the
    read-ahead window), far below the checkpoint (``ckptfmt.load`` needs it all); a window as
    large as the checkpoint (the control) shows the measure sees the difference."""
    rng = np.random.default_rng(1)
    state = {"model": {f"w{i}": random_array(rng, np.float32, (256, 1024)) for i in range(48)}}
    ckptfmt.save(state, tmp_path / "ck", write=WriteOptions(fsync=False))
    del state
    src = tmp_path / "ck"

    def export(out: str, **kw: Any) -> Any:
        return lambda: export_safetensors(
            src, tmp_path / out, write=WriteOptions(fsync=False), **kw
        )

    grew = _peak_rss_growth(export("a", max_shard_size="4MiB"))
    assert len(os.listdir(tmp_path / "a")) == 12 + 1
    # the control: loading holds all 48 MiB, and the measure sees most of it
    control = _peak_rss_growth(lambda: ckptfmt.load(src))
    assert grew < 16 << 20 < 24 << 20 < control and control > 4 * grew, (grew, control)

    def cast_peak(out: str, **kw: Any) -> int:  # a cast reads each tensor into memory first
        tracemalloc.start()
        try:
            export(out, dtype="float16", **kw)()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    bounded = cast_peak("c", max_shard_size="4MiB")
    unbounded = cast_peak("d", max_shard_size="64MiB", window_bytes=1 << 30)  # the control
    assert bounded < 12 << 20 < 40 << 20 < unbounded, (bounded, unbounded)


def test_export_is_atomic(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    src, _ = saved
    out = tmp_path / "out"
    calls = []

    real = export_module._OutFile.release

    def boom(self: Any, key: int) -> None:  # the third tensor written: the disk fills up
        calls.append(key)
        real(self, key)
        if len(calls) == 3:
            raise OSError("disk full (injected)")

    with pytest.MonkeyPatch.context() as mp, pytest.raises(OSError, match="injected"):
        mp.setattr(export_module._OutFile, "release", boom)
        export_safetensors(src, out, max_shard_size=3000, write=WriteOptions(fsync=False))
    assert len(calls) >= 3 and not out.exists() and leftovers(tmp_path) == []
    export_safetensors(src, out, write=WriteOptions(fsync=False))
    before = tree(out)
    with pytest.raises(DestinationExistsError):
        export_safetensors(src, out)
    assert tree(out) == before
    (out / "config.json").write_text("{}")  # not ours: never replaced
    with pytest.raises(DestinationExistsError, match=r"config\.json"):
        export_safetensors(src, out, write=WriteOptions(overwrite=True))
    (out / "config.json").unlink()
    export_safetensors(
        src, out, max_shard_size=3000, write=WriteOptions(fsync=False, overwrite=True)
    )
    assert (out / "model.safetensors.index.json").exists() and not (
        out / "model.safetensors"
    ).exists()
    assert leftovers(tmp_path) == []


def test_damaged_level3_fails_and_writes_nothing(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    src, _ = saved
    manifest = parse_manifest((src / "ckptfmt.json").read_bytes())
    t = next(t for t in manifest.tensors() if t.name == ("model", "layers.0.weight"))
    flip(src / t.regions[0].files[0].path)
    with pytest.raises(ChecksumError) as exc:
        export_safetensors(src, tmp_path / "hf")
    assert exc.value.tensors == ("model/layers.0.weight",)
    assert not (tmp_path / "hf").exists() and leftovers(tmp_path) == []
    result = run("export", src, tmp_path / "hf")
    assert result.exit_code == ExitStatus.DAMAGED, result.output
    assert not (tmp_path / "hf").exists()


# --- export of a checkpoint saved by 4 ranks, level 1 and 3 -------------------------------------


@pytest.fixture
def four(tmp_path: Path) -> tuple[Path, str]:
    root = tmp_path / "l1"
    return root, save_level1(root, "xor", NODES4)


def check_whole(out: Path, size: int = 4) -> None:
    with safe_open(out / "model.safetensors", "numpy") as f:  # bfloat16 "norm": by hand below
        assert sorted(f.keys()) == ["embed", "norm", "w"]
        got = {k: f.get_tensor(k) for k in ("embed", "w")}
    want = whole(size)
    assert_bit_equal(got["embed"], want["model/embed"])
    assert_bit_equal(got["w"], want["model/w"])  # a tensor held in row blocks by 4 ranks
    assert raw_file(out / "model.safetensors")["norm"][2] == want["model/norm"].tobytes()


def test_export_of_four_ranks_level3_and_level1(four: tuple[Path, str], tmp_path: Path) -> None:
    root, template = four
    merged = merge(root, NODES4, tmp_path / "l3")
    export_safetensors(merged, tmp_path / "from3", write=WriteOptions(fsync=False))
    check_whole(tmp_path / "from3")
    before = tree(root)
    r = export_safetensors(template, tmp_path / "from1", write=WriteOptions(fsync=False))
    assert r.rebuilt_nodes == []
    check_whole(tmp_path / "from1")
    assert tree(root) == before
    assert (tmp_path / "from1" / "model.safetensors").read_bytes() == (
        tmp_path / "from3" / "model.safetensors"
    ).read_bytes()


def test_export_rebuilds_a_lost_node_on_the_fly(four: tuple[Path, str], tmp_path: Path) -> None:
    root, template = four
    import shutil

    shutil.rmtree(root / "n2")
    before = tree(root)
    result = run("export", template, tmp_path / "hf", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["rebuilt_nodes"] == ["n2"]
    check_whole(tmp_path / "hf")
    assert tree(root) == before and not (root / "n2").exists()  # the source is left as it was
    assert leftovers(tmp_path / "hf") == [] and leftovers(tmp_path) == []


def test_export_rebuilds_a_corrupt_file_on_the_fly(four: tuple[Path, str], tmp_path: Path) -> None:
    root, template = four
    manifest = parse_manifest((root / "n1" / "ckptfmt.json").read_bytes())
    flip(root / "n1" / member_files(manifest, 1)[0][1].path)  # sizes fine: found by its CRC
    before = tree(root)
    r = export_safetensors(template, tmp_path / "hf", write=WriteOptions(fsync=False))
    assert r.rebuilt_nodes == ["n1"]
    check_whole(tmp_path / "hf")
    assert tree(root) == before


def test_export_beyond_the_redundancy_writes_nothing(
    four: tuple[Path, str], tmp_path: Path
) -> None:
    root, template = four
    import shutil

    shutil.rmtree(root / "n1")
    shutil.rmtree(root / "n3")
    with pytest.raises(UnrecoverableDamageError):
        export_safetensors(template, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and leftovers(tmp_path) == []
    assert run("export", template, tmp_path / "hf").exit_code == ExitStatus.DAMAGED


# --- import ---------------------------------------------------------------------------------------


def test_roundtrip_export_import(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    src, state = saved
    export_safetensors(src, tmp_path / "hf", max_shard_size=300, write=WriteOptions(fsync=False))
    r = import_safetensors(tmp_path / "hf", tmp_path / "back", write=WriteOptions(fsync=False))
    assert r.format == "hf" and len(r.files) > 2
    back = ckptfmt.load(tmp_path / "back")
    assert list(back) == ["model"]
    assert sorted(back["model"]) == sorted(state["model"])
    for k, v in state["model"].items():
        assert_bit_equal(back["model"][k], v)
    assert ckptfmt.verify(tmp_path / "back").healthy


def test_import_a_file_the_library_wrote(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    tensors = {f"x.{np.dtype(d).name}": random_array(rng, d, (4, 3)) for d in NUMPY_DTYPES}
    tensors["enc/layer_0/kernel"] = random_array(rng, np.float32, (2, 2))
    stnp.save_file(tensors, tmp_path / "lib.safetensors", metadata={"format": "np"})
    r = import_safetensors(
        tmp_path / "lib.safetensors", tmp_path / "ck", prefix="", renames=["x.=y."]
    )
    assert r.format == "safetensors"
    ck = ckptfmt.open(tmp_path / "ck")
    assert sorted(ck.keys()) == sorted(
        ["enc/layer_0/kernel", *(k.replace("x.", "y.", 1) for k in tensors if k.startswith("x."))]
    )
    for k, v in tensors.items():
        assert_bit_equal(ck[k.replace("x.", "y.", 1)].read(), v)


def write_st(path: Path, header: dict[str, Any], data: bytes, n: int | None = None) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if n is None else n) + raw + data)


def e(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


GOOD = {"a": e("F32", [2], 0, 8), "b": e("U8", [4], 8, 12)}
Z1, Z8 = b"\0", b"\0" * 8
BAD_FILES: dict[str, tuple[dict[str, Any], bytes, int | None, str]] = {
    "truncated data": (GOOD, b"\0" * 10, None, "truncated"),
    "trailing bytes": (GOOD, b"\0" * 13, None, "no tensor covers"),
    "header past the end": (GOOD, b"", 10**6, "truncated"),
    "header too large": (GOOD, b"", 10**12, "exceeds"),
    "offsets past the data": ({"a": e("F32", [2], 8, 16)}, Z8, None, "hole"),
    "offsets lie about the size": ({"a": e("F32", [3], 0, 8)}, Z8, None, "needs 12"),
    "overlapping": ({"a": e("F32", [2], 0, 8), "b": e("U8", [4], 4, 8)}, Z8, None, "overlap"),
    "negative offsets": ({"a": e("U8", [0], -1, -1)}, b"", None, "begin"),
    "unknown dtype": ({"a": e("F128", [1], 0, 16)}, Z8 + Z8, None, "dtype"),
    "bad shape": ({"a": e("U8", [-2], 0, 0)}, b"", None, "shape"),
    "parent name": ({"../x": e("U8", [1], 0, 1)}, Z1, None, "periods"),
    "empty component": ({"a//b": e("U8", [1], 0, 1)}, Z1, None, "empty"),
    "reserved name": ({"__x": e("U8", [1], 0, 1)}, Z1, None, "reserved"),
    "control character": ({"a\nb": e("U8", [1], 0, 1)}, Z1, None, "control"),
    "leaf and group": (
        {"a": e("U8", [1], 0, 1), "a/b": e("U8", [1], 1, 2)},
        Z1 + Z1,
        None,
        "below",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_safetensors_is_refused_and_nothing_is_written(case: str, tmp_path: Path) -> None:
    header, data, n, reason = BAD_FILES[case]
    src = tmp_path / "in" / "bad.safetensors"
    src.parent.mkdir()
    write_st(src, header, data, n)
    out = tmp_path / "work" / "out"
    out.parent.mkdir()
    with pytest.raises(ForeignFormatError, match=reason) as exc:
        import_safetensors(src, out)
    assert exc.value.path == str(src) or exc.value.path.startswith(str(tmp_path))
    assert not out.exists() and os.listdir(out.parent) == []
    assert os.listdir(tmp_path) == ["in", "work"] or sorted(os.listdir(tmp_path)) == ["in", "work"]
    result = run("import", src, out)
    assert result.exit_code == ExitStatus.UNREADABLE, result.output
    assert "not a valid import source" in result.output and not out.exists()


def test_duplicate_header_keys_are_refused(tmp_path: Path) -> None:
    entry = b'{"dtype":"U8","shape":[1],"data_offsets":[0,1]}'
    raw = b'{"a":' + entry + b',"a":' + entry + b"}"
    (tmp_path / "d.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0")
    with pytest.raises(ForeignFormatError, match="twice"):
        import_safetensors(tmp_path / "d.safetensors", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def hf_dir(tmp_path: Path) -> Path:
    ckptfmt.save(
        {"model": {"a": np.arange(6, dtype=np.float32), "b": np.arange(3, dtype=np.int64)}},
        tmp_path / "ck",
        write=WriteOptions(fsync=False),
    )
    export_safetensors(
        tmp_path / "ck", tmp_path / "hf", max_shard_size=20, write=WriteOptions(fsync=False)
    )
    return tmp_path / "hf"


def test_bad_index_is_refused(tmp_path: Path) -> None:
    hf = hf_dir(tmp_path)
    index = hf / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    (tmp_path / "secret.safetensors").write_bytes((hf / doc["weight_map"]["a"]).read_bytes())
    cases = {
        "missing file": (
            {**doc["weight_map"], "a": "model-00009-of-00009.safetensors"},
            "not a file",
        ),
        "path outside": ({**doc["weight_map"], "a": "../secret.safetensors"}, "not a file of this"),
        "absolute path": (
            {**doc["weight_map"], "a": str(tmp_path / "secret.safetensors")},
            "not a file of this",
        ),
        "tensor not in its file": (
            {**doc["weight_map"], "zz": doc["weight_map"]["a"]},
            "does not hold it",
        ),
        "file tensor not listed": (
            {"a": doc["weight_map"]["a"], "b": doc["weight_map"]["a"]},
            "does not hold it",
        ),
    }
    for case, (wm, reason) in cases.items():
        index.write_text(json.dumps({"metadata": {}, "weight_map": wm}))
        out = tmp_path / f"out-{case.replace(' ', '-')}"
        with pytest.raises(ForeignFormatError, match=reason):
            import_safetensors(hf, out)
        assert not out.exists(), case
    index.write_text("{not json")
    with pytest.raises(ForeignFormatError, match="JSON"):
        import_safetensors(hf, tmp_path / "out")
    assert leftovers(tmp_path) == [] and not (tmp_path / "out").exists()


# --- CLI ------------------------------------------------------------------------------------------


def test_cli_export_and_import(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    src, state = saved
    result = run(
        "export", src, tmp_path / "hf", "--max-shard-size", "3KB", "--dtype", "float32", "--json"
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["format"] == "safetensors" and doc["files"][-1] == "model.safetensors.index.json"
    assert doc["cast"] == "float32"
    text = run("export", src, tmp_path / "hf2", "--rows", "model/layers.*")
    assert text.exit_code == 0 and "exported step 7: 1 tensor(s)" in text.output
    assert run("export", src, tmp_path / "hf2").exit_code == ExitStatus.USAGE  # exists
    assert run("export", src, tmp_path / "x", "--rename", "=a").exit_code == ExitStatus.USAGE
    assert run("export", tmp_path / "nothing", tmp_path / "y").exit_code == ExitStatus.UNREADABLE
    result = run("import", tmp_path / "hf2", tmp_path / "back", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["names"] == {"layers.0.weight": "model/layers.0.weight"}
    assert_bit_equal(
        ckptfmt.load(tmp_path / "back")["model"]["layers.0.weight"],
        state["model"]["layers.0.weight"],
    )
    trust = run("import", tmp_path / "hf2", tmp_path / "back2", "--trust-pickle")
    assert trust.exit_code == ExitStatus.USAGE and "DCP" in trust.output
    assert not (tmp_path / "back2").exists()
    assert "--trust-pickle" in run("import", "--help").output
    assert "--trust-pickle" not in run("export", "--help").output


def test_core_interop_imports_no_framework() -> None:
    code = (
        "import sys, ckptfmt.interop, ckptfmt_cli.main; "
        "bad = [m for m in ('torch', 'tensorflow', 'keras') if m in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr + proc.stdout


def test_import_with_the_layout_of_four_ranks(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    tensors = {f"w{i}": random_array(rng, np.float32, (10 + i, 6)) for i in range(3)}
    stnp.save_file(tensors, tmp_path / "in.safetensors")
    template = str(tmp_path / "l1" / "{node}" / "ck")
    result = run(
        "import", tmp_path / "in.safetensors", template, "--ranks", "4", "--ranks-per-node", "2",
        "--rows", "model/*", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    manifest = parse_manifest((tmp_path / "l1" / "n1" / "ck" / "ckptfmt.json").read_bytes())
    assert manifest.world_size == 4 and [r.node for r in manifest.ranks] == ["n0", "n0", "n1", "n1"]
    for t in manifest.tensors():  # row blocks: every rank writes its own rows
        assert sorted({r.rank for r in t.regions}) == [0, 1, 2, 3]
    export_safetensors(
        template, tmp_path / "hf", write=WriteOptions(fsync=False)
    )  # back out, from level 1
    got = stnp.load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(got) == sorted(tensors)
    for k, v in tensors.items():
        assert_bit_equal(got[k], v)
    assert [p.name for p in (tmp_path / "l1").iterdir()] in (["n0", "n1"], ["n1", "n0"])
    assert leftovers(tmp_path / "l1" / "n0") == [] and leftovers(tmp_path) == []
