"""A checkpoint of many tensors in a bucket has as many small ``zarr.json`` objects: they are
read (a load, a collective load, verify) and put (a flush) several at once, and verify reads
the data objects several at once too, each small one in one GET, not one round trip after
another, and a flush spreads them over the ranks, each checked against the manifest before it
is put. Seen at the fault proxy with a round trip added to every request (a local server
answers in a millisecond, which would hide requests made one at a time): the most requests for
documents in the proxy at once, and each rank's PUTs. Thread ranks, the tests' real S3 server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit.arrays import assert_state_equal
from kit.s3 import S3
from kit.s3_proxy import S3Proxy

import ckptfmt
from ckptfmt import Shard, WriteOptions
from ckptfmt.container.metadata import ManifestMeta
from ckptfmt.errors import SaveFailedError
from ckptfmt.format.zarr_meta import documents
from ckptfmt.parallel.collective.load import load_collective
from ckptfmt.parallel.collective.save import save_collective
from ckptfmt.parallel.levels.bucket import flush_to_bucket
from ckptfmt.storage.objects import Bucket
from ckptfmt.storage.objects.commit import read_commit
from ckptfmt.storage.objects.source import ObjectInside
from ckptfmt.storage.steps import step_dir_name
from ckptfmt.transport.threads import run_threads

ROUND_TRIP = 0.02  # seconds a request waits at the proxy: a remote store's, roughly
LAYERS = 12  # 24 tensors, 12 groups and the root: 37 documents
ROWS = 64


def _layers(rank: int | None = None) -> dict[str, Any]:
    """The model: each layer's ``w`` split by rows between 2 ranks (``rank``), or whole."""
    rng = np.random.default_rng(11)
    out: dict[str, Any] = {}
    for i in range(LAYERS):
        w = rng.standard_normal((ROWS, 32)).astype(np.float32)
        b = rng.standard_normal(32).astype(np.float32)
        if rank is not None:
            half = ROWS // 2
            w = Shard(w[rank * half : (rank + 1) * half], (rank * half, 0), w.shape)  # type: ignore[assignment]
        out[f"layer{i}"] = {"w": w, "b": b}
    return out


def test_a_load_reads_the_documents_several_at_once(s3: S3, s3_proxy: S3Proxy) -> None:
    url = f"{s3.url}/many"
    ckptfmt.save(_layers(), url)
    s3_proxy.delay(ROUND_TRIP)
    assert_state_equal(ckptfmt.load(url), _layers())
    assert s3_proxy.peak_in_flight("GET", "zarr.json") >= 2


def test_verify_reads_the_documents_and_the_data_objects_several_at_once(
    s3: S3, s3_proxy: S3Proxy
) -> None:
    url = f"{s3.url}/many"
    ckptfmt.save(_layers(), url)
    s3_proxy.delay(ROUND_TRIP)
    start = len(s3_proxy.seen)
    report = ckptfmt.verify(url)
    assert not report.problems and report.files_checked == 2 * LAYERS, report
    data_gets = [p for m, p in s3_proxy.seen[start:] if m == "GET" and "/c/" in p]
    assert len(data_gets) == 2 * LAYERS  # a small object in one GET, not its index and chunks
    assert s3_proxy.peak_in_flight("GET", "zarr.json") >= 2
    assert s3_proxy.peak_in_flight("GET", "/c/") >= 2


def _on_level1(comm: Any, tmp_path: Path) -> tuple[Any, Path]:
    """This thread rank's half saved to its node's level 1 (node ``n<rank>``) as step 1."""
    local = tmp_path / f"l1-{comm.rank}" / step_dir_name(1)
    manifest, _ = save_collective(
        comm,
        _layers(comm.rank),
        local,
        step=1,
        node=f"n{comm.rank}",
        group=f"node:n{comm.rank}",
        write=WriteOptions(fsync=False),
        meta=ManifestMeta(levels={"1": {}}),
    )
    return manifest, local


def _flushed(tmp_path: Path, url: str) -> tuple[list[int], list[Any]]:
    """Two thread ranks save their halves to level 1 and flush them to ``url``; each rank's
    PUT count and manifest."""

    def rank(comm: Any) -> tuple[int, Any]:
        manifest, local = _on_level1(comm, tmp_path)
        root = Bucket.at(url)
        flush_to_bucket(comm, manifest, local, root)
        return root.requests["PUT"], manifest

    puts, manifests = zip(*run_threads(2, rank))
    return list(puts), list(manifests)


def test_a_flush_puts_the_documents_several_at_once_from_every_rank(
    tmp_path: Path, s3: S3, s3_proxy: S3Proxy
) -> None:
    s3_proxy.delay(ROUND_TRIP)
    puts, manifests = _flushed(tmp_path, f"{s3.url}/run")
    m = manifests[0]
    docs = sorted(documents(m))
    data = [
        sum(1 for t in m.tensors() for r in t.regions if r.rank == k for _ in r.files)
        for k in (0, 1)
    ]
    # rank 1: its data files and every other document; rank 0: the rest, the manifest, the
    # commit object and the latest pointer
    assert puts[1] == data[1] + len(docs[1::2]), (puts, data, len(docs))
    assert puts[0] == data[0] + len(docs[0::2]) + 3, (puts, data, len(docs))
    assert s3_proxy.peak_in_flight("PUT", "zarr.json") >= 2
    commit = read_commit(Bucket.at(f"{s3.url}/run/{step_dir_name(1)}"))
    assert commit is not None
    assert {o.key for o in commit.objects} >= set(docs)

    # a collective load reads them several at once on each rank, the ranks sharing them
    s3_proxy.spans.clear()

    def load(comm: Any) -> Any:
        bucket = Bucket.at(f"{s3.url}/run/{step_dir_name(1)}")
        c = read_commit(bucket)
        assert c is not None
        src = ObjectInside(bucket, c)
        return load_collective(comm, src.root, None, 1, source=src)[0]

    for got in run_threads(2, load):
        assert_state_equal(got, _layers())
    assert s3_proxy.peak_in_flight("GET", "zarr.json") >= 3  # more than one per rank


def test_a_flush_refuses_a_damaged_document_on_level_1(tmp_path: Path, s3: S3) -> None:
    """A ``zarr.json`` changed on level 1 is not propagated: the flush fails on every rank
    naming it, and no commit object appears."""

    def damage(comm: Any) -> None:
        manifest, local = _on_level1(comm, tmp_path)
        doc = local / "layer3" / "w" / "zarr.json"  # each node's copy: whichever rank puts it
        doc.write_bytes(doc.read_bytes().replace(b'"float32"', b'"float64"'))
        with pytest.raises(SaveFailedError, match=r"layer3/w/zarr\.json"):
            flush_to_bucket(comm, manifest, local, Bucket.at(f"{s3.url}/run"))

    run_threads(2, damage)
    assert not [k for k in s3.keys("run/") if k.endswith("ckptfmt-commit.json")]
