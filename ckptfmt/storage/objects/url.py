"""Object-store URLs: which strings are URLs, and how one splits into scheme, bucket and key prefix.

Pure string work, no client library: the entry points ask :func:`is_url` before deciding whether a
checkpoint lives in a directory or in a bucket, with or without the ``cloud`` extra installed.
"""

from __future__ import annotations

import os
import re

from ckptfmt.errors import UrlNotSupportedError, UsageError

SUPPORTED = frozenset({"s3", "s3a", "gs", "az", "abfs", "abfss", "azure", "memory"})
"""The schemes ckptfmt hands to the object-store library (what obstore's ``from_url`` takes,
less ``file://`` and ``http(s)://``: a directory is given as a path, and plain HTTP has no
conditional writes)."""

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+)://(.*)$", re.DOTALL)


def is_url(path: str | os.PathLike[str] | None) -> bool:
    """Whether ``path`` is an object-store URL of a supported scheme (``s3://bucket/x``)."""
    if path is None or isinstance(path, os.PathLike):
        return False
    m = _URL.match(path)
    return m is not None and m.group(1).lower() in SUPPORTED


def split_url(url: str) -> tuple[str, str, str]:
    """``(scheme, bucket, key_prefix)`` of ``url``: ``"s3://b/run/ckpt/"`` ->
    ``("s3", "b", "run/ckpt")``. The scheme is lower-cased; the key prefix has no leading or
    trailing ``/`` and no empty, ``.`` or ``..`` segment. ``memory:///x`` has bucket ``""``.
    Raises :class:`UrlNotSupportedError` for another scheme, ``UsageError`` for a malformed one."""
    m = _URL.match(url)
    if not m:
        raise UrlNotSupportedError(url, "")
    scheme = m.group(1).lower()
    if scheme not in SUPPORTED:
        raise UrlNotSupportedError(url, scheme)
    bucket, _, rest = m.group(2).partition("/")
    if not bucket and scheme != "memory":
        raise _malformed(url, "no bucket named")
    parts = [p for p in rest.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise _malformed(url, "'.' and '..' are not key segments")
    return scheme, bucket, "/".join(parts)


def join_key(*parts: str) -> str:
    """Keys joined with ``/``, empty parts left out."""
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


def _malformed(url: str, why: str) -> UsageError:
    return UsageError(f"{url!r} is not a usable object-store URL: {why}")
