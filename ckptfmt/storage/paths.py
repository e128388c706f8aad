"""Checks on the paths a user passes, before anything touches the file system.

:func:`refuse_url` is called by every entry point that takes a checkpoint path (``ckptfmt.save``,
``load``, ``open``, ``verify``, ``latest``, the CLI, ``CheckpointManager``): a URL such as
``s3://bucket/x`` would otherwise become the relative directory ``./s3:/bucket/x``, and a job
would "save" into its working directory.
"""

from __future__ import annotations

import os
import re

from ckptfmt.errors import UrlNotSupportedError

# an RFC 3986 scheme, then "://" (or ":/": what ``pathlib.Path("s3://b/x")`` leaves of it); a
# one-letter scheme would be a Windows drive, which this POSIX-only package never sees anyway
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):/")


def refuse_url(path: str | os.PathLike[str] | None) -> None:
    """Raise :class:`UrlNotSupportedError` when ``path`` is a URL (``s3://``, ``gs://``,
    ``file://``, ...): object storage is not supported yet. Paths (and ``None``) pass."""
    if path is None:
        return
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    m = _URL.match(text)
    if m:
        raise UrlNotSupportedError(text, m.group(1).lower())
