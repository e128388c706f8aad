"""Step directories under a checkpoint root (``spec/FORMAT.md``, "Step directories").

A root holds one committed checkpoint per step, named ``step-`` and the step zero-padded to ten
digits (more digits past 9,999,999,999). The latest complete checkpoint is the highest step whose
directory holds a manifest that parses; dot-names (staging and replaced directories) are never
candidates. Two saves of the same step (a job restarted from an older step) are told apart by the
manifest's ``save_id``.
"""

from __future__ import annotations

import re
from pathlib import Path

from ckptfmt.errors import UsageError

STEP_NAME = re.compile(r"^step-(\d{10,})$")


_LOOSE_STEP = re.compile(r"^(?:step-)?(\d+)$")


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


def step_dir_name(step: int) -> str:
    return f"step-{step:010d}"


def list_step_dirs(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every step-named directory under ``root``, ascending (committed or
    not)."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = STEP_NAME.match(child.name)
        if m and child.is_dir() and step_dir_name(int(m[1])) == child.name:
            found.append((int(m[1]), child))
    return sorted(found)
