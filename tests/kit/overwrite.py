"""One overwrite of a checkpoint by each route a user's overwrite takes, for the crash tests
(``tests/objects/test_overwrite_crash.py``, ``tests/storage/test_overwrite_crash_fs.py``) and
their worker (``tests/workers/_overwrite_worker.py``), which runs it in a process of its own so
that it can be killed part way.

Routes: ``fs``, the collective save behind ``ckptfmt.save`` (``save_collective`` on one rank:
the public ``save`` takes no crash hook) to a directory; ``url``, ``ckptfmt.save`` to a URL;
``collective``, ``ckptfmt.parallel.save_to_bucket`` on one rank; ``flush``, a level-1 copy of
step :data:`STEP` saved locally, then the manager's flush of it (``flush_to_bucket``) to a
level-3 root in a bucket (the checkpoint is then ``<root>/step-0000000007``).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np

STEP = 7
WRITE: dict[str, Any] = {"chunk_bytes": 2048, "shard_bytes": 8192, "fsync": False}
BUCKET_ROUTES = ("url", "collective", "flush")


def state(seed: int) -> dict[str, Any]:
    """A state of several shard files per tensor, so that a save is many objects."""
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((48, 100)).astype(np.float32),
        "b": rng.integers(-(2**40), 2**40, 700, dtype=np.int64),
        "seed": seed,
    }


def checkpoint_of(route: str, target: str) -> str:
    """Where the route's checkpoint is: the target itself, or the step under a flush's root."""
    return f"{target}/step-{STEP:010d}" if route == "flush" else target


def save(
    route: str,
    target: str,
    seed: int,
    *,
    overwrite: bool = True,
    fault: Any = None,
    comm: Any = None,
) -> None:
    """Save :func:`state` of ``seed`` at ``target`` by ``route`` (``fault``: the ``fs`` route's
    crash hook; ``comm``: the ``collective`` route's communicator, one rank by default, every
    rank saving the same state)."""
    import ckptfmt
    from ckptfmt import WriteOptions
    from ckptfmt.transport.comm import SingleComm

    write = WriteOptions(overwrite=overwrite, **WRITE)
    if route == "fs":
        from ckptfmt.parallel.collective.save import save_collective

        save_collective(
            SingleComm(), state(seed), target, step=None, node="n0", write=write, fault=fault
        )
    elif route == "url":
        ckptfmt.save(state(seed), target, write=write)
    elif route == "collective":
        from ckptfmt.parallel import save_to_bucket

        comm = comm or SingleComm()
        node = f"n{comm.rank}"
        save_to_bucket(comm, state(seed), target, step=None, node=node, write=write)
    elif route == "flush":
        from ckptfmt.parallel.levels.bucket import flush_to_bucket
        from ckptfmt.storage.objects import Bucket

        with tempfile.TemporaryDirectory(prefix="ckptfmt-l1-") as tmp:
            local = Path(tmp) / f"step-{STEP:010d}"
            manifest = ckptfmt.save(state(seed), local, step=STEP, write=WriteOptions(**WRITE))
            flush_to_bucket(SingleComm(), manifest, local, Bucket.at(target))
    else:
        raise ValueError(f"unknown route {route!r}")
