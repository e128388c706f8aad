"""Hosts in miniature: N simulated hosts on this one machine, each a host as far as software can
tell, for multi-node tests and benchmarks (no ckptfmt import here).

Every host is one long-lived *holder* process (``unshare --net --uts --mount``) whose
namespaces the host's processes join with ``nsenter``:

- **network**: its own namespace with ``lo`` and ``eth0``, one end of a veth pair whose other
  end sits on a bridge inside a separate *switch* namespace; the addresses (198.18.0.0/24, the
  range RFC 2544 sets aside for benchmarking, chosen so that no real network is named) exist
  only inside these namespaces. Nothing is connected to this machine's own network namespace,
  so nothing can be routed outside.
- **UTS**: its own host name (``socket.gethostname()`` on that host returns it).
- **mount**: ``local_path`` (default ``/local/ckpt``) is a bind mount of the host's own backing
  directory, at the same path on every host, and the folder that holds every host's backing
  directory is covered by an empty tmpfs, so a host cannot see another host's node-local files
  at all. ``/etc/hosts`` is a bind mount of the cluster's hosts file (every host name -> its
  address). The shared directory (level 3) and the rest of the file system are common.

The switch namespace doubles as a *login* host (name ``login``, address .254) from which
``mpiexec`` is started: hydra's bootstrap reaches the compute hosts through
:data:`LAUNCHER` (in place of ``ssh``), which enters the named host's namespaces; MPI then
moves data between hosts over real TCP on the bridge.

``kill_host`` ends every process of a host (SIGKILL to each process in its namespaces) and wipes
its node-local directory, the way a node that fails loses its RAM disk. Everything (processes,
namespaces, bridge, directories, the mount point made for ``local_path``) is removed by
:meth:`Cluster.close`, which the context manager calls even when the body fails.

Needs root and ``unshare``/``nsenter``/``ip``; :func:`unavailable` says why not, for skips.
Command-line use: ``scripts/hosts.sh`` (``python tests/hostsim.py --help``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "scripts" / "hostsim-launch"  # hydra's "ssh": enters a host's namespaces
SUBNET = "198.18.0"  # RFC 2544 benchmarking range; exists only inside our namespaces
LOGIN = "login"
LOGIN_ADDR = f"{SUBNET}.254"
BRIDGE_MAC = "02:00:c6:12:00:fe"  # locally administered; set once, so it never changes
ROOT_ENV = "HOSTSIM_ROOT"  # where the launcher finds the cluster's host table
_NS = ("net", "uts", "mnt")


class HostSimError(RuntimeError):
    """A host could not be set up or reached."""


def unavailable() -> str | None:
    """Why simulated hosts cannot run here (for a visible skip reason), or None when they can."""
    if sys.platform != "linux":
        return "simulated hosts need Linux namespaces"
    if os.geteuid() != 0:
        return "simulated hosts need root (network, UTS and mount namespaces, veth, bridge)"
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"simulated hosts need `{tool}` (util-linux / iproute2)"
    probe = subprocess.run(
        ["unshare", "--net", "--uts", "--mount", "sh", "-c", "hostname probe && ip link set lo up"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return f"namespaces are not available here: {probe.stderr.strip() or probe.returncode}"
    return None


def _ns_ids(pid: int) -> tuple[str, ...] | None:
    try:
        return tuple(os.readlink(f"/proc/{pid}/ns/{ns}") for ns in _NS)
    except OSError:
        return None


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise HostSimError(f"{' '.join(cmd)}: {result.stderr.strip() or result.returncode}")
    return result


def _start_holder(name: str, mounts: str) -> subprocess.Popen[str]:
    """A process in new net/UTS/mount namespaces that names the host, makes its mounts, says
    ``ready`` and sleeps until killed (the namespaces live as long as it does)."""
    script = f"set -e; hostname {name}; ip link set lo up; {mounts} echo ready; exec sleep infinity"
    holder = subprocess.Popen(
        ["unshare", "--net", "--uts", "--mount", "--propagation", "private", "sh", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # a Ctrl-C in the terminal does not kill the hosts
    )
    assert holder.stdout is not None
    line = holder.stdout.readline().strip()
    if line != "ready":
        holder.kill()
        err = holder.stderr.read() if holder.stderr else ""
        holder.wait()
        raise HostSimError(f"host {name} did not start: {err.strip() or line!r}")
    return holder


@dataclass
class Host:
    """One simulated host: its name, address, holder process and node-local backing folder."""

    name: str
    addr: str
    holder: subprocess.Popen[str]
    backing: Path  # the backing folder, seen as ``local_path`` on this host only
    local_path: str = "/local/ckpt"
    ns: tuple[str, ...] = ()

    tmpfs: bool = False

    @property
    def local(self) -> Path:
        """The host's node-local folder as this (root-namespace) process can reach it: the
        backing folder, or for a tmpfs the holder's view (``/proc/PID/root/...``, a magic link
        that code refusing symbolic links will not follow)."""
        return Path(f"/proc/{self.pid}/root{self.local_path}") if self.tmpfs else self.backing

    @property
    def pid(self) -> int:
        return self.holder.pid

    def enter(self, cwd: str | os.PathLike[str] | None = None) -> list[str]:
        """The ``nsenter`` prefix that runs a command on this host."""
        return [
            "nsenter",
            f"--target={self.pid}",
            "--net",
            "--uts",
            "--mount",
            f"--wd={cwd or os.getcwd()}",
            "--",
        ]

    def pids(self) -> list[int]:
        """Every process now running on this host (in its namespaces), the holder included."""
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and _ns_ids(int(entry)) == self.ns:
                found.append(int(entry))
        return found


@dataclass
class Cluster:
    """Simulated hosts, a switch/login namespace and a shared folder; use as a context manager.

    ``root`` holds ``shared/`` (visible to all hosts), ``private/`` (the hosts' backing folders,
    hidden on every host) and the host table the launcher reads. ``local_path`` is where each
    host sees its own node-local folder.
    """

    root: Path
    local_path: str = "/local/ckpt"
    local_tmpfs: str | None = None  # a size ("2g"): each host's local_path is a tmpfs of its own
    hosts: dict[str, Host] = field(default_factory=dict)
    _switch: subprocess.Popen[str] | None = None
    _user: Path | None = None  # this cluster's entry in the registry of live clusters
    _serial: int = 0
    _addr_next: int = 1

    # --- life cycle ------------------------------------------------------------------------------

    def __post_init__(self) -> None:
        self.root = Path(self.root).absolute()
        (self.root / "shared").mkdir(parents=True, exist_ok=True)
        (self.root / "private").mkdir(exist_ok=True)
        self.hosts_file.write_text("")
        self._make_mountpoint(Path(self.local_path))

    def _make_mountpoint(self, path: Path) -> None:
        """Make ``local_path`` in this machine's file system (hosts mount over it), recording
        what was made in a registry shared by the clusters alive now: removing a folder that
        another cluster's hosts mount on would detach their mounts, so the last one to close
        removes it."""
        with _registry() as reg:
            made = json.loads(reg["made"].read_text()) if reg["made"].exists() else []
            for p in [path, *path.parents]:
                if p.exists():
                    break
                made.append(str(p))  # deepest first: removed in this order
            path.mkdir(parents=True, exist_ok=True)
            reg["made"].write_text(json.dumps(made))
            self._user = reg["users"] / f"{os.getpid()}-{id(self)}"
            self._user.write_text("")

    def _release_mountpoint(self) -> None:
        user = getattr(self, "_user", None)
        if user is None:
            return
        with _registry() as reg:
            user.unlink(missing_ok=True)
            self._user = None
            for other in reg["users"].iterdir():  # clusters whose process died
                pid = other.name.split("-")[0]
                if not Path(f"/proc/{pid}").exists():
                    other.unlink(missing_ok=True)
            if any(reg["users"].iterdir()):
                return
            made = json.loads(reg["made"].read_text()) if reg["made"].exists() else []
            for p in made:
                with contextlib.suppress(OSError):
                    Path(p).rmdir()
            reg["made"].unlink(missing_ok=True)

    @property
    def shared(self) -> Path:
        return self.root / "shared"

    @property
    def hosts_file(self) -> Path:
        return self.root / "etc-hosts"

    def start(self, names: Sequence[str]) -> Cluster:
        """Start the switch/login namespace (once) and a host for each name."""
        if self._switch is None:
            mounts = f"mount --bind {self.hosts_file} /etc/hosts;"
            self._switch = _start_holder(LOGIN, mounts)
            sw = str(self._switch.pid)
            for cmd in (
                # a fixed address: a bridge without one takes the lowest of its ports' and
                # changes it as ports come and go (a host killed, a spare added); the hosts'
                # cached ARP entry for the login address then names a MAC nobody has, and
                # their TCP connections to it (hydra's proxies to mpiexec) wait 35-70 s of SYN
                # retransmissions until the entry expires
                ["ip", "link", "add", "br0", "address", BRIDGE_MAC, "type", "bridge"],
                ["ip", "addr", "add", f"{LOGIN_ADDR}/24", "dev", "br0"],
                ["ip", "link", "set", "br0", "up"],
            ):
                _run(["nsenter", f"--target={sw}", "--net", *cmd])
        for name in names:
            self.add_host(name)
        return self

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End every host and the switch, remove the folders; safe to call twice."""
        for name in list(self.hosts):
            with contextlib.suppress(Exception):
                self.kill_host(name, wipe=True)
        if self._switch is not None:
            _kill_all(self._switch, _ns_ids(self._switch.pid))
            self._switch = None
        shutil.rmtree(self.root / "hosts.d", ignore_errors=True)
        shutil.rmtree(self.root / "private", ignore_errors=True)
        self._release_mountpoint()

    # --- hosts -----------------------------------------------------------------------------------

    def add_host(self, name: str) -> Host:
        """Start a fresh host called ``name`` (a new address, an empty node-local folder)."""
        if self._switch is None:
            self.start([])
        if name in self.hosts or name == LOGIN or not name.replace("-", "").isalnum():
            raise HostSimError(f"host name {name!r} is taken or invalid")
        self._serial += 1
        local = self.root / "private" / f"{name}.{self._serial}"
        local.mkdir(parents=True)
        private = self.root / "private"
        own = (
            f"mount -t tmpfs -o size={self.local_tmpfs} hostsim-local {self.local_path}; "
            if self.local_tmpfs
            else f"mount --bind {local} {self.local_path}; "
        )
        mounts = (
            own + f"mount --bind {self.hosts_file} /etc/hosts; "
            f"mount -t tmpfs -o size=64k,mode=700 hostsim-hidden {private};"
        )
        holder = _start_holder(name, mounts)
        addr = f"{SUBNET}.{self._addr_next}"
        self._addr_next += 1
        host = Host(name, addr, holder, local, self.local_path, tmpfs=bool(self.local_tmpfs))
        try:
            assert self._switch is not None
            sw, pid = str(self._switch.pid), str(holder.pid)
            port = f"p{self._serial}"  # the switch's end of the pair
            _run(
                [
                    "nsenter",
                    f"--target={sw}",
                    "--net",
                    "ip",
                    "link",
                    "add",
                    port,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    pid,
                ]
            )
            _run(["nsenter", f"--target={sw}", "--net", "ip", "link", "set", port, "master", "br0"])
            _run(["nsenter", f"--target={sw}", "--net", "ip", "link", "set", port, "up"])
            _run(
                [
                    "nsenter",
                    f"--target={pid}",
                    "--net",
                    "ip",
                    "addr",
                    "add",
                    f"{addr}/24",
                    "dev",
                    "eth0",
                ]
            )
            _run(["nsenter", f"--target={pid}", "--net", "ip", "link", "set", "eth0", "up"])
            host.ns = _ns_ids(holder.pid) or ()
        except Exception:
            _kill_all(holder, _ns_ids(holder.pid))
            shutil.rmtree(local, ignore_errors=True)
            raise
        self.hosts[name] = host
        self._write_tables()
        return host

    def kill_host(self, name: str, wipe: bool = True) -> list[int]:
        """Fail host ``name``: SIGKILL every process on it (its namespaces go with the holder)
        and, with ``wipe``, delete its node-local folder. Returns the killed process ids."""
        host = self.hosts.pop(name)
        killed = _kill_all(host.holder, host.ns)
        if wipe:  # (a tmpfs went with the host's mount namespace)
            shutil.rmtree(host.backing, ignore_errors=True)
        self._write_tables()
        return killed

    def _write_tables(self) -> None:
        lines = ["127.0.0.1 localhost", f"{LOGIN_ADDR} {LOGIN}"]
        lines += [f"{h.addr} {h.name}" for h in self.hosts.values()]
        # written in place: the bind mounts on every host see the same inode
        with open(self.hosts_file, "r+") as f:
            f.truncate(0)
            f.write("\n".join(lines) + "\n")
        table = self.root / "hosts.d"  # host name -> holder pid, for the launcher
        table.mkdir(exist_ok=True)
        for entry in table.iterdir():
            if entry.name not in self.hosts:
                entry.unlink()
        for h in self.hosts.values():
            (table / h.name).write_text(str(h.pid))

    # --- running things --------------------------------------------------------------------------

    def popen(
        self,
        host: str,
        cmd: Sequence[str],
        env: Mapping[str, str] | None = None,
        **kwargs: object,
    ) -> subprocess.Popen[str]:
        """Start ``cmd`` on ``host`` (``login`` for the switch/login namespace), from the
        current folder, with ``env`` added to this process's environment."""
        prefix = self.login_enter() if host == LOGIN else self.hosts[host].enter()
        return subprocess.Popen(  # type: ignore[call-overload,no-any-return]
            [*prefix, *cmd], env={**os.environ, **(env or {})}, text=True, **kwargs
        )

    def login_enter(self) -> list[str]:
        assert self._switch is not None
        pid = self._switch.pid
        return [
            "nsenter",
            f"--target={pid}",
            "--net",
            "--uts",
            "--mount",
            f"--wd={os.getcwd()}",
            "--",
        ]

    def mpiexec_cmd(
        self, hosts: Sequence[str], ppn: int, cmd: Sequence[str], mpiexec: str | None = None
    ) -> list[str]:
        """The command line that runs ``cmd`` as ``len(hosts) * ppn`` MPI ranks, ``ppn`` per
        host in order (rank r on ``hosts[r // ppn]``), started from the login host."""
        exe = mpiexec or str(Path(sys.executable).parent / "mpiexec")
        return [
            *self.login_enter(),
            "env",
            f"{ROOT_ENV}={self.root}",
            exe,
            "-launcher",
            "ssh",
            "-launcher-exec",
            str(LAUNCHER),
            "-hosts",
            ",".join(f"{h}:{ppn}" for h in hosts),
            "-n",
            str(len(hosts) * ppn),
            "-ppn",
            str(ppn),
            *mpi_env_args(),
            *cmd,
        ]

    def address(self, host: str) -> str:
        return LOGIN_ADDR if host == LOGIN else self.hosts[host].addr


def mpi_env_args() -> list[str]:
    """``-genv`` settings that keep MPICH's transports on the hosts' ``eth0`` (TCP between hosts,
    shared memory within one)."""
    settings = {
        "UCX_NET_DEVICES": "eth0",
        "UCX_TLS": "tcp,self,sm",
        "FI_PROVIDER": "tcp",
        "FI_TCP_IFACE": "eth0",
        "MPIR_CVAR_CH4_NETMOD": "ofi",
    }
    out: list[str] = []
    for k, v in settings.items():
        out += ["-genv", k, v]
    return out


REGISTRY = Path("/run/hostsim")


@contextlib.contextmanager
def _registry() -> Iterator[dict[str, Path]]:
    """The live clusters' registry (``/run/hostsim``), locked for the block."""
    (REGISTRY / "users").mkdir(parents=True, exist_ok=True)
    with open(REGISTRY / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield {"users": REGISTRY / "users", "made": REGISTRY / "made.json"}


def _kill_all(holder: subprocess.Popen[str], ns: tuple[str, ...] | None) -> list[int]:
    """SIGKILL every process in ``ns`` (the holder's namespaces) until none is left."""
    killed: list[int] = []
    deadline = time.monotonic() + 10
    while ns is not None and time.monotonic() < deadline:
        victims = [int(e) for e in os.listdir("/proc") if e.isdigit() and _ns_ids(int(e)) == ns]
        victims = [p for p in victims if p != os.getpid()]
        if not victims:
            break
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                if pid not in killed:
                    killed.append(pid)
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        holder.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        holder.wait(timeout=10)
    for stream in (holder.stdout, holder.stderr):
        if stream is not None:
            stream.close()
    return killed


@contextlib.contextmanager
def cluster(
    names: Sequence[str],
    root: str | os.PathLike[str] | None = None,
    local_path: str = "/local/ckpt",
    local_tmpfs: str | None = None,
) -> Iterator[Cluster]:
    """Start hosts ``names`` (in a temporary root unless ``root`` is given); remove everything
    when the block ends, however it ends."""
    tmp = None if root is not None else tempfile.mkdtemp(prefix="hostsim-")
    c = Cluster(Path(root or tmp or "."), local_path, local_tmpfs)
    try:
        c.start(names)
        yield c
    finally:
        c.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


# --- command line (scripts/hosts.sh) -------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="scripts/hosts.sh",
        description="Start N simulated hosts (own network, host name and node-local folder each) "
        "and run one command across them: an MPI job from the login host (with --mpi) or the "
        "same command on every host; everything is removed afterwards.",
    )
    ap.add_argument("-n", "--hosts", type=int, default=2, help="number of hosts (default 2)")
    ap.add_argument("--ppn", type=int, default=1, help="MPI ranks per host (with --mpi)")
    ap.add_argument("--prefix", default="node", help="host names PREFIX0, PREFIX1, ...")
    ap.add_argument("--local-path", default="/local/ckpt", help="node-local folder on every host")
    ap.add_argument("--root", help="folder for shared/ and the hosts' backing folders")
    ap.add_argument("--mpi", action="store_true", help="run the command under mpiexec")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="command (default: a tour)")
    args = ap.parse_args(argv)
    reason = unavailable()
    if reason:
        print(f"hosts.sh: {reason}", file=sys.stderr)
        return 2
    names = [f"{args.prefix}{i}" for i in range(args.hosts)]
    with cluster(names, args.root, args.local_path) as c:
        env = {"HOSTSIM_SHARED": str(c.shared)}
        cmd = list(args.command)
        if cmd[:1] == ["--"]:
            cmd = cmd[1:]
        if not cmd:
            cmd = [
                "sh",
                "-c",
                f"echo $(hostname) $(hostname -I) sees: $(ls -A {args.local_path})"
                f"; touch {args.local_path}/$(hostname).txt; ls {args.local_path}",
            ]
        print(
            f"hosts: {', '.join(f'{h.name}={h.addr}' for h in c.hosts.values())}; "
            f"shared: {c.shared}",
            flush=True,
        )
        if args.mpi:
            proc = subprocess.run(c.mpiexec_cmd(names, args.ppn, cmd), env={**os.environ, **env})
            return proc.returncode
        status = 0
        for name in names:
            status = max(status, c.popen(name, cmd, env).wait())
        return status


if __name__ == "__main__":
    sys.exit(main())
