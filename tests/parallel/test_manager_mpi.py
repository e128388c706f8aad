"""``CheckpointManager`` under real ``mpiexec`` (``MpiComm``) and ``torchrun`` (``TorchComm``):
asynchronous multi-level saves and restores in fresh jobs, bit-exact; the ownership plan as
recorded in the manifest; what each node's level-1 directory holds; node loss; a crash at every
fault point of the save and flush protocols; SIGTERM; ``ckptfmt list``.

Every rank runs ``tests/workers/_parallel_worker.py`` (which checks what it restored itself and
writes digests of it); the tests here check those results again against the expected states, and the
directories on disk, from the outside. Two simulated nodes: rank ``r`` of ``n`` is on node
``n{r * 2 // n}``, with level 1 at ``<root>/l1/{node}`` and level 3 at ``<root>/l3``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from _parallel_worker import (
    FSDP_TENSORS,
    digest,
    dp_whole,
    fsdp_full,
    fsdp_replicated,
    make_state,
    nodes,
    split_rows,
)
from ckptfmt_cli.main import cli
from click.testing import CliRunner
from kit import REPO
from kit.arrays import assert_state_equal
from kit.files import committed_steps, data_files, files_under, metadata_files
from kit.launch import describe, run_mpi, run_torchrun, with_kit_path
from kit.worker import node_of

import ckptfmt
from ckptfmt.container.reader import read_manifest
from ckptfmt.dtypes import by_name
from ckptfmt.manifest.model import Manifest
from ckptfmt.storage import commit
from ckptfmt.storage.steps import step_dir_name

WORKER = str(REPO / "tests" / "workers" / "_parallel_worker.py")
JOB_TIMEOUT = 120


# --- launching the worker and reading what it found ---------------------------------------------


def launch(
    kind: str, n: int, tmp: Path, job: str, tasks: list[dict[str, Any]], timeout: float
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the worker with ``tasks`` on ``n`` ranks; return the finished job and its duration."""
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    plan = tmp / f"{job}.plan.json"
    plan.write_text(json.dumps({"out": str(out), "tasks": tasks}))
    start = time.monotonic()
    if kind == "mpi":
        proc = run_mpi(n, WORKER, "mpi", str(plan), timeout=timeout)
    else:
        proc = run_torchrun(n, WORKER, "torch", str(plan), timeout=timeout)
    return proc, time.monotonic() - start


def launch_ok(kind: str, n: int, tmp: Path, job: str, tasks: list[dict[str, Any]]) -> None:
    proc, _ = launch(kind, n, tmp, job, tasks, JOB_TIMEOUT)
    if proc.returncode != 0:
        pytest.fail(f"{job}: exit status {proc.returncode}\n{describe(proc)}", pytrace=False)


def results(out: Path, task: str, n: int) -> list[dict[str, Any]]:
    got = []
    for r in range(n):
        path = out / f"{task}.rank{r}.json"
        assert path.exists(), f"rank {r} wrote no results for {task}"
        res = json.loads(path.read_text())
        assert (res["rank"], res["size"], res["node"]) == (r, n, node_of(r, n))
        got.append(res)
    return got


def check_restored(out: Path, task: str, n: int, kind: str, step: int, level: int) -> list[Any]:
    """Every rank restored ``step`` from ``level``, bit-exact (digests computed here)."""
    reports = []
    for r, res in enumerate(results(out, task, n)):
        assert res["problems"] == [], f"rank {r}: {res['problems']}"
        assert res["failed_saves"] == []
        assert (res["step"], res["report"]["step"], res["report"]["level"]) == (step, step, level)
        assert res["digest"] == digest(make_state(kind, step, r, n)), f"rank {r}: data differ"
        reports.append(res["report"])
    return reports


def l1(root: Path, node: str) -> Path:
    return root / "l1" / node


def l3(root: Path) -> Path:
    return root / "l3"


def check_level1_layout(root: Path, step: int, n: int) -> Manifest:
    """Each node's copy holds exactly its ranks' files plus metadata, with the same manifest
    everywhere (level 3 included when flushed)."""
    name = step_dir_name(step)
    copies = [l1(root, node) / name for node in nodes(n)]
    if commit.is_committed(l3(root) / name):
        copies.append(l3(root) / name)
    manifests = {(c / "ckptfmt.json").read_bytes() for c in copies}
    assert len(manifests) == 1, f"step {step}: the copies hold different manifests"
    m = read_manifest(copies[0])
    assert m.step == step and m.world_size == n
    assert [(ri.rank, ri.node) for ri in m.ranks] == [(r, node_of(r, n)) for r in range(n)]
    union: set[str] = set()
    for node in nodes(n):
        mine = data_files(m, node)
        assert mine, f"node {node} wrote nothing"
        assert not mine & union, "a file written by two nodes"
        union |= mine
        got = files_under(l1(root, node) / name)
        assert got == mine | metadata_files(m), (
            f"{node}: extra {sorted(got - mine - metadata_files(m))}, "
            f"missing {sorted(mine | metadata_files(m) - got)}"
        )
    assert union == data_files(m)
    return m


def check_level3(root: Path, step: int, want: Any) -> Manifest:
    """Level 3's copy of ``step`` is committed, verifies with nothing extra and loads in one
    process bit-exactly equal to ``want``."""
    path = l3(root) / step_dir_name(step)
    assert commit.is_committed(path), f"step {step} is not on level 3"
    report = ckptfmt.verify(path)
    assert report.healthy, [p.to_json() for p in report.problems]
    assert report.unexpected_files == []
    m = read_manifest(path)
    assert files_under(path) == data_files(m) | metadata_files(m)
    assert_state_equal(ckptfmt.load(path), want(m.world_size) if callable(want) else want)
    return m


def cli_list(root: Path) -> dict[str, Any]:
    """``ckptfmt list <root>/l3 --json``."""
    result = CliRunner().invoke(cli, ["list", str(l3(root)), "--json"], prog_name="ckptfmt")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def leftovers(root: Path, n: int) -> list[str]:
    found = []
    for d in [*(l1(root, node) for node in nodes(n)), l3(root)]:
        if d.is_dir():
            found += [str(p) for p in d.iterdir() if commit.LEFTOVER.match(p.name)]
    return found


def no_audit_violations(out: Path, task: str, n: int) -> None:
    for res in results(out, task, n):
        assert res["audit_violations"] == [], (
            f"{task}: rank {res['rank']} on {res['node']} touched another node's level 1: "
            f"{res['audit_violations'][:5]}"
        )


def assert_blames_node(reason: str, lost: str, n: int) -> None:
    """A restore refusal names the lost node (or each of its ranks) and none of the others'
    ranks."""
    lost_ranks = [r for r in range(n) if node_of(r, n) == lost]
    assert lost in reason or all(f"rank {r}" in reason for r in lost_ranks), reason
    for r in range(n):
        if r not in lost_ranks:
            assert f"rank {r}:" not in reason and f"ranks {r})" not in reason, reason


def fsdp_whole(step: int) -> dict[str, Any]:
    return {"shards": fsdp_full(step), "replicated": fsdp_replicated(step), "step": step}


# --- save in one job, restore in another: data parallel, sharded, node loss ---------------------


@dataclass
class Run:
    n: int
    tmp: Path
    out: Path
    roots: dict[str, Path]
    lists: dict[str, dict[str, Any]]  # ckptfmt list --json, taken between the jobs


LOST = {"loss-flushed": "n1", "loss-local": "n0", "fsdp-loss": "n1"}


def run_save_restore(kind: str, n: int, tmp: Path) -> Run:
    names = ("dp", "fsdp", "loss-flushed", "loss-local", "fsdp-loss", "big")
    roots = {k: tmp / k for k in names}

    def task(name: str, action: str, state: str, **kw: Any) -> dict[str, Any]:
        return {
            "name": f"{name}-{action}",
            "action": action,
            "root": str(roots[name]),
            "state": state,
            **kw,
        }

    saves = [task("dp", "save", "dp", steps=[1, 2, 3])]
    restores = [task("dp", "restore", "dp")]
    saves.append(task("fsdp", "save", "fsdp", steps=[5]))
    restores.append(task("fsdp", "restore", "fsdp"))
    if kind == "mpi":
        # newest step flushed to level 3; after the restore, training goes on: step 4
        saves.append(task("loss-flushed", "save", "dp", steps=[1, 2, 3]))
        restores.append(task("loss-flushed", "restore", "dp", then_save=[4], close_flush=True))
        # only step 2 flushed; step 3 on level 1 only
        saves.append(
            task("loss-local", "save", "dp", steps=[1, 2, 3], flush_every=2, close_flush=False)
        )
        restores.append(task("loss-local", "restore", "dp", flush_every=2))
        # sharded state restored from level 3: each rank reads its rows from the shared copy
        saves.append(task("fsdp-loss", "save", "fsdp", steps=[5, 6]))
        restores.append(task("fsdp-loss", "restore", "fsdp"))
        # the default grid: a tensor bigger than one 16 MiB shard
        saves.append(task("big", "save", "big", steps=[7], default_grid=True))
        restores.append(task("big", "restore", "big", default_grid=True))
    launch_ok(kind, n, tmp, "save", saves)
    lists = {name: cli_list(root) for name, root in roots.items() if root.exists()}
    for name, node in LOST.items():
        if roots[name].exists():
            shutil.rmtree(l1(roots[name], node))
            lists[f"{name}-after-loss"] = cli_list(roots[name])
    launch_ok(kind, n, tmp, "restore", restores)
    return Run(n, tmp, tmp / "out", roots, lists)


@pytest.fixture(scope="module", params=[2, 4], ids=["n2", "n4"])
def mpi_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Run:
    n = request.param
    return run_save_restore("mpi", n, tmp_path_factory.mktemp(f"mpi{n}"))


@pytest.mark.mpi
def test_dp_restore_in_fresh_job_is_bit_exact(mpi_run: Run) -> None:
    n = mpi_run.n
    for r, res in enumerate(results(mpi_run.out, "dp-save", n)):
        assert res["failed_saves"] == [], f"rank {r}"
    [rep, *_] = check_restored(mpi_run.out, "dp-restore", n, "dp", step=3, level=1)
    assert rep["tried"] == []


@pytest.mark.mpi
def test_dp_writers_are_balanced_within_one_shard(mpi_run: Run) -> None:
    for step in (2, 3):
        m = read_manifest(l1(mpi_run.roots["dp"], "n0") / step_dir_name(step))
        written = [0] * mpi_run.n
        largest_shard = 0
        for t in m.tensors():
            item = by_name(t.dtype).itemsize
            largest_shard = max(largest_shard, math.prod(t.shard_shape) * item)
            for r in t.regions:
                written[r.rank] += math.prod(r.shape) * item
        total = sum(math.prod(t.shape) * by_name(t.dtype).itemsize for t in m.tensors())
        assert sum(written) == total
        even = total / mpi_run.n
        assert all(abs(w - even) <= largest_shard for w in written), (
            f"step {step}: bytes written per rank {written}: one is more than the largest shard "
            f"({largest_shard}) away from the even share {even}"
        )


@pytest.mark.mpi
def test_dp_level1_holds_own_nodes_files_only(mpi_run: Run) -> None:
    root = mpi_run.roots["dp"]
    for node in nodes(mpi_run.n):
        # keep_local=2: step 1 was removed from level 1 by retention
        assert committed_steps(l1(root, node)) == [2, 3]
    for step in (2, 3):
        check_level1_layout(root, step, mpi_run.n)


@pytest.mark.mpi
def test_dp_level3_verifies_and_loads_in_one_process(mpi_run: Run) -> None:
    root = mpi_run.roots["dp"]
    assert committed_steps(l3(root)) == [1, 2, 3]
    for step in (1, 2, 3):
        check_level3(root, step, partial(dp_whole, step))


@pytest.mark.mpi
def test_default_grid_tensor_bigger_than_a_shard(mpi_run: Run) -> None:
    check_restored(mpi_run.out, "big-restore", mpi_run.n, "big", step=7, level=1)
    m = check_level1_layout(mpi_run.roots["big"], 7, mpi_run.n)
    [w] = [t for t in m.tensors() if t.path == "w"]
    assert w.shard_shape == (4096, 1024)  # 16 MiB
    assert [f.path for r in w.regions for f in r.files] == ["w/c/0/0", "w/c/1/0"]
    check_level3(mpi_run.roots["big"], 7, make_state("big", 7, 0, mpi_run.n))


@pytest.mark.mpi
def test_fsdp_restore_gives_each_rank_its_rows(mpi_run: Run) -> None:
    check_restored(mpi_run.out, "fsdp-restore", mpi_run.n, "fsdp", step=5, level=1)


@pytest.mark.mpi
def test_fsdp_writers_hold_their_regions(mpi_run: Run) -> None:
    n = mpi_run.n
    m = check_level1_layout(mpi_run.roots["fsdp"], 5, n)
    seen = set()
    for t in m.tensors():
        name = t.path.split("/")[-1]
        if t.path.startswith("shards/"):
            seen.add(name)
            rows = split_rows(FSDP_TENSORS[name][1][0], n)
            for r in t.regions:
                start, count = rows[r.rank]
                assert start <= r.offset[0] and r.offset[0] + r.shape[0] <= start + count, (
                    f"{t.path}: rank {r.rank} writes rows {r.offset[0]}..+{r.shape[0]} but "
                    f"holds {start}..+{count}"
                )
                assert r.offset[1:] == (0,) * (len(t.shape) - 1) and r.shape[1:] == t.shape[1:]
    assert seen == set(FSDP_TENSORS)


@pytest.mark.mpi
def test_fsdp_level3_loads_whole_tensors(mpi_run: Run) -> None:
    check_level3(mpi_run.roots["fsdp"], 5, fsdp_whole(5))


@pytest.mark.mpi
def test_node_loss_newest_step_from_level3(mpi_run: Run) -> None:
    n, lost = mpi_run.n, LOST["loss-flushed"]
    [rep, *_] = check_restored(mpi_run.out, "loss-flushed-restore", n, "dp", step=3, level=3)
    assert rep["path"] == str(l3(mpi_run.roots["loss-flushed"]) / step_dir_name(3))
    assert len(rep["tried"]) == 1 and rep["tried"][0].startswith("step 3 level 1:"), rep["tried"]
    assert_blames_node(rep["tried"][0], lost, n)
    # training went on after the restore: step 4 everywhere again, flushed
    root = mpi_run.roots["loss-flushed"]
    for r, res in enumerate(results(mpi_run.out, "loss-flushed-restore", n)):
        assert res["failed_saves"] == [], f"rank {r}"
    check_level1_layout(root, 4, n)
    check_level3(root, 4, partial(dp_whole, 4))


@pytest.mark.mpi
def test_node_loss_newest_step_not_flushed_falls_back(mpi_run: Run) -> None:
    n, lost = mpi_run.n, LOST["loss-local"]
    root = mpi_run.roots["loss-local"]
    assert committed_steps(l3(root)) == [2]
    [rep, *_] = check_restored(mpi_run.out, "loss-local-restore", n, "dp", step=2, level=3)
    refused_l1 = [t for t in rep["tried"] if " level 1:" in t]
    assert [t.split(":")[0] for t in refused_l1] == ["step 3 level 1", "step 2 level 1"]
    for reason in refused_l1:
        assert_blames_node(reason, lost, n)
    assert all(t.startswith(("step 3 ", "step 2 level 1")) for t in rep["tried"]), rep["tried"]
    check_level3(root, 2, partial(dp_whole, 2))


@pytest.mark.mpi
def test_node_loss_sharded_state_from_level3(mpi_run: Run) -> None:
    n = mpi_run.n
    [rep, *_] = check_restored(mpi_run.out, "fsdp-loss-restore", n, "fsdp", step=6, level=3)
    assert len(rep["tried"]) == 1 and rep["tried"][0].startswith("step 6 level 1:"), rep["tried"]
    assert_blames_node(rep["tried"][0], LOST["fsdp-loss"], n)


@pytest.mark.mpi
def test_ckptfmt_list_reports_levels_and_node_loss(mpi_run: Run) -> None:
    n = mpi_run.n
    doc = mpi_run.lists["dp"]
    assert set(doc["nodes"]) == set(nodes(n))
    for node in nodes(n):
        assert doc["nodes"][node] == str(l1(mpi_run.roots["dp"], node))
    assert doc["steps"] == {
        "1": {"level3": "flushed", "level1": {nd: "absent" for nd in nodes(n)}},
        "2": {"level3": "flushed", "level1": {nd: "complete" for nd in nodes(n)}},
        "3": {"level3": "flushed", "level1": {nd: "complete" for nd in nodes(n)}},
    }
    for name in ("loss-flushed", "loss-local"):
        lost = LOST[name]
        before, after = mpi_run.lists[name], mpi_run.lists[f"{name}-after-loss"]
        assert set(before["steps"]) == set(after["steps"])
        assert after["nodes"][lost] == "not visible from here"
        for step in ("2", "3"):  # keep_local=2
            assert set(before["steps"][step]["level1"].values()) == {"complete"}
        for step, e in after["steps"].items():
            assert e["level1"][lost] == "not visible", (name, step, e)
            kept = {nd: s for nd, s in e["level1"].items() if nd != lost}
            assert kept == {
                nd: s for nd, s in before["steps"][step]["level1"].items() if nd != lost
            }
            assert e["level3"] == before["steps"][step]["level3"]
    assert mpi_run.lists["loss-flushed"]["steps"] == mpi_run.lists["dp"]["steps"]
    local = mpi_run.lists["loss-local"]["steps"]
    assert {s: e["level3"] for s, e in local.items()} == {"2": "flushed", "3": "absent"}
    # after the restore and step 4 of the job that went on: the lost node is back
    doc = cli_list(mpi_run.roots["loss-flushed"])
    assert doc["steps"]["4"] == {
        "level3": "flushed",
        "level1": {nd: "complete" for nd in nodes(n)},
    }


@pytest.mark.mpi
def test_ckptfmt_list_command_line(mpi_run: Run) -> None:
    """The installed command, in a subprocess, says the same as in-process."""
    proc = subprocess.run(
        [sys.executable, "-m", "ckptfmt_cli", "list", str(l3(mpi_run.roots["dp"])), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == mpi_run.lists["dp"]


@pytest.mark.mpi
def test_no_rank_touches_another_nodes_level1(mpi_run: Run) -> None:
    n = mpi_run.n
    tasks = ["dp", "fsdp", "loss-flushed", "loss-local", "fsdp-loss", "big"]
    for job in ("save", "restore"):
        for t in tasks:
            no_audit_violations(mpi_run.out, f"{t}-{job}", n)
    for t in tasks:  # the hook does see this rank's own level-1 traffic
        for res in results(mpi_run.out, f"{t}-save", n):
            assert res["audit_own_events"] > 0, (t, res["rank"])


AUDIT_PROBE = """
import json, shutil, sys
from pathlib import Path
from _parallel_worker import Audit
tmp = Path(sys.argv[1])
(tmp / "l1" / "n1").mkdir(parents=True)
(tmp / "l1" / "n0").mkdir()
audit = Audit()
audit.watch(str(tmp), "n0", ["n0", "n1"])
(tmp / "l1" / "n0" / "x").write_text("")
(tmp / "l1" / "n1" / "y").write_text("")
list((tmp / "l1" / "n1").iterdir())
shutil.rmtree(tmp / "l1" / "n1")
found = {"violations": audit.violations, "own": audit.own_events}
audit.watch("", "n0", [])
print(json.dumps(found))
"""


def test_audit_hook_catches_other_nodes_paths(tmp_path: Path) -> None:
    """The instrument of the test above (run in a subprocess: an audit hook stays for good)."""
    proc = subprocess.run(
        [sys.executable, "-c", AUDIT_PROBE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO / "tests" / "workers",
        env=with_kit_path(os.environ),
    )
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    other = str(tmp_path / "l1" / "n1")
    events = [(event, path) for event, path, _thread in found["violations"]]
    assert events[:3] == [("open", f"{other}/y"), ("os.listdir", other), ("shutil.rmtree", other)]
    assert found["own"] == 1


# --- torch.distributed ----------------------------------------------------------------------------


@pytest.mark.torch
@pytest.mark.slow
def test_torchrun_save_restore_bit_exact(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    n = 4
    run = run_save_restore("torch", n, tmp_path)
    check_restored(run.out, "dp-restore", n, "dp", step=3, level=1)
    check_restored(run.out, "fsdp-restore", n, "fsdp", step=5, level=1)
    for step in (2, 3):
        check_level1_layout(run.roots["dp"], step, n)
    check_level1_layout(run.roots["fsdp"], 5, n)
    check_level3(run.roots["dp"], 3, partial(dp_whole, 3))
    check_level3(run.roots["fsdp"], 5, fsdp_whole(5))
    for t in ("dp", "fsdp"):
        for job in ("save", "restore"):
            no_audit_violations(run.out, f"{t}-{job}", n)


# --- crash at every fault point ------------------------------------------------------------------

N_CRASH = 4
ALL = frozenset({"n0", "n1"})
NONE: frozenset[str] = frozenset()
# point -> the rank that dies there (the hook must fire on it: "committing" and "committed" run on
# the node leaders only, ranks 0 and 2; "flush-committing" on rank 0 only), the nodes whose level 1
# must hold step 2 committed afterwards, and those whose level 1 must not. The others depend on
# how far the surviving leaders got before the job was ended (after "manifest" on a non-leader,
# every leader still has all it needs to commit; after n1's leader died at "committing" or
# "committed", n0's leader may or may not have committed). Either way restore must get step 2
# exactly when every node's level 1 holds it committed, else step 1.
CRASH_POINTS: dict[str, tuple[int, frozenset[str], frozenset[str]]] = {
    "declared": (1, NONE, ALL),
    "staged": (1, NONE, ALL),
    "written": (1, NONE, ALL),
    "manifest": (1, NONE, NONE),
    "committing": (2, NONE, frozenset({"n1"})),
    "committed": (2, frozenset({"n1"}), NONE),
    "flush-staged": (1, ALL, NONE),
    "flush-copied": (1, ALL, NONE),
    "flush-committing": (0, ALL, NONE),
    "flushed": (1, ALL, NONE),
}
FLUSHED_AT = {"flushed"}  # points by which level 3 holds step 2 committed


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("point", list(CRASH_POINTS))
def test_crash_at_fault_point_restores_old_or_new_never_a_mix(point: str, tmp_path: Path) -> None:
    n = N_CRASH
    rank, committed_on, not_on = CRASH_POINTS[point]
    root = tmp_path / "ckpt"
    proc, took = launch(
        "mpi",
        n,
        tmp_path,
        "crash",
        [
            {
                "name": "crash",
                "action": "crash",
                "root": str(root),
                "state": "dp",
                "point": point,
                "crash_rank": rank,
                "flush_every": 1,
            }
        ],
        timeout=60,
    )
    out = tmp_path / "out"
    assert (out / "crash.crashed").is_file(), f"the fault never fired\n{describe(proc)}"
    assert (out / "crash.crashed").read_text() == f"{rank} {point}"
    assert proc.returncode != 0, f"the job survived the crash\n{describe(proc)}"
    assert took < 30, f"the job took {took:.0f} s to end after the crash: a hang"
    assert not (out / f"crash.rank{rank}.json").exists(), "the crashed rank went on"

    # what the crash left: step 2 committed on these nodes' level 1 (and on level 3?)
    on_l1 = {node for node in nodes(n) if commit.is_committed(l1(root, node) / step_dir_name(2))}
    assert committed_on <= on_l1 and not on_l1 & not_on, on_l1
    assert commit.is_committed(l3(root) / step_dir_name(2)) == (point in FLUSHED_AT)
    step = 2 if on_l1 == set(nodes(n)) else 1
    if point.startswith("flush-"):  # the torn copy shows as such until restore cleans it
        assert cli_list(root)["steps"]["2"]["level3"] == "flushing"

    launch_ok(
        "mpi",
        n,
        tmp_path,
        "restore",
        [{"name": "restore", "action": "restore", "root": str(root), "state": "dp"}],
    )
    check_restored(out, "restore", n, "dp", step=step, level=1)
    no_audit_violations(out, "restore", n)
    assert leftovers(root, n) == []
    # the old checkpoint is untouched on level 3
    check_level3(root, 1, partial(dp_whole, 1))
    if point in FLUSHED_AT:
        check_level3(root, 2, partial(dp_whole, 2))
    doc = cli_list(root)
    for s, e in doc["steps"].items():
        states = [e["level3"], *e["level1"].values()]
        assert not any(x.startswith("damaged") or x == "flushing" for x in states), (s, e)
    assert set(doc["steps"][str(step)]["level1"].values()) == {"complete"}


@pytest.mark.mpi
@pytest.mark.slow
def test_crashes_leaving_two_saves_of_one_step_are_never_mixed(tmp_path: Path) -> None:
    """Step 2 is committed on n0 only (n1's leader died at "committing"); the restarted job
    restores step 1 and saves step 2 again, and this time n0's leader dies at "committing": n0
    still holds the first save of step 2, n1 the second. Both nodes have a committed step 2, but
    not the same one: restore must refuse it and take step 1."""
    n, root, out = N_CRASH, tmp_path / "ckpt", tmp_path / "out"
    crash = {"action": "crash", "root": str(root), "state": "dp", "point": "committing"}
    proc, _ = launch(
        "mpi", n, tmp_path, "crash1", [{**crash, "name": "crash1", "crash_rank": 2}], timeout=60
    )
    assert (out / "crash1.crashed").is_file() and proc.returncode != 0, describe(proc)
    first = read_manifest(l1(root, "n0") / step_dir_name(2)).save_id
    proc, _ = launch(
        "mpi",
        n,
        tmp_path,
        "crash2",
        [
            {"name": "restore1", "action": "restore", "root": str(root), "state": "dp"},
            {**crash, "name": "crash2", "crash_rank": 0, "before": []},
        ],
        timeout=60,
    )
    assert (out / "crash2.crashed").is_file() and proc.returncode != 0, describe(proc)
    check_restored(out, "restore1", n, "dp", step=1, level=1)
    ids = {node: read_manifest(l1(root, node) / step_dir_name(2)).save_id for node in nodes(n)}
    assert ids["n0"] == first != ids["n1"]
    launch_ok(
        "mpi",
        n,
        tmp_path,
        "restore",
        [{"name": "restore2", "action": "restore", "root": str(root), "state": "dp"}],
    )
    [rep, *_] = check_restored(out, "restore2", n, "dp", step=1, level=1)
    assert [t.split(":")[0] for t in rep["tried"]] == ["step 2 level 1"], rep["tried"]
    assert leftovers(root, n) == []


# --- SIGTERM -------------------------------------------------------------------------------------


@pytest.mark.mpi
def test_sigterm_flushes_newest_to_level3(tmp_path: Path) -> None:
    n = 4
    root = tmp_path / "ckpt"
    proc, took = launch(
        "mpi",
        n,
        tmp_path,
        "sigterm",
        [
            {
                "name": "sigterm",
                "action": "sigterm",
                "root": str(root),
                "state": "dp",
                "steps": [1, 2],
                "flush_every": 1000,
            }
        ],
        timeout=60,
    )
    out = tmp_path / "out"
    assert took < 40, describe(proc)
    for r in range(n):
        assert (out / f"sigterm.rank{r}.killing").is_file(), f"rank {r}\n{describe(proc)}"
    assert not list(out.glob("sigterm.rank*.json")), f"a rank survived SIGTERM\n{describe(proc)}"
    assert proc.returncode != 0
    for node in nodes(n):
        assert committed_steps(l1(root, node)) == [1, 2]
    assert committed_steps(l3(root)) == [2], describe(proc)
    check_level3(root, 2, partial(dp_whole, 2))
    assert leftovers(root, n) == []
