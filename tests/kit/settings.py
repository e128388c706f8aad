"""``ManagerSettings`` for the tests that follow one settings object from an integration to its
manager: a value other than the default for every field, found by introspecting the class, so
that a field added to ``ManagerSettings`` fails :func:`changed_settings` until it has a value
here, and is then checked through every integration without a line of theirs naming it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ckptfmt import ExitPolicy, ManagerSettings, WriteOptions
from ckptfmt.parallel.manager.telemetry import SaveReport
from ckptfmt.storage.progress import Progress

# invalid values, each refused by ManagerSettings with its own UsageError
INVALID: list[dict[str, Any]] = [
    {"flush_every": 0},
    {"keep_local": -1},
    {"keep_shared": True},
    {"on_error": "ignore"},
    {"deadline_s": 0},
    {"saves_in_flight": 0},
    {"saves_in_flight": 1.5},
    {"when_busy": "drop"},
    {"async_save": "yes"},
    {"recycle_level1": 1},
    {"write": {"fsync": False}},
    {"at_exit": "flush"},
    {"redundancy": "no-such-scheme", "local_dir": "l1"},
    {"local_dir": "s3://bucket/l1"},
]


def on_save(report: SaveReport) -> None:
    """A report sink (compared by identity)."""


def progress(event: Progress) -> None:
    """A progress sink (compared by identity)."""


def changed_settings(tmp: Path, bucket: str | None = None, **endpoint: Any) -> ManagerSettings:
    """Settings with every field other than its default, that a manager of one process on one
    node takes: level 1 under ``tmp/l1/n0``, level 3 the bucket URL ``bucket`` reached with the
    storage options ``endpoint`` (else ``tmp/l3`` and no storage options: the two fields then
    keep their defaults). Asserts that every field of ``ManagerSettings`` has a value here."""
    values: dict[str, Any] = {
        "local_dir": str(tmp / "l1" / "{node}"),
        "shared_dir": bucket if bucket is not None else str(tmp / "l3"),
        "storage_options": endpoint or None,
        "node": "n0",
        "redundancy": [{"every": 2, "flush": True}],  # a policy one node can carry
        "flush_every": 3,
        "keep_local": 5,
        "keep_shared": 7,
        "async_save": False,
        "incremental": True,
        "recycle_level1": False,
        "fallback_to_shared": False,
        "on_error": "raise",
        "saves_in_flight": 2,
        "when_busy": "skip",
        "deadline_s": 60.0,
        "write": WriteOptions(fsync=False, threads=1, chunk_bytes=1 << 12),
        "at_exit": ExitPolicy(flush=False, budget_s=5.0, sigterm=False),
        "on_save": on_save,
        "progress": progress,
    }
    fields = {f.name for f in dataclasses.fields(ManagerSettings)}
    assert set(values) == fields, f"give tests/kit/settings.py a value for {fields - set(values)}"
    settings = ManagerSettings(**values)
    default = ManagerSettings()
    same = [
        n
        for n in fields
        if getattr(settings, n) == getattr(default, n) and (bucket or n != "storage_options")
    ]
    assert not same, f"these fields kept their default: {same}"
    return settings


def given_fields(settings: ManagerSettings) -> dict[str, Any]:
    """The fields of ``settings`` that differ from the defaults, by name: the keyword spelling
    of the same settings."""
    default = ManagerSettings()
    return {
        f.name: getattr(settings, f.name)
        for f in dataclasses.fields(ManagerSettings)
        if getattr(settings, f.name) != getattr(default, f.name)
    }


def left_to(settings: ManagerSettings, *names: str) -> ManagerSettings:
    """``settings`` with the fields ``names`` at their defaults (those an integration decides)."""
    default = ManagerSettings()
    return dataclasses.replace(settings, **{n: getattr(default, n) for n in names})
