"""What the code past the boundary asks a parsed :class:`~ckptfmt.storage.Location` instead of
the string (``storage.store.location``): ``on_disk()`` and ``directory()`` where only a file
system works, ``files()`` to read the committed checkpoint there, ``shown`` for a reader's
path. Each kind a user hands in: a path, a ``{node}`` template, a mapping node -> directory,
a bucket's URL (on the test S3 server), and a URL of another scheme, refused as before."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from ckptfmt_cli.exits import ExitStatus
from kit.cli import run_cli
from kit.s3 import S3

import ckptfmt
from ckptfmt import ManagerSettings, WriteOptions
from ckptfmt.errors import NotACheckpointError, UrlNotSupportedError, UsageError
from ckptfmt.manifest.codec import MANIFEST_NAME
from ckptfmt.storage import Inside, ObjectInside, parse_location
from ckptfmt.storage.paths import refuse_url

STATE = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "step": 7}
FAST = WriteOptions(fsync=False)


def _refused(spec: str) -> str:
    """The message ``refuse_url`` gives for ``spec``: what every refusal of a URL says."""
    with pytest.raises(UrlNotSupportedError) as info:
        refuse_url(spec)
    return str(info.value)


def test_a_path(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    where = parse_location(root)
    assert (where.kind, where.is_bucket) == ("directory", False)
    assert where.on_disk() is where
    assert where.directory() == root
    assert where.shown == root and isinstance(where.shown, Path)
    with pytest.raises(NotACheckpointError):
        where.files()  # nothing committed there yet
    ckptfmt.save(STATE, root, write=FAST)
    files = where.files()
    assert isinstance(files, Inside) and not files.reads_parts  # a local file is read whole
    assert files.read(MANIFEST_NAME, 1 << 20) == (root / MANIFEST_NAME).read_bytes()


def test_a_template_and_a_node_map(tmp_path: Path) -> None:
    template = str(tmp_path / "{node}" / "step-1")
    for spec in (template, {"n0": tmp_path / "n0", "n1": tmp_path / "n1"}):
        where = parse_location(spec)
        assert where.kind == "spread" and not where.is_bucket
        assert where.on_disk() is where  # level 1: node directories are a file system's
        with pytest.raises(UsageError, match="spread over node directories: give one directory"):
            where.directory()
        with pytest.raises(UsageError, match="one store per node"):
            where.files()
    assert parse_location(template).shown == Path(template)


def test_a_bucket_url(tmp_path: Path, s3: S3) -> None:
    url = f"{s3.url}/run/ckpt"
    where = parse_location(url)
    assert (where.kind, where.is_bucket) == ("url", True)
    assert where.shown == url  # a str: a Path would fold its "//"
    for only_a_directory in (where.on_disk, where.directory):
        with pytest.raises(UrlNotSupportedError) as info:
            only_a_directory()
        assert str(info.value) == _refused(url)  # what refuse_url said of a bucket before
    ckptfmt.save(STATE, url, write=FAST)
    files = where.files()
    assert isinstance(files, ObjectInside) and files.reads_parts  # ranged GETs
    (key,) = [k for k in s3.keys("run/ckpt/") if k.endswith(f"/{MANIFEST_NAME}")]
    stored = s3.server.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read()
    assert files.read(MANIFEST_NAME, 1 << 20) == stored
    assert ckptfmt.open(where.shown)["w"][2, 3] == 11


def test_an_unsupported_url_is_refused_as_before(tmp_path: Path) -> None:
    for spec in ("http://x/y", "file:///x/y", "http://x/{node}/y"):
        with pytest.raises(UrlNotSupportedError) as info:
            parse_location(spec)
        assert str(info.value) == _refused(spec)
    with pytest.raises(UrlNotSupportedError, match="URLs are not supported"):
        parse_location({"n0": tmp_path, "n1": "s3://bucket/n1"})  # a node directory is local


def test_a_location_passes_the_parser_unchanged(tmp_path: Path) -> None:
    where = parse_location("s3://bucket/x", {"region": "eu-west-1"})
    assert parse_location(where) is where
    assert parse_location(where, {"region": "eu-west-1"}) is where
    with pytest.raises(UsageError, match="other storage_options"):
        parse_location(where, {"region": "us-east-1"})
    assert parse_location(parse_location(tmp_path)).directory() == tmp_path


def test_the_callers_refuse_a_bucket_where_a_directory_is_needed(tmp_path: Path) -> None:
    """Level 1 (the manager's ``local_dir``) and ``ckptfmt gc`` (a bucket only) ask the
    Location; a ``{node}`` template stays a valid level 1."""
    with pytest.raises(UrlNotSupportedError) as info:
        ManagerSettings(local_dir="s3://bucket/l1")
    assert str(info.value) == _refused("s3://bucket/l1")
    assert ManagerSettings(local_dir=str(tmp_path / "{node}")).local_dir == str(tmp_path / "{node}")
    result = run_cli("gc", tmp_path)
    assert result.exit_code == ExitStatus.USAGE
    assert "gc works on object-store URLs" in result.stderr


@pytest.mark.parametrize("call", ["save", "load"])
def test_a_state_passed_as_the_location_is_a_usage_error(tmp_path: Path, call: str) -> None:
    """``save(path, state)`` with its arguments swapped: the state (a mapping of arrays) looks
    like a mapping node -> directory; it is refused naming what it holds, not with a
    ``TypeError`` from deep in the path handling, and nothing is written."""
    import numpy as np

    import ckptfmt

    state = {"w": np.zeros(3)}
    with pytest.raises(UsageError, match="maps to ndarray"):
        if call == "save":
            ckptfmt.save(str(tmp_path / "c"), state)  # type: ignore[arg-type]
        else:
            ckptfmt.load(state)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("call", ["save", "load", "verify", "save-template"])
def test_a_path_with_a_nul_character_is_a_usage_error(tmp_path: Path, call: str) -> None:
    """No file system path holds a NUL: such a path (bytes pasted from elsewhere, a C string
    gone wrong) is refused as a :class:`UsageError` naming it, not a bare ``ValueError``
    ("embedded null byte") from ``os.mkdir`` deep in the save, nor "no such directory"."""
    bad = f"{tmp_path}/ck\0pt" + ("/{node}" if call == "save-template" else "")
    with pytest.raises(UsageError, match="NUL"):
        if call.startswith("save"):
            ckptfmt.save(STATE, bad, write=FAST)
        elif call == "load":
            ckptfmt.load(bad)
        else:
            ckptfmt.verify(bad)
    assert list(tmp_path.iterdir()) == []
