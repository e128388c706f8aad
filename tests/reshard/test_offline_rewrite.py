"""The offline rewrite for another number of ranks (``ckptfmt.maintenance.reshard.reshard``, what
``ckptfmt reshard`` runs), in process.

The rewrite of checkpoints saved by N thread-ranks is verified and bitwise equal for several
(N, M) and row splits (uneven ones included, whose grids cut source chunks); its ownership is
that of an M-rank save (the writer of each row block is the rank holding it); source chunks
that several new shards need are read once; a damaged or stale (swapped) source file is found —
also when it is read in parts, through its data CRC once all its chunks are in — and then
nothing is committed and no staging directory is left; per-rank entries follow the rules.
"""

from __future__ import annotations

import shutil
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit.cli import run_cli
from kit.faults import flip_bit
from kit.files import leftovers
from kit.reshard import ROWS, check_resharded, full_state, per_rank_extra, rows_of, save

from ckptfmt import ReadOptions, WriteOptions
from ckptfmt.container.reader import read_manifest
from ckptfmt.errors import ChecksumError, DamagedError, DestinationExistsError, PerRankError
from ckptfmt.maintenance.reshard import reshard

GRID = {"chunk_bytes": 1 << 10, "shard_bytes": 8 << 10, "fsync": False}
WRITE = WriteOptions(**GRID)  # reshard takes the save's options object


def check_equal(dst: Path) -> dict[str, Any]:
    got = check_resharded(dst)
    assert got["empty"].shape == (0, 4)
    assert got["group"] == {}
    return got


@pytest.mark.parametrize(("n", "m"), [(4, 2), (4, 3), (2, 4), (1, 4), (3, 2), (3, 1)])
def test_rewrite_is_verified_bitwise_and_owned_as_an_m_rank_save(
    tmp_path: Path, n: int, m: int
) -> None:
    src = save(tmp_path, n, 3)
    dst = tmp_path / "dst"
    nodes = [f"n{k * 2 // m}" for k in range(m)]
    rep = reshard(src, dst, m, nodes=nodes, rows=["shards/*"], write=WRITE)
    check_equal(dst)
    assert (rep.saved_ranks, rep.ranks, rep.rows) == (n, m, [f"shards/{x}" for x in sorted(ROWS)])
    man = read_manifest(dst)
    assert man.world_size == m and [r.node for r in man.ranks] == nodes
    assert man.step == 1 and man.writer["resharded_from"]["world_size"] == n
    full = full_state()
    for t in man.tensors():
        if t.path.startswith("shards/"):  # each row block written by the rank that holds it
            for r in t.regions:
                start, count = rows_of(full[t.name[1]].shape[0], r.rank, m)
                assert start <= r.offset[0] and r.offset[0] + r.shape[0] <= start + count
    assert rep.bytes_read <= 1.5 * rep.data_bytes + 4096, "source chunks read more than once"
    assert leftovers(tmp_path) == []


def test_rewrite_from_level1_copies(tmp_path: Path) -> None:
    """SRC as the level-1 copies of the saved nodes (a {node} template): each file is read from
    its writer's node's directory; a node's copy missing is named, nothing is written."""
    src = save(tmp_path, 4, 1)
    reshard(str(src), tmp_path / "dst", 3, rows=["shards/*"], write=WRITE)
    check_equal(tmp_path / "dst")
    shutil.rmtree(tmp_path / "l1" / "n1")
    with pytest.raises(DamagedError) as exc:
        reshard(str(src), tmp_path / "dst2", 3, rows=["shards/*"], write=WRITE)
    assert "missing" in str(exc.value)
    assert not (tmp_path / "dst2").exists() and leftovers(tmp_path) == []


def test_replicated_only_rewrite_spreads_the_writing(tmp_path: Path) -> None:
    src = save(tmp_path, 4, 3)
    reshard(src, tmp_path / "dst", 2, write=WRITE)
    man = read_manifest(tmp_path / "dst")
    writers = {r.rank for t in man.tensors() for r in t.regions}
    assert writers == {0, 1}
    check_equal(tmp_path / "dst")


def test_destination_is_refused_unless_overwrite(tmp_path: Path) -> None:
    src = save(tmp_path, 2, 3)
    reshard(src, tmp_path / "dst", 2, write=WRITE)
    with pytest.raises(DestinationExistsError):
        reshard(src, tmp_path / "dst", 3, write=WRITE)
    reshard(src, tmp_path / "dst", 3, write=replace(WRITE, overwrite=True))
    assert read_manifest(tmp_path / "dst").world_size == 3


def test_damaged_source_commits_nothing(tmp_path: Path) -> None:
    src = save(tmp_path, 2, 3)
    man = read_manifest(src)
    t = next(e for e in man.tensors() if e.path == "shards/w10")
    flip_bit(src / t.regions[0].files[0].path, 0)
    with pytest.raises(DamagedError) as exc:
        reshard(src, tmp_path / "dst", 3, rows=["shards/*"], write=WRITE)
    assert "shards/w10" in str(exc.value)
    assert not (tmp_path / "dst").exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("rows", [[], ["model/rep"]], ids=["whole-files", "in-parts"])
def test_a_stale_swapped_source_file_is_found(tmp_path: Path, rows: list[str]) -> None:
    """Two shard files of one tensor, equal in size, swapped: every chunk and index CRC is
    valid, only the file's data CRC tells. Read whole (same grid) or in parts (1-row cells of
    a 3-way row split cut the 2-row source chunks), the rewrite finds it."""
    src = save(tmp_path, 1, 3)
    t = next(e for e in read_manifest(src).tensors() if e.path == "model/rep")
    a, b = (src / f.path for f in t.regions[0].files[:2])
    assert a.stat().st_size == b.stat().st_size
    tmp = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(tmp)
    with pytest.raises(ChecksumError) as exc:
        reshard(src, tmp_path / "dst", 3, rows=rows, write=WRITE)
    assert exc.value.what == "data (all chunks)" and "model/rep" in str(exc.value)
    assert not (tmp_path / "dst").exists() and leftovers(tmp_path) == []


def test_per_rank_entries_follow_the_rules(tmp_path: Path) -> None:
    src = save(tmp_path, 4, 3, per_rank_extra)
    with pytest.raises(PerRankError) as exc:
        reshard(src, tmp_path / "dst", 2, write=WRITE)
    assert set(exc.value.entries) == {"rng", "loader"}
    assert not (tmp_path / "dst").exists()
    read = ReadOptions(rank_map={3: 0, 1: 1}, per_rank="drop")
    rep = reshard(src, tmp_path / "dst", 2, read=read, write=WRITE)
    assert rep.warning is not None and "saved rank(s) 0, 2 are not carried over" in rep.warning
    got = check_equal(tmp_path / "dst")
    assert np.array_equal(got["rng"], np.stack([per_rank_extra(3)["rng"].value,
                                                per_rank_extra(1)["rng"].value]))  # fmt: skip
    assert got["loader"] == [per_rank_extra(3)["loader"].value, per_rank_extra(1)["loader"].value]
    shutil.rmtree(tmp_path / "dst")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rewrite reports, it does not warn
        read = ReadOptions(rank_map="identity", per_rank="drop")
        rep = reshard(src, tmp_path / "dst", 6, read=read, write=WRITE)
    assert rep.dropped == ["rng", "loader"] and "current rank(s) 4, 5 get none" in (
        rep.warning or ""
    )
    got = check_equal(tmp_path / "dst")
    assert "rng" not in got and "loader" not in got


# --- the command line -----------------------------------------------------------------------------


def test_cli_exit_statuses(tmp_path: Path) -> None:
    src = save(tmp_path, 2, 3, per_rank_extra)
    dst = str(tmp_path / "dst")
    grid = ["--chunk-bytes", "1024", "--shard-bytes", "8192", "--no-fsync"]
    for bad in (
        ["--ranks", "2", "--nodes", "a,b,c"],  # three names for two ranks
        ["--ranks", "2", "--nodes", "a,b", "--ranks-per-node", "1"],
        ["--ranks", "2", "--m", "2"],  # --m without --redundancy
        ["--ranks", "2", "--rank-map", "0-1"],
        ["--ranks", "2", "--rank-map", "0:0,1:0"],  # not injective
        ["--ranks", "0"],
        ["--ranks", "3"],  # per-rank entries, no map: an explicit usage error
        ["--ranks", "3", "--nodes", "a,b,a/b", "--rank-map", "identity", "--drop-per-rank"],
    ):
        result = run_cli("reshard", str(src), dst, *bad, *grid)
        assert result.exit_code == 2, (bad, result.output)
        assert "Traceback" not in result.output
    assert not (tmp_path / "dst").exists()
    assert run_cli("reshard", str(tmp_path / "nothing"), dst, "--ranks", "2").exit_code == 3
    ok = run_cli("reshard", str(src), dst, "--ranks", "3", "--rank-map", "identity",
                 "--drop-per-rank", "--rows", "shards/*", *grid)  # fmt: skip
    assert ok.exit_code == 0, ok.output
    assert "2 rank(s) -> 3 rank(s)" in ok.output
    assert "Warning: per-rank entries" in ok.output and "current rank(s) 2 get none" in ok.output
    assert run_cli("verify", dst).exit_code == 0
    again = run_cli("reshard", str(src), dst, "--ranks", "2", *grid)
    assert again.exit_code == 2 and "already" in again.output  # refuses to overwrite
    flip_bit(src / read_manifest(src).tensors()[0].regions[0].files[0].path, 0)
    damaged = run_cli("reshard", str(src), str(tmp_path / "dst2"), "--ranks", "2",
                      "--rank-map", "identity", *grid)  # fmt: skip
    assert damaged.exit_code == 1, damaged.output
    assert not (tmp_path / "dst2").exists()
