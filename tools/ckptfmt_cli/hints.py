"""What the commands tell a user besides their reports: what a path they gave really is, what to
run next, and what is really lost.

Pure reading (manifests, file sizes, the core's verify and dry-run rebuild); nothing here writes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ckptfmt.container import read_manifest
from ckptfmt.errors import CkptError, UnrecoverableDamageError
from ckptfmt.maintenance import NodeDirs, VerifyReport, node_dirs, rebuild, verify
from ckptfmt.manifest import Manifest, display
from ckptfmt.redundancy import member_files

LEVELS_FILE = "ckptfmt-levels.json"  # what CheckpointManager records under its shared root


def _nodes(manifest: Manifest) -> list[str]:
    return sorted({r.node for r in manifest.ranks})


def one_node_of_level1(path: str) -> tuple[str, Manifest] | None:
    """``(node, manifest)`` when ``path`` is one node's directory of a level-1 checkpoint that
    several nodes saved (each node's directory holds only its own ranks' files): checked alone
    it would report every other node's file as missing. None for anything else (a complete
    copy, a directory holding every node's files, a template, not a checkpoint)."""
    if "{node}" in path:
        return None
    root = Path(path)
    try:
        manifest = read_manifest(root)
    except CkptError:
        return None
    nodes = _nodes(manifest)
    if len(nodes) < 2:
        return None
    present = set()
    for info in manifest.ranks:
        files = member_files(manifest, info.rank)
        if files and any((root / f.path).is_file() for _, f in files):
            present.add(info.node)
    if len(present) != 1:
        return None
    return present.pop(), manifest


def template_for(path: str, node: str) -> str | None:
    """``path`` with the component naming ``node`` replaced by ``{node}`` (the form every
    command takes for level-1 copies); None when no component is the node's name."""
    parts = list(Path(path).parts)
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] == node:
            parts[i] = "{node}"
            return str(Path(*parts))
    return None


def one_node_message(path: str, node: str, manifest: Manifest) -> str:
    nodes = _nodes(manifest)
    step = "none" if manifest.step is None else manifest.step
    what = (
        f"{path} is node {node}'s level-1 copy of step {step}, which {manifest.world_size} "
        f"rank(s) saved on {len(nodes)} nodes ({', '.join(nodes)}): each node's directory holds "
        "only its own ranks' files, so it is checked together with the others'"
    )
    template = template_for(path, node)
    if template is not None:
        return f"{what}: ckptfmt verify '{template}'"
    pairs = " ".join(f"--node {n}=DIR" for n in nodes)
    return f"{what}: give every node's directory, ckptfmt verify {pairs}"


def rebuild_hint(spec: NodeDirs, report: VerifyReport) -> str | None:
    """For a damaged level-1 checkpoint with redundancy: whether ``ckptfmt rebuild`` repairs it
    (a dry run, nothing written), as the line to print; None when there is no redundancy."""
    if report.healthy or report.redundancy is None:
        return None
    shown = None if isinstance(spec, Mapping) else os.fspath(spec)
    command = f"ckptfmt rebuild '{shown}'" if shown else "ckptfmt rebuild --node NAME=DIR ..."
    scheme = report.redundancy.get("scheme", "its")
    try:
        rebuild(spec, dry_run=True)
    except UnrecoverableDamageError:
        return (
            f"the damage is beyond what the {scheme} redundancy rebuilds (`{command}` says "
            "what is lost)"
        )
    except CkptError:
        return None
    return f"within what the {scheme} redundancy rebuilds: run `{command}` to repair it"


def lost_for_real(spec: NodeDirs, exc: UnrecoverableDamageError) -> list[str]:
    """The tensors an unrecoverable level-1 checkpoint really lost: those with a region in a
    missing or damaged file of a rank whose data cannot be rebuilt (the error lists every
    tensor those ranks wrote, though most of their files may be intact)."""
    try:
        manifest, _, dirs = node_dirs(spec)
    except CkptError:
        return list(exc.tensors)
    try:
        report = verify(spec)
    except CkptError:
        return list(exc.tensors)
    gone = {p.node for p in report.problems if p.kind == "missing" and p.file == "ckptfmt.json"}
    bad = {(p.node, p.file) for p in report.problems}
    node_of = {r.rank: r.node for r in manifest.ranks}
    single = len(set(dirs.values())) == 1
    lost: set[str] = set()
    for rank in exc.lost_ranks:
        node = node_of[rank]
        for t, f in member_files(manifest, rank):
            where = None if single else node
            if node in gone or (where, f.path) in bad or (node, f.path) in bad:
                lost.add(display(t.name))
    ordered = [display(t.name) for t in manifest.tensors() if display(t.name) in lost]
    return ordered or list(exc.tensors)


def without_absent_level1(doc: dict[str, Any], shared: Path) -> dict[str, Any]:
    """The ``list`` document without level-1 nodes when the manager that wrote ``shared`` had
    no level 1 (``local_dir`` null in its record): those nodes only ran the job."""
    try:
        record = json.loads((shared / LEVELS_FILE).read_text())
    except (OSError, ValueError):
        return doc
    if not isinstance(record, dict) or record.get("local_dir") is not None:
        return doc
    steps = {step: {**e, "level1": {}} for step, e in doc.get("steps", {}).items()}
    return {**doc, "nodes": {}, "steps": steps}


def first_node_dir(template: str) -> Path:
    """The directory ``inspect`` reads for a ``{node}`` template: a node's copy of the manifest
    (the good one most nodes hold; every node's copy describes the whole checkpoint)."""
    _, data, dirs = node_dirs(template)
    for d in dirs.values():
        try:
            if (d / "ckptfmt.json").read_bytes() == data:
                return d
        except OSError:  # that node's copy is missing or unreadable: another one holds it
            continue
    return next(iter(dirs.values()))  # pragma: no cover - node_dirs found a holder


def ranks_text(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))
