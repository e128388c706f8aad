"""The writer threads kept from save to save (``storage/pools.py``) and how a save's file
writes use them (``format.shard_io.run_jobs``): a failed write returns only once every other
write of the save has stopped, because the save's draft is removed and its buffers reused
right after, while the pool lives on."""

from __future__ import annotations

import errno
import os
import select
import threading
import time
from typing import Any

import pytest

from ckptfmt.format.shard_io import run_jobs
from ckptfmt.storage.pools import writer_pool


class Job:
    """A stand-in for one shard file's write: ``run`` sleeps, then fails or returns a ref."""

    def __init__(self, delay: float, fail: bool, done: list[str], name: str) -> None:
        self.delay, self.fail, self.done, self.name = delay, fail, done, name

    def nbytes(self) -> int:
        return 1

    def run(self, fsync: bool, into: Any, incremental: Any) -> Any:
        time.sleep(self.delay)
        if self.fail:
            raise OSError(errno.ENOSPC, "full")
        self.done.append(self.name)
        return type("Ref", (), {"size": 1})()


def test_a_failed_write_waits_for_the_running_ones() -> None:
    done: list[str] = []
    pool = writer_pool(2)
    jobs = [Job(0.01, True, done, "fails"), Job(0.4, False, done, "slow")]
    jobs += [Job(0.0, False, done, f"queued{i}") for i in range(20)]
    with pytest.raises(OSError):
        run_jobs(jobs, pool)  # type: ignore[arg-type]
    assert "slow" in done  # it was running: it finished before the error came back
    after = list(done)
    time.sleep(0.1)
    assert done == after  # nothing of that save runs any more
    assert len(run_jobs([Job(0, False, [], "a"), Job(0, False, [], "b")], pool)) == 2  # type: ignore[list-item]


def test_one_pool_per_size_and_process() -> None:
    assert writer_pool(2) is writer_pool(2)
    assert writer_pool(3) is not writer_pool(2)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child's pool is its own: the parent's threads are not in it
        ok = writer_pool(2).submit(threading.get_ident).result(timeout=10) is not None
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.close(w)
    ready, _, _ = select.select([r], [], [], 60)
    if not ready:
        os.kill(pid, 9)
    os.waitpid(pid, 0)
    assert ready and os.read(r, 1) == b"1"
