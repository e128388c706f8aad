"""The error boundary between ranks: one per collective operation, one vote per phase.

A collective operation (save, flush, load, rebuild) runs as phases of local work separated by
votes. Every rank runs each phase's local work under :meth:`Boundary.guard`, which catches *any*
exception (a ``ValueError`` from user code, a ``MemoryError`` while copying, an ``OSError`` from a
full disk, a ``CkptError``) and keeps the first one as this rank's :class:`RankFailure`. The rank
does not leave: it goes on to the phase's vote (:meth:`Boundary.vote`), where every rank learns
every rank's failure, the staging directories are cleaned up, and every rank raises the same
typed error (:class:`SaveFailedError`, :class:`LoadFailedError`, ...) carrying each failing
rank's error type, message, phase and structured fields.

Each vote also carries the operation, its step, its phase and a sequence number: ranks that are
not in the same collective call (one rank saving step 8 while the others save step 7, or one
rank in ``restore`` while the others save) are named as failures instead of pairing their
messages up. Why a vote per phase and not one at the end: a rank that failed to create its
staging directory must not leave the others writing into theirs, and no node may rename its
step into place before every node has staged its manifest (the commit is atomic across nodes).

Who calls what: every rank of the communicator calls :meth:`Boundary.vote` for the same phases in
the same order; :meth:`Boundary.guard` is local.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ckptfmt.errors import CollectiveError, FailureKind, RankFailure, SaveFailedError
from ckptfmt.storage import commit
from ckptfmt.transport.comm import Comm

log = logging.getLogger("ckptfmt")

Cleanup = Path | Callable[[], None] | None


class Boundary:
    """One rank's side of one collective operation: its first failure, and the votes.

    ``operation`` (``"save"``, ``"flush"``, ``"load"``, ``"rebuild"``) and ``step`` are carried
    by every vote; ``error`` is the class raised when a vote finds a failure; ``seq`` is the
    caller's sequence number of the operation (the manager's call count), checked like the
    operation and the step. ``failure``, when given, is this rank's failure before the operation
    began (staging the state failed): the rank then takes part in the first vote only, to fail
    the operation everywhere; its kind is ``"state"`` whatever its type (an ``OSError`` from the
    caller's ``ready`` hook is not a storage failure)."""

    def __init__(
        self,
        comm: Comm,
        operation: str,
        step: int | None,
        *,
        error: type[CollectiveError] = SaveFailedError,
        seq: int | None = None,
        failure: BaseException | None = None,
        failure_phase: str = "copy",
    ) -> None:
        self.comm = comm
        self.operation = operation
        self.step = step
        self.error = error
        self.seq = seq
        self.failure: RankFailure | None = None
        self.cause: BaseException | None = None
        if failure is not None:  # whatever its type, nothing of the operation reached storage
            self._record(failure, failure_phase, "state")

    @property
    def failed(self) -> bool:
        """Whether this rank has failed in this operation (so far)."""
        return self.failure is not None

    def _record(self, exc: BaseException, phase: str, kind: FailureKind | None = None) -> None:
        if self.failure is None:
            self.failure, self.cause = RankFailure.of(exc, phase, kind), exc

    @contextmanager
    def guard(self, phase: str) -> Iterator[None]:
        """Local: run the block; any ``Exception`` escaping it becomes this rank's failure (the
        first one is kept) instead of leaving the collective. The block runs even when the rank
        has already failed; callers test :attr:`failed` where that matters."""
        try:
            yield
        except Exception as exc:
            self._record(exc, phase)

    def fail(self, exc: BaseException, phase: str) -> None:
        """Local: record ``exc`` as this rank's failure (where a ``with`` block does not fit)."""
        self._record(exc, phase)

    def vote(self, phase: str, payload: Any = None, cleanup: Cleanup = None) -> list[Any]:
        """Collective (every rank, same phases in the same order): share each rank's failure
        and ``payload`` (JSON), and check that every rank is in the same operation, step, phase
        and sequence number. On any failure, run ``cleanup`` (a staging directory to remove, or
        a callable) and raise :attr:`error` on every rank; else return the payloads by rank."""
        key = [self.operation, self.step, self.seq, phase]
        doc = {
            "key": key,
            "failure": None if self.failure is None else self.failure.to_json(),
            "payload": None if self.failure is not None else payload,
        }
        gathered = self.comm.allgather_json(doc)
        failures: dict[int, RankFailure] = {}
        keys = Counter(tuple(g["key"]) for g in gathered)
        expected = max(keys.items(), key=lambda kv: (kv[1], kv[0] == tuple(key)))[0]
        for rank, g in enumerate(gathered):
            if g["failure"] is not None:
                failures[rank] = RankFailure.from_json(g["failure"])
            elif tuple(g["key"]) != expected:
                failures[rank] = RankFailure(
                    "OutOfStepError",
                    f"is in {_where(g['key'])} while the others are in {_where(expected)}",
                    phase,
                    kind="collective",
                )
        if failures:
            self._cleanup(cleanup)
            raise self.error(failures, self.cause, operation=self.operation, step=self.step)
        return [g["payload"] for g in gathered]

    def _cleanup(self, cleanup: Cleanup) -> None:
        try:
            if isinstance(cleanup, Path):
                commit.abort(cleanup)
            elif cleanup is not None:
                cleanup()
        except Exception as exc:  # cleaning up must not hide the failure being reported
            log.warning(
                "rank %s: cleanup after a failed %s: %s",
                self.comm.rank,
                self.operation,
                exc,
            )


def _where(key: Any) -> str:
    op, step, seq, phase = key
    return f"{op} of step {step} (phase {phase}, call {seq})"
