"""The node directories of a level-1 checkpoint, as the offline tools take them: a ``{node}``
template (``/local/{node}/ckpt/step-0000000100``), a mapping node -> directory, or one directory
that holds every node's files; and the manifest copy they agree on (``ckptfmt.engine.copies``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from ckptfmt.engine.copies import Choice, Copy, choose, copies_of, read_copy
from ckptfmt.errors import ManifestError, NotACheckpointError, UsageError
from ckptfmt.manifest.codec import MANIFEST_NAME
from ckptfmt.manifest.model import Manifest
from ckptfmt.storage.nodes import expand, is_template, matching

__all__ = ["NodeDirs", "node_copies", "node_dirs"]

NodeDirs = str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]]


def node_dirs(spec: NodeDirs) -> tuple[Manifest, bytes, dict[str, Path]]:
    """The manifest (and its bytes) of a level-1 checkpoint and each node's directory.

    ``spec``: a ``{node}`` template, a mapping node -> directory, or one directory for all. The
    manifest is the good copy most directories hold (``ckptfmt.engine.copies``)."""
    choice, dirs, _ = node_copies(spec)
    return choice.manifest, choice.data, dirs


def node_copies(spec: NodeDirs) -> tuple[Choice, dict[str, Path], list[Copy]]:
    """:func:`node_dirs` with the choice among the copies and every directory's copy."""
    if isinstance(spec, Mapping):
        given = {str(k): Path(v) for k, v in spec.items()}
        candidates = list(given.values())
    else:
        text = os.fspath(spec)
        candidates = matching(text) if is_template(text) else [Path(text)]
        given = {}
    copies = copies_of(candidates)
    try:
        choice = choose(copies)
    except NotACheckpointError as exc:
        single = [c.error for c in copies if isinstance(c.error, NotACheckpointError)]
        if not isinstance(spec, Mapping) and len(copies) == 1 and single:
            raise single[0] from None  # one directory: its own error, hint and all
        shown = (
            os.fspath(spec) if not isinstance(spec, Mapping) else ", ".join(map(str, candidates))
        )
        errors = [str(c.error) for c in copies if c.error is not None]
        raise NotACheckpointError(
            shown, "no committed copy found" + (f" ({'; '.join(errors[:3])})" if errors else "")
        ) from exc
    manifest = choice.manifest
    nodes = sorted({r.node for r in manifest.ranks})
    if isinstance(spec, Mapping):
        missing = [n for n in nodes if n not in given]
        if missing:
            raise UsageError(f"no directory given for node(s) {', '.join(missing)}")
        return choice, {n: given[n] for n in nodes}, copies
    text = os.fspath(spec)
    if is_template(text):
        _check_node_names(choice, text)
        dirs = {n: expand(text, n) for n in nodes}
        known = {c.directory for c in copies}
        copies += [read_copy(d) for d in dirs.values() if d not in known]
        return choice, dirs, copies
    return choice, {n: Path(text) for n in nodes}, copies


def _check_node_names(choice: Choice, template: str) -> None:
    """Refuse a manifest whose node names cannot fill ``{node}``: each becomes a directory of
    ``template``, so a name that ``spec/PROTOCOL.md`` §5 forbids (empty, ``.``, ``..``, holding
    ``/``) would name a directory outside the template's (where a rebuild recreates a "lost"
    node) or the template's parent itself (which a rebuild takes for a torn copy and removes)."""
    for r in choice.manifest.ranks:
        if not r.node or "/" in r.node or r.node in (".", ".."):
            raise ManifestError(
                f"node name {r.node!r} cannot fill {{node}} in {template} (a node's name is "
                "non-empty, holds no '/' and is not '.' or '..')",
                f"/world/ranks/{r.rank}/node",
                str(choice.holders[0] / MANIFEST_NAME),
            )
