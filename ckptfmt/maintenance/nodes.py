"""The node directories of a level-1 checkpoint, as the offline tools take them: a ``{node}``
template (``/local/{node}/ckpt/step-0000000100``), a mapping node -> directory, or one directory
that holds every node's files; and the manifest copy they agree on (``ckptfmt.engine.copies``)."""

from __future__ import annotations

import glob
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

from ckptfmt.engine.copies import GOOD, Choice, Copy, choose, copies_of, read_copy
from ckptfmt.errors import ManifestError, NotACheckpointError, UsageError
from ckptfmt.manifest.codec import MANIFEST_NAME
from ckptfmt.manifest.model import Manifest
from ckptfmt.storage.commit import LEFTOVER, remove
from ckptfmt.storage.nodes import NODE, expand, is_template, matching, parent_of

__all__ = [
    "NodeDirs",
    "node_copies",
    "node_dirs",
    "node_of",
    "remove_stale_nodes",
    "save_id_at",
    "superseded_by",
]

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
    if not isinstance(spec, Mapping) and is_template(os.fspath(spec)):
        copies = _not_superseded(copies, os.fspath(spec))
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


def node_of(template: str, directory: Path) -> str | None:
    """The node name that fills ``{node}`` in ``template`` to give ``directory`` (None when it
    does not match, or the name would hold ``/``)."""
    pattern = "(?P<node>[^/]+)".join(re.escape(p) for p in template.split(NODE, 1))
    if NODE in template.split(NODE, 1)[1]:  # {node} twice: the same name both times
        pattern = pattern.replace(re.escape(NODE), "(?P=node)")
    m = re.fullmatch(pattern, os.fspath(directory))
    return m["node"] if m else None


def superseded_by(manifest: Manifest) -> str | None:
    """The save id that the save of ``manifest`` rewrote (``ckptfmt reshard`` records it in
    ``writer.resharded_from``), None for any other save."""
    src = manifest.writer.get("resharded_from")
    if isinstance(src, dict) and isinstance(src.get("save_id"), str):
        return str(src["save_id"])
    return None


def _not_superseded(copies: list[Copy], template: str) -> list[Copy]:
    """``copies`` less those of a node that a reshard in place onto ``template`` (to fewer
    nodes) left behind: a good copy of save S in the directory of a node that is not one of
    the nodes of a good copy that rewrote S. The reshard removes them once its new save is
    committed (``reshard_write``); a kill before that must not let the old save's extra nodes
    outvote the new save's copies (``engine.copies.choose`` takes the majority)."""
    newer: dict[str, set[str]] = {}
    for c in copies:
        if c.state == GOOD and c.manifest is not None:
            old = superseded_by(c.manifest)
            if old is not None:
                newer.setdefault(old, set()).update(r.node for r in c.manifest.ranks)
    if not newer:
        return copies
    return [
        c
        for c in copies
        if not (
            c.state == GOOD
            and c.manifest is not None
            and c.manifest.save_id in newer
            and node_of(template, c.directory) not in newer[c.manifest.save_id]
        )
    ]


def save_id_at(directory: Path) -> str | None:
    """The save id of the good manifest copy in ``directory``, None when it holds none."""
    c = read_copy(directory)
    return c.manifest.save_id if c.state == GOOD and c.manifest is not None else None


def remove_stale_nodes(
    template: str, nodes: Sequence[str], replaced: set[str], old_nodes: set[str]
) -> list[Path]:
    """Once a reshard onto ``template`` has committed its save on every one of ``nodes``,
    remove the directories of the other nodes that hold a save it replaced (``replaced``: the
    save ids its nodes held before, and the saves those had rewritten): the nodes of the old
    layout that the new one no longer has. Only a directory at the name of a node that its
    own manifest lists is a node's: a copy of a node's directory under another name (a
    user's ``cp -r n0 n0-backup``) holds the same save and stays. ``old_nodes``: the nodes
    the replaced saves' manifests listed (read before the reshard replaced them), the only
    names whose staging leftovers are taken for a killed reshard's. Each is renamed to a
    dot-name first (``commit.remove``), so a kill part way leaves it whole and ignored by
    readers (:func:`_not_superseded`), or out of sight; what such a kill, or a reshard killed before
    it committed, left beside a node's directory (:func:`_stale_leftover`) is removed here
    too, by the next reshard onto ``template``.
    Directories between ``template``'s parent and a removed node's directory that are empty
    now (``/local/n3`` of ``/local/{node}/ckpt``) are removed with it. Returns what was
    removed."""
    removed: list[Path] = []
    top = parent_of(template).absolute()
    for d in matching(template):
        node = node_of(template, d)
        if node is None or node in nodes or not d.is_dir() or d.is_symlink():
            continue
        c = read_copy(d)
        if c.state != GOOD or c.manifest is None:
            continue
        older = superseded_by(c.manifest)
        if c.manifest.save_id not in replaced and (older is None or older not in replaced):
            continue
        listed = {r.node for r in c.manifest.ranks}
        if node not in listed:
            continue  # a copy under another name, not a node's directory
        old_nodes = old_nodes | listed
        remove(d)
        removed.append(d)
        _remove_empty_between(d.absolute().parent, top)
    head, last = os.path.split(template)
    pattern = os.path.join(
        glob.escape(head).replace(glob.escape(NODE), "*"),
        "." + glob.escape(last).replace(glob.escape(NODE), "*") + ".*-*",
    )
    for p in map(Path, glob.glob(pattern)):
        if _stale_leftover(template, p, nodes, replaced, old_nodes):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
            _remove_empty_between(p.absolute().parent, top)
    return removed


def _stale_leftover(
    template: str, p: Path, nodes: Sequence[str], replaced: set[str], old_nodes: set[str]
) -> bool:
    """Whether ``p``, a dot-named directory beside a node directory of ``template``, is what a
    killed commit or removal left there that no later save to its name will clear: a removal
    cut short (``.<name>.del-*``); or, for a node of the old layout (``old_nodes``) that the
    new layout lacks and whose directory is gone or held a replaced save, a staging directory
    (``.tmp-``: a reshard killed before it committed) or a copy moved aside holding a replaced
    save (``.old-``). The staging directory of a save running beside the template, to another
    name, is not one of those."""
    m = LEFTOVER.match(p.name)
    if m is None or not p.is_dir() or p.is_symlink():
        return False
    final = p.parent / m["name"]
    node = node_of(template, final)
    if node is None or node.startswith("."):  # no node's: a dot-name (an import's scratch)
        return False
    if m["kind"] == "del":
        return True
    if node in nodes or node not in old_nodes:
        return False  # the next save to it clears its leftovers (commit.prepare); not ours
    if final.exists() or final.is_symlink():
        return False  # another checkpoint there: its own
    if m["kind"] == "tmp":
        return True
    held = save_id_at(p)
    return held is not None and held in replaced


def _remove_empty_between(d: Path, top: Path) -> None:
    """Remove ``d`` and its parents below ``top`` while they are empty."""
    while d != top and top in d.parents:
        try:
            d.rmdir()
        except OSError:
            return
        d = d.parent
