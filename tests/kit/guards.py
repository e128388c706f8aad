"""Guards around code under test: a memory cap, a time limit, an ``open()`` tracker."""

from __future__ import annotations

import builtins
import contextlib
import gc
import io
import os
import resource
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def memory_cap(extra: int = 3 << 30) -> Iterator[None]:
    """Cap this process's address space at its current size plus ``extra`` bytes, so that an
    unbounded allocation fails at once (MemoryError) instead of swapping the machine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _vm_size() + extra
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


class Hang(Exception):
    """Raised by :func:`time_limit` when the code under test runs too long."""


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """Turn a hang into a test failure (SIGALRM; main thread only)."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise Hang(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


class OpenTracker:
    """Records every path opened through builtins.open / io.open / os.open while active."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def outside(self, root: Path) -> list[str]:
        base = os.path.realpath(root)
        return [p for p in self.paths if os.path.commonpath([base, os.path.realpath(p)]) != base]


@contextlib.contextmanager
def track_opens(monkeypatch: pytest.MonkeyPatch) -> Iterator[OpenTracker]:
    """Record the paths opened inside the block. The garbage of earlier tests is collected
    first: a finalizer running inside the block (a ``TemporaryDirectory`` an earlier test's
    ``ckptfmt.open`` kept, removed by ``rmtree``, which opens it) would be recorded as the
    code under test's."""
    gc.collect()
    tracker = OpenTracker()
    real_open, real_os_open = builtins.open, os.open

    def fake_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, (str, bytes, os.PathLike)):
            tracker.paths.append(os.fsdecode(file))
        return real_open(file, *args, **kwargs)

    def fake_os_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("dir_fd") is None:
            tracker.paths.append(os.fsdecode(path))
        return real_os_open(path, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(builtins, "open", fake_open)
        m.setattr(io, "open", fake_open)
        m.setattr(os, "open", fake_os_open)
        yield tracker
