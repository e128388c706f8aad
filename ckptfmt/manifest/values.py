"""Non-tensor values: checked, made JSON-safe, and restored. Nothing is ever pickled.

A value is ``None``, ``bool``, ``int``, ``float`` (non-finite included), ``str``, a list or tuple
of values, or a dict with string keys whose values are values. Tuples come back as lists. numpy
scalars inside a value are taken as the Python scalar they equal. Non-finite floats, which JSON
cannot hold, are written as ``null`` and listed by JSON pointer in the entry's ``nonfinite``
member (``{"/a/0": "nan"}``), so the stored value stays plain JSON that any reader can parse.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ckptfmt.errors import LimitExceededError, ManifestError, UnsupportedValueError
from ckptfmt.manifest.limits import MAX_JSON_DEPTH

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _pointer_token(key: str | int) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def encode_value(value: Any, name: str) -> tuple[Any, dict[str, str]]:
    """Return ``(json_value, nonfinite)`` for a value; raise :class:`UnsupportedValueError`."""
    nonfinite: dict[str, str] = {}

    def walk(v: Any, pointer: str, depth: int) -> Any:
        if depth > MAX_JSON_DEPTH:
            raise LimitExceededError(f"nesting depth of value {name!r}", depth, MAX_JSON_DEPTH)
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise UnsupportedValueError(
                    name, f"string at {pointer or '/'} is not valid Unicode (lone surrogate)"
                ) from None
            return v
        if v is None or isinstance(v, bool):
            return v
        if isinstance(v, np.generic) and not isinstance(v, (np.void, np.str_, np.bytes_)):
            v = v.item()
            if isinstance(v, complex):
                raise UnsupportedValueError(name, "complex scalars must be saved as 0-d arrays")
        if isinstance(v, bool) or v is None:
            return v
        if isinstance(v, int):
            if v.bit_length() > 4096:  # JSON holds it, but most readers would not
                raise UnsupportedValueError(name, f"integer at {pointer or '/'} exceeds 2**4096")
            return int(v)
        if isinstance(v, float):
            if math.isfinite(v):
                return float(v)
            nonfinite[pointer] = "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
            return None
        if isinstance(v, (list, tuple)):
            return [walk(x, f"{pointer}/{i}", depth + 1) for i, x in enumerate(v)]
        if isinstance(v, dict):
            out = {}
            for k, x in v.items():
                if not isinstance(k, str):
                    raise UnsupportedValueError(
                        name, f"dict keys inside values must be strings, got {k!r}"
                    )
                walk(k, f"{pointer}/{_pointer_token(k)}", depth + 1)  # valid Unicode
                out[k] = walk(x, f"{pointer}/{_pointer_token(k)}", depth + 1)
            return out
        if isinstance(v, np.ndarray):
            raise UnsupportedValueError(
                name, "arrays inside lists are not supported; put them in a mapping"
            )
        raise UnsupportedValueError(name, f"{type(v).__name__} is neither an array nor JSON-able")

    return walk(value, "", 0), nonfinite


def decode_value(value: Any, nonfinite: dict[str, str], where: str) -> Any:
    """Restore the non-finite floats listed in ``nonfinite`` into a parsed JSON value."""
    if not isinstance(nonfinite, dict):
        raise ManifestError("nonfinite must be an object", where)
    for pointer, kind in nonfinite.items():
        if not isinstance(kind, str) or kind not in _NONFINITE:
            raise ManifestError(f"bad nonfinite entry {pointer!r}: {kind!r}", where)
        if pointer == "":
            if value is not None:
                raise ManifestError("nonfinite pointer to a non-null value", where)
            value = _NONFINITE[kind]
            continue
        if not pointer.startswith("/"):
            raise ManifestError(f"bad JSON pointer {pointer!r}", where)
        tokens = [t.replace("~1", "/").replace("~0", "~") for t in pointer[1:].split("/")]
        parent = value
        for tok in tokens[:-1]:
            parent = _step(parent, tok, pointer, where)
        last = tokens[-1]
        if isinstance(parent, list):
            idx = _index(parent, last, pointer, where)
            if parent[idx] is not None:
                raise ManifestError(f"nonfinite pointer {pointer!r} to a non-null value", where)
            parent[idx] = _NONFINITE[kind]
        elif isinstance(parent, dict) and last in parent and parent[last] is None:
            parent[last] = _NONFINITE[kind]
        else:
            raise ManifestError(f"nonfinite pointer {pointer!r} does not resolve to null", where)
    return value


def _index(seq: list[Any], tok: str, pointer: str, where: str) -> int:
    if not (tok.isascii() and tok.isdigit()) or len(tok) > 12 or int(tok) >= len(seq):
        raise ManifestError(f"JSON pointer {pointer!r} does not resolve", where)
    return int(tok)


def _step(node: Any, tok: str, pointer: str, where: str) -> Any:
    if isinstance(node, list):
        return node[_index(node, tok, pointer, where)]
    if isinstance(node, dict) and tok in node:
        return node[tok]
    raise ManifestError(f"JSON pointer {pointer!r} does not resolve", where)
