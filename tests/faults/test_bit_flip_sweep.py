"""Reliability sweep: random single-bit flips in every kind of file of a checkpoint.

Two checkpoints: one saved by one process, and a level-1 checkpoint with XOR parity over two
simulated nodes (``kit.level1``, every rank a thread). Each flip is made in a real file, then:

* one process: ``verify`` and ``load`` must both find it (a report that is not healthy or a
  CkptError; a CkptError from ``load``), unless the file still parses to the same document
  (*benign*, allowed); a load that returns other values without an error is a *silent
  corruption*, a change that neither finds an *undetected* one;
* level 1: ``verify`` of the ``{node}`` template must find it, ``rebuild`` must repair it (one
  flip is always within XOR's tolerance) and afterwards every file of both nodes must be
  byte-identical to what the save wrote.

The seed is printed (``pytest -s``) and can be set with ``CKPTFMT_SWEEP_SEED``; the flips and
their order follow from it alone, so a failure is reproduced by running the sweep with the
seed it printed. ``CKPTFMT_SWEEP_FLIPS`` sets the flips per checkpoint (default 600 + 500).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit.arrays import assert_state_equal
from kit.faults import flipped
from kit.files import tree
from kit.level1 import save_level1

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.errors import CkptError
from ckptfmt.format.shard import index_nbytes
from ckptfmt.format.shard_io import Geometry
from ckptfmt.maintenance.repair import rebuild

SEED = int(os.environ.get("CKPTFMT_SWEEP_SEED", "20261203"))
FLIPS = os.environ.get("CKPTFMT_SWEEP_FLIPS", "600,500").split(",")
SINGLE_FLIPS, LEVEL1_FLIPS = int(FLIPS[0]), int(FLIPS[-1])

KINDS = ("data chunk", "shard index", "array zarr.json", "group zarr.json", "manifest", "parity")

pytestmark = pytest.mark.slow


def state() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    return {
        "model": {
            "w": rng.standard_normal((12, 10)).astype(np.float32),
            "b": rng.integers(-9, 9, 30).astype(np.int16),
            "scale": np.float64(0.5) * np.ones(()),
        },
        "optim": {"lr": 1e-05, "betas": [0.9, 0.999], "step": 12, "name": "adam"},
        "step": 12,
        "hooks": {},
    }


Region = tuple[str, str, int, int]  # kind, file (relative), first byte, end byte


def regions(root: Path, manifest: ckptfmt.Manifest, prefix: str = "") -> list[Region]:
    """Every flippable region of the checkpoint at ``root`` by kind: each shard file's chunks
    (payloads with their CRCs) and its index, each zarr.json, the manifest, parity files."""
    out: list[Region] = []
    for t in manifest.tensors():
        geo = Geometry.of(t.path, t.dtype, t.shape, t.shard_shape, t.chunk_shape)
        for r in t.regions:
            for f in r.files:
                if not (root / prefix / f.path).is_file():
                    continue  # another node's file
                n_idx = index_nbytes(geo.n_slots) if t.shape else 0
                out.append(("data chunk", prefix + f.path, 0, f.size - n_idx))
                if n_idx:
                    out.append(("shard index", prefix + f.path, f.size - n_idx, f.size))
    for p in sorted((root / prefix).rglob("zarr.json")):
        rel = p.relative_to(root).as_posix()
        kind = json.loads(p.read_bytes())["node_type"] + " zarr.json"
        out.append((kind, rel, 0, p.stat().st_size))
    m = root / prefix / "ckptfmt.json"
    out.append(("manifest", (Path(prefix) / "ckptfmt.json").as_posix(), 0, m.stat().st_size))
    parity = root / prefix / "ckptfmt-redundancy"
    if parity.is_dir():
        for p in sorted(parity.iterdir()):
            out.append(("parity", p.relative_to(root).as_posix(), 0, p.stat().st_size))
    return out


def pick(rng: random.Random, by_kind: dict[str, list[Region]]) -> tuple[str, str, int]:
    """A kind (uniformly among those present), a region of it, a bit inside: (kind, file,
    bit index from the start of the file)."""
    kind = rng.choice(sorted(by_kind))
    _, rel, lo, hi = rng.choice(by_kind[kind])
    return kind, rel, rng.randrange(lo * 8, hi * 8)


def flip_bit(path: Path, bit: int) -> bytes:
    """Flip ``bit`` of the file in place; the original bytes."""
    data = path.read_bytes()
    path.write_bytes(flipped(data, bit))
    return data


def same_document(before: bytes, after: bytes) -> bool:
    """``after`` parses to the very document ``before`` is (a benign change of JSON)."""
    try:
        a, b = json.loads(before), json.loads(after)
    except ValueError:
        return False
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def report(title: str, counts: Counter[tuple[str, str]]) -> str:
    outcomes = sorted({o for _, o in counts})
    lines = [f"{title} (seed {SEED}):", f"  {'kind':<16}" + "".join(f"{o:>14}" for o in outcomes)]
    for kind in KINDS:
        if any(k == kind for k, _ in counts):
            lines.append(f"  {kind:<16}" + "".join(f"{counts[(kind, o)]:>14}" for o in outcomes))
    totals = Counter(o for (_, o), n in counts.items() for _ in range(n))
    lines.append("  total           " + "".join(f"{totals[o]:>14}" for o in outcomes))
    return "\n".join(lines)


def test_sweep_one_process(tmp_path: Path) -> None:
    print(f"\nsweep seed {SEED} (set CKPTFMT_SWEEP_SEED to repeat)")
    rng = random.Random(f"{SEED}-one-process")
    root = tmp_path / "c"
    want = state()
    ckptfmt.save(
        want, root, step=12, write=WriteOptions(chunk_bytes=64, shard_bytes=256, fsync=False)
    )
    manifest = ckptfmt.open(root).manifest
    by_kind: dict[str, list[Region]] = {}
    for reg in regions(root, manifest):
        by_kind.setdefault(reg[0], []).append(reg)
    assert set(by_kind) == set(KINDS) - {"parity"}
    counts: Counter[tuple[str, str]] = Counter()
    failures: list[str] = []
    for i in range(SINGLE_FLIPS):
        kind, rel, bit = pick(rng, by_kind)
        path = root / rel
        original = flip_bit(path, bit)
        try:
            verified = _detects(lambda: ckptfmt.verify(root).healthy)
            loaded: Any = None
            try:
                loaded = ckptfmt.load(root)
                load_found = False
            except CkptError:
                load_found = True
        finally:
            path.write_bytes(original)
        benign = rel.endswith(".json") and same_document(original, flipped(original, bit))
        where = f"flip {i}: {kind} {rel} bit {bit}"
        if load_found and verified:
            outcome = "detected"
        elif benign and not load_found and not verified:
            outcome = "benign"
        elif not load_found and not _equal(loaded, want):
            outcome = "silent"
            failures.append(f"{where}: loaded other values without an error")
        else:
            outcome = "undetected"
            failures.append(f"{where}: verify found it: {verified}, load found it: {load_found}")
        counts[(kind, outcome)] += 1
    print(report("one process", counts))
    assert ckptfmt.verify(root).healthy
    assert not failures, f"seed {SEED}: " + "; ".join(failures[:10])
    assert sum(counts.values()) == SINGLE_FLIPS


def test_sweep_level1_xor(tmp_path: Path) -> None:
    print(f"\nsweep seed {SEED} (set CKPTFMT_SWEEP_SEED to repeat)")
    rng = random.Random(f"{SEED}-level1")
    base = tmp_path / "l1"
    save_level1(base, "xor", ["n0", "n1"], set_size=2)
    template = str(base / "{node}")
    healthy = {k: v[0] for k, v in tree(base).items()}
    manifest = ckptfmt.open(base / "n0").manifest
    by_kind: dict[str, list[Region]] = {}
    for node in ("n0", "n1"):
        for reg in regions(base, manifest, f"{node}/"):
            by_kind.setdefault(reg[0], []).append(reg)
    assert set(by_kind) == set(KINDS)
    counts: Counter[tuple[str, str]] = Counter()
    failures: list[str] = []
    for i in range(LEVEL1_FLIPS):
        kind, rel, bit = pick(rng, by_kind)
        path = base / rel
        original = flip_bit(path, bit)
        where = f"flip {i}: {kind} {rel} bit {bit}"
        found = _detects(lambda: ckptfmt.verify(template).healthy)
        benign = rel.endswith(".json") and same_document(original, path.read_bytes())
        try:
            rebuild(template, write=WriteOptions(fsync=False))
            repaired = {k: v[0] for k, v in tree(base).items()} == healthy
            error = None
        except CkptError as exc:
            repaired, error = False, exc
        if found and repaired:
            outcome = "repaired"
        elif benign and not found:
            outcome = "benign"
            repaired = True  # parses the same; rebuild may leave it (it rewrote it here)
        else:
            outcome = "failed"
            failures.append(f"{where}: found {found}, repaired {repaired}, error {error}")
        counts[(kind, outcome)] += 1
        if {k: v[0] for k, v in tree(base).items()} != healthy:  # put it back for the next
            shutil.rmtree(base)
            for k, blob in healthy.items():
                (base / k).parent.mkdir(parents=True, exist_ok=True)
                (base / k).write_bytes(blob)
    print(report("level 1, xor over 2 nodes", counts))
    assert ckptfmt.verify(template).healthy
    assert not failures, f"seed {SEED}: " + "; ".join(failures[:10])
    assert sum(counts.values()) == LEVEL1_FLIPS


def test_the_sweep_has_enough_flips() -> None:
    assert SINGLE_FLIPS + LEVEL1_FLIPS >= 1000 or "CKPTFMT_SWEEP_FLIPS" in os.environ


def _detects(healthy: Callable[[], bool]) -> bool:
    """Whether a check finds the damage: a report that is not healthy, or a CkptError."""
    try:
        return not healthy()
    except CkptError:
        return True


def _equal(got: Any, want: Any) -> bool:
    try:
        assert_state_equal(got, want)
    except AssertionError:
        return False
    return True
