"""The interface between the stage supervisor and whatever runs a stage's processes.

`flows.stage.supervise` holds the artifact lock, watches heartbeats and the timeout, and checks
the artifact; a `Launcher` only starts the stage's processes on every node and reports on them.
Three engines implement it: `local` (a child process of this one, torchrun for several ranks),
`slurm` (one sbatch job per stage, `srun` starts one torchrun agent per node) and `kubernetes`
(an Indexed Job with a headless Service, one pod per node). Everything the stage writes goes to
the shared workspace (metrics.jsonl, heartbeats, checkpoints, the manifest), so the supervisor
reads progress and hangs the same way whatever ran it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from posttrain.runtime.spec import PlannedStage
from posttrain.telemetry.heartbeat import Hang

Log = logging.LoggerAdapter | logging.Logger


@dataclass
class LaunchRequest:
    """What a launcher needs to start one stage.

    `env`: the variables every process of the stage must see (launch marker, held locks, the
    remote-launcher beat file, offline switches), on top of whatever the engine sets. A remote
    engine passes exactly these (plus its own), not this machine's whole environment.
    """

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
        """The stage's merged output, line by line, from every node (a remote engine prefixes
        each line with its node), until the stage has ended and everything was read."""
        ...

    def started(self) -> bool:
        """Whether the stage's processes run (a queued Slurm job or pending pod do not yet):
        the stage timeout counts from then."""
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
        """After the end: why the engine ended it, when the engine did (a time limit,
        preemption, node failure, an evicted or OOM-killed pod), else None."""
        ...

    def stop(self, grace_s: float, log: Log) -> None:
        """End every process of the stage on every node (SIGTERM, then SIGKILL after
        `grace_s`) and return once none is left. Safe to call after the end and twice."""
        ...

    def dump_stacks(self, hang: Hang, out_dir: Path) -> list[Path]:
        """Ask the hung ranks for their Python stacks (SIGUSR1 to ranks that registered
        faulthandler); returns the stack files written, [] where the engine cannot signal."""
        ...


class Launcher(Protocol):
    """An engine that runs stages."""

    name: str  # "local", "slurm", "kubernetes"

    def start(self, request: LaunchRequest, log: Log) -> Launch:
        """Start the stage on all its nodes (submit it); raises `LaunchError` when the engine
        refuses it (no such partition, the API says no), with the engine's words."""
        ...

    def find(self, record: dict[str, str], log: Log) -> Launch | None:
        """The launch `record` names (`Launch.record`) if the engine still runs or queues it,
        else None: a run whose flow died may have left it behind."""
        ...


class LaunchError(RuntimeError):
    """The engine refused to start a stage, or could not be reached."""
