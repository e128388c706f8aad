"""The Hugging Face layout of safetensors weights: one ``model.safetensors``, or shards
``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json``
(``{"metadata": {"total_size": bytes}, "weight_map": {tensor: file}}``), as
``transformers``' ``save_pretrained`` and ``huggingface_hub``'s ``split_*_state_dict_into_shards``
write it: tensors taken in order and packed greedily, a new shard started when the next tensor
would take the current one over the limit (a tensor larger than the limit gets a shard alone).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ckptfmt.errors import ForeignFormatError, UsageError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD = 5 * 10**9  # "5GB", transformers' default
MAX_INDEX_BYTES = 256 << 20

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}


def parse_size(text: str | int) -> int:
    """``5GB`` (decimal, as Hugging Face reads it), ``512MiB``, ``1000000``: bytes, >= 1."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
        unit = m.group(2).upper() if m else ""
        if m is None or unit not in _UNITS:
            raise UsageError(f"{text!r} is not a size like 5GB, 500MB, 2GiB or a byte count")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise UsageError(f"a shard size must be at least 1 byte, got {text!r}")
    return value


def plan_shards(sizes: Sequence[int], max_bytes: int) -> list[list[int]]:
    """Indices of ``sizes`` per shard, in order, packed greedily up to ``max_bytes`` each."""
    shards: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(sizes):
        if current and used + n > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current or not shards:
        shards.append(current)
    return shards


def shard_names(n: int) -> list[str]:
    if n == 1:
        return [SINGLE]
    return [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]


def index_doc(total_size: int, weight_map: dict[str, str], extra: dict[str, Any]) -> bytes:
    doc = {"metadata": {"total_size": total_size, **extra}, "weight_map": weight_map}
    return (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _plain_file_name(name: Any) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


def read_index(root: Path) -> dict[str, list[str]]:
    """The shard files of the Hugging Face directory ``root`` and the tensors the index places in
    each (file -> tensor names, in index order). Every file must be a plain name inside ``root``
    (no ``/``, no ``..``) that exists as a regular file; :class:`ForeignFormatError` otherwise."""
    path = root / INDEX
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_INDEX_BYTES + 1)
    except OSError as exc:
        raise ForeignFormatError(str(path), f"cannot read the index: {exc}") from None
    if len(raw) > MAX_INDEX_BYTES:
        raise ForeignFormatError(str(path), f"larger than {MAX_INDEX_BYTES} bytes")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ForeignFormatError(str(path), f"not valid JSON: {exc}") from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise ForeignFormatError(str(path), "no weight_map (a map of tensor name -> file)")
    files: dict[str, list[str]] = {}
    for tensor, file in wm.items():
        if not _plain_file_name(file):
            raise ForeignFormatError(
                str(path), f"weight_map names {file!r}, not a file of this directory", tensor
            )
        files.setdefault(file, []).append(tensor)
    for file in files:
        p = root / file
        if not p.is_file():  # a link is the user's own (the Hub cache links to blobs)
            raise ForeignFormatError(
                str(path), f"the index names {file!r}, which is not a file in {root}"
            )
    return files
