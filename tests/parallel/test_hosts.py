"""Level-1 redundancy across simulated hosts (``tests/hostsim.py``): every rank on a host of its
own (own network namespace and address, own host name, own ``/local/ckpt`` that no other host
can see), MPI (``mpiexec`` across the hosts, TCP between them) and torch (gloo over TCP).

Each test saves steps 1 and 2 with xor or rs (m=2) on four hosts, kills one host while the job
runs (SIGKILL to every process on it) and wipes its node-local folder, then restarts on the three
survivors plus a spare host, with the dead host's name or a new one, and restores step 2
bit-exact from level 1 and parity (the job has no level 3). The node identity is the host name
(``resolve_node``'s default): nothing sets ``CKPTFMT_NODE``.

Needs root (namespaces, veth, bridge): skipped with the reason otherwise (and when
``CKPTFMT_HOST_TESTS=0``, to leave them out on purpose). MPI cases take about
10 s each, torch cases 25-75 s (marked slow; all eight about 5 minutes on 2 busy cores).

Every rank's stdout and stderr go to a file of its own (``<cluster>/logs/<phase>.rank<r>.log``,
with a timestamped line at each stage), and so does the launcher's; a failure shows them all.
A job has two time limits: :data:`STARTUP_S` until every rank has its communicator (starting
four interpreters that import numpy, ckptfmt and for torch jobs torch, then the rendezvous) and
:data:`WORK_S` from then on for the saves and restores themselves. Starting is what takes long
on a loaded machine (four torch imports on 2 cores shared with other jobs took up to 100 s
here, against 5 s of CPU each), while a hung collective shows in the second limit.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hostsim
import pytest
from kit import REPO
from kit.launch import mpiexec

import ckptfmt

WORKER = REPO / "tests" / "workers" / "_hosts_worker.py"
HOSTS = ["h0", "h1", "h2", "h3"]
VICTIM = "h2"
SCHEMES: dict[str, Any] = {"xor": "xor", "rs": {"scheme": "rs", "m": 2}, "partner": "partner"}
SECOND_VICTIM, SECOND_SPARE = "h0", "spare8"  # the host lost before a second restart
STARTUP_S = 420.0  # launch -> every rank has its communicator (interpreters, imports, rendezvous)
WORK_S = 120.0  # every rank up -> every rank reported
JOB_TIMEOUT_S = STARTUP_S + WORK_S + 30  # each process's own `timeout` (a backstop)
UP = "communicator up"  # the worker's mark once its communicator exists

_reason = hostsim.unavailable()
if _reason is None and os.environ.get("CKPTFMT_HOST_TESTS") == "0":
    _reason = "turned off with CKPTFMT_HOST_TESTS=0"
pytestmark = pytest.mark.skipif(_reason is not None, reason=f"simulated hosts: {_reason}")


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[hostsim.Cluster]:
    with hostsim.cluster(HOSTS, root=tmp_path / "cluster") as c:
        yield c
    # the fixture's own promise: nothing of the cluster outlives it
    assert not (tmp_path / "cluster" / "private").exists()


def _env(c: hostsim.Cluster) -> dict[str, str]:
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["HOSTSIM_LOGS"] = str(_logs(c))  # every rank's stdout/stderr in a file of its own
    os.environ.pop("CKPTFMT_NODE", None)
    return env


def _logs(c: hostsim.Cluster) -> Path:
    folder = c.root / "logs"
    folder.mkdir(exist_ok=True)
    return folder


def _all_logs(c: hostsim.Cluster, phase: str) -> str:
    """Every log of ``phase`` (the launcher's and each rank's), for a failure message."""
    parts = []
    for f in sorted(_logs(c).glob(f"{phase}.*")):
        text = f.read_text(errors="replace")
        parts.append(f"--- {f.name} ---\n{text[-3000:]}")
    launch = c.root / "launch.log"
    if launch.exists():
        parts.append(f"--- launch.log ---\n{launch.read_text(errors='replace')[-3000:]}")
    return "\n".join(parts)


def _reports(out: Path, phase: str, n: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"{phase}.rank{r}.json").read_text()) for r in range(n)]


class Job:
    """A job's processes (mpiexec, or torch's ranks), each writing to a log file of its own."""

    def __init__(self, c: hostsim.Cluster, phase: str) -> None:
        self.c, self.phase = c, phase
        self.procs: list[subprocess.Popen[str]] = []

    def log(self, name: str) -> Any:
        return open(_logs(self.c) / f"{self.phase}.{name}.log", "w")

    def marks(self, n: int) -> list[list[str]]:
        """Each rank's timestamped stage lines so far (from its log)."""
        out = []
        for r in range(n):
            f = _logs(self.c) / f"{self.phase}.rank{r}.log"
            text = f.read_text(errors="replace") if f.exists() else ""
            out.append([ln for ln in text.splitlines() if " pid " in ln and ": " in ln])
        return out

    def wait_for_reports(self, n: int) -> None:
        """Until every rank has written its report; fails (with every log and each rank's last
        stage) when the job ends first, when the ranks are not all up within
        :data:`STARTUP_S`, or when they have not all reported :data:`WORK_S` after that."""
        out = self.c.shared
        started = time.monotonic()
        up_at: float | None = None
        why = "the job ended first"
        while True:
            if all((out / f"{self.phase}.rank{r}.json").exists() for r in range(n)):
                return
            if all(p.poll() is not None for p in self.procs):
                break
            now = time.monotonic()
            if up_at is None and all(any(UP in m for m in ms) for ms in self.marks(n)):
                up_at = now
            if up_at is None and now - started > STARTUP_S:
                why = f"not every rank had its communicator {STARTUP_S:.0f} s after the launch"
                break
            if up_at is not None and now - up_at > WORK_S:
                why = f"not every rank reported {WORK_S:.0f} s after all were up"
                break
            time.sleep(0.2)
        codes = [p.poll() for p in self.procs]
        now_wall = time.time()
        last = []
        for r, ms in enumerate(self.marks(n)):
            if not ms:
                last.append(f"rank {r}: no output")
                continue
            stamp, _, rest = ms[-1].partition(" ")
            last.append(f"rank {r}: {now_wall - float(stamp):.0f} s ago: {rest}")
        pytest.fail(
            f"{self.phase}: {why} ({time.monotonic() - started:.0f} s; exit status {codes});"
            f" last stage of each rank:\n"
            + "\n".join(last)
            + "\nlogs:\n"
            + _all_logs(self.c, self.phase)[-12000:]
        )

    def finish(self) -> list[int]:
        """The processes' exit statuses (each killed if it outlives the job's time)."""
        codes = []
        for p in self.procs:
            try:
                p.wait(timeout=JOB_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            codes.append(p.returncode)
        return codes


# --- launching on the hosts ------------------------------------------------------------------


_jobs = 0


def _start_mpi(c: hostsim.Cluster, names: list[str], phase: str, red: Any) -> Job:
    cmd = c.mpiexec_cmd(
        names,
        1,
        [sys.executable, "-m", "mpi4py", str(WORKER), "mpi", phase, str(c.shared), json.dumps(red)],
        mpiexec=str(mpiexec()),
    )
    job = Job(c, phase)
    with job.log("mpiexec") as log:
        job.procs.append(
            subprocess.Popen(
                ["timeout", "-k", "5", str(JOB_TIMEOUT_S), *cmd],
                env={**os.environ, **_env(c)},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                cwd=REPO,
            )
        )
    return job


def _start_torch(c: hostsim.Cluster, names: list[str], phase: str, red: Any) -> Job:
    pytest.importorskip("torch")
    global _jobs
    _jobs += 1  # a port of its own per job: never the one a killed job's store listened on
    port = 29500 + (os.getpid() % 500) * 8 + _jobs % 8
    job = Job(c, phase)
    for rank, name in enumerate(names):
        env = {
            **_env(c),
            "MASTER_ADDR": c.address(names[0]),
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(len(names)),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "GLOO_SOCKET_IFNAME": "eth0",
        }
        cmd = [sys.executable, str(WORKER), "torch", phase, str(c.shared), json.dumps(red)]
        with job.log(f"launch{rank}") as log:
            job.procs.append(
                c.popen(
                    name,
                    ["timeout", "-k", "5", str(JOB_TIMEOUT_S), *cmd],
                    env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    cwd=REPO,
                )
            )
    return job


# --- the scenario ----------------------------------------------------------------------------


def _scenario(c: hostsim.Cluster, kind: str, scheme: str, spare: str, twice: bool = False) -> None:
    red = SCHEMES[scheme]
    start = _start_mpi if kind == "mpi" else _start_torch
    out = c.shared

    # 1. save steps 1 and 2 on four hosts, then lose one host while the job runs
    job = start(c, HOSTS, "save", red)
    job.wait_for_reports(len(HOSTS))
    saved = _reports(out, "save", len(HOSTS))
    assert [r["host"] for r in saved] == HOSTS
    assert [r["node"] for r in saved] == HOSTS  # the host name is the node
    for r in saved:
        assert r["failed"] == [], r
        assert r["local"] == ["step-0000000001", "step-0000000002"], r
        others = {c.address(h) for h in HOSTS if h != r["host"]}
        assert others & set(r["tcp_peers"]), f"{r['host']}: no TCP connection to another host"
    victim = c.hosts[VICTIM]
    victim_files = list(victim.backing.rglob("*"))
    assert sorted(p.name for p in victim.local.iterdir()) == saved[HOSTS.index(VICTIM)]["local"]
    assert victim_files, "the victim host wrote nothing to its node-local folder"
    killed = c.kill_host(VICTIM, wipe=True)
    assert len(killed) >= 2, killed  # the holder and at least the rank (or its proxy)
    assert not c.hosts.get(VICTIM) and not any(p.exists() for p in victim_files)
    if kind == "torch":  # no mpiexec to end the job: the survivors are ended like torchrun would
        for p in job.procs:  # each is `timeout`, leader of its process group: rank and all
            if p.poll() is None:  # not reaped yet: its pid (the group's id) is not reused
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
    for rc in job.finish():
        assert rc != 0, "the job ended normally although a host was killed:\n" + _all_logs(
            c, "save"
        )
    assert not list(out.glob("lingered.*")), "a rank lingered to the end: the kill missed it"

    # 2. a spare host takes the dead host's place; restore from level 1 + parity only
    names = [spare if h == VICTIM else h for h in HOSTS]
    _restore_on(c, kind, red, names, spare, "restore")
    if twice:  # 3. another host lost, another spare: restore from what the first restore rebuilt
        c.kill_host(SECOND_VICTIM, wipe=True)
        names = [SECOND_SPARE if h == SECOND_VICTIM else h for h in names]
        _restore_on(c, kind, red, names, SECOND_SPARE, "restore2")


def _restore_on(
    c: hostsim.Cluster, kind: str, red: Any, names: list[str], spare: str, phase: str
) -> None:
    """Add host ``spare`` and restore on ``names`` (saved node i now on host names[i]): every
    rank restores step 2 from level 1, rebuilt, bit for bit, and level 1 verifies node by node
    from outside the hosts."""
    start = _start_mpi if kind == "mpi" else _start_torch
    out = c.shared
    c.add_host(spare)
    assert not any(c.hosts[spare].local.iterdir()), "the spare's node-local folder is not empty"
    job = start(c, names, phase, red)
    job.wait_for_reports(len(names))
    codes = job.finish()
    got = _reports(out, phase, len(names))
    for r, name in zip(got, names):
        assert r["host"] == name and r["node"] == name, r
        assert r["step"] == 2, r
        assert r["level"] == 1, r
        assert r["mismatches"] == [], r
        assert r["unrecoverable"] == [], r
        assert r["rebuilt"], f"nothing was rebuilt: {r}"
        assert r["rewrite"] == "written", r  # after mgr.wait(): the rebuilt files are on disk
        assert r["local"] == ["step-0000000002"] or "step-0000000002" in r["local"], r
    assert codes == [0] * len(codes), _all_logs(c, phase)
    # the rebuilt level 1 verifies, node by node with its parity, from outside the hosts
    # (a spare under a new name holds the files of the node it replaces)
    placed = {
        saved_as: c.hosts[now].local / "step-0000000002" for saved_as, now in zip(HOSTS, names)
    }
    report = ckptfmt.verify(placed)
    assert report.healthy, report.problems


TORCH_MARKS = [pytest.mark.torch, pytest.mark.slow]  # 25-75 s each: four ranks import torch twice
CASES = [
    pytest.param(
        kind,
        scheme,
        spare,
        id=f"{kind}-{scheme}-{tag}",
        marks=TORCH_MARKS if kind == "torch" else [],
    )
    for kind in ("mpi", "torch")
    for scheme in ("xor", "rs", "partner")
    for spare, tag in ((VICTIM, "same-name"), ("spare9", "new-name"))
    if kind == "mpi" or scheme != "partner"  # partner over gloo adds nothing the others show
]


@pytest.mark.mpi
@pytest.mark.parametrize("kind,scheme,spare", CASES)
def test_lose_a_host_restore_on_a_spare(
    hosts: hostsim.Cluster, kind: str, scheme: str, spare: str
) -> None:
    if kind == "torch":
        pytest.importorskip("torch")
    _scenario(hosts, kind, scheme, spare)


@pytest.mark.mpi
@pytest.mark.parametrize("scheme", ["xor", "rs", "partner"])
def test_two_hosts_replaced_over_two_restarts(hosts: hostsim.Cluster, scheme: str) -> None:
    """Host h2 is lost and replaced by spare9 (a new name), the job restores; then h0 is lost
    and replaced by spare8, and the job restores again: from the level 1 the first restore
    rebuilt (on spare9) plus the survivors, bit for bit, without level 3."""
    _scenario(hosts, "mpi", scheme, "spare9", twice=True)


_CONNECT = """
import socket, sys, time
t = time.monotonic()
socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60).close()
print(time.monotonic() - t)
"""


def test_survivors_reach_the_login_host_at_once_after_hosts_are_replaced(
    hosts: hostsim.Cluster,
) -> None:
    """The bridge keeps its address when ports go and come: a surviving host's cached ARP
    entry for the login host stays right, so its TCP connections there (hydra's proxies to
    mpiexec) are made at once. (A bridge takes the lowest of its ports' addresses unless given
    one; killing a host and adding a spare changed it about one time in two, and the survivors'
    connections then took 35-70 s.) Three times, the host whose port on the bridge has the
    lowest address (the one an unset bridge address follows) is replaced by a spare; the
    bridge's address must stay and every host must connect to the login host within 2 s."""
    listener = hosts.popen(
        hostsim.LOGIN,
        [
            sys.executable,
            "-c",
            "import socket\ns = socket.socket()\n"
            "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            "s.bind(('0.0.0.0', 7777))\ns.listen(64)\nprint('up', flush=True)\n"
            "while True:\n    s.accept()[0].close()",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert listener.stdout is not None and listener.stdout.readline().strip() == "up"

        def connect_times() -> dict[str, float]:
            times = {}
            for name in hosts.hosts:
                p = hosts.popen(
                    name,
                    [sys.executable, "-c", _CONNECT, hostsim.LOGIN_ADDR, "7777"],
                    stdout=subprocess.PIPE,
                )
                out, _ = p.communicate(timeout=90)
                assert p.returncode == 0, name
                times[name] = float(out)
            return times

        def bridge_macs() -> dict[str, str]:
            """The bridge's own address ("br0") and each host's port on it (by host name)."""
            p = hosts.popen(hostsim.LOGIN, ["ip", "-o", "link"], stdout=subprocess.PIPE)
            out, _ = p.communicate(timeout=30)
            macs = {}
            for line in out.splitlines():
                if "link/ether " not in line:
                    continue
                name = line.split(": ")[1].split("@")[0]
                macs[name] = line.split("link/ether ")[1].split()[0]
            by_port = {f"p{h.backing.name.rsplit('.', 1)[1]}": n for n, h in hosts.hosts.items()}
            return {by_port.get(k, k): v for k, v in macs.items() if k in by_port or k == "br0"}

        connect_times()  # every host now has an ARP entry for the login address
        bridge = bridge_macs()["br0"]
        for i in range(3):
            ports = {n: m for n, m in bridge_macs().items() if n != "br0"}
            hosts.kill_host(min(ports, key=ports.__getitem__))  # the lowest port's host
            hosts.add_host(f"spare{i}")
            assert bridge_macs()["br0"] == bridge, f"replacement {i + 1}: the bridge's MAC moved"
            slow = {h: t for h, t in connect_times().items() if t > 2.0}
            assert not slow, f"after replacement {i + 1}: slow connections {slow}"
    finally:
        listener.kill()
        listener.wait()
