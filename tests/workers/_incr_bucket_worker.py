"""A rank of an incremental collective save to a bucket: ``_incr_bucket_worker.py BASE URL OUT``.

Run under ``mpiexec -n N ... python -m mpi4py`` by ``tests/objects/test_incremental_bucket.py``
with the AWS environment of the tests' S3 proxy and an empty ``TMPDIR``. Every rank saves step 0
to ``BASE`` (``ckptfmt.parallel.save_to_bucket``, content hashes recorded), then step 1 to ``URL``
incrementally against ``BASE``: the rows of rank 0 and the replicated table are unchanged, the
rows of every other rank change. Each rank then loads ``URL`` whole and compares every byte with
step 1's state, and writes ``OUT/rank<r>.json``: whether it matched, its save ids, what it found
in ``TMPDIR`` after the saves (and any temporary directory they made), and its peak resident memory.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from kit.worker import make_comm

ROWS, COLS = 64, 512  # float32: 128 KiB of rows, 16 shard files of 8 KiB


def full(step: int, size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    w = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    per = ROWS // size
    w[per:] += np.float32(step)  # every rank's rows but rank 0's change at step 1
    return {"w": w, "table": rng.standard_normal((128, 64)).astype(np.float32)}


def state(step: int, rank: int, size: int) -> dict[str, Any]:
    from ckptfmt import Shard

    g = full(step, size)
    per = ROWS // size
    return {
        "w": Shard(g["w"][rank * per : (rank + 1) * per], (rank * per, 0), g["w"].shape),
        "table": g["table"],
        "step": step,
    }


def main() -> None:
    import ckptfmt
    from ckptfmt import WriteOptions
    from ckptfmt.parallel import save_to_bucket

    made: list[str] = []  # every temporary directory made by the saves (noted, and made)
    original = tempfile.mkdtemp

    def noted(*args: Any, **kwargs: Any) -> str:
        path = original(*args, **kwargs)
        made.append(path)
        return path

    tempfile.mkdtemp = noted  # type: ignore[assignment]
    base, url, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    comm = make_comm("mpi")
    rank, size = comm.rank, comm.size
    write = WriteOptions(fsync=False, chunk_bytes=4 << 10, shard_bytes=8 << 10, content_hash=True)
    first = save_to_bucket(comm, state(0, rank, size), base, step=0, node="host", write=write)
    second = save_to_bucket(
        comm, state(1, rank, size), url, step=1, node="host", write=write, base=base
    )
    tmp = sorted(os.listdir(os.environ["TMPDIR"])) + made
    got = ckptfmt.load(url)
    want = full(1, size)
    same = all(got[k].tobytes() == want[k].tobytes() for k in want) and got["step"] == 1
    doc = {
        "same": bool(same),
        "save_ids": [first.save_id, second.save_id],
        "tmp": tmp,
        "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(doc))
    comm.barrier()


if __name__ == "__main__":
    main()
