"""Step directories under a checkpoint root (``spec/PROTOCOL.md``, "Step directories").

A root holds one committed checkpoint per step, named ``step-`` and the step zero-padded to ten
digits (more digits past 9,999,999,999). The latest complete checkpoint is the highest step whose
directory holds a manifest that parses; dot-names (staging and replaced directories) are never
candidates. Two saves of the same step (a job restarted from an older step) are told apart by the
manifest's ``save_id``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

from ckptfmt.errors import UsageError

STEP_NAME = re.compile(r"^step-(\d{10,})$")


_LOOSE_STEP = re.compile(r"^(?:step-)?(\d+)$")
_LOOSE_NAME = re.compile(r"^step-(\d+)$")


def parse_step(step: int | str) -> int:
    """A step given as a number or as a step directory name: ``100``, ``"100"``,
    ``"step-100"`` and ``"step-0000000100"`` are all step 100."""
    if isinstance(step, bool):
        raise UsageError(f"not a step: {step!r}")
    if isinstance(step, int):
        if step < 0:
            raise UsageError(f"a step is >= 0, got {step}")
        return step
    m = _LOOSE_STEP.match(str(step).strip().rstrip("/").rsplit("/", 1)[-1])
    if not m:
        raise UsageError(f"not a step: {step!r} (a number, or a name like 'step-0000000100')")
    return int(m[1])


class StepRef(NamedTuple):
    """A committed checkpoint found under a root: its step and its directory (a tuple, so
    ``step, path = ckptfmt.latest(root)`` unpacks it)."""

    step: int
    path: Path


def step_dir_name(step: int) -> str:
    return f"step-{step:010d}"


def list_step_dirs(root: Path, *, loose: bool = False) -> list[tuple[int, Path]]:
    """``(step, path)`` of every step-named directory under ``root``, ascending (committed or
    not).

    ``loose``: also directories named ``step-<digits>`` without the padding (``step-100``,
    what a user names a checkpoint saved by hand, as the README's examples do), for a step no
    directory of the canonical name holds (``spec/PROTOCOL.md`` §4). What searches for
    checkpoints to read takes them (``latest``, ``ckptfmt list``); a manager's own roots hold
    only canonical names, which are all its retention and restore look at."""
    if not root.is_dir():
        return []
    canonical: dict[int, Path] = {}
    other: dict[int, Path] = {}
    for child in root.iterdir():
        m = STEP_NAME.match(child.name) or (_LOOSE_NAME.match(child.name) if loose else None)
        if not m or not child.is_dir():
            continue
        step = int(m[1])
        if step_dir_name(step) == child.name:
            canonical[step] = child
        elif step not in other or child.name < other[step].name:  # step-100 before step-0100
            other[step] = child
    return sorted({**other, **canonical}.items())
