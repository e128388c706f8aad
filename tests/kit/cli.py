"""The ``ckptfmt`` command line, run in this process (click's runner: no interpreter start, so a
test may run it many times)."""

from __future__ import annotations

import os

from ckptfmt_cli.main import cli
from click.testing import CliRunner, Result


def run_cli(*args: str | os.PathLike[str]) -> Result:
    """``ckptfmt *args``: its exit status and output (``result.exit_code``, ``result.output``).
    Fails the calling test when anything but click's own exit escapes the command, or when the
    output holds a traceback: a command reports every failure as one line and a status."""
    result = CliRunner().invoke(cli, [os.fspath(a) for a in args], prog_name="ckptfmt")
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    return result
