"""The suite's fixtures and session hooks only; helpers that test modules import live in
``tests/kit/``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kit.arrays import make_state
from kit.s3 import S3, S3Server, start_server
from kit.s3_proxy import S3Proxy

import ckptfmt
from ckptfmt import WriteOptions

# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A checkpoint of :func:`make_state` with small chunks (many shard files, padded edges)."""
    state = make_state()
    root = tmp_path / "ckpt"
    ckptfmt.save(state, root, write=WriteOptions(chunk_bytes=24, shard_bytes=96, fsync=False))
    return root, state


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One real S3 server (moto, 127.0.0.1) for the whole session; see ``kit.s3``."""
    yield from start_server()


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3:
    """A fresh bucket on the session's S3 server, with the AWS environment variables that point
    clients at it set for this process (``s3.env`` holds them for subprocesses)."""
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    return S3(s3_server, s3_server.make_bucket())


@pytest.fixture
def s3_proxy(s3: S3, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Proxy]:
    """A fault-injecting proxy in front of the S3 server (``kit.s3_proxy``), with this process's
    ``AWS_ENDPOINT_URL`` pointing at it; ``s3_proxy.env(s3.env)`` for subprocesses."""
    proxy = S3Proxy(s3.server.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        yield proxy
    finally:
        proxy.close()


# --- MPICH's shared-memory segments left by killed jobs ------------------------------------------
# A rank killed while MPICH sets up its intra-node shared memory (the fault, SIGKILL and host tests
# kill ranks on purpose) leaves its /dev/shm/mpich_shm_* segment behind: about 3 MiB each, 220
# of them (690 MiB of RAM) after two full runs here. The session removes the ones made while it
# ran that no process has mapped any more.

_SHM = Path("/dev/shm")
_SESSION_START = 0.0


def pytest_sessionstart(session: pytest.Session) -> None:
    global _SESSION_START
    _SESSION_START = time.time()


def _mapped_shm() -> set[str]:
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            mapped.update(
                line.rsplit(" ", 1)[-1].strip()
                for line in maps.read_text().splitlines()
                if "/dev/shm/mpich_shm_" in line
            )
    return mapped


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _SHM.is_dir() or not _SESSION_START:
        return
    mapped = _mapped_shm()
    for seg in _SHM.glob("mpich_shm_*"):
        with contextlib.suppress(OSError):
            if seg.stat().st_mtime >= _SESSION_START and str(seg) not in mapped:
                seg.unlink()
