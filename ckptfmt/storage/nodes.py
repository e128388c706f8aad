"""The one resolver of node templates: a level-1 path names every node's directory at once with
``{node}`` in place of the node's name (``/local/{node}/ckpt/step-0000000100``), as the manager's
``local_dir``, the CLI and the offline tools take it (``spec/PROTOCOL.md``, "Storage levels")."""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["NODE", "expand", "is_spread", "is_template", "matching", "parent_of"]

NODE = "{node}"


def is_template(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names one directory per node (holds ``{node}``)."""
    return NODE in os.fspath(path)


def is_spread(spec: object) -> bool:
    """Whether ``spec`` names a level-1 checkpoint spread over node directories: a template or a
    mapping node -> directory."""
    return isinstance(spec, Mapping) or (isinstance(spec, str | os.PathLike) and is_template(spec))


def expand(template: str | os.PathLike[str], node: str) -> Path:
    """``template``'s directory for ``node`` (a path without ``{node}`` is itself)."""
    return Path(os.fspath(template).replace(NODE, node))


def matching(template: str | os.PathLike[str]) -> list[Path]:
    """The existing paths ``template`` names, one per node directory found, sorted."""
    pattern = glob.escape(os.fspath(template)).replace(glob.escape(NODE), "*")
    return [Path(p) for p in sorted(glob.glob(pattern))]


def parent_of(template: str | os.PathLike[str]) -> Path:
    """The deepest directory every node's path lies under (the part before ``{node}``)."""
    head = os.fspath(template).split(NODE)[0]
    parent = Path(head)
    return parent if head.endswith(os.sep) or not head else parent.parent
