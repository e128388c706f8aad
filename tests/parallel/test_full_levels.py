"""A training loop whose levels fill up loses no checkpoint silently.

Each case mounts small tmpfs file systems as level 1 and level 3 (in a child mount namespace,
``kit.full_disk``) and runs ``workers/_full_levels_worker.py``: a ``CheckpointManager`` with
``keep_local=3, keep_shared=3`` saves steps 10..120 of random sizes (one that fits on no
full level, the last one small), the loop catching ``CkptError`` around each save, then
``close``; a fresh manager restores. The level sizes keep the ratio of the report that found
the losses (level 1 40 MB, level 3 30 MB, checkpoints of 3-15 MB and one of 45 MB), scaled
down 10x.

What every run must show, for ``on_error="raise"`` and ``"warn"``, one process and
``mpiexec -n 2``:

- every save is accounted for: committed (on level 1, or level 3 when level 1 could not take
  it) or in ``failed_saves``, never both, never neither; only the step that fits nowhere fails;
- an error raised at a later call names the earlier step that failed, and the later call's own
  save was still taken;
- a failed flush is told once per step as a ``FlushWarning``, never as a failed save;
- each level keeps at most its ``keep`` steps, among them the newest it received;
- the fresh restore gives the newest step the loop was told was saved, bit for bit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from kit.full_disk import run_in_tmpfs_mounts
from kit.launch import mpiexec

WORKER = "tests/workers/_full_levels_worker.py"
FULL_L1, FULL_L3, ROOMY = "size=4m", "size=3m", "size=64m"
CASES = {
    "level 1 full": {"l1": FULL_L1, "l3": ROOMY},
    "level 3 full": {"l1": ROOMY, "l3": FULL_L3},
    "both full": {"l1": FULL_L1, "l3": FULL_L3},
}
SEEDS = [str(s) for s in range(1, 9)]


def run_loops(
    tmp_path: Path, mounts: dict[str, str], mode: str, ranks: int, seeds: list[str] = SEEDS
) -> list[Any]:
    out = tmp_path / "out.jsonl"
    launch = [str(mpiexec()), "-n", str(ranks), sys.executable, "-m", "mpi4py"]
    argv = [
        *(launch if ranks > 1 else [sys.executable]),
        WORKER,
        str(tmp_path / "l1"),
        str(tmp_path / "l3"),
        str(out),
        mode,
        *seeds,
    ]
    proc, _ = run_in_tmpfs_mounts(tmp_path, mounts, argv, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def check_run(r: dict[str, Any], case: str) -> None:
    sizes = {int(s): n for s, n in r["sizes"].items()}
    steps = sorted(sizes)
    failed, committed = set(r["failed"]), set(r["committed"])
    what = f"{case}, seed {r['seed']}, {r['mode']}, {r['ranks']} rank(s): {r}"
    assert committed.isdisjoint(failed) and committed | failed == set(steps), what
    too_big = {s for s in steps if sizes[s] == 45}
    # only the step that fits on no level fails (a roomy level 3 takes it when level 1 cannot)
    assert failed == (too_big if case == "both full" else set()), what
    assert len(r["failed"]) == len(failed), what  # each told once
    if r["mode"] == "raise":
        # every failure was raised, by a later save or by close, naming its own step
        assert sorted(v for v in r["raised"].values()) == sorted(failed), what
        for call, named in r["raised"].items():
            assert int(call) == -1 or int(call) > named, what
        taken = {int(c) for c in r["raised"] if int(c) != -1}
        assert taken <= committed | failed, what  # a call that raised still saved its step
    else:
        assert r["raised"] == {}, what
    assert len(r["flush_warned"]) == len(set(r["flush_warned"])), what
    assert set(r["flush_warned"]) <= committed, what  # a failed flush is no failed save
    if case == "level 1 full":
        assert r["flush_warned"] == [], what
    for level, keep in (("l1", 3), ("l3", 3)):
        held = [int(name[5:]) for name in r["held"][level]]
        assert len(held) <= keep, what
        newest = max(s for s in r["reached"][level]) if r["reached"][level] else None
        assert newest is None or newest in held, what  # the newest it received is kept
    told = [s for s in steps if s not in failed]
    assert r["restored"] == max(told) and r["exact"] is True, what


@pytest.mark.parametrize("mode", ["raise", "warn"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_full_level_loses_no_checkpoint_silently(tmp_path: Path, case: str, mode: str) -> None:
    for r in run_loops(tmp_path, CASES[case], mode, ranks=1):
        check_run(r, case)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["raise", "warn"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_full_level_loses_no_checkpoint_silently_on_two_ranks(
    tmp_path: Path, case: str, mode: str
) -> None:
    for r in run_loops(tmp_path, CASES[case], mode, ranks=2, seeds=SEEDS[:5]):
        check_run(r, case)


KEPT_SCRIPT = """
import json, os, sys
import numpy as np
import ckptfmt
from ckptfmt import CheckpointManager, WriteOptions

l1 = sys.argv[1]

def state(step):
    return {"w": np.full(1 << 18, step, np.float32)}  # 1 MiB

mgr = CheckpointManager(local_dir=l1, keep_local=10, async_save=False,
                        write=WriteOptions(fsync=False), recycle_level1=False)
mgr.keep([1])
for step in range(1, 9):
    mgr.save(step, state(step))
failed = [s for s, _ in mgr.failed_saves]
mgr.close(flush=False)
held = sorted(int(n[5:]) for n in os.listdir(l1) if n.startswith("step-"))
first = ckptfmt.load(os.path.join(l1, "step-0000000001"))["w"]
print(json.dumps({"held": held, "failed": failed, "exact": bool((first == 1).all())}))
"""


def test_a_full_level_keeps_the_steps_kept(tmp_path: Path) -> None:
    """Level 1 with room for ~3 checkpoints, 8 saves of 1 MiB, step 1 kept (``keep``, as the
    HF ``Trainer`` keeps its best): making room removes the oldest steps but the kept one,
    which still loads bit for bit, and every save commits."""
    argv = [sys.executable, "-c", KEPT_SCRIPT, str(tmp_path / "l1")]
    proc, _ = run_in_tmpfs_mounts(tmp_path, {"l1": "size=3600k"}, argv, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["failed"] == [], r
    assert r["held"][0] == 1 and r["held"][-1] == 8 and len(r["held"]) < 8, r  # room was made
    assert r["exact"], r


ROOM_SCRIPT = """
import json, os, sys, warnings
import numpy as np
import ckptfmt
from ckptfmt import CheckpointManager, WriteOptions

l1, l3, level = sys.argv[1], sys.argv[2], sys.argv[3]

def state(step):
    return {"w": np.full(1 << 18, step, np.float32)}  # 1 MiB

reports = []
mgr = CheckpointManager(local_dir=l1, shared_dir=l3, flush_every=1, keep_local=100,
                        keep_shared=100, async_save=False, on_save=reports.append,
                        write=WriteOptions(fsync=False))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for step in range(1, 9):
        mgr.save(step, state(step))
    mgr.close(flush=False)
told = [str(w.message) for w in caught if "to make room" in str(w.message)]
root = l1 if level == "1" else l3
held = sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step-"))
exact = all(
    (ckptfmt.load(os.path.join(root, f"step-{s:010d}"))["w"] == s).all() for s in held
)
print(json.dumps({
    "held": held,
    "exact": bool(exact),
    "failed": [s for s, _ in mgr.failed_saves],
    "reached": [r.step for r in reports if (r.level == 1 if level == "1" else r.flushed)],
    "made_room": {r.step: r.made_room for r in reports if r.made_room},
    "told": told,
}))
"""


@pytest.mark.parametrize("level", ["1", "3"])
def test_the_steps_a_full_level_gives_up_are_counted(tmp_path: Path, level: str) -> None:
    """A level with room for about 3 checkpoints of 1 MiB, 8 saves and ``keep`` of 100 (so no
    retention removes anything): each step the level no longer holds is in the ``made_room``
    of the save that removed it (its ``SaveReport``, what ``on_save`` hands a metrics logger),
    and was warned of; every step kept loads bit for bit."""
    mounts = {"l1": "size=3600k", "l3": "size=64m"}
    if level == "3":
        mounts = {"l1": "size=64m", "l3": "size=3600k"}
    argv = [sys.executable, "-c", ROOM_SCRIPT, str(tmp_path / "l1"), str(tmp_path / "l3"), level]
    proc, _ = run_in_tmpfs_mounts(tmp_path, mounts, argv, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["failed"] == [], r
    assert r["reached"] == list(range(1, 9)), r
    assert len(r["held"]) < 8 and r["held"][-1] == 8 and r["exact"], r  # room was made
    removed = [s for steps in r["made_room"].values() for s in steps.get(level, [])]
    assert sorted(removed) == sorted(set(range(1, 9)) - set(r["held"])), r  # each counted once
    for step, by_level in r["made_room"].items():
        assert all(s < int(step) for s in by_level[level]), r  # only older steps
    assert len(r["told"]) == len(r["made_room"]), r  # and each time the loop was told
