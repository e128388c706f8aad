"""Step directories under a checkpoint root (``spec/PROTOCOL.md``, "Step directories").

A root holds one committed checkpoint per step, named ``step-`` and the step zero-padded to ten
digits (more digits past 9,999,999,999). The latest complete checkpoint is the highest step whose
directory holds a manifest that parses; dot-names (staging and replaced directories) are never
candidates. Two saves of the same step (a job restarted from an older step) are told apart by the
manifest's ``save_id``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from ckptfmt.errors import UsageError

STEP_NAME = re.compile(r"^step-(\d{10,})$")


_LOOSE_STEP = re.compile(r"^(?:step-)?([0-9]+)$")
_LOOSE_NAME = re.compile(r"^step-([0-9]+)$")


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


def pick_steps(names: Iterable[str], *, loose: bool = False) -> list[tuple[int, str]]:
    """``(step, name)`` of the step names among ``names``, ascending by step: the one rule
    (``spec/PROTOCOL.md`` §4) for the children of a directory and the step prefixes of a bucket
    alike.

    A name is a step's exactly when it is :func:`step_dir_name` of it (``step-0000000100``).
    ``loose``: also ``step-<digits>`` without that padding (``step-100``, ``step-00100``),
    for a step no exact name holds; of several such names for one step, the one that sorts
    first. So ``step-2`` and ``step-0000000002`` side by side are step 2 once, at
    ``step-0000000002``. What searches for checkpoints to read takes loose names (``latest``,
    ``ckptfmt list``); a manager writes exact names, and its retention and restore see only
    those."""
    exact: dict[int, str] = {}
    other: dict[int, str] = {}
    for name in names:
        m = _LOOSE_NAME.match(name)
        if not m:
            continue
        step = int(m[1])
        if step_dir_name(step) == name:
            exact[step] = name
        elif loose and (step not in other or name < other[step]):
            other[step] = name
    return sorted({**other, **exact}.items())


def list_step_dirs(root: Path, *, loose: bool = False) -> list[tuple[int, Path]]:
    """``(step, path)`` of every step-named directory under ``root``, ascending (committed or
    not), as :func:`pick_steps` chooses them: exact names, and with ``loose`` also
    ``step-100`` (what a user names a checkpoint saved by hand, as the README's examples do)
    for a step no directory of the exact name holds."""
    if not root.is_dir():
        return []
    names = [c.name for c in root.iterdir() if _LOOSE_NAME.match(c.name) and c.is_dir()]
    return [(step, root / name) for step, name in pick_steps(names, loose=loose)]
