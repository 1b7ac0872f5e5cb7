"""A real Slurm cluster on this machine, for the Slurm launcher's tests.

`LocalSlurm` starts munged and slurmctld in the root network namespace and one slurmd per node,
each in its own network + UTS namespace (hostname n1, n2, ...), joined by veth pairs on a bridge.
Debian's slurm-wlm is not built with --enable-multiple-slurmd, so namespaces are how one machine
holds two real nodes: each slurmd, its slurmstepd and the job's tasks see their own hostname and
address, and a private mount namespace bind-mounts /etc/netns/<ns>/hosts over /etc/hosts so
n1/n2 resolve to the bridge addresses inside every node. That is what torchrun's c10d rendezvous
(`n1:port`) and gloo (which binds the address its hostname resolves to) rely on on a real
cluster, so the launcher needs no test-only setting (no GLOO_SOCKET_IFNAME).

Clients (sbatch, squeue, scancel, scontrol) run in the root namespace with `env` (SLURM_CONF);
sbatch exports it into jobs, so srun inside a job reaches the same controller.

Everything it creates is named after the owning process id, and recorded in a registry file, so
`stop()` (and the next run, after a crash) removes exactly what it made: daemons by PID, every
process left in its namespaces, the namespaces, veths, bridge and /etc/netns entries.

Needs root, iproute2, util-linux (`nsenter`, `unshare`, `mount`), and Debian's `slurm-wlm` and
`munge` (`scripts/dev.sh test` installs them). Use through the `slurm_cluster` fixture.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

_NETNS_PREFIX = "posttrain-slurm-"
# Interface names are at most 15 characters: pts<pid hex>x<instance><b|h><node index>.
_IFACE_RE = re.compile(r"^pts([0-9a-f]+)x(\d+)[bh]\d*$")
_NETNS_RE = re.compile(rf"^{_NETNS_PREFIX}(\d+)-(\d+)-n\d+$")
REGISTRY = Path(tempfile.gettempdir()) / "posttrain-test-slurm"
_TOOLS = ("slurmctld", "slurmd", "munged", "sbatch", "ip", "unshare", "nsenter", "mount")
_instances = 0


def missing_tools() -> list[str]:
    """The programs a LocalSlurm needs that this machine lacks (empty when it can start one)."""
    return [tool for tool in _TOOLS if shutil.which(tool) is None]


def require_slurm() -> None:
    """Skip the calling test when Slurm cannot run here, or fail it when the run demands Slurm
    (POSTTRAIN_REQUIRE_SLURM=1, set by `scripts/dev.sh test`), so CI never skips silently."""
    reasons = []
    if missing := missing_tools():
        reasons.append(f"missing {', '.join(missing)} (apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        reasons.append("needs root (network namespaces, slurmd)")
    if not reasons:
        return
    message = "local Slurm cluster unavailable: " + "; ".join(reasons)
    if os.environ.get("POSTTRAIN_REQUIRE_SLURM") == "1":
        pytest.fail(message + " [POSTTRAIN_REQUIRE_SLURM=1]", pytrace=False)
    pytest.skip(message)


def _run(*cmd: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, env=env, timeout=60)


def _pid_alive(pid: int) -> bool:
    return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _netns_pids(netns: str) -> list[int]:
    out = _run("ip", "netns", "pids", netns, check=False).stdout
    return [int(p) for p in out.split()]


def _kill_pids(pids: list[int], timeout: float = 10.0) -> None:
    """SIGTERM `pids`, then SIGKILL whatever is still alive after `timeout` seconds. A zombie
    counts as gone: daemons orphaned by a crashed owner are reaped by init, on its own time."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(pid)
            proc.terminate()
            procs.append(proc)
    for sig_timeout, last in ((timeout, False), (5.0, True)):
        deadline = time.monotonic() + sig_timeout
        while (alive := [p for p in procs if _proc_alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        if last or not alive:
            return
        for proc in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()


def _proc_alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _delete_netns(netns: str) -> None:
    """Kill every process inside `netns` (all started by us: slurmd, slurmstepd, job tasks),
    then delete it and its hosts file."""
    _kill_pids(_netns_pids(netns), timeout=5)
    _run("ip", "netns", "delete", netns, check=False)
    shutil.rmtree(Path("/etc/netns") / netns, ignore_errors=True)


def _delete_link(name: str) -> None:
    _run("ip", "link", "delete", name, check=False)


def clean_stale() -> None:
    """Remove what a crashed earlier LocalSlurm left behind: anything carrying our prefix whose
    owner process is dead. A live owner's resources are never touched."""
    REGISTRY.mkdir(parents=True, exist_ok=True)
    for record in REGISTRY.glob("*.json"):
        owner = int(record.stem.split("-")[0])
        if _pid_alive(owner):
            continue
        try:
            state = json.loads(record.read_text())
        except (OSError, ValueError):
            state = {}
        ours = []
        for pid, created in state.get("daemons", []):
            # The create time guards against a reused PID.
            with contextlib.suppress(psutil.NoSuchProcess):
                if abs(psutil.Process(pid).create_time() - created) < 1.0:
                    ours.append(pid)
        _kill_pids(ours, timeout=5)
        record.unlink(missing_ok=True)
        shutil.rmtree(record.with_suffix(".munge"), ignore_errors=True)
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = _NETNS_RE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _delete_netns(name)
    for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        match = _IFACE_RE.match(name)
        if match and not _pid_alive(int(match.group(1), 16)):
            _delete_link(name)
    netns_dir = Path("/etc/netns")
    if netns_dir.is_dir():
        for entry in netns_dir.glob(f"{_NETNS_PREFIX}*"):
            match = _NETNS_RE.match(entry.name)
            if match and not _pid_alive(int(match.group(1))):
                shutil.rmtree(entry, ignore_errors=True)


def _free_subnet() -> str:
    """A 10.213.X.0/24 no interface on this machine uses yet (two runs must not share one)."""
    used = _run("ip", "-o", "-4", "addr", "show").stdout
    # Start the scan at a pid-derived offset: two runs starting at once rarely pick the same.
    for step in range(254):
        prefix = f"10.213.{(os.getpid() + step) % 254 + 1}."
        if f" {prefix}" not in used:
            return prefix
    raise RuntimeError("no free 10.213.X.0/24 subnet for the test cluster")


class LocalSlurm:
    """A Slurm cluster of `num_nodes` real nodes (n1, n2, ...) under `workdir`.

    Use as a context manager, or call `start()` / `stop()`. `env` holds what a client needs
    (SLURM_CONF), `nodes` the node names, `conf_dir` the folder holding slurm.conf.
    """

    def __init__(self, workdir: Path, num_nodes: int = 2, cpus_per_node: int = 2) -> None:
        global _instances
        _instances += 1
        self.workdir = Path(workdir)
        self.conf_dir = self.workdir / "etc"
        self.nodes = [f"n{i + 1}" for i in range(num_nodes)]
        self.cpus_per_node = cpus_per_node
        self.controller = socket.gethostname().split(".")[0]
        owner = os.getpid()
        self._tag = f"{owner}-{_instances}"
        self._iface = f"pts{owner:x}x{_instances}"
        self._bridge = f"{self._iface}b"
        self._netns = [f"{_NETNS_PREFIX}{self._tag}-{node}" for node in self.nodes]
        self._record = REGISTRY / f"{self._tag}.json"
        # munged wants every folder above its socket searchable by all; a pytest temp dir is
        # 0700, so the socket lives in a folder of ours next to the registry record.
        self._munge_socket = REGISTRY / f"{self._tag}.munge" / "munge.socket"
        self._procs: list[subprocess.Popen] = []
        self._made_links: list[str] = []
        self._made_netns: list[str] = []
        self.env = {"SLURM_CONF": str(self.conf_dir / "slurm.conf")}
        self.addresses: dict[str, str] = {}
        self._made_etc_netns = False

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> LocalSlurm:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 60.0) -> None:
        """Create the network, write the configuration, start the daemons, and return once
        `sinfo` shows every node idle. Raises (after cleaning up) when it cannot."""
        clean_stale()
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> None:
        prefix = _free_subnet()
        self._controller_addr = f"{prefix}1"
        self.addresses = {node: f"{prefix}{i + 2}" for i, node in enumerate(self.nodes)}
        for sub in ("etc", "log", "state", "run", "munge", *(f"spool/{n}" for n in self.nodes)):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        self._make_network(prefix)
        self._write_config()
        self._start_munged()
        self._start_daemon(
            ["slurmctld", "-D", "-i", "-f", self.env["SLURM_CONF"]], self.workdir / "log/ctld.out"
        )
        for node, netns in zip(self.nodes, self._netns, strict=True):
            # Not `ip netns exec`: it remounts /sys, hiding /sys/fs/cgroup, and slurmd 22.05
            # will not start without its cgroup plugin. nsenter + unshare --mount (private
            # propagation) + a bind mount of the hosts file do the same otherwise. nsenter,
            # unshare and sh all exec: the Popen PID is slurmd's. Its slurmstepd and the
            # job's tasks inherit the namespaces and the hosts file.
            hosts = Path("/etc/netns") / netns / "hosts"
            script = (
                f"mount --bind {hosts} /etc/hosts && hostname {node} && "
                f"exec slurmd -D -N {node} -f {self.env['SLURM_CONF']}"
            )
            self._start_daemon(
                [
                    "nsenter",
                    f"--net=/run/netns/{netns}",
                    "unshare",
                    "--mount",
                    "--uts",
                    "sh",
                    "-c",
                    script,
                ],
                self.workdir / f"log/{node}.out",
            )
        self.wait_idle(timeout)

    def stop(self) -> None:
        """Cancel every job, end our daemons by PID and everything left in our namespaces, and
        delete the namespaces, links and hosts files. Safe after a failed or partial start."""
        if len(self._procs) > 1 and all(p.poll() is None for p in self._procs[:2]):
            # munged and slurmctld are up: cancel the jobs. Their processes all live in our
            # namespaces (inherited from slurmd), so the kill below reaches any that linger.
            self.client("scancel", "--full", "--user", "root", check=False, timeout=15)
        # The namespaces' processes first (slurmd, slurmstepd, tasks), then the root daemons.
        for netns in self._made_netns:
            _delete_netns(netns)
        _kill_pids([p.pid for p in self._procs], timeout=10)
        for proc in self._procs:
            proc.wait()
        self._procs.clear()
        for name in self._made_links:
            _delete_link(name)
        self._made_netns.clear()
        self._made_links.clear()
        self._record.unlink(missing_ok=True)
        shutil.rmtree(self._munge_socket.parent, ignore_errors=True)
        if self._made_etc_netns:
            with contextlib.suppress(OSError):  # not empty: another run's hosts files
                Path("/etc/netns").rmdir()

    # ------------------------------------------------------------------ clients
    def client(self, *cmd: str, check: bool = True, timeout: float = 60) -> str:
        """Run a Slurm client command against this cluster; its stdout."""
        result = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            env={**os.environ, **self.env},
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr}")
        return result.stdout

    def node_states(self) -> dict[str, str]:
        """{node: sinfo state} e.g. {"n1": "idle", "n2": "down*"}."""
        out = self.client("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        return dict(line.split() for line in out.splitlines() if line.strip())

    def logs(self) -> str:
        """The daemons' logs, for a failing test's message."""
        parts = []
        for path in sorted((self.workdir / "log").glob("*")):
            parts.append(f"==> {path.name} <==\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    # ------------------------------------------------------------------ setup steps
    def _make_network(self, prefix: str) -> None:
        self._made_etc_netns = not Path("/etc/netns").exists()
        _run("ip", "link", "add", self._bridge, "type", "bridge")
        self._made_links.append(self._bridge)
        _run("ip", "addr", "add", f"{self._controller_addr}/24", "dev", self._bridge)
        _run("ip", "link", "set", self._bridge, "up")
        hosts = "127.0.0.1 localhost\n" + f"{self._controller_addr} {self.controller}\n"
        hosts += "".join(f"{addr} {node}\n" for node, addr in self.addresses.items())
        for i, (node, netns) in enumerate(zip(self.nodes, self._netns, strict=True)):
            host_end, node_end = f"{self._iface}h{i + 1}", f"{self._iface}n{i + 1}"
            _run("ip", "netns", "add", netns)
            self._made_netns.append(netns)
            (Path("/etc/netns") / netns).mkdir(parents=True, exist_ok=True)
            # Only the node names and the controller: no 127.0.1.1 line for the node's own
            # name, so gloo and c10d bind the bridge address, reachable from the other node.
            (Path("/etc/netns") / netns / "hosts").write_text(hosts)
            _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", node_end)
            self._made_links.append(host_end)
            _run("ip", "link", "set", node_end, "netns", netns)
            _run("ip", "link", "set", host_end, "master", self._bridge)
            _run("ip", "link", "set", host_end, "up")
            inside = ("ip", "netns", "exec", netns, "ip")
            _run(*inside, "addr", "add", f"{self.addresses[node]}/24", "dev", node_end)
            _run(*inside, "link", "set", node_end, "up")
            _run(*inside, "link", "set", "lo", "up")

    def _write_config(self) -> None:
        key = self.workdir / "munge/munge.key"
        key.write_bytes(secrets.token_bytes(128))
        key.chmod(0o400)
        w = self.workdir
        nodes = ",".join(self.nodes)
        lines = [
            "ClusterName=posttrain-test",
            f"SlurmctldHost={self.controller}({self._controller_addr})",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            f"AuthInfo=socket={self._munge_socket}",
            f"StateSaveLocation={w}/state",
            f"SlurmdSpoolDir={w}/spool/%n",
            f"SlurmctldPidFile={w}/run/slurmctld.pid",
            f"SlurmdPidFile={w}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={w}/log/slurmctld.log",
            f"SlurmdLogFile={w}/log/slurmd-%n.log",
            # linuxproc follows the parent-pid tree, so it reaches torchrun's ranks even when
            # they start their own sessions (pgid would not); no cgroups needed.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            # 1, not 2: a node set DOWN by `scontrol update` stays down until `state=resume`
            # (with 2 it re-registers as idle at once); a non-responding node still returns.
            "ReturnToService=1",
            "KillWait=5",
            # Finished jobs stay in `scontrol show job` for 5 minutes: the launcher reads the
            # final state there.
            "MinJobAge=300",
            "MessageTimeout=10",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "SchedulerParameters=sched_interval=1",
            f"NodeName=DEFAULT CPUs={self.cpus_per_node} RealMemory=1000 State=UNKNOWN",
        ]
        lines += [f"NodeName={n} NodeAddr={a}" for n, a in self.addresses.items()]
        lines.append(f"PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE State=UP")
        (self.conf_dir / "slurm.conf").write_text("\n".join(lines) + "\n")

    def _start_daemon(self, cmd: list[str], log: Path) -> None:
        with open(log, "ab") as out:
            # Own session: a Ctrl-C aimed at pytest must not kill the cluster before stop().
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        self._procs.append(proc)
        self._write_record()

    def _start_munged(self) -> None:
        m = self.workdir / "munge"
        self._munge_socket.parent.mkdir(parents=True, exist_ok=True)
        for folder in (REGISTRY, self._munge_socket.parent):
            folder.chmod(0o755)
        self._start_daemon(
            [
                "munged",
                "-F",
                f"--socket={self._munge_socket}",
                f"--key-file={m}/munge.key",
                f"--pid-file={m}/munged.pid",
                f"--log-file={self.workdir}/log/munged.log",
                f"--seed-file={m}/munged.seed",
            ],
            self.workdir / "log/munged.out",
        )
        deadline = time.monotonic() + 10
        while not self._munge_socket.exists():
            if self._procs[-1].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start:\n{self.logs()}")
            time.sleep(0.05)

    def _write_record(self) -> None:
        daemons = [[p.pid, psutil.Process(p.pid).create_time()] for p in self._procs]
        self._record.parent.mkdir(parents=True, exist_ok=True)
        self._record.write_text(json.dumps({"daemons": daemons, "workdir": str(self.workdir)}))

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Return once every node is idle and responding (`sinfo` prints "idle", not "idle*",
        which a just-resumed node shows until it re-registers); raise after `timeout` s."""
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            for proc in self._procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args} exited {proc.returncode}:\n{self.logs()}")
            states = self.node_states()
            if sorted(states) == sorted(self.nodes) and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.2)
        raise RuntimeError(f"nodes not idle after {timeout:.0f} s ({states}):\n{self.logs()}")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    """A 2-node LocalSlurm for the whole session, started at its first use (skips, or fails
    under POSTTRAIN_REQUIRE_SLURM=1, where Slurm cannot run). Every test that downs, drains or
    queues on it resumes its nodes and cancels its jobs before it ends."""
    require_slurm()
    with LocalSlurm(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


__all__ = ["LocalSlurm", "clean_stale", "missing_tools", "require_slurm", "slurm_cluster"]
