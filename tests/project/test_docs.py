"""The user guide builds, and every example in it and in the README runs.

``mkdocs build --strict`` fails on any warning, and ``mkdocs.yml`` makes broken links, missing
anchors and pages left out of the navigation warnings, so a link that rots fails here.

Every ```python block of ``README.md`` and ``docs/*.md`` runs in a subprocess with this
interpreter; every ```sh block whose commands are all ``ckptfmt ...`` (or ``rm``) runs line by
line with the installed ``ckptfmt`` command. The blocks of one page share one fresh temporary
directory and run in the page's order, so a page can save a checkpoint in one block and inspect
it in the next; each block is still a complete program (its own imports). A command is expected
to exit 0 unless its line ends with a comment ``# exit N``. A block preceded by the line
``<!-- skip: why -->`` is not run (one that needs ``mpiexec``, say); other blocks (```text,
```json) are prose. A block preceded by ``<!-- bucket -->`` runs against the tests' S3 server
(``kit.s3``): the ``AWS_*`` environment points at it and the bucket ``my-bucket`` exists, the
same one for every such block of the session.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from kit import REPO
from kit.s3 import S3Server

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent
TIMEOUT_S = 600

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
SKIP = re.compile(r"<!--\s*skip:[^>]*-->\s*$")
BUCKET = re.compile(r"<!--\s*bucket\s*-->\s*$")
BUCKET_NAME = "my-bucket"
EXIT = re.compile(r"#\s*exit\s+(\d+)\s*$")


class Block(NamedTuple):
    page: Path
    line: int
    lang: str
    code: str
    bucket: bool = False

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The runnable blocks of ``page``, in order."""
    text = page.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        lang, code = m.group(1), m.group(2)
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if SKIP.search(before):
            continue
        if lang == "python" or (lang == "sh" and commands(code)):
            line = text.count("\n", 0, m.start()) + 1
            out.append(Block(page, line, lang, code, bool(BUCKET.search(before))))
    return out


def commands(code: str) -> list[tuple[str, int]]:
    """The commands of an sh block with the exit status each must give, or [] when the block is
    not one to run (it calls something other than ``ckptfmt`` and ``rm``)."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        expected = EXIT.search(line)
        cmd = line.split(" #", 1)[0].strip()
        if not cmd or cmd.startswith("#"):
            continue
        if shlex.split(cmd)[0] not in ("ckptfmt", "rm"):
            return []
        out.append((cmd, int(expected.group(1)) if expected else 0))
    return out


ALL = [b for page in PAGES for b in blocks(page)]


@pytest.fixture(scope="module")
def page_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, Path]:
    return {page: tmp_path_factory.mktemp(page.stem) for page in PAGES}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.pop("CKPTFMT_NODE", None)
    return env


def _failed(block: Block, what: str, r: subprocess.CompletedProcess[str]) -> str:
    out, err = r.stdout[-3000:], r.stderr[-6000:]
    return f"{block.id}: {what} exited {r.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"


def _bucket_env(request: pytest.FixtureRequest) -> dict[str, str]:
    """The environment of a ``<!-- bucket -->`` block: the S3 server's, with ``my-bucket``."""
    server: S3Server = request.getfixturevalue("s3_server")
    names = {b["Name"] for b in server.client().list_buckets().get("Buckets", [])}
    if BUCKET_NAME not in names:
        server.make_bucket(BUCKET_NAME)
    return {**_env(), **server.env}


@pytest.mark.parametrize("block", ALL, ids=[b.id for b in ALL])
def test_example_runs(
    block: Block, page_dirs: dict[Path, Path], request: pytest.FixtureRequest
) -> None:
    cwd = page_dirs[block.page]
    env = _bucket_env(request) if block.bucket else _env()
    if block.lang == "python":
        r = subprocess.run(
            [sys.executable, "-c", block.code],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        assert r.returncode == 0, _failed(block, "the example", r)
        return
    for cmd, expected in commands(block.code):
        r = subprocess.run(
            ["bash", "-c", cmd],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        assert r.returncode == expected, _failed(block, f"`{cmd}` (expected {expected})", r)


def test_every_page_has_examples_or_says_why() -> None:
    """The extraction finds blocks at all (a changed fence syntax would otherwise pass empty)."""
    found = {b.page.name for b in ALL}
    assert {"README.md", "quickstart.md", "levels.md", "torch.md", "keras.md"} <= found


def test_mkdocs_build_is_strict_and_clean(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert r.returncode == 0 and "WARNING" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert (tmp_path / "site" / "spec" / "FORMAT" / "index.html").is_file()
