"""The scratch of a load's reads (``load_read.ScratchPool``): the chunks a read cannot put
straight into their destination (a box that cuts them) are read into buffers allocated before
the load's allocation vote, one per read thread; these tests check what they hold and when."""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptfmt
from ckptfmt import ReadOptions, WriteOptions
from ckptfmt.parallel.collective import load as load_module
from ckptfmt.parallel.collective.load import load_collective
from ckptfmt.transport.comm import SingleComm

W = np.arange(1024 * 1024, dtype=np.float32).reshape(1024, 1024)  # 4 MiB
GRID = WriteOptions(chunk_bytes=64 << 10, shard_bytes=1 << 20, fsync=False)  # 4 files of 16


@pytest.mark.parametrize("threads", [1, 4])
def test_the_scratch_is_released_once_the_reads_are_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """A column of a row-chunked tensor: every chunk is read into scratch (1 MiB a file, one
    buffer per read thread) and one element of each row copied out. Once the reads are done
    that scratch is freed: it is not held through the exchanges that follow (where the
    destination arrays fill up with what peers send), so it adds nothing to the load's peak
    beyond its reads. The column lands bit for bit."""
    path = tmp_path / "ckpt"
    ckptfmt.save({"w": W}, path, write=GRID)
    held: list[int] = []
    real = load_module.transfer

    def transfer(*args: Any) -> None:
        held.append(tracemalloc.get_traced_memory()[0])
        real(*args)

    monkeypatch.setattr(load_module, "transfer", transfer)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        got, _ = load_collective(
            SingleComm(), path, {"w": ((0, 5), (1024, 1))}, read=ReadOptions(threads=threads)
        )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(got["w"], W[:, 5:6])
    assert peak - base >= min(threads, 4) << 20  # the scratch was there, during the reads
    assert held[0] - base < 512 << 10, (held, base)  # and is gone before the exchanges
