"""An overwrite on a bucket stopped at each step leaves the old checkpoint or the new one at the
path, whole and bit for bit, never neither (``spec/FORMAT.md`` §16, "Overwrite"), by each route
that overwrites there: ``ckptfmt.save`` to a URL, the collective ``save_to_bucket`` and the
manager's flush of a step already on the bucket (``kit.overwrite``).

Stops: the process killed (SIGKILL) while the test's proxy holds one of its requests (a data
object's PUT, the commit object's PUT before it reaches the server, the first delete after the
commit), and the commit put refused by the server. After each, ``ckptfmt gc`` removes what the
stopped overwrite left and nothing of the committed checkpoint, which still loads bit for bit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from kit import REPO
from kit.arrays import assert_state_equal
from kit.launch import mpiexec, with_kit_path
from kit.overwrite import BUCKET_ROUTES, checkpoint_of, save, state
from kit.s3 import S3
from kit.s3_proxy import S3Proxy

import ckptfmt
from ckptfmt.errors import CkptError
from ckptfmt.storage.objects import COMMIT_NAME, LATEST_NAME, Bucket, gc, read_commit

WORKER = "tests/workers/_overwrite_worker.py"
OLD, NEW = 1, 2

# a stop: the proxy rule that holds the request, and which checkpoint must be there after
STOPS: dict[str, tuple[Callable[[S3Proxy], None], int]] = {
    "a data upload": (lambda p: p.stall(1, method="PUT"), OLD),
    "the commit put": (lambda p: p.stall(1, method="PUT", path_contains=COMMIT_NAME), OLD),
    "the first delete": (lambda p: p.stall(1, method="POST", path_contains="delete"), NEW),
}


def _target(s3: S3, route: str) -> str:
    return f"{s3.url}/run" if route == "flush" else f"{s3.url}/run/ckpt"


def _check_whole(s3: S3, route: str, seed: int) -> None:
    """The checkpoint at the route's path loads as ``seed``'s state bit for bit; gc removes
    every other save's objects under it and none of its own, and it still loads after."""
    url = checkpoint_of(route, _target(s3, route))
    assert_state_equal(ckptfmt.load(url), state(seed))
    gc(Bucket.at(_target(s3, route)))
    commit = read_commit(Bucket.at(url))
    assert commit is not None
    prefix = url.removeprefix(f"{s3.url}/") + "/"
    want = {prefix + COMMIT_NAME} | {f"{prefix}{commit.save_id}/{o.key}" for o in commit.objects}
    assert set(s3.keys(prefix)) == want
    assert_state_equal(ckptfmt.load(url), state(seed))


def _killed_at(
    s3: S3, proxy: S3Proxy, route: str, stop: Callable[[S3Proxy], None], ranks: int = 0
) -> None:
    """Run the overwrite in a process (``ranks``: in an ``mpiexec`` job of that many), and
    SIGKILL it (the job's whole process group) once the proxy holds the stop's request."""
    held_before = proxy.faults["stall"]
    stop(proxy)
    env = with_kit_path(proxy.env({**os.environ, **s3.env}))
    cmd = [sys.executable, WORKER, route, _target(s3, route), str(NEW)]
    if ranks:
        cmd = [str(mpiexec()), "-n", str(ranks), sys.executable, "-m", "mpi4py", *cmd[1:]]
        cmd += ["-", "mpi"]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the ranks die with the launcher
    )
    try:
        end = time.monotonic() + 90
        while (
            proxy.faults["stall"] == held_before and proc.poll() is None and time.monotonic() < end
        ):
            time.sleep(0.02)
        held = proxy.faults["stall"] > held_before
        _kill_group(proc)
        out = proc.communicate(timeout=30)[0].decode(errors="replace")
    finally:
        _kill_group(proc)
        proxy.clear()
    assert held, f"the overwrite never reached the stop (status {proc.returncode}):\n{out[-4000:]}"


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("route", BUCKET_ROUTES)
def test_an_overwrite_killed_at_each_step_leaves_the_old_or_the_new_whole(
    s3: S3, s3_proxy: S3Proxy, route: str
) -> None:
    save(route, _target(s3, route), OLD, overwrite=False)
    for name, (stop, expect) in STOPS.items():
        before = read_commit(Bucket.at(checkpoint_of(route, _target(s3, route))))
        _killed_at(s3, s3_proxy, route, stop)
        try:
            _check_whole(s3, route, expect)
        except AssertionError as exc:
            raise AssertionError(f"killed at {name}: {exc}") from exc
        if expect == NEW:  # the next stop starts again from the old checkpoint
            assert before is not None
            save(route, _target(s3, route), OLD)
    if route == "flush":  # the pointer still names the step
        assert s3.keys(f"run/{LATEST_NAME}") == [f"run/{LATEST_NAME}"]


@pytest.mark.mpi
def test_a_collective_overwrite_by_two_mpi_ranks_killed_at_each_step(
    s3: S3, s3_proxy: S3Proxy
) -> None:
    """``save_to_bucket`` by the two ranks of an ``mpiexec`` job, the job killed while the
    proxy holds a data upload, the commit put, or the first delete after the commit."""
    save("collective", _target(s3, "collective"), OLD, overwrite=False)
    for name, (stop, expect) in STOPS.items():
        _killed_at(s3, s3_proxy, "collective", stop, ranks=2)
        try:
            _check_whole(s3, "collective", expect)
        except AssertionError as exc:
            raise AssertionError(f"killed at {name}: {exc}") from exc
        if expect == NEW:
            save("collective", _target(s3, "collective"), OLD)


# a 500 is retried with backoff (seconds): once, on one route; the commit is the same on all
REFUSALS = [(r, s) for r in BUCKET_ROUTES for s in (403, 412)] + [("url", 500)]


@pytest.mark.parametrize(("route", "status"), REFUSALS)
def test_an_overwrite_whose_commit_put_is_refused_leaves_the_old_whole(
    s3: S3, s3_proxy: S3Proxy, route: str, status: int
) -> None:
    """The server refuses the commit put (every time: a 500 is read back and put again, and
    refused again): the save fails naming the commit object, and the old checkpoint loads."""
    save(route, _target(s3, route), OLD, overwrite=False)
    s3_proxy.refuse(100, status, method="PUT", path_contains=COMMIT_NAME)
    with pytest.raises(CkptError) as info:
        save(route, _target(s3, route), NEW)
    assert COMMIT_NAME in str(info.value)
    assert s3_proxy.faults["refuse"] >= 1
    s3_proxy.clear()
    _check_whole(s3, route, OLD)


@pytest.mark.parametrize("route", BUCKET_ROUTES)
def test_a_store_without_conditional_replace_still_replaces_in_one_put(
    s3: S3, s3_proxy: S3Proxy, route: str
) -> None:
    """A store that answers 501 to ``If-Match``: the commit object is replaced by a plain put,
    still in one step; the old save's objects go after it."""
    save(route, _target(s3, route), OLD, overwrite=False)
    s3_proxy.refuse(1, 501, method="PUT", path_contains=COMMIT_NAME)
    save(route, _target(s3, route), NEW)
    assert s3_proxy.faults["refuse"] == 1
    _check_whole(s3, route, NEW)
