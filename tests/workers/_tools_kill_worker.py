"""The ``ckptfmt`` command line in a process of its own that SIGKILLs itself part way through:
``_tools_kill_worker.py N WATCH EXCHANGE -- ARGS...`` runs ``ckptfmt ARGS...`` and kills the
process right after the ``N``-th rename (``os.rename``, ``os.replace``) or directory exchange
whose source or destination is in the directory ``WATCH`` (``N`` = 0: never; ``N`` < 0: right
before the ``-N``-th). ``EXCHANGE`` ``0`` makes
``ckptfmt.storage.commit.exchange`` answer as a file system without ``RENAME_EXCHANGE`` does
(the tools then rename in two steps). Run by ``kit.crash.kill_cli`` for the crash tests of
export, import and reshard (``tests/interop/test_tools_crash.py``,
``tests/reshard/test_reshard_cleanup.py``). Stderr's last line names every step counted."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

from ckptfmt.storage import commit


def main() -> None:
    n, watch, can_exchange = int(sys.argv[1]), Path(sys.argv[2]).absolute(), sys.argv[3] == "1"
    args = sys.argv[sys.argv.index("--") + 1 :]
    steps: list[str] = []

    def watched(a: Any, b: Any) -> bool:
        return watch in (Path(os.fspath(a)).absolute().parent, Path(os.fspath(b)).absolute().parent)

    def step(what: str, a: Any, b: Any) -> None:
        if watched(a, b):
            steps.append(f"{what} {Path(os.fspath(a)).name} {Path(os.fspath(b)).name}")
            print("step:", steps[-1], file=sys.stderr, flush=True)
            if len(steps) == n:
                os.kill(os.getpid(), signal.SIGKILL)

    def before(a: Any, b: Any) -> None:
        if n < 0 and watched(a, b) and len(steps) + 1 == -n:
            os.kill(os.getpid(), signal.SIGKILL)

    real_rename, real_replace, real_exchange = os.rename, os.replace, commit.exchange

    def rename(a: Any, b: Any, *rest: Any, **kw: Any) -> None:
        before(a, b)
        real_rename(a, b, *rest, **kw)
        step("rename", a, b)

    def replace(a: Any, b: Any, *rest: Any, **kw: Any) -> None:
        before(a, b)
        real_replace(a, b, *rest, **kw)
        step("replace", a, b)

    def exchange(a: Path, b: Path) -> bool:
        if not can_exchange:
            return False
        before(a, b)
        done = real_exchange(a, b)
        if done:
            step("exchange", a, b)
        return done

    os.rename = rename  # type: ignore[assignment]
    os.replace = replace  # type: ignore[assignment]
    commit.exchange = exchange  # type: ignore[assignment]
    from ckptfmt_cli.main import main as cli

    try:
        cli(args)
    finally:
        print(f"steps: {len(steps)}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
