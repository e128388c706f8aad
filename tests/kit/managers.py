"""``CheckpointManager`` factories for tests that run the manager in this process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptfmt import CheckpointManager, ExitPolicy, WriteOptions

NO_FSYNC = WriteOptions(fsync=False)  # a test's files need not survive a power cut
NO_EXIT_HOOKS = ExitPolicy(flush=False, sigterm=False)  # nothing runs at the test run's exit


def make_manager(
    tmp_path: Path, *, local: str | None = "l1", shared: str | None = "l3", **kw: Any
) -> CheckpointManager:
    """A manager with level 1 in ``tmp_path/<local>`` and level 3 in ``tmp_path/<shared>``
    (None: no such level) that writes without fsync; ``kw`` goes to the manager as it is and
    wins over these defaults (``local_dir=``, ``write=`` included)."""
    opts: dict[str, Any] = {
        "local_dir": None if local is None else tmp_path / local,
        "shared_dir": None if shared is None else tmp_path / shared,
        "write": NO_FSYNC,
    }
    opts.update(kw)
    return CheckpointManager(**opts)


def node_manager(tmp_path: Path, *, shared: str | None = "l3", **kw: Any) -> CheckpointManager:
    """:func:`make_manager` on one simulated node ``n0`` (level 1 in ``tmp_path/l1/{node}``)
    whose exit hooks are off: a test's manager neither flushes nor takes SIGTERM when the test
    run ends."""
    opts: dict[str, Any] = {"local": "l1/{node}", "node": "n0", "at_exit": NO_EXIT_HOOKS}
    opts.update(kw)
    return make_manager(tmp_path, shared=shared, **opts)
