"""The user guide builds, and every example in it and in the README runs.

``mkdocs build --strict`` fails on any warning, and ``mkdocs.yml`` makes broken links, missing
anchors and pages left out of the navigation warnings, so a link that rots fails here.

Every ```python block of ``README.md`` and ``docs/*.md`` runs in a subprocess with this
interpreter; every ```sh block whose commands are all ``ckptfmt ...`` (or ``rm``) runs line by
line with the installed ``ckptfmt`` command. The blocks of one page share one fresh temporary
directory and run in the page's order, so a page can save a checkpoint in one block and inspect
it in the next; each block is still a complete program (its own imports). A command is expected
to exit 0 unless its line ends with a comment ``# exit N``. A block preceded by the line
``<!-- skip: why -->`` is not run; one preceded by ``<!-- run: torchrun N -->`` is a script that
runs on N ranks under ``torchrun --standalone`` (gloo on this host), in the page's directory like
the others. A block preceded by ``<!-- bucket -->`` runs against the tests' S3 server
(``kit.s3``): the ``AWS_*`` environment points at it and the bucket ``my-bucket`` exists, the
same one for every such block of the session. Other blocks (```text, ```json) are prose.

The README is the first page a user reads, and runs again as they try it: it stays within
:data:`README_MAX_LINES` lines, starts with its two commands, every relative link in it resolves
(a file, and a heading of a Markdown file when the link names one), and its examples run twice
in a row in one directory (a second run must not meet the first one's checkpoints as errors).
Its advice to ``source .venv/bin/activate`` is what puts ``ckptfmt`` on ``PATH``.
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
TORCHRUN = re.compile(r"<!--\s*run:\s*torchrun\s+(\d+)\s*-->\s*$")
BUCKET = re.compile(r"<!--\s*bucket\s*-->\s*$")
BUCKET_NAME = "my-bucket"
TORCH_EXIT_ABORT = "terminate called without an active exception"
EXIT = re.compile(r"#\s*exit\s+(\d+)\s*$")


class Block(NamedTuple):
    page: Path
    line: int
    lang: str
    code: str
    ranks: int = 0  # > 0: run under torchrun on this many ranks
    bucket: bool = False  # run against the tests' S3 server

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
        ranks = TORCHRUN.search(before)
        if lang == "python" or (lang == "sh" and commands(code)):
            line = text.count("\n", 0, m.start()) + 1
            n = int(ranks.group(1)) if ranks else 0
            out.append(Block(page, line, lang, code, n, bool(BUCKET.search(before))))
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
    env = _bucket_env(request) if block.bucket else _env()
    run_block(block, page_dirs[block.page], env)


def run_block(block: Block, cwd: Path, env: dict[str, str] | None = None) -> None:
    """Run ``block`` in ``cwd`` as the module's docstring says; fail the test if it fails."""
    env = _env() if env is None else env
    if block.lang == "python":
        argv = [sys.executable, "-c", block.code]
        if block.ranks:
            script = cwd / f"_{block.page.stem}_{block.line}.py"
            script.write_text(block.code, encoding="utf-8")
            argv = [
                *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
                *("--nproc-per-node", str(block.ranks), "--monitor-interval", "0.2"),
                str(script),
            ]
        for _ in range(3 if block.ranks else 1):
            r = subprocess.run(
                argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
            )
            # torch 2.13 on CPU aborts about one run in three at interpreter exit, after
            # destroy_process_group, once DTensors went through gloo (reproduced with DCP's own
            # FileSystemWriter, no ckptfmt): that abort, and only it, runs the block again
            if r.returncode == 0 or TORCH_EXIT_ABORT not in r.stderr:
                break
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
    assert {"hf.md", "dcp.md"} <= found
    assert any(b.ranks > 1 for b in ALL), "no example runs on several ranks"


README = REPO / "README.md"
README_MAX_LINES = 200
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """The anchors of a Markdown page's headings, as GitHub and mkdocs make them."""
    out = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            words = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
            out.add(words.replace(" ", "-"))
    return out


def test_readme_is_short_and_starts_with_its_two_commands() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    first = next(b for b in FENCE.finditer(README.read_text(encoding="utf-8")))
    assert first.group(1) == "sh"
    assert [ln.split()[0] for ln in first.group(2).splitlines() if ln.strip()] == [
        "scripts/demo.sh",
        "scripts/test.sh",
    ]
    before = README.read_text(encoding="utf-8")[: first.start()]
    assert [ln for ln in before.splitlines() if ln.strip()] == ["# ckptfmt"]
    assert "source .venv/bin/activate" in README.read_text(encoding="utf-8")


def test_readme_links_resolve() -> None:
    text = README.read_text(encoding="utf-8")
    links = [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]
    assert links, "no relative links found: the pattern is broken"
    for target in links:
        path, _, anchor = target.partition("#")
        dest = README.parent / path if path else README
        assert dest.exists(), f"README.md links to {target}: {dest} does not exist"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"README.md links to {target}: no such heading"
    # a repository path named in code quotes (`adapters/ckptfmt_torch/lightning.py`) exists too
    for code in re.findall(r"`([\w.-]+(?:/[\w.-]+)+\.(?:py|md|sh|json|toml|txt))`", text):
        assert (README.parent / code).exists(), f"README.md names {code}, which does not exist"


def test_readme_examples_run_twice_in_one_directory(tmp_path: Path) -> None:
    """Trying the README again must work: its examples, run a second time where they ran, do
    not fail on what the first run left (a checkpoint already there, say)."""
    mine = [b for b in ALL if b.page == README]
    for _ in range(2):
        for block in mine:
            run_block(block, tmp_path)


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


def test_activating_the_environment_puts_ckptfmt_on_path(tmp_path: Path) -> None:
    """What the README says to type: after ``source .venv/bin/activate`` (this environment's
    script), ``ckptfmt`` and a ``python`` that imports ckptfmt are found on a bare ``PATH``."""
    activate = BIN / "activate"
    if not activate.is_file():
        pytest.skip(f"{BIN} is not a virtual environment")
    env = {k: v for k, v in _env().items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = "/usr/bin:/bin"
    script = (
        f"source {shlex.quote(str(activate))} && ckptfmt --version && python -c 'import ckptfmt'"
    )
    r = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and "ckptfmt" in r.stdout, r.stdout + r.stderr
    before = subprocess.run(
        ["bash", "-c", "command -v ckptfmt"], cwd=tmp_path, env=env, capture_output=True
    )
    assert before.returncode != 0  # not found without it: the README's advice is needed
