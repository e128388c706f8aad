"""Exit statuses of every ``ckptfmt`` command, and the one place where errors become them.

Every command shares one table (:data:`EXIT_STATUSES`), shown in ``ckptfmt --help`` and in each
command's help. Commands raise core errors freely: :class:`ckptfmt_cli.main.CkptGroup` turns each
into a one-line message on stderr and the status :func:`exit_status` gives it, never a traceback.
"""

from __future__ import annotations

import enum
import errno
import re

from ckptfmt.errors import (
    CkptError,
    CollectiveError,
    DamagedError,
    StorageError,
    UnreadableError,
    UsageError,
    family_of,
)


class ExitStatus(enum.IntEnum):
    OK = 0
    DAMAGED = 1
    USAGE = 2  # click's own status for bad arguments and options
    UNREADABLE = 3
    INTERRUPTED = 130  # the shell's convention for SIGINT; must not read as "damaged"


EXIT_STATUSES: tuple[tuple[ExitStatus, str], ...] = (
    (ExitStatus.OK, "healthy, or done"),
    (ExitStatus.DAMAGED, "damaged: some data is missing or fails its checks"),
    (ExitStatus.USAGE, "usage error: bad arguments or options"),
    (
        ExitStatus.UNREADABLE,
        "not a readable checkpoint: no manifest, an invalid one, or an unsupported format version",
    ),
    (ExitStatus.INTERRUPTED, "interrupted (Ctrl-C)"),
)

# One status per family of the core's error tree (``ckptfmt.errors.FAMILIES``): an error takes
# its family's, the first family in its MRO (ManifestChecksumError is damage, 1;
# DestinationUnwritableError usage, 2), never a status of its own.
STATUS_BY_FAMILY: dict[type[CkptError], ExitStatus] = {
    UsageError: ExitStatus.USAGE,
    DamagedError: ExitStatus.DAMAGED,
    UnreadableError: ExitStatus.UNREADABLE,
    CollectiveError: ExitStatus.UNREADABLE,
    StorageError: ExitStatus.UNREADABLE,
}

MAX_MESSAGE_CHARS = 2000

# What only a write fails with: a full file system or quota, a file over the size limit.
_WRITE_ONLY = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG})


def exit_status(exc: BaseException) -> ExitStatus | None:
    """The status a command exits with when ``exc`` escapes it: its family's for an error of
    the tree; 3 for another ``OSError`` (a file the core could not read for reasons of its own:
    permissions, I/O); None for an unexpected error (a bug, which should keep its traceback)."""
    family = family_of(exc)
    if family is not None:
        return STATUS_BY_FAMILY[family]
    if isinstance(exc, CkptError | OSError):
        return ExitStatus.UNREADABLE
    return None


def one_line(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` on one line, with control characters escaped, at most ``limit`` characters."""
    out = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)
    return out if len(out) <= limit else out[: limit - 1] + "…"


# The core's messages name its Python keywords; on the command line the flags are what a user
# can pass. Most specific first (the export command's message names both already).
_FLAG_WORDING: tuple[tuple[str, str], ...] = (
    ("--overwrite, overwrite=True,", "--overwrite"),
    ("pass write=WriteOptions(overwrite=True) to replace it", "pass --overwrite to replace it"),
    ("write=WriteOptions(overwrite=True)", "--overwrite"),
    ("overwrite=True", "--overwrite"),
    (
        "give a rank map (saved rank -> current rank), or drop them explicitly",
        "give --rank-map OLD:NEW,... (saved rank -> new rank) or --rank-map identity, or "
        "--drop-per-rank to leave them out",
    ),
    ('per_rank="drop"', "--drop-per-rank"),
    ("rank map entry", "--rank-map entry"),
    ("rank map sends", "--rank-map sends"),
    ("rank_map", "--rank-map"),
)


# A setting a core message names for Python callers only: the commands read the store's
# settings from the environment, which the message names beside it.
_PYTHON_ONLY = re.compile(r" \(in Python also storage_options=\{[^{}]*\}\)")


def cli_wording(text: str) -> str:
    """A core message as the command line says it: CLI flags, not Python keywords."""
    for core, flag in _FLAG_WORDING:
        text = text.replace(core, flag)
    return _PYTHON_ONLY.sub("", text)


def error_message(exc: BaseException) -> str:
    """The one-line message shown for an error that ends a command."""
    if isinstance(exc, CkptError):
        return one_line(cli_wording(str(exc)))
    if isinstance(exc, OSError) and exc.errno in _WRITE_ONLY:
        return one_line(f"cannot write: {exc}")  # a full file system is never a read error
    return one_line(f"cannot read: {exc}")


def help_epilog() -> str:
    """The exit-status table as a click epilog (``\\b`` keeps click from re-wrapping it)."""
    rows = [f"  {int(status):<4} {text}" for status, text in EXIT_STATUSES]
    return "\b\nExit statuses (every command):\n" + "\n".join(rows)
