"""An orphaned stage with infra.orphan=finish takes over its dead supervisor's artifact lock.

A SIGKILLed supervisor's main thread reads as gone while its other threads are still exiting, and
they still hold its open files, so its locks are released a moment after the stage notices. Seen
once in the full suite on a loaded machine: the orphan found the lock held, by the dead
supervisor's own record, and stopped instead of finishing. The take-over now waits for that
release, and only for it: a lock whose record names another process is not waited for."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from posttrain.runtime.orphan import RELEASE_GRACE_S, OrphanWatch
from posttrain.runtime.spec import LaunchInfo
from posttrain.store.locking import FileLock

# Takes the lock as a supervisor does (its own pid in the record), says so, holds it for
# argv[2] seconds and exits without releasing it: the exit does.
HOLDER = """
import sys, time
from posttrain.store.locking import FileLock
lock = FileLock(sys.argv[1])
assert lock.try_acquire({"what": "stage sft supervisor"})
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _holder(path: Path, hold_s: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path), str(hold_s)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _watch(tmp_path: Path, lock: Path, supervisor_pid: int) -> OrphanWatch:
    launch = LaunchInfo(id="l1", lock=str(lock), supervisor_pid=supervisor_pid)
    return OrphanWatch(tmp_path, "sft", "finish", launch, env={"RANK": "0"})


def test_finish_waits_while_the_dead_supervisor_still_holds_its_lock(tmp_path: Path) -> None:
    lock = tmp_path / "sft.lock"
    holder = _holder(lock, hold_s=0.6)
    try:
        watch = _watch(tmp_path, lock, supervisor_pid=holder.pid)
        t0 = time.monotonic()
        taken = watch._take_over_locks()
        waited = time.monotonic() - t0
        assert taken == [str(lock)], "the lock its supervisor's exit released was not taken"
        assert 0.3 < waited < RELEASE_GRACE_S
        assert FileLock(lock).holder()["pid"] == os.getpid()  # the record names the orphan now
    finally:
        holder.kill()
        holder.wait()
        for held in watch.taken:
            held.release()


def test_finish_does_not_wait_for_a_lock_another_process_holds(tmp_path: Path) -> None:
    lock = tmp_path / "sft.lock"
    holder = _holder(lock, hold_s=60)  # a new run, say: not the supervisor that died
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        watch = _watch(tmp_path, lock, supervisor_pid=gone.pid)
        t0 = time.monotonic()
        assert watch._take_over_locks() is None
        assert time.monotonic() - t0 < 1.0
        assert FileLock(lock).holder()["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait()
