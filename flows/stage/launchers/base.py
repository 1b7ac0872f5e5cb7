"""The interface between the stage supervisor and whatever runs a stage's processes.

`flows.stage.supervise` holds the lock, watches heartbeats and the timeout and checks the
artifact; a `Launcher` (`local`, `slurm`, `kubernetes`) only starts the stage's processes on every
node and reports on them. The stage writes everything to the shared workspace, so the supervisor
reads progress and hangs the same way whatever ran it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from posttrain.runtime.spec import PlannedStage
from posttrain.telemetry.heartbeat import Hang

Log = logging.LoggerAdapter | logging.Logger


@dataclass
class LaunchRequest:
    """What a launcher needs to start one stage. `env`: what every process of the stage must
    see; a remote engine passes exactly these (plus its own), not this machine's environment."""

    stage: PlannedStage
    spec_path: Path
    launch_id: str
    env: dict[str, str]
    # The stage's log folder (`<out_dir>/logs`), on the shared workspace: engines that write
    # their own files (a Slurm batch script and output, a Job manifest) put them here.
    log_dir: Path
    # Extra labels for the engine's records (the flow run id), so a hook can find the launch
    # after this process died.
    labels: dict[str, str] = field(default_factory=dict)


class Launch(Protocol):
    """One started stage, on however many nodes."""

    # What it is, for logs and errors: "process 1234", "Slurm job 57 (2 nodes)".
    description: str
    # The engine's handle, JSON-able (`{"job_id": "57"}`), kept in `logs/launch.json` so a later
    # run can find a launch whose flow died (`Launcher.find`).
    record: dict[str, str]

    def output(self) -> Iterable[str]:
        """Every node's output, line by line (`[node k] ` prefixed), until all was read."""
        ...

    def started(self) -> bool:
        """Whether the processes run (not queued): the stage timeout counts from then."""
        ...

    def waiting_reason(self) -> str | None:
        """Why a stage that has not started waits ("Slurm: PENDING (Resources)"), else None."""
        ...

    def poll(self) -> int | None:
        """The stage's exit status once every node ended (0 = all succeeded), else None."""
        ...

    def wait(self, timeout_s: float) -> int | None:
        """`poll()` after waiting up to `timeout_s` for the end."""
        ...

    def engine_reason(self) -> str | None:
        """After the end: why the engine ended it (time limit, preemption, OOM kill), if it did."""
        ...

    def stop(self, grace_s: float, log: Log) -> None:
        """SIGTERM, then SIGKILL after `grace_s`, every process on every node; safe twice."""
        ...

    def dump_stacks(self, hang: Hang, out_dir: Path) -> list[Path]:
        """SIGUSR1 to the hung ranks (faulthandler): the stack files, [] where it cannot."""
        ...


class Launcher(Protocol):
    """An engine that runs stages."""

    name: str  # "local", "slurm", "kubernetes"

    def start(self, request: LaunchRequest, log: Log) -> Launch:
        """Start (submit) the stage on all its nodes; `LaunchError`, in the engine's words."""
        ...

    def find(self, record: dict[str, str], log: Log) -> Launch | None:
        """The launch `record` names if the engine still runs or queues it (a dead flow's)."""
        ...


def poll_after(launch: Launch, next_read: float, timeout_s: float) -> int | None:
    """`launch.poll()`, then (still running) again once its next state read is due at
    `next_read` (monotonic), waiting at most `timeout_s`: a remote engine's `wait`."""
    if (rc := launch.poll()) is None:
        time.sleep(min(timeout_s, max(0.0, next_read - time.monotonic())))
        rc = launch.poll()
    return rc


class LaunchError(RuntimeError):
    """The engine refused to start a stage, or could not be reached."""
