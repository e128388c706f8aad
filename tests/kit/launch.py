"""Launching multi-process tests: ``mpiexec`` (MPI) and ``torchrun`` (torch.distributed, gloo).

Every launch runs under coreutils ``timeout`` (a hung collective becomes a test failure, never a
hung test run), from the repository root, with this interpreter's virtual environment and ``tests/``
first on ``PYTHONPATH`` (so that a worker imports ``kit``), and captures its output. MPI ranks run
as ``python -m mpi4py script``, so that an exception on one rank aborts the whole job instead of
leaving the others waiting.

Use from any test module::

    from kit.launch import assert_ok, run_mpi

    @pytest.mark.mpi
    def test_x(tmp_path):
        assert_ok(run_mpi(4, "tests/workers/_my_worker.py", str(tmp_path)))
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from kit import REPO

BIN = Path(sys.executable).parent  # the venv's bin/ (tests run with .venv/bin/python)
TIMED_OUT = (124, 137)  # timeout's status when the command ran out of time / had to be killed
_KILL_AFTER_S = 5
_TAIL_CHARS = 8000


def mpiexec() -> Path:
    """The ``mpiexec`` beside this interpreter (from the ``mpich`` wheel); skips the calling test
    if there is none or mpi4py is missing."""
    exe = BIN / "mpiexec"
    if not exe.exists() or importlib.util.find_spec("mpi4py") is None:
        pytest.skip(f"no mpi4py / {exe} in this environment")
    return exe


def run_mpi(
    n: int,
    script: str | os.PathLike[str],
    *args: str,
    timeout: float = 120,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``mpiexec -n n python -m mpi4py script args`` under ``timeout``; fails the calling
    test if it runs out of time. Returns the finished process (check ``returncode`` yourself, or
    use :func:`assert_ok`)."""
    cmd = [str(mpiexec()), "-n", str(n), sys.executable, "-m", "mpi4py", str(script), *args]
    return _run(cmd, timeout, env)


def run_torchrun(
    n: int,
    script: str | os.PathLike[str],
    *args: str,
    timeout: float = 120,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``torchrun --standalone --nproc-per-node n script args`` (one host; the script calls
    ``init_process_group("gloo")``) under ``timeout``; fails the calling test if it runs out of
    time. Skips the calling test when torch is not installed."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(n),
        "--monitor-interval",
        "0.2",
        str(script),
        *args,
    ]
    return _run(cmd, timeout, env)


def assert_ok(result: subprocess.CompletedProcess[str]) -> None:
    """Fail the calling test, showing the job's output, unless it exited with status 0."""
    if result.returncode != 0:
        pytest.fail(f"exit status {result.returncode}\n{describe(result)}", pytrace=False)


def describe(result: subprocess.CompletedProcess[str]) -> str:
    """The command and the ends of its stdout and stderr, for failure messages."""
    cmd = result.args if isinstance(result.args, str) else " ".join(map(str, result.args))
    return (
        f"command: {cmd}\n--- stdout (end) ---\n{(result.stdout or '')[-_TAIL_CHARS:]}"
        f"\n--- stderr (end) ---\n{(result.stderr or '')[-_TAIL_CHARS:]}"
    )


def with_kit_path(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with ``tests/`` first on ``PYTHONPATH``: a script outside ``tests/`` (the workers
    in ``tests/workers/``) then imports ``kit``."""
    rest = env.get("PYTHONPATH", "")
    return {**env, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), *([rest] if rest else [])])}


def _run(
    cmd: Sequence[str], timeout: float, env: Mapping[str, str] | None
) -> subprocess.CompletedProcess[str]:
    timeout_exe = shutil.which("timeout")
    if timeout_exe is None:
        pytest.fail("coreutils `timeout` is needed to launch multi-process tests safely")
    full = [timeout_exe, "-k", str(_KILL_AFTER_S), str(timeout), *cmd]
    run_env = with_kit_path({**os.environ, **(env or {})})
    start = time.monotonic()
    try:
        result = subprocess.run(
            full,
            cwd=REPO,
            env=run_env,
            capture_output=True,
            text=True,
            errors="replace",
            # a backstop only: `timeout` signals the whole process group well before this
            timeout=timeout + _KILL_AFTER_S + 30,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
        result = subprocess.CompletedProcess(full, 137, out or "", err or "")
    # 124/137 from a job that ended early is its own status (a rank killed by SIGKILL, say)
    if result.returncode in TIMED_OUT and time.monotonic() - start >= timeout:
        pytest.fail(f"timed out after {timeout} s\n{describe(result)}", pytrace=False)
    return result
