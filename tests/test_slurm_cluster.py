"""The local Slurm test cluster (tests/slurm_cluster.py) is a real 2-node cluster: the nodes
reach each other by hostname (the path torchrun's c10d rendezvous and gloo take), scancel leaves
nothing behind, a node failure ends a job with a state the Slurm launcher can read, and the
cluster cleans up after itself. One cluster serves the whole module (~1.5 s to start, ~0.2 s to
stop). That jobs span both nodes and torchrun meets across them is shown by the Slurm
launcher's own runs (tests/test_slurm_launch.py: NodeList=n[1-2], both nodes' output, a
2-node FSDP SFT)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from slurm_cluster import REGISTRY, LocalSlurm, clean_stale, require_slurm

pytestmark = pytest.mark.slow

# Job states after which a job will not change again (squeue forgets it; scontrol keeps it for
# MinJobAge seconds).
_FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}


def _submit(cluster: LocalSlurm, tmp_path: Path, script: str, *args: str) -> str:
    """sbatch `script` (a shell body) with `args`; the job id. Output goes to <tmp>/<id>.out."""
    path = tmp_path / f"job-{uuid.uuid4().hex[:8]}.sh"
    path.write_text("#!/bin/sh\n" + script)
    out = cluster.client(
        "sbatch", "--parsable", f"--chdir={tmp_path}", f"--output={tmp_path}/%j.out", *args, path
    )
    return out.strip().split(";")[0]


def _job(cluster: LocalSlurm, job_id: str) -> dict[str, str]:
    """`scontrol -o show job` as a dict (JobState, Reason, NodeList, ...)."""
    line = cluster.client("scontrol", "-o", "show", "job", job_id)
    return dict(tok.split("=", 1) for tok in line.split() if "=" in tok)


def _wait(cluster: LocalSlurm, job_id: str, until: set[str], timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = _job(cluster, job_id)
        if job["JobState"] in until:
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} not {until} after {timeout} s: {job}\n{cluster.logs()}")


def _marked(marker: str) -> list[psutil.Process]:
    """Live processes whose environment carries POSTTRAIN_SLURM_TEST=<marker>."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("POSTTRAIN_SLURM_TEST") == marker:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def _wait_marked(marker: str, count: int, timeout: float = 30) -> list[psutil.Process]:
    """Wait until exactly `count` marked processes are alive; return them."""
    deadline = time.monotonic() + timeout
    procs = _marked(marker)
    while len(procs) != count and time.monotonic() < deadline:
        time.sleep(0.2)
        procs = _marked(marker)
    assert len(procs) == count, f"{len(procs)} marked processes, wanted {count}: {procs}"
    return procs


# Task 0 listens on the address its hostname resolves to (what gloo binds); task 1 connects to the
# first node of the allocation by name, as torchrun's --rdzv-endpoint does.
_TCP_PAIR = """
import os, socket, subprocess, time
head = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                      capture_output=True, text=True, check=True).stdout.split()[0]
me = socket.gethostname()
if os.environ["SLURM_PROCID"] == "0":
    assert me == head, (me, head)
    server = socket.create_server((socket.gethostbyname(me), 29512))
    server.settimeout(30)
    conn, (peer, _) = server.accept()
    print(f"{me} at {socket.gethostbyname(me)} got {conn.recv(64).decode()!r} from {peer}")
else:
    for _ in range(150):
        try:
            conn = socket.create_connection((head, 29512), timeout=2)
            break
        except OSError:
            time.sleep(0.1)
    conn.sendall(f"hello from {me}".encode())
"""


def test_second_node_reaches_first_by_hostname(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    (tmp_path / "pair.py").write_text(_TCP_PAIR)
    job_id = _submit(
        slurm_cluster,
        tmp_path,
        f"srun {sys.executable} {tmp_path}/pair.py\n",
        "--nodes=2",
        "--ntasks-per-node=1",
    )
    job = _wait(slurm_cluster, job_id, _FINAL)
    out = (tmp_path / f"{job_id}.out").read_text()
    assert job["JobState"] == "COMPLETED", out
    n1, n2 = slurm_cluster.addresses["n1"], slurm_cluster.addresses["n2"]
    # Two nodes with two addresses: the bytes crossed the bridge, not loopback.
    assert f"n1 at {n1} got 'hello from n2' from {n2}" in out


def test_scancel_leaves_no_job_and_no_process(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    # One task per node; each also starts a child in its own session (as torchrun's ranks may),
    # which proctrack/linuxproc must still reach.
    body = f"export POSTTRAIN_SLURM_TEST={marker}\nsrun sh -c 'setsid sleep 300 & sleep 300'\n"
    job_id = _submit(slurm_cluster, tmp_path, body, "--nodes=2", "--ntasks-per-node=1")
    _wait(slurm_cluster, job_id, {"RUNNING"})
    # batch shell + srun on n1, and per node: the task's sh, its sleep and the setsid sleep.
    procs = _wait_marked(marker, count=8)
    assert {p.name() for p in procs} >= {"sh", "srun", "sleep"}

    slurm_cluster.client("scancel", job_id)
    job = _wait(slurm_cluster, job_id, {"CANCELLED"}, timeout=30)
    assert job["Reason"] == "None"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
        job_id in slurm_cluster.client("squeue", "-h", "-o", "%i").split() or _marked(marker)
    ):
        time.sleep(0.2)
    assert job_id not in slurm_cluster.client("squeue", "-h", "-o", "%i").split()
    assert _marked(marker) == []


def test_node_failure_ends_job_and_node_resumes(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    body = f"export POSTTRAIN_SLURM_TEST={marker}\nsrun sleep 300\n"
    # --no-requeue: by default (JobRequeue=1) Slurm puts a node-failed batch job back in the
    # queue (PENDING, Reason=BeginTime) instead of ending it; the launcher passes it too.
    job_id = _submit(
        slurm_cluster, tmp_path, body, "--nodes=2", "--ntasks-per-node=1", "--no-requeue"
    )
    _wait(slurm_cluster, job_id, {"RUNNING"})
    _wait_marked(marker, count=4)  # batch shell, srun, one sleep per node
    try:
        slurm_cluster.client("scontrol", "update", "nodename=n2", "state=down", "reason=test")
        job = _wait(slurm_cluster, job_id, _FINAL, timeout=30)
        # What the launcher parses: JobState=NODE_FAIL Reason=NodeDown.
        assert (job["JobState"], job["Reason"]) == ("NODE_FAIL", "NodeDown")
        assert slurm_cluster.node_states()["n2"] == "down"
        _wait_marked(marker, count=0)
    finally:
        slurm_cluster.client("scontrol", "update", "nodename=n2", "state=resume")
    slurm_cluster.wait_idle()
    job_id = _submit(slurm_cluster, tmp_path, "hostname\n", "--nodelist=n2")
    assert _wait(slurm_cluster, job_id, _FINAL)["JobState"] == "COMPLETED"
    assert (tmp_path / f"{job_id}.out").read_text().split() == ["n2"]


def test_default_requeue_after_node_failure(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    """Without --no-requeue the failed job is not final: it waits to run again."""
    job_id = _submit(slurm_cluster, tmp_path, "srun sleep 300\n", "--nodes=2")
    _wait(slurm_cluster, job_id, {"RUNNING"})
    try:
        slurm_cluster.client("scontrol", "update", "nodename=n2", "state=down", "reason=test")
        job = _wait(slurm_cluster, job_id, {"PENDING"}, timeout=30)
        assert job["Restarts"] == "1"
    finally:
        slurm_cluster.client("scancel", job_id)
        slurm_cluster.client("scontrol", "update", "nodename=n2", "state=resume")
    assert _wait(slurm_cluster, job_id, _FINAL)["JobState"] == "CANCELLED"
    slurm_cluster.wait_idle()


def test_failed_start_cleans_up(tmp_path: Path) -> None:
    """A cluster whose nodes never become idle (more CPUs configured than slurmd finds) raises
    from start() and leaves no daemon, namespace or link behind; stop() again is harmless."""
    require_slurm()
    cluster = LocalSlurm(tmp_path, num_nodes=1, cpus_per_node=64)
    with pytest.raises(RuntimeError, match="not idle"):
        cluster.start(timeout=5)
    _assert_gone(cluster)
    cluster.stop()


_CRASHING_OWNER = """
import sys, time
sys.path.insert(0, {tests!r})
from slurm_cluster import LocalSlurm
LocalSlurm({workdir!r}).start()
print("ready", flush=True)
time.sleep(300)
"""


def test_crashed_owner_is_cleaned_at_next_start(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    """A run killed without stop() leaves daemons and namespaces; the next start removes them,
    and leaves a live owner's cluster (the session's) alone."""
    code = _CRASHING_OWNER.format(tests=str(Path(__file__).parent), workdir=str(tmp_path))
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "ready"
        record = json.loads(next(REGISTRY.glob(f"{owner.pid}-*.json")).read_text())
    finally:
        owner.kill()
        owner.wait()
    daemons = [pid for pid, _ in record["daemons"]]
    assert len(daemons) == 4 and all(_alive(pid) for pid in daemons)
    stale = [ns for ns in _netns() if f"-{owner.pid}-" in ns]
    assert len(stale) == 2

    clean_stale()
    assert not [pid for pid in daemons if _alive(pid)]
    assert not [ns for ns in _netns() if f"-{owner.pid}-" in ns]
    assert not list(REGISTRY.glob(f"{owner.pid}-*"))
    assert not any(f"pts{owner.pid:x}x" in link for link in _links())
    slurm_cluster.wait_idle(timeout=5)  # the live cluster is untouched


def _alive(pid: int) -> bool:
    """Running, not a zombie: orphaned daemons are reaped by init, on its own time."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _netns() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [line.split(":")[1].strip() for line in out.splitlines()]


def _assert_gone(cluster: LocalSlurm) -> None:
    """Nothing the cluster made is left (a veth goes asynchronously with its namespace)."""
    assert not set(cluster._netns) & set(_netns())
    deadline = time.monotonic() + 5
    while any(link.startswith(cluster._iface) for link in _links()):
        assert time.monotonic() < deadline, _links()
        time.sleep(0.1)
