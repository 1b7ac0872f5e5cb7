"""The local engine: the stage is a child process of this one (torchrun for several ranks, in a
session of its own so its whole tree can be signalled), its output read from a pipe."""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Iterable
from pathlib import Path

from flows.stage.hang import dump_stacks
from flows.stage.launch import node_rank, planned_stage_command
from flows.stage.launchers.base import LaunchRequest, Log
from flows.stage.procs import kill_stage
from posttrain.telemetry.heartbeat import Hang


class LocalLaunch:
    def __init__(self, proc: subprocess.Popen[str], launch_id: str):
        self.proc, self.launch_id = proc, launch_id
        self.description = f"process {proc.pid}: {shlex.join(proc.args)}"  # type: ignore[arg-type]
        self.record = {"pid": str(proc.pid)}

    def output(self) -> Iterable[str]:
        assert self.proc.stdout is not None
        return self.proc.stdout

    def started(self) -> bool:
        return True

    def waiting_reason(self) -> str | None:
        return None

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def engine_reason(self) -> str | None:
        return None  # a signal shows in the exit status, which the failure headline reads

    def stop(self, grace_s: float, log: Log) -> None:
        kill_stage(self.proc, self.launch_id, grace_s, log)

    def dump_stacks(self, hang: Hang, out_dir: Path) -> list[Path]:
        return dump_stacks(self.proc, self.launch_id, hang, out_dir)


class LocalLauncher:
    """Runs the stage on this machine; on a multi-node stage, this node's torchrun agent
    (POSTTRAIN_NODE_RANK), the others being started by hand (`posttrain launch`)."""

    name = "local"

    def find(self, record: dict[str, str], log: Log) -> None:
        # A local stage whose launcher died watches for that itself (posttrain.runtime.orphan) and
        # releases or takes over the artifact lock, which this launcher now holds.
        return None

    def start(self, request: LaunchRequest, log: Log) -> LocalLaunch:
        stage = request.stage  # this node's agent of it
        cmd = planned_stage_command(stage, request.spec_path, node_rank(), stage.rdzv_endpoint)
        pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        lines = {"text": True, "errors": "replace", "bufsize": 1}
        # start_new_session: its own process group, so killpg reaches every rank.
        proc = subprocess.Popen(cmd, env=request.env, start_new_session=True, **pipes, **lines)
        return LocalLaunch(proc, request.launch_id)
