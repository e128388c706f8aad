"""The wheel carries what an installed ckptfmt needs, and the core stays framework-free.

The zarr start-up hook is checked where a user meets it: a wheel, and an editable wheel (what
``pip install -e .`` installs), each installed by pip into a fresh virtual environment of its
own, where a program that imports only zarr then reads a bfloat16 tensor. The fresh environment
sees this environment's numpy, zarr and ml_dtypes through a path line added after the install
(no network, no copies of them), and never this environment's ckptfmt or its hook: paths added
by a ``.pth`` line are not site directories, so their own ``.pth`` files are not run.
"""

from __future__ import annotations

import configparser
import os
import re
import stat
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from kit import REPO

import ckptfmt

PTH = "ckptfmt_zarr_dtypes.pth"
FRAMEWORKS = {
    "torch",
    "tensorflow",
    "tensorflow-cpu",
    "keras",
    "jax",
    "jaxlib",
    "flax",
    "pytorch-lightning",
    "lightning",
    "transformers",
    "accelerate",
    "mpi4py",
}
"""Distributions a core install must not pull (mpi4py is no framework, but a job's launcher's)."""


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tree (tracked and new files), so that the builds' own outputs (build/,
    *.egg-info) never land in the working tree."""
    src = tmp_path_factory.mktemp("source") / "ckptfmt"
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
    return src


@pytest.fixture(scope="module")
def wheel_path(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
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
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    wheels = sorted(out.glob("ckptfmt-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def wheel(wheel_path: Path) -> zipfile.ZipFile:
    return zipfile.ZipFile(wheel_path)


@pytest.fixture(scope="module")
def editable_wheel_path(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel ``pip install -e`` builds and installs (PEP 660's ``build_editable``)."""
    out = tmp_path_factory.mktemp("editable")
    code = f"from setuptools import build_meta; print(build_meta.build_editable({str(out)!r}))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=source, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return out / result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def bfloat16_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    values = (np.arange(24, dtype=np.float32) / 7 - 1).astype(ml_dtypes.bfloat16).reshape(4, 6)
    path = tmp_path_factory.mktemp("bf16") / "ckpt"
    ckptfmt.save({"model": {"w": values}}, path, step=1)
    return path, values


def _fresh_venv(root: Path, wheel: Path) -> Path:
    """A new virtual environment with ``wheel`` installed by pip (no dependencies, no index),
    then this environment's site-packages on its path; its interpreter."""
    env = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / "bin" / "python"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # after pip: seen before, this environment's ckptfmt would count as installed already
    (site / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


READ_WITH_PLAIN_ZARR = textwrap.dedent(
    """
    import sys
    import numpy as np
    import zarr

    a = zarr.open_array(sys.argv[1], mode="r")
    assert str(a.dtype) == "bfloat16", a.dtype
    print(np.asarray(a[...]).view(np.uint16).tobytes().hex())
    print(sys.modules["ckptfmt"].__file__)  # brought in by the hook, not by this program
    """
)


def _read_in(python: Path, array: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        [str(python), "-c", READ_WITH_PLAIN_ZARR, str(array)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("kind", ["wheel", "editable"])
def test_installed_ckptfmt_gives_plain_zarr_bfloat16(
    kind: str,
    request: pytest.FixtureRequest,
    bfloat16_checkpoint: tuple[Path, np.ndarray],
    tmp_path: Path,
) -> None:
    """pip installs the start-up hook from the wheel and from the editable wheel alike; zarr,
    imported alone in the fresh environment, then reads bfloat16 bit for bit; without the hook
    the same program fails (so what passes is the hook)."""
    built = request.getfixturevalue("wheel_path" if kind == "wheel" else "editable_wheel_path")
    python = _fresh_venv(tmp_path, built)
    ckpt, values = bfloat16_checkpoint
    r = _read_in(python, ckpt / "model" / "w", tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    hexed, where = r.stdout.split()
    assert hexed == values.view(np.uint16).tobytes().hex()
    installed = tmp_path / "venv" if kind == "wheel" else request.getfixturevalue("source")
    assert Path(where).is_relative_to(installed), where

    hook = next((tmp_path / "venv").glob(f"lib/python*/site-packages/{PTH}"))
    hook.unlink()
    r = _read_in(python, ckpt / "model" / "w", tmp_path)
    assert r.returncode != 0 and "bfloat16" in r.stderr, r.stdout + r.stderr


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


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in requirements}


def test_core_install_pulls_no_framework() -> None:
    """``pip install .`` installs the format, the manager and the CLI only; every integration's
    framework comes with its extra (the README's table names them)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = _names(project["dependencies"])
    assert not core & FRAMEWORKS, core & FRAMEWORKS
    assert {"numpy", "zarr", "ml_dtypes", "crc32c", "click"} <= core
    extras = {k: _names(v) for k, v in project["optional-dependencies"].items()}
    wanted = {
        "torch": {"torch"},
        "keras": {"tensorflow-cpu", "keras"},
        "tf": {"tensorflow-cpu", "keras"},
        "lightning": {"torch", "pytorch-lightning"},
        "hf": {"torch", "transformers", "accelerate"},
        "mpi": {"mpi4py"},
        "cloud": {"obstore", "boto3"},
    }
    for extra, names in wanted.items():
        assert names <= extras[extra], (extra, extras.get(extra))


def test_cli_core_commands_import_no_framework(tmp_path: Path) -> None:
    """``import ckptfmt`` and the CLI's inspect, verify, list and export to safetensors run in a
    process that never imports torch, TensorFlow, Keras or JAX."""
    root = tmp_path / "run"
    ckptfmt.save({"w": np.ones((4, 4), np.float32)}, root / "step-0000000001", step=1)
    code = textwrap.dedent(
        f"""
        import sys
        import ckptfmt
        from ckptfmt_cli.main import cli

        root = {str(root)!r}
        for args in (["inspect", root + "/step-0000000001"], ["verify", root + "/step-0000000001"],
                     ["list", root],
                     ["export", root + "/step-0000000001", {str(tmp_path / "st")!r}]):
            try:
                cli.main(args=args, prog_name="ckptfmt")
            except SystemExit as e:
                assert e.code in (0, None), (args, e.code)
        found = [m for m in ("torch", "tensorflow", "keras", "jax") if m in sys.modules]
        assert not found, found
        print("clean")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("clean"), out.stdout + out.stderr
    assert (tmp_path / "st" / "model.safetensors").is_file()
