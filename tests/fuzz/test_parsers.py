"""Fuzzing the parsers and readers with hostile input: only ckptfmt's own errors come out, nothing
hangs, nothing allocates without bound, nothing outside the checkpoint is opened."""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from kit.arrays import make_state
from kit.files import manifest_doc, write_manifest
from kit.guards import memory_cap, time_limit, track_opens

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.errors import CkptError, DamagedError, ManifestError
from ckptfmt.maintenance.verify import manifest_schema
from ckptfmt.manifest.codec import parse_manifest, seal_bytes

FUZZ = settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, -1, 1, 2**31, 2**53, 2**53 + 1, 2**63, 2**64, -(2**63), 10**30])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | st.sampled_from(
        [
            "",
            "..",
            "/",
            "../../etc/passwd",
            "/etc/passwd",
            "t/c/0",
            "\x00",
            "__x",
            "zarr.json",
            "tensor",
            "value",
            "group",
            "per_rank_value",
            "container",
            "list",
            "tuple",
            "encoding",
            "bytes",
            "pickle",
            "float32",
            "bfloat16",
            "crc32c",
            "ffffffff",
            "00000000",
            "nan",
            "inf",
            "-inf",
            "/0",
            "",
            "~",
            "/²",
            "/" + "9" * 40,
        ]
    )
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)

# placeholders replaced in the serialized text (json.dumps cannot produce these itself)
DEEP = "\x00DEEP\x00"
HUGE_INT = "\x00HUGEINT\x00"
RAW_TOKENS = {
    json.dumps(DEEP): "[" * 50_000 + "]" * 50_000,
    json.dumps(HUGE_INT): "7" * 5000,
}


def paths_of(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every location in a JSON document (the root included)."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from paths_of(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from paths_of(v, (*prefix, i))


def get_at(doc: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def mutate(data: st.DataObject, doc: Any, rounds: int) -> Any:
    """Apply ``rounds`` random mutations to a copy of a JSON document."""
    doc = copy.deepcopy(doc)
    for _ in range(rounds):
        paths = list(paths_of(doc))
        path = data.draw(st.sampled_from(paths))
        op = data.draw(
            st.sampled_from(
                [
                    "replace",
                    "replace",
                    "delete",
                    "retype",
                    "huge",
                    "negative",
                    "long",
                    "deep",
                    "wrap",
                    "add_key",
                    "duplicate_item",
                    "bump",
                ]
            )
        )
        old = get_at(doc, path)
        if op == "replace":
            new: Any = data.draw(json_values)
        elif op == "delete" and path:
            parent = get_at(doc, path[:-1])
            del parent[path[-1]]
            continue
        elif op == "retype":
            new = data.draw(
                st.sampled_from(
                    [
                        str(old),
                        [old],
                        {"x": old},
                        None,
                        True,
                        0,
                        1.5,
                        len(old) if isinstance(old, (list, dict, str)) else -1,
                    ]
                )
            )
        elif op == "huge":
            new = data.draw(st.sampled_from([2**64, 2**53, 10**40, HUGE_INT, 1e308, -(2**64)]))
        elif op == "negative":
            new = data.draw(st.sampled_from([-1, -(2**63), -0.5]))
        elif op == "long":
            new = data.draw(st.sampled_from(["a" * 100_000, ["a"] * 10_000, [0] * 100_000]))
        elif op == "deep":
            new = DEEP
        elif op == "wrap":
            new = [old]
        elif op == "add_key" and isinstance(old, dict):
            old[data.draw(st.text(max_size=10))] = data.draw(json_values)
            continue
        elif op == "duplicate_item" and isinstance(old, list) and old:
            old.append(copy.deepcopy(old[data.draw(st.integers(0, len(old) - 1))]))
            continue
        elif op == "bump" and isinstance(old, int) and not isinstance(old, bool):
            new = old + data.draw(st.sampled_from([1, -1, 2**32, 2**40]))
        else:
            new = data.draw(json_values)
        if path:
            get_at(doc, path[:-1])[path[-1]] = new
        else:
            doc = new
    return doc


def to_bytes(doc: Any) -> bytes:
    """``doc`` as JSON, with the raw tokens put in; a manifest of format version 2 on is sealed
    with its checksum as a writer would (else the checksum alone would refuse every mutation)."""
    version = doc.get("format_version") if isinstance(doc, dict) else None
    sealed = type(version) is int and version >= 2
    if sealed:
        doc = {k: v for k, v in doc.items() if k != "manifest_crc32c"}
    text = json.dumps(doc)
    for token, raw in RAW_TOKENS.items():
        text = text.replace(token, raw)
    blob = text.encode("utf-8", "surrogatepass")
    return seal_bytes(blob) if sealed and blob.endswith(b"}") and len(doc) else blob


def fuzz_state() -> dict[str, Any]:
    """Small but every entry form: tensors (multi-shard, padded, 0-d, empty), values with
    non-finite floats, an empty group, list and tuple containers, byte strings."""
    return {
        "w": np.arange(40, dtype=np.float32).reshape(8, 5),
        "b": np.arange(6, dtype=np.int16),
        "s": np.array(3, dtype=np.uint8),
        "e": np.zeros((0, 2), np.float64),
        "g": {"h": np.ones((3, 3), np.bool_)},
        "v": [1.5, float("nan"), {"k": float("-inf")}],
        "n": float("inf"),
        "empty": {},
        "l": [np.arange(3, dtype=np.int8), (1, None), b"xy", [()]],
    }


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes, dict[str, Any]]:
    root = tmp_path_factory.mktemp("fuzz") / "c"
    ckptfmt.save(
        fuzz_state(), root, write=WriteOptions(chunk_bytes=16, shard_bytes=32, fsync=False)
    )
    data = (root / "ckptfmt.json").read_bytes()
    manifest_schema()  # cached before any open() is tracked
    import jsonschema  # noqa: F401 - imported before any open() is tracked

    return root, data, json.loads(data)


# --- (a), (b): the manifest parser ---------------------------------------------------------------


@FUZZ
@given(data=st.data(), rounds=st.integers(1, 3))
def test_mutated_manifest_parses_or_raises_manifest_error(
    base: tuple[Path, bytes, dict[str, Any]], data: st.DataObject, rounds: int
) -> None:
    _, _, doc = base
    blob = to_bytes(mutate(data, doc, rounds))
    with time_limit(10), contextlib.suppress(ManifestError):
        parse_manifest(blob)


@FUZZ
@given(
    blob=st.binary(max_size=2000)
    | st.text(max_size=500).map(lambda s: s.encode("utf-8", "surrogatepass"))
)
def test_random_bytes_manifest(blob: bytes) -> None:
    with pytest.raises(ManifestError):
        parse_manifest(blob)


@FUZZ
@given(data=st.data())
def test_spliced_manifest_bytes(
    base: tuple[Path, bytes, dict[str, Any]], data: st.DataObject
) -> None:
    """Byte-level damage of a valid manifest (cut, overwrite, insert)."""
    _, good, _ = base
    i = data.draw(st.integers(0, len(good)))
    j = data.draw(st.integers(i, min(len(good), i + 20)))
    blob = good[:i] + data.draw(st.binary(max_size=8)) + good[j:]
    with contextlib.suppress(ManifestError):
        parse_manifest(blob)


@pytest.mark.parametrize(
    "entry",
    [
        {"kind": "value", "name": ["x"], "value": None, "nonfinite": {"": []}},
        {"kind": "value", "name": ["x"], "value": None, "nonfinite": {"": {}}},
        {"kind": "value", "name": ["x"], "value": [None], "nonfinite": {"/\u00b2": "nan"}},
        {"kind": "value", "name": ["x"], "value": [None], "nonfinite": {"/" + "9" * 5000: "nan"}},
        {"kind": "value", "name": ["x"], "value": [None], "nonfinite": {"/-0": "nan"}},
        {"kind": "value", "name": ["x"], "value": {"a": [None]}, "nonfinite": {"/a/0/x": "nan"}},
        {"kind": "per_rank_value", "name": ["x"], "values": [None], "nonfinite": {"0": [1]}},
        {"kind": "per_rank_value", "name": ["x"], "values": [None], "nonfinite": {"0": "nan"}},
        {"kind": "per_rank_value", "name": ["x"], "values": [None], "nonfinite": {"0": None}},
        {"kind": "per_rank_value", "name": ["x"], "values": [None], "nonfinite": {"0": {"": 1}}},
    ],
    ids=[
        "kind-list",
        "kind-dict",
        "superscript-index",
        "huge-index",
        "minus-zero-index",
        "through-list",
        "per-rank-list",
        "per-rank-str",
        "per-rank-null",
        "per-rank-int-kind",
    ],
)
def test_hostile_nonfinite_tables(
    base: tuple[Path, bytes, dict[str, Any]], entry: dict[str, Any]
) -> None:
    _, _, doc = base
    doc = copy.deepcopy(doc)
    doc["entries"].append(entry)
    with pytest.raises(ManifestError):
        parse_manifest(json.dumps(doc).encode())


def test_huge_integer_literal(base: tuple[Path, bytes, dict[str, Any]]) -> None:
    """A 5000-digit number is valid JSON that Python's int() refuses by default."""
    _, _, doc = base
    for where in ("step", "levels"):
        d = copy.deepcopy(doc)
        d[where] = HUGE_INT if where == "step" else {"x": HUGE_INT}
        with pytest.raises(ManifestError):
            parse_manifest(to_bytes(d))


@pytest.mark.parametrize("depth", [500, 100_000])
def test_deeply_nested_manifest(base: tuple[Path, bytes, dict[str, Any]], depth: int) -> None:
    _, _, doc = base
    d = copy.deepcopy(doc)
    d["levels"] = {"x": DEEP}
    blob = to_bytes(d).replace(b"[" * 50_000 + b"]" * 50_000, b"[" * depth + b"]" * depth)
    try:
        m = parse_manifest(blob)
    except ManifestError:
        return
    assert depth < 1000 and m.levels


# --- (c): whole readers on a checkpoint with a mutated manifest ----------------------------------


def read_all_tensors(root: Path) -> None:
    ck = ckptfmt.open(root)
    for name, view in ck.tensors().items():
        view[...]
        if view.shape and all(view.shape):
            view[tuple(d - 1 for d in view.shape)]
        ck[name]
    for name in list(ck.keys()):
        ck[name]


def read_everything(root: Path) -> None:
    """Each reader on its own: an error in one must not hide what another does."""
    for fn in (ckptfmt.load, ckptfmt.verify, read_all_tensors):
        with contextlib.suppress(CkptError):
            fn(root)


@FUZZ
@given(data=st.data(), rounds=st.integers(1, 2))
def test_readers_on_mutated_manifest(
    base: tuple[Path, bytes, dict[str, Any]],
    data: st.DataObject,
    rounds: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root, good, doc = base
    mutated = mutate(data, doc, rounds)
    (root / "ckptfmt.json").write_bytes(to_bytes(mutated))
    try:
        with memory_cap(), track_opens(monkeypatch) as t, time_limit(20):
            read_everything(root)
        assert t.outside(root) == [], t.outside(root)
    finally:
        (root / "ckptfmt.json").write_bytes(good)


def one_tensor_ckpt(tmp_path: Path, arr: np.ndarray) -> tuple[Path, dict[str, Any]]:
    root = tmp_path / "c"
    ckptfmt.save({"t": arr}, root, write=WriteOptions(fsync=False))
    return root, manifest_doc(root)


def expect_only_ckpt_errors(root: Path, seconds: int = 5) -> None:
    with memory_cap(), time_limit(seconds):
        for fn in (
            ckptfmt.load,
            ckptfmt.verify,
            lambda r: ckptfmt.open(r)["t"][...],
            lambda r: ckptfmt.open(r)["t"][0],
        ):
            with pytest.raises(CkptError):
                fn(root)


@pytest.mark.parametrize("shard", [2**40, 2**24])
def test_huge_shard_to_chunk_ratio(tmp_path: Path, shard: int) -> None:
    """A manifest whose shard holds 2**40 inner-chunk slots (the file is 40 bytes): the reader
    must see that the file cannot hold such an index instead of enumerating the slots."""
    root, doc = one_tensor_ckpt(tmp_path, np.arange(8, dtype=np.int8))
    e = doc["entries"][0]
    e["shard_shape"], e["chunk_shape"] = [shard], [1]
    write_manifest(root, doc)
    expect_only_ckpt_errors(root)


def test_huge_claimed_tensor_is_not_allocated(tmp_path: Path) -> None:
    """A 16 TiB tensor (inside the format's 2**50-byte limit) whose one shard file is 40 bytes:
    the reader must refuse it from the file sizes, not try to allocate 16 TiB first."""
    root, doc = one_tensor_ckpt(tmp_path, np.arange(8, dtype=np.int8))
    e = doc["entries"][0]
    n = 2**44
    e["shape"] = e["shard_shape"] = e["chunk_shape"] = [n]
    e["regions"][0]["shape"] = [n]
    write_manifest(root, doc)
    expect_only_ckpt_errors(root)


def test_hostile_chunk_shape_many_dims(tmp_path: Path) -> None:
    """32 axes of extent 2**10 with chunk extent 1: 2**320 slots claimed for one small file."""
    root, doc = one_tensor_ckpt(tmp_path, np.zeros((1,) * 32, np.int8))
    e = doc["entries"][0]
    e["shard_shape"] = [2**10] * 32
    e["chunk_shape"] = [1] * 32
    write_manifest(root, doc)
    expect_only_ckpt_errors(root)


# --- (d): mutated zarr.json ----------------------------------------------------------------------


@pytest.mark.slow
@FUZZ
@given(
    data=st.data(),
    rounds=st.integers(1, 2),
    which=st.sampled_from(
        ["w/zarr.json", "s/zarr.json", "e/zarr.json", "g/h/zarr.json", "zarr.json", "g/zarr.json"]
    ),
)
def test_mutated_zarr_json(
    base: tuple[Path, bytes, dict[str, Any]], data: st.DataObject, rounds: int, which: str
) -> None:
    root, _, _ = base
    path = root / which
    original = path.read_bytes()
    doc = json.loads(original)
    mutated = mutate(data, doc, rounds)
    # format version 2: every document is checked whole, as a parsed document (FORMAT.md §10)
    same = json.dumps(mutated, sort_keys=True) == json.dumps(doc, sort_keys=True)
    if any(token in json.dumps(mutated) for token in RAW_TOKENS):
        same = False  # 50,000-deep nesting or a 5000-digit integer: not readable JSON for us
    path.write_bytes(to_bytes(mutated))
    try:
        with time_limit(20):
            report = ckptfmt.verify(root)
    finally:
        path.write_bytes(original)
    if same:
        assert report.healthy, report.problems
    else:
        assert [(p.file, p.kind) for p in report.problems] == [(which, "metadata")]


# --- (e): random bytes in a shard file -----------------------------------------------------------


@FUZZ
@given(data=st.data(), which=st.sampled_from(["w/c/0/0", "w/c/1/0", "b/c/0", "s/c", "g/h/c/0/0"]))
def test_random_bytes_in_shard(
    base: tuple[Path, bytes, dict[str, Any]], data: st.DataObject, which: str
) -> None:
    root, _, _ = base
    path = root / which
    original = path.read_bytes()
    n = len(original)
    start = data.draw(st.integers(0, n - 1))
    patch = data.draw(st.binary(min_size=1, max_size=n - start))
    damaged = original[:start] + patch + original[start + len(patch) :]
    assume(damaged != original)
    assert len(damaged) == n
    tensor = which.rsplit("/c", 1)[0]
    path.write_bytes(damaged)
    try:
        with pytest.raises(DamagedError) as info:
            ckptfmt.load(root)
        assert info.value.path == which and info.value.tensors == (tensor,)
        with pytest.raises(DamagedError):
            ckptfmt.open(root)[tensor][...]
        report = ckptfmt.verify(root)
        assert [(p.file, p.tensors) for p in report.problems] == [(which, (tensor,))]
    finally:
        path.write_bytes(original)


# --- a hostile manifest in a fresh process: nothing outside is opened ----------------------------


@pytest.mark.slow
def test_hostile_manifest_opens_nothing_outside_strace_free(tmp_path: Path) -> None:
    """In a separate process with an audit hook (sys.addaudithook sees every open, whatever
    module does it): load/verify/open of manifests pointing outside open only the manifest."""
    root = tmp_path / "c"
    ckptfmt.save(
        make_state(), root, write=WriteOptions(chunk_bytes=64, shard_bytes=128, fsync=False)
    )
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 36)
    doc = manifest_doc(root)
    hostile = []
    for target in ["../secret", str(secret), "t/c/../../../secret", "model/../../secret"]:
        d = copy.deepcopy(doc)
        for e in d["entries"]:
            if e["kind"] == "tensor" and e["regions"]:
                e["regions"][0]["files"][0]["path"] = target
                break
        hostile.append(d)
    d = copy.deepcopy(doc)
    for e in d["entries"]:
        if e["kind"] == "tensor" and e["regions"]:
            e["path"] = "../secret"
            break
    hostile.append(d)
    code = textwrap.dedent(
        """
        import json, os, sys
        import ckptfmt, jsonschema
        from ckptfmt.maintenance.verify import manifest_schema
        manifest_schema()
        root = os.path.realpath(sys.argv[1])
        opened = []
        def hook(event, args):
            if event == "open" and isinstance(args[0], (str, bytes)):
                opened.append(os.path.realpath(os.fsdecode(args[0])))
        sys.addaudithook(hook)
        errors = []
        for fn in (ckptfmt.load, ckptfmt.verify, lambda r: ckptfmt.open(r).tensors()):
            try:
                fn(root)
                errors.append("no error")
            except ckptfmt.CkptError as exc:
                errors.append(type(exc).__name__)
        print(json.dumps({"opened": sorted(set(opened)), "errors": errors}))
        """
    )
    for d in hostile:
        write_manifest(root, d)
        out = subprocess.run(
            [sys.executable, "-c", code, str(root)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert out.returncode == 0, out.stderr
        res = json.loads(out.stdout.strip().splitlines()[-1])
        assert res["errors"] == ["ManifestError"] * 3
        base_dir = str(root.resolve())
        outside = [p for p in res["opened"] if not p.startswith(base_dir + "/")]
        assert outside == [], outside
        assert str(secret.resolve()) not in res["opened"]


def test_symlinked_shard_outside_is_not_followed(tmp_path: Path) -> None:
    """A shard file replaced by a symlink to a file outside the checkpoint (with the same bytes)
    is not read through: the checkpoint must not vouch for what lies outside it."""
    root, _ = one_tensor_ckpt(tmp_path, np.arange(8, dtype=np.int8))
    outside = tmp_path / "outside.bin"
    shutil.copy(root / "t/c/0", outside)
    (root / "t/c/0").unlink()
    (root / "t/c/0").symlink_to(outside)
    with pytest.raises(DamagedError):
        ckptfmt.load(root)
    assert not ckptfmt.verify(root).healthy
