"""Level-1 redundancy under real ``mpiexec`` (``spec/redundancy.md``): a ``CheckpointManager``
job saves with ``redundancy=`` (xor, partner, rs with m=2, a cadence policy), whole node
directories are then deleted or files bit-flipped on disk, and a fresh job's ``restore`` must
rebuild what was lost from the surviving nodes and return the newest step from level 1, bit for
bit, without reading level 3; beyond the scheme's tolerance it must fall back (to level 3) and
say which ranks and tensors were lost. A rank that dies while encoding never leaves a mixed
checkpoint behind.

Every rank runs ``tests/workers/_parallel_worker.py`` (``"nodes"`` simulated nodes: rank ``r`` of
``n`` is on ``n{r * nodes // n}``), which checks what it restored itself and records digests, its
restore report and the paths it touched (other nodes' level 1; level-3 step directories); the
tests here check all of it again from the outside, plus the directories on disk and
``ckptfmt.maintenance.repair.rebuild(..., dry_run=True)`` before and after.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from _parallel_worker import digest, make_state, nodes
from kit import REPO
from kit.faults import flip
from kit.files import committed_steps, data_files, files_under, metadata_files, tree_digests
from kit.launch import describe, run_mpi, with_kit_path
from kit.worker import node_of

from ckptfmt.container.reader import read_manifest
from ckptfmt.errors import UnrecoverableDamageError
from ckptfmt.maintenance import repair
from ckptfmt.manifest.limits import display
from ckptfmt.manifest.model import Manifest
from ckptfmt.storage import commit
from ckptfmt.storage.steps import step_dir_name

WORKER = str(REPO / "tests" / "workers" / "_parallel_worker.py")
JOB_TIMEOUT = 120
RS2 = {"scheme": "rs", "m": 2}
POLICY = [{"every": 1, "redundancy": "xor"}, {"every": 2, "redundancy": "rs", "m": 2}]


@dataclass(frozen=True)
class Scenario:
    """One checkpoint directory: saved with ``redundancy``, then damaged on disk: the nodes in
    ``lose`` lose their whole level-1 directory; ``flip`` flips one bit in a file of step
    ``newest`` on a node (``"data"``: a data file of that node's first rank; ``"parity"``: that
    rank's parity file)."""

    redundancy: Any
    lose: tuple[str, ...] = ()
    flip: tuple[tuple[str, str], ...] = ()
    steps: tuple[int, ...] = (1, 2, 3)  # flush_every=2: only step 2 reaches level 3
    keep_local: int = 2
    restored: int = 3  # the step restore must return
    level: int = 1  # from this level

    @property
    def newest(self) -> int:
        return self.steps[-1]


# (ranks, simulated nodes) -> scenarios; the sets are [[0, 2], [1, 3]] on 4 ranks / 2 nodes and
# [[0, 2, 4, 6], [1, 3, 5, 7]] on 8 ranks / 4 nodes (the spec's index rule)
SCENARIOS: dict[tuple[int, int], dict[str, Scenario]] = {
    (4, 2): {
        "xor": Scenario("xor", lose=("n1",)),
        "partner": Scenario("partner", lose=("n0",)),  # n0 holds rank 0
        "corrupt-partner": Scenario("partner", flip=(("n1", "data"),)),
        # steps 4 and 5 are written into recycled slots (keep_local=2): their data and parity
        # files overwritten in place (storage/slots.py), then a node lost and rebuilt
        "xor-recycled": Scenario("xor", lose=("n1",), steps=(1, 2, 3, 4, 5), restored=5),
    },
    (8, 4): {
        "xor": Scenario("xor", lose=("n2",)),
        "partner": Scenario("partner", lose=("n1",)),
        "rs": Scenario(RS2, lose=("n1", "n3")),
        "corrupt-xor": Scenario("xor", flip=(("n3", "data"),)),
        "corrupt-rs": Scenario(RS2, flip=(("n2", "data"), ("n0", "parity"))),
        # two members of each xor set: no rebuild; level 3 holds step 2
        "beyond": Scenario("xor", lose=("n1", "n2"), restored=2, level=3),
        # saves 2 and 4 are rs (m=2), 1 and 3 xor: losing two nodes leaves step 4 rebuildable
        "policy": Scenario(POLICY, lose=("n0", "n3"), steps=(1, 2, 3, 4), keep_local=4, restored=4),
    },
}
SETS = {(4, 2): [[0, 2], [1, 3]], (8, 4): [[0, 2, 4, 6], [1, 3, 5, 7]]}


def l1(root: Path, node: str) -> Path:
    return root / "l1" / node


def template(root: Path, step: int) -> str:
    return str(root / "l1" / "{node}" / step_dir_name(step))


def ranks_on(node_names: tuple[str, ...] | list[str], n: int, k: int) -> list[int]:
    return [r for r in range(n) if node_of(r, n, k) in node_names]


def parity_files(m: Manifest, node: str) -> set[str]:
    red = m.levels["1"]["redundancy"]
    return {
        p["path"]
        for s in red["sets"]
        for r, p in zip(s["members"], s["parity"], strict=True)
        if m.ranks[r].node == node
    }


# --- launching ------------------------------------------------------------------------------------


def launch(n: int, tmp: Path, job: str, tasks: list[dict[str, Any]], timeout: float = JOB_TIMEOUT):
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    plan = tmp / f"{job}.plan.json"
    plan.write_text(json.dumps({"out": str(out), "tasks": tasks}))
    start = time.monotonic()
    proc = run_mpi(n, WORKER, "mpi", str(plan), timeout=timeout)
    return proc, time.monotonic() - start


def launch_ok(n: int, tmp: Path, job: str, tasks: list[dict[str, Any]]) -> None:
    proc, _ = launch(n, tmp, job, tasks)
    if proc.returncode != 0:
        pytest.fail(f"{job}: exit status {proc.returncode}\n{describe(proc)}", pytrace=False)


def results(out: Path, task: str, n: int, k: int) -> list[dict[str, Any]]:
    got = []
    for r in range(n):
        path = out / f"{task}.rank{r}.json"
        assert path.exists(), f"rank {r} wrote no results for {task}"
        res = json.loads(path.read_text())
        assert (res["rank"], res["size"], res["node"]) == (r, n, node_of(r, n, k))
        assert res["audit_violations"] == [], (
            f"{task}: rank {r} touched another node's level 1: {res['audit_violations'][:5]}"
        )
        assert res["failed_saves"] == [], f"{task}: rank {r}: {res['failed_saves']}"
        got.append(res)
    return got


def check_restored(
    out: Path, task: str, n: int, k: int, step: int, level: int
) -> list[dict[str, Any]]:
    """Every rank restored ``step`` from ``level``, bit-exact (digests computed here); the ranks'
    reports, which must agree."""
    reports = []
    for r, res in enumerate(results(out, task, n, k)):
        assert res["problems"] == [], f"{task}: rank {r}: {res['problems']}"
        assert (res["step"], res["report"]["step"], res["report"]["level"]) == (step, step, level)
        assert res["digest"] == digest(make_state("dp", step, r, n)), f"rank {r}: data differ"
        reports.append(res)
    for res in reports[1:]:
        for key in ("tried", "rebuilt", "unrecoverable"):
            assert untimed(res["report"][key]) == untimed(reports[0]["report"][key]), (
                task,
                key,
                res["rank"],
            )
    return reports


def untimed(lines: list[Any]) -> list[Any]:
    """Report lines without what differs between ranks: the rebuild's duration (each rank
    measures its own) and the node directory in paths (each rank names its own)."""
    return [
        re.sub(r"/l1/n[0-9]+/", "/l1/{node}/", re.sub(r" in [0-9.]+ s$", "", x))
        if isinstance(x, str)
        else x
        for x in lines
    ]


# --- one save job, damage on disk, one restore job, per job size ---------------------------------


@dataclass
class Run:
    n: int
    k: int
    tmp: Path
    out: Path
    roots: dict[str, Path]
    aside: dict[str, dict[str, Path]] = field(default_factory=dict)  # lost dirs, moved aside
    flipped: dict[str, list[tuple[Path, int, bytes]]] = field(default_factory=dict)
    dry_before: dict[str, Any] = field(default_factory=dict)  # RepairReport or the error
    intact_before: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)


def damage(run: Run, name: str, sc: Scenario) -> None:
    root = run.roots[name]
    m = read_manifest(l1(root, "n0" if "n0" not in sc.lose else "n1") / step_dir_name(sc.newest))
    for node in sc.lose:
        dest = run.tmp / "aside" / name / node
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(l1(root, node), dest)  # gone from l1; kept to compare with the rebuild
        run.aside.setdefault(name, {})[node] = dest
    for node, kind in sc.flip:
        rank = ranks_on([node], run.n, run.k)[0]
        if kind == "data":
            refs = [f for t in m.tensors() for g in t.regions if g.rank == rank for f in g.files]
            rel = max(refs, key=lambda f: f.size).path
        else:
            rel = f"ckptfmt-redundancy/{rank}"
        path = l1(root, node) / step_dir_name(sc.newest) / rel
        run.flipped.setdefault(name, []).append((path, rank, path.read_bytes()))
        flip(path, path.stat().st_size // 2, 0x10)
    try:
        run.dry_before[name] = repair.rebuild(template(root, sc.newest), dry_run=True)
    except UnrecoverableDamageError as exc:
        run.dry_before[name] = exc
    run.intact_before[name] = {
        node: tree_digests(l1(root, node)) for node in nodes(run.n, run.k) if node not in sc.lose
    }


def run_job(n: int, k: int, tmp: Path) -> Run:
    scenarios = SCENARIOS[(n, k)]
    run = Run(n, k, tmp, tmp / "out", {name: tmp / name for name in scenarios})

    def task(name: str, action: str, **kw: Any) -> dict[str, Any]:
        sc = scenarios[name]
        return {
            "name": f"{name}-{action}",
            "action": action,
            "root": str(run.roots[name]),
            "state": "dp",
            "nodes": k,
            "redundancy": sc.redundancy,
            "flush_every": 2,
            "keep_local": sc.keep_local,
            **kw,
        }

    launch_ok(
        n,
        tmp,
        "save",
        [
            task(name, "save", steps=list(sc.steps), close_flush=False)
            for name, sc in scenarios.items()
        ],
    )
    for name, sc in scenarios.items():
        damage(run, name, sc)
    launch_ok(n, tmp, "restore", [task(name, "restore") for name in scenarios])
    return run


@pytest.fixture(
    scope="module",
    params=[
        pytest.param((4, 2), id="4ranks-2nodes"),
        pytest.param((8, 4), id="8ranks-4nodes", marks=pytest.mark.slow),
    ],
)
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Run:
    n, k = request.param
    return run_job(n, k, tmp_path_factory.mktemp(f"red{n}"))


def scenarios_of(run: Run, *kinds: str) -> list[tuple[str, Scenario]]:
    return [
        (name, sc)
        for name, sc in SCENARIOS[(run.n, run.k)].items()
        if any(name == kd or name.startswith(kd + "-") for kd in kinds)
    ]


def check_node_dirs(run: Run, name: str, step: int) -> Manifest:
    """Every node's copy of ``step`` is committed with one manifest, and holds exactly its ranks'
    data files, the metadata and its ranks' parity files."""
    root = run.roots[name]
    copies = [l1(root, node) / step_dir_name(step) for node in nodes(run.n, run.k)]
    assert all(commit.is_committed(c) for c in copies), name
    assert len({(c / "ckptfmt.json").read_bytes() for c in copies}) == 1, name
    m = read_manifest(copies[0])
    for node, c in zip(nodes(run.n, run.k), copies, strict=True):
        want = data_files(m, node) | metadata_files(m) | parity_files(m, node)
        assert files_under(c) == want, (name, node, files_under(c) ^ want)
    return m


@pytest.mark.mpi
def test_manifest_records_scheme_and_sets(run: Run) -> None:
    for name, sc in SCENARIOS[(run.n, run.k)].items():
        node = next(nd for nd in nodes(run.n, run.k) if nd not in sc.lose)
        for step in sc.steps[-sc.keep_local :]:
            red = read_manifest(l1(run.roots[name], node) / step_dir_name(step)).levels["1"]
            red = red["redundancy"]
            if isinstance(sc.redundancy, list):  # the policy: xor on odd saves, rs on even
                want = ("rs", 2) if step % 2 == 0 else ("xor", 1)
            elif isinstance(sc.redundancy, dict):
                want = (sc.redundancy["scheme"], sc.redundancy["m"])
            else:
                want = (sc.redundancy, {"xor": 1, "partner": 0}[sc.redundancy])
            assert (red["scheme"], red["m"]) == want, (name, step)
            assert [s["members"] for s in red["sets"]] == SETS[(run.n, run.k)], (name, step)


@pytest.mark.mpi
def test_lost_nodes_rebuilt_and_restored_from_level1(run: Run) -> None:
    for name, sc in scenarios_of(run, "xor", "partner", "rs", "policy"):
        lost = ranks_on(sc.lose, run.n, run.k)
        before = run.dry_before[name]  # the instrument sees the loss before the restore
        assert isinstance(before, repair.RepairReport), (name, before)
        assert (before.lost_data, before.lost_parity) == (lost, lost), name

        [res, *_] = check_restored(run.out, f"{name}-restore", run.n, run.k, sc.restored, 1)
        rep = res["report"]
        assert rep["tried"] == [] and rep["unrecoverable"] == [], (name, rep)
        [line] = rep["rebuilt"]
        shown = ", ".join(map(str, lost))
        lost_nodes = ", ".join(sorted(sc.lose))
        assert line.startswith(
            f"step {sc.restored} level 1: no current rank sees the files written on node(s) "
            f"{lost_nodes} (saved ranks {shown})"
        ), line
        assert f"rebuilt data of rank(s) {shown} and parity of rank(s) {shown}" in line, line
        assert f"recreated node(s) {', '.join(sc.lose)} in " in line, line

        # the lost directories hold the newest step again, committed, byte for byte as saved
        check_node_dirs(run, name, sc.restored)
        for node, aside in run.aside[name].items():
            assert committed_steps(l1(run.roots[name], node)) == [sc.restored], (name, node)
            rebuilt = tree_digests(l1(run.roots[name], node) / step_dir_name(sc.restored))
            assert rebuilt == tree_digests(aside / step_dir_name(sc.restored)), (name, node)
        after = repair.rebuild(template(run.roots[name], sc.restored), dry_run=True)
        assert not after.repaired and after.lost_data == after.lost_parity == [], name


@pytest.mark.mpi
def test_bit_flipped_files_rebuilt_and_restored_from_level1(run: Run) -> None:
    for name, sc in scenarios_of(run, "corrupt"):
        data_ranks = sorted(
            r for p, r, _ in run.flipped[name] if "ckptfmt-redundancy" not in str(p)
        )
        parity_ranks = sorted(r for p, r, _ in run.flipped[name] if "ckptfmt-redundancy" in str(p))
        before = run.dry_before[name]
        assert isinstance(before, repair.RepairReport), (name, before)
        assert (before.lost_data, before.lost_parity) == (data_ranks, parity_ranks), name

        [res, *_] = check_restored(run.out, f"{name}-restore", run.n, run.k, sc.restored, 1)
        rep = res["report"]
        assert rep["tried"] == [] and rep["unrecoverable"] == [], (name, rep)
        [line] = rep["rebuilt"]
        assert line.startswith(f"step {sc.restored} level 1: "), line
        want = f"rebuilt data of rank(s) {', '.join(map(str, data_ranks))}"
        if parity_ranks:
            want += f" and parity of rank(s) {', '.join(map(str, parity_ranks))}"
        assert want + " in " in line, (want, line)
        assert "recreated" not in line, line

        for path, _rank, original in run.flipped[name]:
            assert path.read_bytes() == original, f"{name}: {path} not restored to its bytes"
            assert not list(path.parent.glob(".*rebuild*")), f"{name}: a temporary file was left"
        check_node_dirs(run, name, sc.restored)
        after = repair.rebuild(template(run.roots[name], sc.restored), dry_run=True)
        assert not after.repaired, name


@pytest.mark.mpi
def test_restore_from_level1_never_reads_level3(run: Run) -> None:
    for name, sc in SCENARIOS[(run.n, run.k)].items():
        if sc.level != 1:
            continue
        if sc.newest % 2 == 0:  # flush_every=2: the restored step is on level 3 as well
            assert committed_steps(run.roots[name] / "l3") == [2, 4], name
        for res in results(run.out, f"{name}-restore", run.n, run.k):
            assert res["l3_events"] == [], (name, res["rank"], res["l3_events"][:5])


@pytest.mark.mpi
def test_recycled_slots_were_written_in_place(run: Run) -> None:
    """``xor-recycled``: before the manager closed, every node held the slot retention made of
    step 3 after step 5, so steps 4 and 5 were written into slots (data and parity in place);
    step 5 was rebuilt and restored from them bit for bit
    (``test_lost_nodes_rebuilt_and_restored_from_level1``). Closing removed the slots."""
    if "xor-recycled" not in SCENARIOS[(run.n, run.k)]:
        pytest.skip("a scenario of the 4-rank job")
    sc = SCENARIOS[(run.n, run.k)]["xor-recycled"]
    saved = results(run.out, "xor-recycled-save", run.n, run.k)
    assert [r["slots_held"] for r in saved] == [1] * run.n
    for node in nodes(run.n, run.k):
        if node in sc.lose:
            continue
        assert not (l1(run.roots["xor-recycled"], node) / ".slots").exists(), node
        assert committed_steps(l1(run.roots["xor-recycled"], node)) == [4, 5], node


@pytest.mark.mpi
def test_beyond_tolerance_falls_back_and_names_what_is_lost(run: Run) -> None:
    if "beyond" not in SCENARIOS[(run.n, run.k)]:
        pytest.skip("needs two nodes of one set lost, with a third node alive")
    sc = SCENARIOS[(run.n, run.k)]["beyond"]
    root = run.roots["beyond"]
    lost = ranks_on(sc.lose, run.n, run.k)
    survivor = next(nd for nd in nodes(run.n, run.k) if nd not in sc.lose)
    before = run.dry_before["beyond"]
    assert isinstance(before, UnrecoverableDamageError), before
    assert list(before.lost_ranks) == lost

    [res, *_] = check_restored(run.out, "beyond-restore", run.n, run.k, 2, 3)
    rep = res["report"]
    assert rep["rebuilt"] == []
    assert [t.split(":")[0] for t in rep["tried"]] == ["step 3 level 1", "step 2 level 1"]
    assert all("cannot rebuild" in t for t in rep["tried"]), rep["tried"]
    assert [u["step"] for u in rep["unrecoverable"]] == [3, 2]
    for u in rep["unrecoverable"]:
        m = read_manifest(l1(root, survivor) / step_dir_name(u["step"]))
        tensors = sorted(
            {display(t.name) for t in m.tensors() for g in t.regions if g.rank in lost}
        )
        assert tensors and len(tensors) < len(m.tensors())
        assert (u["ranks"], u["nodes"], u["tensors"]) == (lost, list(sc.lose), tensors), u
    # the fallback read level 3 (the audit sees it), and nothing intact was touched
    for r in results(run.out, "beyond-restore", run.n, run.k):
        assert any("/l3/step-0000000002/" in e[1] for e in r["l3_events"]), r["rank"]
    for node, tree in run.intact_before["beyond"].items():
        assert tree_digests(l1(root, node)) == tree, node
    for node in sc.lose:
        assert not l1(root, node).exists()


@pytest.mark.mpi
def test_policy_xor_saves_tolerate_one_node_rs_saves_two(run: Run) -> None:
    if "policy" not in SCENARIOS[(run.n, run.k)]:
        pytest.skip("rs with m=2 needs sets of 3 or more: 4 nodes")
    root = run.roots["policy"]
    # step 4 (rs) was rebuilt by the restore; step 3 (xor) cannot be, having lost two members
    with pytest.raises(UnrecoverableDamageError) as err:
        repair.rebuild(template(root, 3), dry_run=True)
    lose = SCENARIOS[(run.n, run.k)]["policy"].lose
    assert list(err.value.lost_ranks) == ranks_on(lose, run.n, run.k)


# --- a rank dies while encoding -------------------------------------------------------------------

# case -> (fault point, the rank that dies there, ranks, simulated nodes), xor throughout.
# "encode-sendrecv": right after the rank's first encoding message
# (tests/workers/_parallel_worker.py crash_in_encoding), with its parity incomplete; on 8 ranks / 4
# nodes (sets of 4, three rounds of messages) the other members are in the middle of the ring.
# "encoded": its parity file written, before the save's one vote (on the data and the parity). No
# rank gets past that vote, so no node may commit step 2. "manifest": after the vote; rank 2, n1's
# leader, dies, so n1 never commits step 2, but nothing stops n0's leader from committing it: then
# step 2 is whole by its redundancy and the restore rebuilds n1's copy from it.
ENCODE_CRASHES = {
    "encode-sendrecv-r1": ("encode-sendrecv", 1, 4, 2),
    "encode-sendrecv-r2": ("encode-sendrecv", 2, 4, 2),
    "encode-sendrecv-8ranks": ("encode-sendrecv", 3, 8, 4),
    "encoded-r1": ("encoded", 1, 4, 2),
    "manifest-r2": ("manifest", 2, 4, 2),
}


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("case", list(ENCODE_CRASHES))
def test_crash_while_encoding_never_leaves_a_mix(case: str, tmp_path: Path) -> None:
    point, rank, n, k = ENCODE_CRASHES[case]
    root = tmp_path / "ckpt"
    common = {"root": str(root), "state": "dp", "redundancy": "xor", "nodes": k}
    proc, took = launch(
        n,
        tmp_path,
        "crash",
        [{"name": "crash", "action": "crash", "point": point, "crash_rank": rank, **common}],
        timeout=60,
    )
    out = tmp_path / "out"
    assert (out / "crash.crashed").is_file(), f"the fault never fired\n{describe(proc)}"
    assert (out / "crash.crashed").read_text() == f"{rank} {point}"
    assert proc.returncode != 0 and took < 30, describe(proc)
    assert not (out / f"crash.rank{rank}.json").exists(), "the crashed rank went on"
    on_l1 = {nd for nd in nodes(n, k) if commit.is_committed(l1(root, nd) / step_dir_name(2))}
    if point in ("encode-sendrecv", "encoded"):
        assert on_l1 == set(), on_l1
    else:
        assert node_of(rank, n, k) not in on_l1, on_l1
    assert not commit.is_committed(root / "l3" / step_dir_name(2))

    launch_ok(n, tmp_path, "restore", [{"name": "restore", "action": "restore", **common}])
    step = 2 if on_l1 else 1
    [res, *_] = check_restored(out, "restore", n, k, step, 1)
    if step == 2:  # committed on some nodes only: rebuilt on the others from its redundancy
        [line] = res["report"]["rebuilt"]
        assert "recreated node(s) " + ", ".join(sorted(set(nodes(n, k)) - on_l1)) in line, line
    else:
        assert res["report"]["rebuilt"] == [] and res["report"]["tried"] == [], res["report"]
    for nd in nodes(n, k):
        assert [p.name for p in l1(root, nd).iterdir() if commit.LEFTOVER.match(p.name)] == []
    assert not repair.rebuild(template(root, step), dry_run=True).repaired


AUDIT_L3_PROBE = """
import json, sys
from pathlib import Path
from _parallel_worker import Audit
tmp = Path(sys.argv[1])
(tmp / "l3" / "step-0000000002").mkdir(parents=True)
(tmp / "l1" / "n0").mkdir(parents=True)
audit = Audit()
audit.watch(str(tmp), "n0", ["n0", "n1"])
list((tmp / "l3").iterdir())
(tmp / "l3" / "ckptfmt-levels.json").write_text("{}")
(tmp / "l3" / "step-0000000002" / "x").write_text("")
found = audit.l3_events
audit.watch("", "n0", [])
print(json.dumps(found))
"""


def test_audit_hook_sees_level3_step_directories(tmp_path: Path) -> None:
    """The instrument of the level-3 check: listing the level-3 root and its levels file are not
    reads of a checkpoint; anything inside a step directory is."""
    proc = subprocess.run(
        [sys.executable, "-c", AUDIT_L3_PROBE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO / "tests" / "workers",
        env=with_kit_path(os.environ),
    )
    assert proc.returncode == 0, proc.stderr
    events = [(e, p) for e, p, _thread in json.loads(proc.stdout)]
    assert events == [("open", str(tmp_path / "l3" / "step-0000000002" / "x"))]
