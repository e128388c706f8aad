"""What each save of a ``CheckpointManager`` cost, as the manager reports it.

A training loop judges a checkpointer by two numbers: how long ``save`` blocked it, and how long
the background part ran beside it. :class:`SaveReport` holds those and what the save wrote, so a
user can send them to a metrics logger (``CheckpointManager(on_save=...)``) instead of finding
out from step times that a save waited for the previous one.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ckptfmt.manifest.model import Manifest
from ckptfmt.redundancy.record import record_of

log = logging.getLogger("ckptfmt")


@dataclass
class SaveReport:
    """One save, on this rank.

    ``blocked_s``: how long ``save`` kept the caller (``waited_s`` of it waiting for the
    previous save or flush still in flight, the rest copying the state); ``background_s``: the
    background part (write, encode, commit, flush, retention); ``level``: the level the step
    was committed on (1, or 3 when there is no level 1 or the save fell back to it; None when
    it failed); ``fell_back``: level 1 failed and the step was written to level 3 instead;
    ``bytes_written``: this rank's data bytes by level (``"1"``, ``"3"``); ``parity_bytes``:
    this rank's parity file (``parity_linked``: of them, the bytes hard-linked from the previous
    step's parity file instead of encoded, when nothing of the rank's redundancy set changed);
    ``flushed``: the step reached level 3 in this save;
    ``bytes_linked``: an incremental manager's data bytes by level that were hard-linked from
    the previous step instead of written, or on a bucket level 3 copied inside the store
    instead of uploaded (``bytes_written`` then counts only what was written or uploaded);
    ``link_refused``: files written because the file system refused a link; ``error``: why
    it failed (or why it fell back); ``skipped``: the save was taken but not made, on every
    rank (``ManagerSettings.when_busy="skip"``: ``error`` says why), nothing written;
    ``made_room``: by level (``"1"``, ``"3"``), the older steps removed because the level was
    full when this save or its flush wrote there (``docs/levels.md``, "When a level fills
    up"), the same on every rank: the steps a full level gave up, counted where a metrics
    logger sees them, besides the warning the loop gets."""

    step: int
    blocked_s: float = 0.0
    waited_s: float = 0.0
    staged_bytes: int = 0
    background_s: float = 0.0
    level: int | None = None
    fell_back: bool = False
    flushed: bool = False
    redundancy: str | None = None
    bytes_written: dict[str, int] = field(default_factory=dict)
    parity_bytes: int = 0
    parity_linked: int = 0
    bytes_linked: dict[str, int] = field(default_factory=dict)
    link_refused: int = 0
    error: str | None = None
    flush_error: str | None = None
    skipped: bool = False
    made_room: dict[str, list[int]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Skips:
    """The saves a manager skipped (``when_busy="skip"``): counted, their newest steps kept,
    and each logged as a warning, at most one line per ``every_s`` seconds (a loop that saves
    every step and skips every other save would otherwise log every step); the line says how
    many were skipped since the last one. Written by the saver thread (and the training thread
    for a save skipped at its call), read by anyone."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self.count = 0
        self.steps: list[int] = []  # the newest 100 skipped steps, oldest first
        self._lock = threading.Lock()
        self._logged_at = float("-inf")
        self._unlogged = 0

    def note(self, step: int, why: str) -> None:
        """Count the skipped save of ``step`` and log it (rate-limited)."""
        with self._lock:
            self.count += 1
            self.steps = [*self.steps[-99:], step]
            self._unlogged += 1
            now = time.monotonic()
            if now - self._logged_at < self.every_s:
                return
            since, self._unlogged, self._logged_at = self._unlogged, 0, now
        log.warning(
            "save of step %s skipped (%s); %d save(s) skipped since the last such line, "
            "%d in all (ManagerSettings.when_busy='skip')",
            step,
            why,
            since,
            self.count,
        )


def data_bytes_of(manifest: Manifest, rank: int) -> int:
    """The bytes of the data files ``rank`` wrote for ``manifest``."""
    return sum(
        f.size for t in manifest.tensors() for r in t.regions if r.rank == rank for f in r.files
    )


def parity_bytes_of(manifest: Manifest, rank: int) -> int:
    """The size of ``rank``'s level-1 parity file (0 without redundancy)."""
    record = record_of(manifest)
    if record is None:
        return 0
    rset, j = record.set_of(rank)
    return int(rset.parity[j].size)
