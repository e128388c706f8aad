"""The layers of the code, enforced: the import contracts of ``pyproject.toml``
(``[tool.importlinter]``: the core's layers point down only, the collective protocol and the
offline tools never import each other, the core imports no framework), no import of the project's
own modules inside a function (the way to hide a cycle), and the adapters and the CLI importing
the core only through what its packages declare in ``__all__``."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kit import REPO

PROJECT = ("ckptfmt", "ckptfmt_torch", "ckptfmt_keras", "ckptfmt_cli", "ckptfmt_zarr_hook")
# imports that are lazy for a reason other than a cycle: the CLI loads an adapter (and so its
# framework) only for the command that needs it; the zarr hook runs at interpreter start-up and
# imports ckptfmt only when zarr is imported
LAZY_ALLOWED = {("tools/ckptfmt_cli", "ckptfmt_torch"), ("tools/ckptfmt_zarr_hook", "ckptfmt")}
SOURCES = [REPO / "ckptfmt", REPO / "adapters", REPO / "tools"]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), str(root / "adapters"), str(root / "tools")]),
    }
    return subprocess.run(
        [str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _files() -> list[Path]:
    return [p for d in SOURCES for p in d.rglob("*.py")]


def _imported(node: ast.Import | ast.ImportFrom, path: Path) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:  # relative: inside the project by definition
        return [f"(relative) {node.module or ''}"]
    return [node.module or ""]


def test_import_contracts_hold() -> None:
    done = _lint(REPO)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_an_upward_import_breaks_the_contract(tmp_path: Path) -> None:
    """The contract can fail: the manifest layer importing the manager is reported."""
    copy = tmp_path / "tree"
    copy.mkdir()
    for name in ("ckptfmt", "adapters", "tools"):
        shutil.copytree(REPO / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", copy / "pyproject.toml")
    model = copy / "ckptfmt" / "manifest" / "model.py"
    upward = "\nimport ckptfmt.parallel.manager.checkpoint_manager  # noqa\n"
    model.write_text(model.read_text() + upward)
    done = _lint(copy)
    assert done.returncode != 0
    assert "ckptfmt.manifest.model -> ckptfmt.parallel.manager.checkpoint_manager" in done.stdout


def test_no_project_import_inside_a_function() -> None:
    found = []
    for path in _files():
        tree = ast.parse(path.read_text(), str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    for mod in _imported(node, path):
                        rel = str(path.relative_to(REPO).parent)
                        if any(rel == d and mod.split(".")[0] == m for d, m in LAZY_ALLOWED):
                            continue
                        if mod.startswith("(relative)") or mod.split(".")[0] in PROJECT:
                            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {mod}")
    assert not found, "imports inside functions:\n" + "\n".join(found)


def _public(module: str) -> set[str]:
    __import__(module)
    return set(getattr(sys.modules[module], "__all__", ()))


def test_adapters_and_cli_use_only_the_public_api() -> None:
    """``from ckptfmt.X import name``: X is ``ckptfmt`` or one of its layers (a package, or a
    one-module layer such as ``ckptfmt.errors``), never a module inside a package, and ``name`` is
    in its ``__all__``."""
    bad = []
    for path in [p for d in SOURCES[1:] for p in d.rglob("*.py")]:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}"
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.split(".")[0] == "ckptfmt"
            ):
                mod = node.module
                if mod.count(".") > 1:
                    bad.append(f"{where}: {mod} is a module inside a package")
                    continue
                public = _public(mod)
                for a in node.names:
                    if a.name not in public and not hasattr(
                        sys.modules.get(f"{mod}.{a.name}"), "__path__"
                    ):
                        bad.append(f"{where}: {mod}.{a.name} is not in {mod}.__all__")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("ckptfmt."):
                        bad.append(f"{where}: import {a.name}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "package",
    [
        "ckptfmt",
        "ckptfmt.errors",
        "ckptfmt.tree",
        "ckptfmt.manifest",
        "ckptfmt.redundancy",
        "ckptfmt.storage",
        "ckptfmt.plan",
        "ckptfmt.format",
        "ckptfmt.container",
        "ckptfmt.engine",
        "ckptfmt.transport",
        "ckptfmt.parallel",
        "ckptfmt.maintenance",
        "ckptfmt.interop",
    ],
)
def test_every_package_declares_its_public_api(package: str) -> None:
    public = _public(package)
    assert public, f"{package} declares no __all__"
    mod = sys.modules[package]
    assert [n for n in sorted(public) if not hasattr(mod, n)] == []
