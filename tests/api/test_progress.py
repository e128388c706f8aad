"""Progress events (``ckptfmt.Progress``) of save, load, rebuild and reshard, and the CLI's bars.

Every operation's events are checked for what ``ckptfmt.storage.progress`` promises: ``done``
never decreases and never passes ``total``; ``total`` is fixed before the first byte is counted
(a rebuild that finds damage adds its work once, going from ``"check"`` to ``"rebuild"``); only
the last event is ``final``, with ``done == total``, and it comes once the result is committed
(so a bar at 100% means finished: the reshard bar used to sit full while the parity was still
being written). The meter's clock is replaced by one that advances a second per reading, so
that every counted step gives an event (the real one throttles them to one per 0.1 s).
"""

from __future__ import annotations

import io
import itertools
import shutil
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from ckptfmt_cli import render
from ckptfmt_cli.main import cli
from click.testing import CliRunner
from kit.level1 import NODES4, save_level1
from kit.reshard import save as save_ranks
from rich.console import Console

import ckptfmt
from ckptfmt import Progress, WriteOptions
from ckptfmt.maintenance import rebuild
from ckptfmt.maintenance.reshard import reshard
from ckptfmt.redundancy import Redundancy
from ckptfmt.storage import progress as progress_mod

GRID = {"chunk_bytes": 1 << 10, "shard_bytes": 4 << 10, "fsync": False}


@pytest.fixture(autouse=True)
def every_step_an_event(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = itertools.count()
    monkeypatch.setattr(progress_mod, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))


class Recorder:
    """A progress callback that keeps every event and, with each, ``probe()``'s answer then."""

    def __init__(self, probe: Callable[[], object] = lambda: None) -> None:
        self.events: list[Progress] = []
        self.probes: list[object] = []
        self.probe = probe

    def __call__(self, p: Progress) -> None:
        self.events.append(p)
        self.probes.append(self.probe())

    def check(self, op: str, fixed_total: bool = True) -> Progress:
        """The promises every operation keeps; returns the final event."""
        ev = self.events
        assert len(ev) >= 2, ev  # something in between, and the end
        assert {p.op for p in ev} == {op}
        assert [p.final for p in ev] == [False] * (len(ev) - 1) + [True]
        dones = [p.done for p in ev]
        assert dones == sorted(dones), dones
        assert all(p.done < p.total for p in ev[:-1]), ev  # never full before the end
        totals = [p.total for p in ev]
        assert totals == sorted(totals)
        if fixed_total:
            assert len(set(totals)) == 1, totals
        last = ev[-1]
        assert last.done == last.total > 0 and last.fraction == 1.0
        return last


def state() -> dict[str, object]:
    rng = np.random.default_rng(3)
    return {
        "w": rng.standard_normal((64, 100)).astype(np.float32),
        "b": rng.standard_normal(1000).astype(np.float64),
        "step": 4,
    }


def test_save_and_load_count_their_bytes(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    committed = Recorder(lambda: (path / "ckptfmt.json").exists())
    manifest = ckptfmt.save(state(), path, progress=committed, write=WriteOptions(**GRID))
    last = committed.check("save")
    assert last.total == sum(f.size for _, f in manifest.files())  # the data files written
    assert committed.probes[-1] is True and not any(committed.probes[:-1])

    loaded = Recorder()
    got = ckptfmt.load(path, progress=loaded)
    assert loaded.check("load").total >= 64 * 100 * 4 + 1000 * 8
    assert got["w"].tobytes() == state()["w"].tobytes()  # type: ignore[attr-defined]


def test_rebuild_checks_then_adds_the_rebuild_once(tmp_path: Path) -> None:
    template = save_level1(tmp_path / "ckpt", "xor", NODES4, set_size=4)
    shutil.rmtree(tmp_path / "ckpt" / "n2")
    back = Recorder(lambda: (tmp_path / "ckpt" / "n2" / "ckptfmt.json").exists())
    report = rebuild(template, write=WriteOptions(fsync=False), progress=back)
    assert report.recreated and report.lost_data == [2]
    back.check("rebuild", fixed_total=False)
    phases = [p.phase for p in back.events]
    first_rebuild = phases.index("rebuild")
    assert set(phases[:first_rebuild]) == {"check"} and set(phases[first_rebuild:]) == {"rebuild"}
    totals = [p.total for p in back.events]
    assert len(set(totals)) == 2  # the check's, then with the rebuild's work added once
    assert back.probes[-1] is True and not any(back.probes[:-1])  # full once n2 is committed

    healthy = Recorder()
    rebuild(template, write=WriteOptions(fsync=False), progress=healthy)
    assert {p.phase for p in healthy.events} == {"check"}
    healthy.check("rebuild")


def test_reshard_is_full_only_once_committed_parity_included(tmp_path: Path) -> None:
    src = save_ranks(tmp_path, 2, 3)
    dst = tmp_path / "dst" / "{node}"
    nodes = ["a", "b", "c", "d"]
    done = Recorder(lambda: all((tmp_path / "dst" / n / "ckptfmt.json").exists() for n in nodes))
    red = Redundancy.of({"scheme": "xor", "set_size": 4})
    reshard(
        src,
        dst,
        4,
        nodes=nodes,
        rows=["shards/*"],
        redundancy=red,
        progress=done,
        write=WriteOptions(**GRID),
    )
    done.check("reshard")  # the total planned before the first byte
    phases = [p.phase for p in done.events]
    assert {"read", "write", "parity"} <= set(phases)
    last_write = max(i for i, ph in enumerate(phases) if ph == "write")
    first_parity = phases.index("parity")
    assert last_write < first_parity  # the data files are all written before the parity
    at_data_end = done.events[last_write]
    assert at_data_end.done < at_data_end.total  # the parity is still to come
    assert done.probes[-1] is True and not any(done.probes[:-1])


def test_a_failing_callback_is_dropped_and_the_operation_goes_on(tmp_path: Path) -> None:
    calls = []

    def boom(p: Progress) -> None:
        calls.append(p)
        raise RuntimeError("the user's bar broke")

    ckptfmt.save(state(), tmp_path / "ckpt", progress=boom, write=WriteOptions(**GRID))
    assert len(calls) == 1
    assert ckptfmt.verify(tmp_path / "ckpt").healthy


def terminal(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    buffer = io.StringIO()
    term = Console(file=buffer, force_terminal=True, width=150)
    monkeypatch.setattr(render, "stderr_terminal", lambda: term)
    return buffer


def test_cli_rebuild_shows_its_phases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    template = save_level1(tmp_path / "ckpt", "xor", NODES4, set_size=4)
    shutil.rmtree(tmp_path / "ckpt" / "n1")
    buffer = terminal(monkeypatch)
    result = CliRunner().invoke(cli, ["rebuild", "--no-fsync", template])
    assert result.exit_code == 0, result.output
    shown = buffer.getvalue()
    assert "checking" in shown and "rebuilding" in shown
    assert (tmp_path / "ckpt" / "n1" / "ckptfmt.json").exists()

    buffer.seek(0)
    buffer.truncate()
    shutil.rmtree(tmp_path / "ckpt" / "n1")
    assert CliRunner().invoke(cli, ["rebuild", "-q", "--no-fsync", template]).exit_code == 0
    assert buffer.getvalue() == ""


def test_cli_reshard_bar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = save_ranks(tmp_path, 2, 3)
    buffer = terminal(monkeypatch)
    result = CliRunner().invoke(
        cli, ["reshard", "--no-fsync", "--ranks", "3", str(src), str(tmp_path / "dst")]
    )
    assert result.exit_code == 0, result.output
    assert "resharding" in buffer.getvalue()
    assert ckptfmt.verify(tmp_path / "dst").healthy
