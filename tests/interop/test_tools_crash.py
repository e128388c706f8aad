"""``ckptfmt export --overwrite`` killed (SIGKILL, a process of its own: ``kit.crash.kill_cli``)
right after each rename or directory exchange it makes beside OUT: OUT is at every instant the
old export or the new one, bit for bit, or (where the file system cannot exchange, so the old
export is renamed aside first) missing with the old export whole beside it, which the next
export or an import of OUT puts back; the next run leaves nothing beside OUT. And a failed
export or import leaves no directory it made."""

from __future__ import annotations

import errno
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy as stnp
from kit.arrays import assert_bit_equal, random_array
from kit.cli import run_cli
from kit.crash import kill_cli, steps
from kit.files import leftovers, tree_snapshot

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.errors import NotDurableError
from ckptfmt.interop import export as export_module
from ckptfmt.interop import export_safetensors

FAST = WriteOptions(chunk_bytes=512, shard_bytes=2048, fsync=False)


def _checkpoint(path: Path, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    state = {"model": {f"w{i}": random_array(rng, np.float32, (40, 30)) for i in range(3)}}
    ckptfmt.save(state, path, step=seed, write=FAST)
    return path


@pytest.fixture
def exports(tmp_path: Path) -> tuple[Path, Path, dict[str, bytes], dict[str, bytes]]:
    """Two checkpoints, and their exports' files (made aside, once) to compare OUT with."""
    old_src, new_src = _checkpoint(tmp_path / "a", 1), _checkpoint(tmp_path / "b", 2)
    for src, ref in ((old_src, "ref-old"), (new_src, "ref-new")):
        assert run_cli("export", src, tmp_path / ref, "-q").exit_code == 0
    return (
        old_src,
        new_src,
        tree_snapshot(tmp_path / "ref-old"),
        tree_snapshot(tmp_path / "ref-new"),
    )


def _export_over(tmp_path: Path, new_src: Path, n: int, exchange: bool) -> Path:
    """Export ``new_src`` over ``tmp_path/out/model`` in a process killed after the ``n``-th
    step; the parent of OUT is watched (``out/``)."""
    out = tmp_path / "out" / "model"
    done = kill_cli(n, out.parent, "export", new_src, out, "--overwrite", "-q", exchange=exchange)
    assert done.returncode == -9, f"not killed at step {n}: {done.returncode}\n{done.stderr}"
    return out


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_an_overwriting_export_killed_at_each_step_loses_neither_export(
    tmp_path: Path, exports: tuple[Path, Path, dict[str, bytes], dict[str, bytes]], exchange: bool
) -> None:
    old_src, new_src, old, new = exports
    out = tmp_path / "out" / "model"
    assert run_cli("export", old_src, out, "-q").exit_code == 0
    whole = kill_cli(0, out.parent, "export", new_src, out, "--overwrite", "-q", exchange=exchange)
    assert whole.returncode == 0, whole.stderr
    total = steps(whole)
    assert total >= 1, whole.stderr
    for n in range(1, total + 1):
        assert run_cli("export", old_src, out, "--overwrite", "-q").exit_code == 0
        _export_over(tmp_path, new_src, n, exchange)
        if exchange:  # OUT never lacks an export: the new one from the exchange on
            assert tree_snapshot(out) == new, n
        elif n == 1:  # between the two renames: OUT missing, the old export whole beside it
            assert not out.exists()
            # a reader of OUT (ckptfmt import) puts it back, and so would the next export
            got = run_cli("import", out, tmp_path / f"imported-{n}", "-q")
            assert got.exit_code == 0, got.output
            assert tree_snapshot(out) == old
        else:
            assert tree_snapshot(out) == new
        # the next export to OUT (refused without --overwrite: OUT is whole) cleans up beside it
        refused = run_cli("export", new_src, out, "-q")
        assert refused.exit_code == 2 and "exists" in refused.output, refused.output
        assert leftovers(out.parent) == [], n


def test_the_next_export_puts_back_the_export_a_kill_left_aside(
    tmp_path: Path, exports: tuple[Path, Path, dict[str, bytes], dict[str, bytes]]
) -> None:
    """Without an exchange, killed between its renames; the next export (not an import) is
    the first to look: it finds the old export first, then replaces it as asked."""
    old_src, new_src, old, new = exports
    out = tmp_path / "out" / "model"
    assert run_cli("export", old_src, out, "-q").exit_code == 0
    _export_over(tmp_path, new_src, 1, exchange=False)
    assert not out.exists() and len(leftovers(out.parent)) == 2  # the old aside, the staged new
    refused = run_cli("export", new_src, out, "-q")  # no --overwrite: the old one is there again
    assert refused.exit_code == 2, refused.output
    assert tree_snapshot(out) == old and leftovers(out.parent) == []
    assert run_cli("export", new_src, out, "--overwrite", "-q").exit_code == 0
    assert tree_snapshot(out) == new and leftovers(out.parent) == []


def test_an_import_killed_leaves_no_scratch_checkpoint_behind(
    tmp_path: Path, exports: tuple[Path, Path, dict[str, bytes], dict[str, bytes]]
) -> None:
    """An import for a job of 2 ranks (``--ranks 2``) saves into a scratch checkpoint beside
    OUT, then reshards it into OUT. Killed at each step, its scratch (a whole checkpoint) stays;
    the next import to OUT removes it, and nothing but the nodes' directories is left."""
    hf = tmp_path / "ref-old"
    root = tmp_path / "l1"
    template = str(root / "{node}")
    args = ["import", hf, template, "--ranks", "2", "--ranks-per-node", "1", "--overwrite", "-q"]
    whole = kill_cli(0, root, *args)
    assert whole.returncode == 0, whole.stderr
    total = steps(whole)
    assert total >= 3, whole.stderr  # the scratch committed, then each node's commit
    for n in range(1, total + 1):
        killed = kill_cli(n, root, *args)
        assert killed.returncode == -9, f"step {n}: {killed.returncode}\n{killed.stderr}"
        again = run_cli(*args)
        assert again.exit_code == 0, again.output
        assert sorted(p.name for p in root.iterdir()) == ["n0", "n1"], n
    got = run_cli("export", template, tmp_path / "back", "-q")
    assert got.exit_code == 0, got.output
    back = stnp.load_file(tmp_path / "back" / "model.safetensors")
    want = stnp.load_file(hf / "model.safetensors")
    assert sorted(back) == sorted(want)
    for name, a in want.items():
        assert_bit_equal(back[name], a)


def test_a_torch_export_killed_before_its_rename_leaves_nothing_after_the_next(
    tmp_path: Path, exports: tuple[Path, Path, dict[str, bytes], dict[str, bytes]]
) -> None:
    """``--to torch`` writes ``.<name>.export-*`` and renames it over OUT: killed just before
    the rename, the whole temporary file stays beside OUT (OUT is the old file); the next
    export to OUT removes it."""
    pytest.importorskip("torch")
    old_src, new_src, _, _ = exports
    root = tmp_path / "out"
    out = root / "model.pt"
    assert run_cli("export", "--to", "torch", old_src, out, "-q").exit_code == 0
    before = out.read_bytes()
    args = ["export", "--to", "torch", new_src, out, "--overwrite", "-q"]
    killed = kill_cli(-1, root, *args)
    assert killed.returncode == -9, killed.stderr
    assert out.read_bytes() == before and len(leftovers(root)) == 1
    assert run_cli(*args).exit_code == 0
    assert leftovers(root) == [] and out.read_bytes() != before


def test_the_next_export_leaves_the_users_files_that_only_look_like_leftovers(
    tmp_path: Path, exports: tuple[Path, Path, dict[str, bytes], dict[str, bytes]]
) -> None:
    """An export finishes what killed exports to OUT left beside it, by name; a directory or file
    of the user's whose name merely starts alike (``.model.export-notes``), and the staging
    directory of an export to another OUT (``model.export-b``), are not its own and stay, bit
    for bit, through exports to OUT (safetensors and ``--to torch``)."""
    old_src, _, old, _ = exports
    root = tmp_path / "out"
    root.mkdir()
    theirs = {
        root / ".model.export-notes" / "a.txt": b"the user's notes",
        root / ".model.export-old-backup" / "model.safetensors": b"the user's old copy",
        root / ".model.export-b.export-0123456789abcdef0123456789abcdef" / "x": b"another OUT's",
        root / ".model.pt.export-log": b"the user's log",
        root / ".model.pt.rebuilt-mine" / "y": b"the user's dir",
    }
    for path, data in theirs.items():
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
    assert run_cli("export", old_src, root / "model", "-q").exit_code == 0
    assert run_cli("export", old_src, root / "model", "--overwrite", "-q").exit_code == 0
    assert tree_snapshot(root / "model") == old
    if importlib.util.find_spec("torch") is not None:
        for _ in range(2):
            args = ["export", "--to", "torch", old_src, root / "model.pt", "--overwrite", "-q"]
            assert run_cli(*args).exit_code == 0
    for path, data in theirs.items():
        assert path.read_bytes() == data, path


def test_an_export_whose_swap_is_not_synced_keeps_the_replaced_export(
    tmp_path: Path,
    exports: tuple[Path, Path, dict[str, bytes], dict[str, bytes]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``export --overwrite`` swaps the new export in, then the sync of OUT's directory fails
    (EIO): the swap may not be on disk, so after a power loss OUT may name the old export
    again. The error says so (``StorageError``) and the replaced export stays whole beside OUT
    (it was deleted, leaving neither export in that case); the next export to OUT, synced,
    removes it."""
    old_src, new_src, old, new = exports
    out = tmp_path / "out" / "model"
    assert run_cli("export", old_src, out, "-q").exit_code == 0
    real = export_module.fsync_dir

    def fsync_dir(path: Path) -> None:
        if Path(path) == out.parent:
            raise OSError(errno.EIO, "Input/output error", str(path))
        real(path)

    monkeypatch.setattr(export_module, "fsync_dir", fsync_dir)
    with pytest.raises(NotDurableError, match="could not be synced"):
        export_safetensors(new_src, out, write=WriteOptions(overwrite=True, fsync=True))
    monkeypatch.undo()
    assert tree_snapshot(out) == new
    (aside,) = leftovers(out.parent)
    assert tree_snapshot(out.parent / aside) == old
    assert run_cli("export", new_src, out, "--overwrite", "-q").exit_code == 0
    assert tree_snapshot(out) == new and leftovers(out.parent) == []
