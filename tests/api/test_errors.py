"""The error tree: every exception and warning of the project in ``ckptfmt.errors`` under
:class:`CkptError` or :class:`CkptWarning`, each error in one family, one field name per idea,
constructors that call their parents, the CLI's exit status derived from the family, and an OS
error on a level's directory reaching the user as a storage error naming the path and the level.
"""

from __future__ import annotations

import ast
import errno
import importlib
import inspect
import os
import pkgutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ckptfmt_cli.exits import STATUS_BY_FAMILY, ExitStatus, exit_status
from kit import REPO

import ckptfmt
import ckptfmt.errors as errors
from ckptfmt import CheckpointManager, ExitPolicy, WriteOptions
from ckptfmt.errors import (
    FAMILIES,
    CkptError,
    CkptWarning,
    SaveFailedError,
    StorageError,
    family_of,
)
from ckptfmt.parallel.levels.layout import Levels, agree_nodes
from ckptfmt.transport.threads import run_threads

ERRORS_DIR = REPO / "ckptfmt" / "errors"
SOURCES = [REPO / "ckptfmt", REPO / "adapters", REPO / "tools"]
# the same idea once had several names; the tree spells each one way (``path``, ``actual``, ...)
RETIRED_FIELDS = {"file", "directory", "url", "found", "nbytes", "filename"}


def _tree_classes() -> list[type[BaseException]]:
    return [
        c
        for c in vars(errors).values()
        if isinstance(c, type) and issubclass(c, Warning | CkptError)
    ]


def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _subclasses(sub)
    return out


# --- the tree's shape ----------------------------------------------------------------------------


def test_every_exception_class_of_the_project_is_defined_in_the_tree() -> None:
    """No module outside ``ckptfmt/errors/`` defines a class deriving from an exception or a
    warning (read from the source, so the adapters need no framework imported)."""
    outside = []
    for root in SOURCES:
        for path in root.rglob("*.py"):
            if ERRORS_DIR in path.parents:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ClassDef):
                    continue
                bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
                if any(b.endswith(("Error", "Exception", "Warning", "Interrupt")) for b in bases):
                    outside.append(f"{path.relative_to(REPO)}: {node.name}({', '.join(bases)})")
    assert outside == [], outside


def test_every_class_in_the_core_is_a_ckpt_error_or_warning() -> None:
    """Walking every module of ``ckptfmt``: each exception class it holds is a CkptError (or a
    CkptWarning), and is the tree's own class, exported by ``ckptfmt.errors``."""
    exported = set(_tree_classes())
    found = set()
    for info in pkgutil.walk_packages(ckptfmt.__path__, "ckptfmt."):
        if info.name == "ckptfmt.transport.mpi":  # needs mpi4py; read by the AST test above
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            ours = isinstance(value, type) and value.__module__.startswith("ckptfmt")
            if ours and issubclass(value, BaseException):
                found.add(value)
    assert found, "no exception class found: the walk is broken"
    for cls in found:
        assert issubclass(cls, CkptError | CkptWarning), cls
        assert cls in exported, f"{cls.__qualname__} is not exported by ckptfmt.errors"
    assert set(_subclasses(CkptError)) - exported == set()
    assert set(_subclasses(CkptWarning)) - exported == set()


def test_every_error_has_one_family_and_warnings_none() -> None:
    for cls in _tree_classes():
        if issubclass(cls, CkptError) and cls is not CkptError:
            assert family_of(cls) in FAMILIES, cls
        elif issubclass(cls, Warning):
            assert issubclass(cls, CkptWarning) and family_of(cls) is None, cls
    assert family_of(ValueError("x")) is None
    assert issubclass(CkptError, Exception) and not issubclass(CkptError, ValueError)


def test_built_in_mix_ins_are_kept() -> None:
    assert issubclass(errors.UsageError, ValueError)
    assert issubclass(errors.MissingFileError, FileNotFoundError)
    assert issubclass(errors.NotACheckpointError, FileNotFoundError)
    assert issubclass(errors.DestinationExistsError, FileExistsError)
    assert issubclass(errors.StorageError, OSError)
    assert issubclass(errors.DestinationUnwritableError, OSError | ValueError)
    assert issubclass(errors.AllocationLimitError, MemoryError)
    assert issubclass(errors.ManifestChecksumError, errors.ManifestError | errors.DamagedError)


def test_the_keras_adapter_raises_the_core_state_mismatch_error() -> None:
    source = (REPO / "adapters" / "ckptfmt_keras" / "__init__.py").read_text()
    assert "from ckptfmt.errors import" in source and "StateMismatchError" in source


# --- fields and constructors ---------------------------------------------------------------------


def test_one_field_name_per_idea() -> None:
    for cls in _tree_classes():
        if "__init__" in vars(cls):
            names = set(inspect.signature(cls.__init__).parameters)
            assert not names & RETIRED_FIELDS, (cls, names & RETIRED_FIELDS)


def test_every_constructor_calls_its_parents() -> None:
    """Each ``__init__`` of the tree calls ``super().__init__`` or a base's ``__init__`` by name
    (a diamond's roots are called by name so that neither runs twice)."""
    for path in ERRORS_DIR.glob("*.py"):
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef):
                continue
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                    calls = [ast.unparse(c.func) for c in ast.walk(fn) if isinstance(c, ast.Call)]
                    assert any(c.endswith("__init__") for c in calls), f"{path.name}: {cls.name}"


def test_the_fields_hold_what_they_name(tmp_path: Path) -> None:
    e: Any = errors.ChecksumError("t/c/0", "chunk", 1, 2, ("t",))
    assert (e.path, e.expected, e.actual, e.tensors) == ("t/c/0", 1, 2, ("t",))
    e = errors.ManifestChecksumError("a/ckptfmt.json", "bad")
    assert (e.path, e.reason, e.pointer) == ("a/ckptfmt.json", "bad", "")
    assert str(e) == "a/ckptfmt.json: damaged manifest: bad"
    e = errors.NotRegularFileError("t/c/0", "a FIFO")
    assert (e.path, e.what) == ("t/c/0", "a FIFO") and "not a regular file" in str(e)
    e = errors.FormatVersionError(9, [1, 2])
    assert (e.actual, e.supported) == (9, (1, 2))
    assert errors.LimitExceededError("depth", 70, 64).actual == 70
    assert errors.AllocationLimitError("w", 10, 5).actual == 10
    assert errors.UrlNotSupportedError("s3://b/x", "s3").path == "s3://b/x"
    full = errors.StorageFullError(
        "/d", err=errno.ENOSPC, writing="/d/f", level="level 1 (local_dir)"
    )
    assert (full.path, full.writing, full.level, full.errno) == (
        "/d",
        "/d/f",
        "level 1 (local_dir)",
        28,
    )
    moved = full.with_context(path="/e", needed=7)
    assert (moved.path, moved.needed, moved.level, moved.writing) == ("/e", 7, full.level, "/d/f")
    unwritable = errors.DestinationUnwritableError("/x/y", "/x is a file", err=errno.ENOTDIR)
    assert unwritable.errno == errno.ENOTDIR and "/x/y" in str(unwritable)
    broken = errors.ManagerBrokenError("gone")
    assert isinstance(broken, errors.CollectiveError) and str(broken) == "gone"
    state = errors.StateMismatchError(["a"], ["b"], {"w": ("float32[2]", "bfloat16[2]")})
    assert state.mismatched == {"w": ("float32[2]", "bfloat16[2]")}
    assert "bfloat16[2] in the state, float32[2] in the checkpoint" in str(state)
    assert 'cast="safe"' in str(state)  # only the dtype differs
    fields = errors.RankFailure.of(full).fields
    assert fields["path"] == "/d" and fields["level"] == "level 1 (local_dir)"


# --- exit statuses -------------------------------------------------------------------------------


def test_exit_status_follows_the_family() -> None:
    assert set(STATUS_BY_FAMILY) == set(FAMILIES)
    cases: list[tuple[BaseException, ExitStatus | None]] = [
        (errors.ChecksumError("f", "chunk", 1, 2), ExitStatus.DAMAGED),
        (errors.MissingFileError("f"), ExitStatus.DAMAGED),
        (errors.ManifestChecksumError("f", "bad"), ExitStatus.DAMAGED),
        (errors.UnrecoverableDamageError("d", "lost"), ExitStatus.DAMAGED),
        (errors.UsageError("bad"), ExitStatus.USAGE),
        (errors.DestinationExistsError("d", "exists"), ExitStatus.USAGE),
        (errors.DestinationUnwritableError("d", "read-only"), ExitStatus.USAGE),
        (errors.PerRankError(["rng"], 4, 2, [2, 3], []), ExitStatus.USAGE),
        (errors.NotACheckpointError("d", "no manifest"), ExitStatus.UNREADABLE),
        (errors.ManifestError("bad"), ExitStatus.UNREADABLE),
        (errors.FormatVersionError(9, [1, 2]), ExitStatus.UNREADABLE),
        (errors.ForeignFormatError("f", "truncated"), ExitStatus.UNREADABLE),
        (errors.StorageFullError("d", err=errno.ENOSPC), ExitStatus.UNREADABLE),
        (errors.StorageError("d", "permission denied"), ExitStatus.UNREADABLE),
        (errors.SaveFailedError({0: "x"}), ExitStatus.UNREADABLE),
        (PermissionError(13, "denied"), ExitStatus.UNREADABLE),
        (ValueError("a bug"), None),
    ]
    for exc, status in cases:
        assert exit_status(exc) == status, (type(exc).__name__, exit_status(exc), status)


# --- OS errors on a level's directory ------------------------------------------------------------


def test_shared_dir_under_a_file_is_named_at_the_constructor(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    shared = tmp_path / "afile" / "l3"
    with pytest.raises(StorageError) as info:
        CheckpointManager(shared_dir=shared, at_exit=ExitPolicy(sigterm=False))
    exc = info.value
    assert isinstance(exc, OSError) and isinstance(exc, CkptError)
    assert exc.errno == errno.ENOTDIR and exc.level == "level 3 (shared_dir)"
    assert str(shared) in str(exc) and "level 3 (shared_dir)" in str(exc)
    assert f"{tmp_path / 'afile'} is a file" in str(exc)


def test_local_dir_under_a_file_is_refused_at_the_constructor(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(StorageError) as info:
        CheckpointManager(local_dir=tmp_path / "afile" / "l1", at_exit=ExitPolicy(sigterm=False))
    assert info.value.level == "level 1 (local_dir)"
    assert f"{tmp_path / 'afile'} is a file" in str(info.value)


def test_local_dir_under_a_file_fails_the_save_naming_path_and_level(tmp_path: Path) -> None:
    """A level-1 root that became unwritable after the start (a file put where its parent
    directory belongs) fails the save, naming the path and the level."""
    mgr = CheckpointManager(
        local_dir=tmp_path / "afile" / "l1",
        on_error="raise",
        write=WriteOptions(fsync=False),
        at_exit=ExitPolicy(sigterm=False),
    )
    (tmp_path / "afile").write_text("x")
    try:
        with pytest.raises(SaveFailedError) as info:
            mgr.save(1, {"w": np.ones(4, np.float32)})
            mgr.wait()
        [failure] = info.value.rank_failures.values()
        assert failure.type == "StorageError" and failure.kind == "storage", failure
        assert failure.fields["level"] == "level 1 (local_dir)"
        assert str(tmp_path / "afile" / "l1") in failure.message
        assert "level 1 (local_dir)" in str(info.value)
    finally:
        mgr.close(flush=False)


def test_the_level_verdict_is_the_same_on_every_rank(tmp_path: Path) -> None:
    """The start's check of the level roots: one rank's unwritable root raises the same
    StorageError, naming it, its level and the rank, on every rank."""
    (tmp_path / "n1").write_text("a file where node n1's directory belongs")
    levels = Levels(str(tmp_path / "{node}" / "l1"), tmp_path / "l3")

    def start(comm: Any) -> object:
        try:
            return agree_nodes(comm, levels, f"n{comm.rank}")
        except StorageError as exc:
            return (exc.path, exc.level, exc.errno, str(exc))

    results = run_threads(2, start)
    assert results[0] == results[1], results
    path, level, err, message = results[0]  # type: ignore[misc]
    assert path == str(tmp_path / "n1" / "l1") and level == "level 1 (local_dir)"
    assert err == errno.ENOTDIR and "seen by rank 1" in message
    assert run_threads(2, lambda c: agree_nodes(c, Levels(None, tmp_path / "l3"), "n0")) == [
        ["n0", "n0"],
        ["n0", "n0"],
    ]
    assert not (tmp_path / "l3").exists(), "the check makes nothing"


def test_a_read_only_level_1_is_refused_at_the_constructor(tmp_path: Path) -> None:
    mnt = tmp_path / "ro"
    mnt.mkdir()
    code = (
        "from ckptfmt import CheckpointManager, ExitPolicy\n"
        "from ckptfmt.errors import StorageError\n"
        "try:\n"
        f"    CheckpointManager(local_dir={str(mnt / 'l1')!r}, at_exit=ExitPolicy(sigterm=False))\n"
        "except StorageError as e:\n"
        "    print('REFUSED', type(e).__name__, e.level, '|', e)\n"
    )
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("no mount namespace here to make a read-only file system in")
    shell = f'mount -t tmpfs -o ro none {mnt} && {sys.executable} -c "$CODE"'
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", shell],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "CODE": code},
    )
    out = proc.stdout
    assert "REFUSED StorageError level 1 (local_dir)" in out, out + proc.stderr
    assert str(mnt / "l1") in out and "read-only file system" in out, out


def test_saving_onto_a_checkpoint_names_the_keyword_that_replaces_it(tmp_path: Path) -> None:
    """Saving twice to one path (re-running an example) is refused with a hint that is a call
    ``save`` takes, copied from the message as it is."""
    path = tmp_path / "ckpt"
    ckptfmt.save({"w": np.zeros(3, np.float32)}, path)
    with pytest.raises(errors.DestinationExistsError) as info:
        ckptfmt.save({"w": np.ones(3, np.float32)}, path)
    message = str(info.value)
    assert str(path) in message
    hint = message.split("(pass ", 1)[1].split(" to replace it", 1)[0]
    assert hint == "write=WriteOptions(overwrite=True)"
    eval(
        f"save(state, path, {hint})",
        {**vars(ckptfmt), "state": {"w": np.ones(3, np.float32)}, "path": path},
    )
    assert (ckptfmt.load(path)["w"] == 1).all()


# a value per constructor field, for building every error of the tree in the pickling test
FIELD_VALUES: dict[str, Any] = {
    "path": "/ckpt/step-5",
    "reason": "why",
    "tensors": ("w",),
    "expected": 1,
    "actual": 2,
    "limit": 3,
    "tensor": "w",
    "what": "data",
    "op": "GET",
    "status": 403,
    "bucket": "b",
    "endpoint": "http://127.0.0.1:1",
    "failures": {0: ValueError("boom")},
    "cause": None,
    "operation": "save",
    "step": 5,
    "message": "failed",
    "missing": ("a",),
    "deadline_s": 1.5,
    "phase": "vote",
    "older": None,
    "hint": None,
    "mismatched": (),
    "cast": False,
    "supported": (3,),
    "framework": "torch",
    "version": "2.13",
    "name": "w",
    "world_size": 2,
    "launcher": "torchrun",
    "level": "level 1 (local_dir)",
    "err": errno.ENOSPC,
    "keys": ("k",),
    "entries": (),
    "saved": 2,
    "current": 1,
    "dropped": (),
    "ranks": (0,),
    "names": ("w",),
    "committed": False,
    "unexpected": (),
    "into": "model",
    "source": "/ckpt",
    "writing": "w",
    "needed": 10,
    "free": 5,
    "nodes": ("n0",),
    "writers": (1,),
    "lost_ranks": (1,),
    "lost": (1, 2),
    "tolerates": 1,
    "k": 4,
    "dtype": "complex256",
    "scheme": "xor",
    "needs": None,
    "args": "message",
    "fix": "set AWS_ENDPOINT_URL",
    "code": "missing",
}

FIELD_OVERRIDES: dict[str, dict[str, Any]] = {
    "CollectiveTimeoutError": {"missing": (1, 3)},
    "OutOfStepError": {"keys": {0: "save-5", 1: "save-6"}},
}


def test_every_error_pickles_with_its_message_and_fields() -> None:
    """``torch.distributed.checkpoint`` pickles a failed save's error on its coordinator and
    raises it on every rank: each error of the tree comes back of its type, with its message,
    its fields and its notes, though its constructor takes fields rather than the message; a
    field that does not pickle is dropped, never the error."""
    import pickle

    built = 0
    for name in errors.__all__:
        cls = getattr(errors, name)
        if not (inspect.isclass(cls) and issubclass(cls, CkptError)):
            continue
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
        needed = [p for p in params if p.default is inspect.Parameter.empty]
        values = FIELD_VALUES | FIELD_OVERRIDES.get(name, {})
        if any(p.kind is p.VAR_POSITIONAL for p in params):
            exc = cls(FIELD_VALUES["args"])
        else:
            exc = cls(
                *[values[p.name] for p in needed if p.kind is not p.KEYWORD_ONLY],
                **{p.name: values[p.name] for p in needed if p.kind is p.KEYWORD_ONLY},
            )
        exc.add_note("a note")
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is cls, name
        assert str(back) == str(exc), name
        assert back.__notes__ == ["a note"], name
        for k, v in vars(exc).items():
            if k != "cause":  # a CollectiveError's own exception stays with its rank
                assert getattr(back, k) == v or repr(getattr(back, k)) == repr(v), (name, k)
        assert family_of(back) == family_of(exc), name
        built += 1
    assert built >= 45, built
    unpicklable = errors.DestinationExistsError("/ckpt", "a checkpoint is there")
    unpicklable.handle = lambda: None  # type: ignore[attr-defined]
    back = pickle.loads(pickle.dumps(unpicklable))
    assert str(back) == str(unpicklable) and back.path == "/ckpt"
    assert not hasattr(back, "handle")
