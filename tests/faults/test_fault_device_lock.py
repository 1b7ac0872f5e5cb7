"""The pieces the fault tests rely on, in seconds: the host-wide device lock (freed by the
kernel when its holder dies, shared by every user, naming its holder) and the orphan watch's
test of whether a launcher is still alive."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posttrain.runtime.device_lock import DIR_ENV, DeviceLock
from posttrain.runtime.orphan import process_start, supervisor_alive
from tests.faults.fault_runs import ROOT

HOLD = """
import sys, time
from posttrain.runtime.device_lock import DeviceLock
lock = DeviceLock("posttrain-devices-test-cpu")
assert lock.try_acquire({"what": "posttrain run", "flow_run_name": "dead-run"})
print("held", flush=True)
time.sleep(600)
"""


def test_a_killed_holder_frees_the_device_lock_and_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "locks"
    monkeypatch.setenv(DIR_ENV, str(folder))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        lock = DeviceLock("posttrain-devices-test-cpu")
        assert not lock.try_acquire({"what": "posttrain run"})
        assert lock.holder()["pid"] == holder.pid  # type: ignore[index]
        # Multi-user safe: a sticky world-writable folder, a file anyone may open to lock.
        assert stat.S_IMODE(folder.stat().st_mode) == 0o1777
        assert stat.S_IMODE(lock.path.stat().st_mode) == 0o666
        holder.kill()
        holder.wait()
        deadline = time.monotonic() + 5
        while not lock.try_acquire({"what": "posttrain run"}):
            assert time.monotonic() < deadline, "the kernel did not free the dead holder's flock"
            time.sleep(0.05)
        # The record the dead holder left: whose slot is being repossessed.
        assert lock.previous and lock.previous["flow_run_name"] == "dead-run"
        assert lock.holder()["pid"] == os.getpid()  # type: ignore[index]
        lock.release()
    finally:
        holder.kill()
        holder.wait()


def test_supervisor_alive_follows_the_process_not_the_pid() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        pid, start = child.pid, process_start(child.pid)
        assert supervisor_alive(pid, start)
        # Same PID, another start time: a reused PID is not our supervisor.
        assert not supervisor_alive(pid, start - 10)
        child.kill()
        child.wait()
        assert not supervisor_alive(pid, start)
        assert supervisor_alive(os.getpid(), process_start())
    finally:
        child.kill()
        child.wait()
