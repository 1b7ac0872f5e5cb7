"""Hangs: a training stage whose ranks all stop beating their heartbeats for
`infra.hang_timeout_s` gets its ranks' Python stacks dumped (SIGUSR1 -> faulthandler) into
logs/stacks-rank<k>.txt before it is killed, and fails with `StageHung` naming the rank that is
behind. The heartbeats themselves and the watch are `posttrain.telemetry.heartbeat`.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from pathlib import Path

import psutil

from flows.stage.failures import StageFailed
from flows.stage.procs import stage_processes
from posttrain.runtime.spec import PlannedStage
from posttrain.telemetry.heartbeat import Hang, HangWatch, stack_file

# How long the ranks get to write their stacks after SIGUSR1 (faulthandler writes from the
# signal handler itself, so this is normally a few milliseconds).
STACK_DUMP_WAIT_S = 5.0
STACK_EXCERPT_LINES = 40


class StageHung(StageFailed):
    """No rank of a training stage beat its heartbeat for `infra.hang_timeout_s`; its stacks
    were dumped and it was killed."""

    def __init__(self, message: str, hang: Hang, stack_files: list[Path]):
        super().__init__(message)
        self.hang = hang
        self.stack_files = stack_files


def hang_watch(stage: PlannedStage, every_rank: bool = False) -> HangWatch | None:
    """The heartbeat watch for one launch of `stage`, cleared of an earlier launch's beats;
    None when the stage has no hang timeout (only training stages beat)."""
    if not stage.hang_timeout_s:
        return None
    # Ranks beat into the (shared) workspace. A launch of this node's agent only can expect
    # only this node's ranks; one the engine started on every node (`every_rank`), all of them.
    if every_rank:
        expected = tuple(range(stage.nprocs * stage.nnodes))
    else:
        expected = tuple(range(stage.nprocs)) if stage.nnodes <= 1 else ()
    watch = HangWatch(stage.out_dir, stage.hang_timeout_s, stage.hang_startup_s, expected)
    watch.clear()  # an earlier launch's beats must not count as this one's
    return watch


def dump_stacks(
    proc: subprocess.Popen[str],
    launch_id: str,
    hang: Hang,
    out_dir: Path,
    wait_s: float = STACK_DUMP_WAIT_S,
) -> list[Path]:
    """SIGUSR1 to every rank that announced its PID in a beat and is still a process of this
    launch, then wait until their stack files stop growing. Only those: they registered
    faulthandler, while SIGUSR1 kills a process that did not (torchrun's agent, a helper).
    Returns the stack files of the ranks signalled."""
    ours = {p.pid: p for p in stage_processes(proc, launch_id)}
    files = []
    for r in hang.ranks:
        if r.pid in ours:
            with contextlib.suppress(psutil.Error):
                ours[r.pid].send_signal(signal.SIGUSR1)
                files.append(stack_file(out_dir, r.rank))
    return wait_for_stacks(files, wait_s)


def wait_for_stacks(files: list[Path], wait_s: float = STACK_DUMP_WAIT_S) -> list[Path]:
    """Wait until the signalled ranks' stack files exist and stop growing; returns `files`."""
    deadline = time.monotonic() + wait_s
    sizes: list[int] = []
    while files and time.monotonic() < deadline:
        time.sleep(0.2)
        now = [f.stat().st_size if f.exists() else 0 for f in files]
        if all(now) and now == sizes:
            break
        sizes = now
    return files


def hang_message(
    stage: PlannedStage, hang: Hang, files: list[Path], log_path: Path, tail: str
) -> str:
    behind = hang.behind
    where = "stopped before beating"
    if behind.silent_s is not None:
        where = f"is behind: last beat at step {behind.step} (phase {behind.phase}), "
        where += f"{behind.silent_s:.0f} s ago"
    text = (
        f"stage '{stage.name}' hung: no rank's heartbeat advanced for {hang.limit_s:g} s "
        f"(infra.hang_timeout_s {stage.hang_timeout_s:g}); rank {behind.rank} {where}. "
        f"Ranks: {hang.describe()}. The stage was killed with its process group. "
    )
    if files:
        text += "Python stacks (SIGUSR1): " + ", ".join(str(f) for f in files) + "."
        mine = stack_file(stage.out_dir, behind.rank)
        if mine in files and mine.exists():
            lines = mine.read_text(errors="replace").splitlines()[:STACK_EXCERPT_LINES]
            text += f"\n--- rank {behind.rank}'s stacks ---\n" + "\n".join(lines)
    else:
        text += "No rank process was left to dump its stacks."
    return f"{text}\nLog: {log_path}\n--- end of the log ---\n{tail}"
