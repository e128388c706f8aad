"""Hostile files cannot hang a reader or exhaust its memory.

A FIFO (or another non-regular file) where a shard file, a ``zarr.json`` or the manifest belongs
would block a naive ``open()`` forever; each case runs in a child process
under a timeout, so that a regression fails instead of hanging the suite. A manifest and
``zarr.json`` claiming a tensor of 10^12 elements over a sparse file of matching size must not
make ``load`` allocate it (numpy's MemoryError) nor ``verify`` read the whole file into memory."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from kit import REPO
from kit.files import seal_if_sealed
from kit.guards import memory_cap

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.dtypes import by_name
from ckptfmt.errors import AllocationLimitError, CkptError, NotACheckpointError
from ckptfmt.format.zarr_meta import array_doc, doc_bytes

STATE = {"w": np.arange(64, dtype=np.float32).reshape(8, 8), "step": 3}


def child(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter; a hang becomes a failure after ``timeout`` s."""
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'tests'}:{REPO / 'tools'}"}
    try:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=REPO,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the reader blocked for {timeout} s")


READERS = """
import json, sys
import ckptfmt
from ckptfmt.errors import CkptError
from click.testing import CliRunner
from ckptfmt_cli.main import cli
root = sys.argv[1] if len(sys.argv) > 1 else {root!r}
out = {{}}
for name, fn in (("load", ckptfmt.load), ("open", lambda r: ckptfmt.open(r)["w"][...])):
    try:
        fn(root)
        out[name] = "ok"
    except CkptError as exc:
        out[name] = type(exc).__name__ + ": " + str(exc)
try:
    report = ckptfmt.verify(root)
    out["verify"] = [[p.file, p.kind, p.reason] for p in report.problems]
except CkptError as exc:
    out["verify"] = type(exc).__name__ + ": " + str(exc)
out["cli"] = CliRunner().invoke(cli, ["verify", root]).exit_code
print(json.dumps(out))
"""


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    root = tmp_path / "c"
    ckptfmt.save(STATE, root, write=WriteOptions(fsync=False))
    return root


def readers(root: Path) -> dict[str, object]:
    proc = child(READERS.format(root=str(root)))
    assert proc.returncode == 0, proc.stderr
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def shard_of(root: Path) -> str:
    m = ckptfmt.open(root).manifest
    return m.tensors()[0].regions[0].files[0].path


def test_a_fifo_for_a_shard_file(ckpt: Path) -> None:
    rel = shard_of(ckpt)
    (ckpt / rel).unlink()
    os.mkfifo(ckpt / rel)
    out = readers(ckpt)
    for name in ("load", "open"):
        assert str(out[name]).startswith("NotRegularFileError"), out
        assert rel in str(out[name]) and "FIFO" in str(out[name])
    assert out["verify"] == [[rel, "missing", "missing: not a regular file (a FIFO)"]]
    assert out["cli"] == 1


def test_a_fifo_for_the_manifest(ckpt: Path) -> None:
    (ckpt / "ckptfmt.json").unlink()
    os.mkfifo(ckpt / "ckptfmt.json")
    out = readers(ckpt)
    for name in ("load", "open", "verify"):
        assert str(out[name]).startswith("NotACheckpointError"), out
        assert "FIFO" in str(out[name])
    assert out["cli"] == 3
    with pytest.raises(NotACheckpointError):  # in this process too: nothing blocks
        ckptfmt.load(ckpt)


def test_a_fifo_for_a_zarr_json(ckpt: Path) -> None:
    (ckpt / "w" / "zarr.json").unlink()
    os.mkfifo(ckpt / "w" / "zarr.json")
    out = readers(ckpt)
    assert "w/zarr.json" in str(out["load"]) and "FIFO" in str(out["load"])
    assert out["verify"] == [["w/zarr.json", "missing", "missing: not a regular file (a FIFO)"]]
    assert out["cli"] == 1


def test_a_fifo_in_a_level1_node(tmp_path: Path) -> None:
    from kit.level1 import save_level1

    root = tmp_path / "l1"
    save_level1(root, "xor", ["n0", "n1"], set_size=2)
    (root / "n1" / "ckptfmt-redundancy" / "1").unlink()
    os.mkfifo(root / "n1" / "ckptfmt-redundancy" / "1")
    code = f"""
    from ckptfmt_cli.main import cli
    from click.testing import CliRunner
    t = {str(root / "{node}")!r}
    print(CliRunner().invoke(cli, ["verify", t]).exit_code,
          CliRunner().invoke(cli, ["rebuild", "--no-fsync", t]).exit_code,
          CliRunner().invoke(cli, ["verify", t]).exit_code)
    """
    proc = child(code)
    assert proc.stdout.split() == ["1", "0", "0"], proc.stdout + proc.stderr


def test_a_symlink_out_of_the_checkpoint(ckpt: Path, tmp_path: Path) -> None:
    rel = shard_of(ckpt)
    outside = tmp_path / "outside"
    outside.write_bytes((ckpt / rel).read_bytes())  # even the right bytes are not read
    (ckpt / rel).unlink()
    (ckpt / rel).symlink_to(outside)
    out = readers(ckpt)
    assert str(out["load"]).startswith("NotRegularFileError") and "symbolic link" in str(
        out["load"]
    )
    assert out["cli"] == 1
    (ckpt / "ckptfmt.json").rename(tmp_path / "m.json")
    (ckpt / "ckptfmt.json").symlink_to(tmp_path / "m.json")
    with pytest.raises(NotACheckpointError, match="symbolic link"):
        ckptfmt.load(ckpt)


# --- huge claims over sparse files -----------------------------------------------------------


N = 10**12  # elements of int8: one terabyte


def huge_claim(root: Path) -> str:
    """Make the manifest and zarr.json of ``root``'s one tensor claim N int8 elements, backed
    by a sparse shard file of exactly the size the claim implies; its path."""
    doc = json.loads((root / "ckptfmt.json").read_bytes())
    (e,) = [x for x in doc["entries"] if x["kind"] == "tensor"]
    chunk, slots = 2**29, 2048
    shard = chunk * slots
    present = math.ceil(N / chunk)
    size = present * (chunk + 4) + 16 * slots + 4
    e.update(dtype="int8", shape=[N], shard_shape=[shard], chunk_shape=[chunk])
    rel = f"{e['path']}/c/0"
    files = [{"path": rel, "size": size, "crc32c": "00000000"}]
    e["regions"] = [{"offset": [0], "shape": [N], "rank": 0, "files": files}]
    (root / "ckptfmt.json").write_bytes(seal_if_sealed(doc))
    meta = array_doc(by_name("int8"), (N,), (shard,), (chunk,))
    (root / e["path"] / "zarr.json").write_bytes(doc_bytes(meta))
    for old in (root / e["path"] / "c").iterdir():
        if old.is_dir():
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
        else:
            old.unlink()
    with open(root / rel, "wb") as f:
        f.truncate(size)  # sparse: no block is written
    return rel


def test_a_huge_tensor_over_a_sparse_file_is_not_allocated(tmp_path: Path) -> None:
    root = tmp_path / "c"
    ckptfmt.save({"w": np.zeros(8, np.int8)}, root, write=WriteOptions(fsync=False))
    rel = huge_claim(root)
    assert (root / rel).stat().st_size > N  # the sizes agree: only a cap can refuse it
    assert (root / rel).stat().st_blocks * 512 < 1 << 20
    with memory_cap(1 << 30):
        for call in (
            ckptfmt.load,
            lambda r: ckptfmt.load(r, max_bytes=1 << 20),
            lambda r: ckptfmt.open(r)["w"].read(),
            lambda r: ckptfmt.open(r)["w"][:],
        ):
            with pytest.raises(AllocationLimitError) as info:
                call(root)
            assert info.value.tensor == "w" and info.value.actual == N
            assert "'w'" in str(info.value) and str(N) in str(info.value)
        # verify reads chunk by chunk whatever a file claims: the index (zeros) fails at once
        report = ckptfmt.verify(root)
    assert [(p.file, p.kind) for p in report.problems] == [(rel, "checksum")]
    assert "shard index" in report.problems[0].reason


def test_verify_reads_in_bounded_memory(tmp_path: Path) -> None:
    """One shard file of 192 MiB, verified with 96 MiB of address space to spare: reading it
    whole (as verify did) cannot fit; chunk by chunk it does, and one flipped bit is found."""
    root = tmp_path / "big"
    big = np.random.default_rng(0).integers(0, 255, 192 << 20, dtype=np.uint8)
    ckptfmt.save(
        {"b": big},
        root,
        write=WriteOptions(chunk_bytes=1 << 20, shard_bytes=256 << 20, fsync=False),
    )
    (rel,) = [f.path for _, f in ckptfmt.open(root).manifest.files()]
    del big
    with memory_cap(96 << 20):
        assert ckptfmt.verify(root).healthy
    with open(root / rel, "r+b") as f:
        f.seek(150 << 20)
        byte = f.read(1)
        f.seek(150 << 20)
        f.write(bytes([byte[0] ^ 0x10]))
    with memory_cap(96 << 20):
        report = ckptfmt.verify(root)
    assert [(p.file, p.kind) for p in report.problems] == [(rel, "checksum")]


def test_no_hostile_file_escapes_the_error_tree(ckpt: Path) -> None:
    """A device node where a shard belongs (where mknod is allowed): refused, not read."""
    rel = shard_of(ckpt)
    (ckpt / rel).unlink()
    try:
        os.symlink("/dev/zero", ckpt / rel)
    except OSError:
        pytest.skip("cannot make a link")
    with pytest.raises(CkptError):
        ckptfmt.load(ckpt)
