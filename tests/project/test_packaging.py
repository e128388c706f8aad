"""The wheel carries what an installed ckptfmt needs, and the core stays framework-free."""

from __future__ import annotations

import configparser
import stat
import subprocess
import sys
import textwrap
import zipfile

import pytest
from kit import REPO


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    # build from a copy of the tree, so that the build's own outputs (build/, *.egg-info) never
    # land in the working tree
    src = out / "src"
    files = (
        subprocess.run(
            [
                "git",
                "-C",
                str(REPO),
                "ls-files",
                "-z",
                "--cached",
                "--others",
                "--exclude-standard",
            ],
            check=True,
            capture_output=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for rel in filter(None, files):
        p = REPO / rel
        if not p.exists() and not p.is_symlink():
            continue
        dest = src / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if p.is_symlink():
            dest.symlink_to(p.readlink())
        elif p.is_file():
            dest.write_bytes(p.read_bytes())
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    wheels = sorted(out.glob("ckptfmt-*.whl"))
    assert len(wheels) == 1, wheels
    return zipfile.ZipFile(wheels[0])


def entry_points(wheel: zipfile.ZipFile) -> configparser.ConfigParser:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt"))
    cp = configparser.ConfigParser(delimiters=("=",))
    cp.optionxform = str  # type: ignore[assignment,method-assign]
    cp.read_string(wheel.read(name).decode())
    return cp


def test_pth_hook_at_top(wheel: zipfile.ZipFile) -> None:
    names = wheel.namelist()
    assert "ckptfmt_zarr_dtypes.pth" in names
    assert (
        wheel.read("ckptfmt_zarr_dtypes.pth")
        == (REPO / "tools/ckptfmt_zarr_dtypes.pth").read_bytes()
    )
    assert "ckptfmt_zarr_hook/__init__.py" in names
    record = next(n for n in names if n.endswith(".dist-info/RECORD"))
    assert "ckptfmt_zarr_dtypes.pth," in wheel.read(record).decode()


def test_schema_is_a_real_file(wheel: zipfile.ZipFile) -> None:
    info = wheel.getinfo("ckptfmt/manifest/manifest.schema.json")
    mode = info.external_attr >> 16
    assert not stat.S_ISLNK(mode), "shipped as a symlink"
    assert wheel.read(info) == (REPO / "spec/manifest.schema.json").read_bytes()
    assert "ckptfmt/py.typed" in wheel.namelist()


def test_packages_present(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for module in [
        "ckptfmt/__init__.py",
        "ckptfmt/zarr_plugin.py",
        "ckptfmt/maintenance/verify.py",
        "ckptfmt/manifest/codec.py",
        "ckptfmt/format/shard.py",
        "ckptfmt/storage/commit.py",
        "ckptfmt_cli/__init__.py",
        "ckptfmt_zarr_hook/__init__.py",
    ]:
        assert module in names, module
    assert not any(n.startswith(("tests/", "spec/", "bench/", "examples/")) for n in names)


def test_entry_points(wheel: zipfile.ZipFile) -> None:
    cp = entry_points(wheel)
    assert cp["console_scripts"]["ckptfmt"].strip() == "ckptfmt_cli.main:main"
    group = cp["zarr.data_type"]
    assert {k: v.strip() for k, v in group.items()} == {
        "bfloat16": "ckptfmt.zarr_plugin:BFloat16",
        "float8_e4m3fn": "ckptfmt.zarr_plugin:Float8E4M3FN",
        "float8_e5m2": "ckptfmt.zarr_plugin:Float8E5M2",
    }


def test_entry_point_targets_are_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    """Every entry point names a module the wheel ships (a console script whose module is
    missing installs fine and fails at its first run)."""
    names = set(wheel.namelist())
    cp = entry_points(wheel)
    for section in cp.sections():
        for key, target in cp[section].items():
            module = target.strip().split(":")[0].replace(".", "/")
            assert f"{module}.py" in names or f"{module}/__init__.py" in names, (section, key)


def test_entry_point_targets_import() -> None:
    from importlib.metadata import entry_points as installed

    import ckptfmt.zarr_plugin as plugin

    eps = installed(group="zarr.data_type")
    assert {ep.name for ep in eps} >= {"bfloat16", "float8_e4m3fn", "float8_e5m2"}
    for ep in eps:
        if ep.value.startswith("ckptfmt."):
            assert ep.load() in plugin.PLUGIN_DTYPES
    scripts = [ep for ep in installed(group="console_scripts") if ep.name == "ckptfmt"]
    assert len(scripts) == 1
    assert callable(scripts[0].load())


def test_core_never_imports_frameworks() -> None:
    code = textwrap.dedent(
        """
        import importlib, pkgutil, sys
        import ckptfmt
        for info in pkgutil.walk_packages(ckptfmt.__path__, "ckptfmt."):
            importlib.import_module(info.name)
        import ckptfmt_zarr_hook
        found = [m for m in ("torch", "tensorflow", "keras", "mpi4py", "jax")
                 if m in sys.modules]
        print(sorted(n for n in sys.modules if n.startswith("ckptfmt")))
        assert not found, found
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO.parent
    )
    assert out.returncode == 0, out.stdout + out.stderr
    imported = out.stdout
    for module in ("ckptfmt.zarr_plugin", "ckptfmt.maintenance.verify", "ckptfmt.manifest.codec"):
        assert repr(module) in imported, module


def test_zarr_learns_dtypes_without_importing_ckptfmt() -> None:
    """The .pth start-up hook is installed: a program that imports only zarr resolves
    'bfloat16' etc. (ckptfmt is pulled in by the hook, not by the program)."""
    code = textwrap.dedent(
        """
        from zarr.core.dtype import data_type_registry
        for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
            data_type_registry.match_json(name, zarr_format=3)
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO.parent
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
