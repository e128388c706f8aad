"""A location is parsed once, where the user hands it in (``storage.store.location``): past that
boundary the code asks the :class:`~ckptfmt.storage.Location` (``is_bucket``, ``kind``,
``on_disk()``, ``directory()``, ``files()``), never the string. This scan of the source keeps it
so: outside ``ckptfmt/storage/`` no module imports or calls ``is_url`` or ``refuse_url``."""

from __future__ import annotations

import ast
from pathlib import Path

from kit import REPO

SOURCES = [REPO / "ckptfmt", REPO / "adapters", REPO / "tools"]
STORAGE = REPO / "ckptfmt" / "storage"
BANNED = frozenset({"is_url", "refuse_url"})


def string_branches(path: Path) -> list[str]:
    """``line: what`` for each import of ``is_url``/``refuse_url`` (under any name) and each
    call of one (by its name, an alias, or as an attribute: ``storage.is_url(x)``) in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = set(BANNED)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                if a.name in BANNED:
                    aliases.add(a.asname or a.name)
                    found.append(f"{node.lineno}: imports {a.name}")
    called: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = (
                f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            )
            if name in aliases:
                called.add(id(f))
                found.append(f"{node.lineno}: calls {name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in BANNED and id(node) not in called:
            found.append(f"{node.lineno}: names {node.attr}")  # passed on: filter(url.is_url, ..)
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


def _sources() -> list[Path]:
    return sorted(
        p
        for d in SOURCES
        for p in d.rglob("*.py")
        if STORAGE not in p.parents and "__pycache__" not in p.parts
    )


def test_no_string_branch_on_urls_outside_the_storage_layer() -> None:
    """Every ``is_url``/``refuse_url`` outside ``ckptfmt/storage/`` is reported with its line."""
    bad = []
    for path in _sources():
        rel = path.relative_to(REPO).as_posix()
        bad += [f"{rel}:{hit}" for hit in string_branches(path)]
    assert not bad, (
        "parse the location once where it is handed in (ckptfmt.storage.parse_location) and ask "
        "the Location:\n" + "\n".join(bad)
    )


def test_the_scan_finds_each_form(tmp_path: Path) -> None:
    """The scan can fail: a direct import and call, an alias, a call through the package, a
    function passed on; and it does not report the Location's own attributes."""
    cases = {
        "from ckptfmt.storage import is_url\nif is_url(p): pass\n": ["imports", "calls is_url"],
        "from ckptfmt.storage.paths import refuse_url as r\nr(p)\n": ["imports", "calls r"],
        "import ckptfmt.storage as s\ns.refuse_url(p)\n": ["calls refuse_url"],
        "from ckptfmt.storage.objects import url\nurls = filter(url.is_url, xs)\n": ["names"],
        "where = parse_location(p)\nif where.is_bucket: where.on_disk()\n": [],
    }
    for text, wanted in cases.items():
        path = tmp_path / "m.py"
        path.write_text(text)
        hits = string_branches(path)
        assert len(hits) == len(wanted), (text, hits)
        assert all(w in h for w, h in zip(wanted, hits)), (text, hits)
