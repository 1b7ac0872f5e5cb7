"""Finding and killing a stage's processes: its process group, its descendants, and every
process carrying its launch's tag (`POSTTRAIN_LAUNCH`, posttrain.runtime.spec: torchrun starts
each rank in a session of its own, so a process group is not enough)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable

import psutil

from posttrain.runtime.spec import LAUNCH_TAG_ENV, tag_flow_run_id, tag_launch_id

KILL_GRACE_S = 10.0


def _alive(p: psutil.Process) -> bool:
    try:
        # Orphans here may be re-parented to a PID 1 that never reaps: a zombie is dead.
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stage_processes(proc: subprocess.Popen[str], launch_id: str) -> list[psutil.Process]:
    """The stage process, its descendants, and any other process carrying the launch's tag
    (every process of one launch inherits it, so stray ranks are found even after their parent
    died or when they run in a session of their own)."""
    found: dict[int, psutil.Process] = {}
    # Only while our child is unreaped is its PID surely still ours (not reused).
    if proc.poll() is None:
        with contextlib.suppress(psutil.Error):
            leader = psutil.Process(proc.pid)
            for p in [leader, *leader.children(recursive=True)]:
                found[p.pid] = p
    for p in tagged_processes(lambda tag: tag_launch_id(tag) == launch_id):
        found.setdefault(p.pid, p)
    return [p for p in found.values() if _alive(p)]


def tagged_processes(match: Callable[[str], bool]) -> list[psutil.Process]:
    """Live processes (other than this one) whose launch tag `match`es."""
    me, found = os.getpid(), []
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            tag = p.environ().get(LAUNCH_TAG_ENV)
            if tag is not None and match(tag) and _alive(p):
                found.append(p)
        except psutil.Error:
            continue  # gone, a zombie, or not ours to read
    return found


def kill_flow_run_processes(flow_run_id: str, grace_s: float = KILL_GRACE_S) -> int:
    """SIGTERM, then SIGKILL after `grace_s`, every stage process of a flow run; returns how
    many were found. The backstop for a flow process that died before its tasks cleaned up (a
    cancel that ran out of grace, a crash): the tag names the flow run."""
    procs = tagged_processes(lambda tag: tag_flow_run_id(tag) == flow_run_id)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(p) for p in procs):
            time.sleep(0.1)
        if not any(_alive(p) for p in procs):
            break
    return len(procs)


def _in_group(p: psutil.Process, pgid: int) -> bool:
    try:
        return os.getpgid(p.pid) == pgid
    except OSError:
        return False


def _signal_all(
    proc: subprocess.Popen[str], procs: list[psutil.Process], sig: signal.Signals
) -> None:
    """Signal the stage's process group (which catches processes spawned since `procs` was
    listed) and each of `procs` (which catches those in sessions of their own)."""
    pgid = proc.pid  # start_new_session: the child leads its own group
    # Signal the group only while it surely is ours: our child is unreaped, or a member is
    # known. An empty group's id could be reused by an unrelated process.
    if proc.poll() is None or any(_in_group(p, pgid) for p in procs):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)


def kill_stage(
    proc: subprocess.Popen[str],
    launch_id: str,
    grace_s: float,
    log: logging.LoggerAdapter | logging.Logger,
) -> None:
    """SIGTERM the stage's process group and every process of the launch; SIGKILL what is
    still alive after `grace_s` (torchrun forwards SIGTERM to its ranks and needs a moment).
    Every process of the launch inherits the tag: none found (our child reaped), none left."""
    procs = stage_processes(proc, launch_id)
    if not procs and proc.poll() is not None:
        return
    log.warning("stage: terminating %d process(es)", len(procs))
    _signal_all(proc, procs, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc.poll() is not None and not any(_alive(p) for p in procs):
            break
        time.sleep(0.1)
    # Processes may have started during the grace period (a rank being spawned): look again.
    survivors = [p for p in {*procs, *stage_processes(proc, launch_id)} if _alive(p)]
    if survivors or proc.poll() is None:
        log.warning("stage: killing %d process(es) still alive after SIGTERM", len(survivors))
        _signal_all(proc, survivors, signal.SIGKILL)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        log.error("stage process %d did not exit after SIGKILL", proc.pid)
