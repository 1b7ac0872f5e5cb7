"""The Slurm engine: one `sbatch` job per stage.

The flow writes `slurm-<launch>.sbatch` (setup, the first node as rendezvous host, one `srun`
task per node) and `slurm-<launch>.node.sh` (each node's torchrun, `--node-rank $SLURM_PROCID`)
into the stage's `logs/` and submits the first. `output()` follows `slurm-<job id>.out`, srun's
task labels turned into `[node k] `. `scontrol -o show job` (finished jobs stay visible for
MinJobAge, 300 s by default) says whether the job waits, runs or ended, and why Slurm ended it.
`scancel` SIGTERMs every process on every node, SIGKILLs them after KillWait.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flows.stage.hang import stack_file, wait_for_stacks
from flows.stage.launch import planned_stage_command, project_pythonpath
from flows.stage.launchers.base import LaunchError, LaunchRequest, Log, poll_after
from posttrain.sections.slurm import SlurmConfig
from posttrain.telemetry.heartbeat import Hang

# Job states in which the job may still run (Slurm's squeue/scontrol names).
QUEUED = {"PENDING", "CONFIGURING", "REQUEUED"}
ACTIVE = QUEUED | {"RUNNING", "COMPLETING", "SUSPENDED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING"}
ACTIVE |= {"SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"}
# End states in which Slurm, not the stage's own processes, ended the job.
ENGINE_ENDS = {
    "TIMEOUT": "reached its time limit",
    "PREEMPTED": "was preempted",
    "NODE_FAIL": "lost a node",
    "BOOT_FAIL": "could not boot its nodes",
    "OUT_OF_MEMORY": "ran out of memory",
    "DEADLINE": "passed its deadline",
    "CANCELLED": "was cancelled outside the flow",
}
SCONTROL_TIMEOUT_S = 30.0
# The srun task label (`--label`): "0: text", padded to the widest task number.
_LABEL = re.compile(r"^\s*(\d+): ?(.*)$")
_FIELD = re.compile(r"(\w+)=(\S*)")


def _run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=SCONTROL_TIMEOUT_S, check=False
        )
    except FileNotFoundError:
        raise LaunchError(f"{cmd[0]} not found: is this a Slurm login node?") from None
    except subprocess.TimeoutExpired:
        raise LaunchError(f"{shlex.join(cmd)} did not answer in {SCONTROL_TIMEOUT_S:g} s") from None


def job_info(job_id: str) -> dict[str, str] | None:
    """`scontrol -o show job` as a dict (JobState, Reason, ExitCode, NodeList, TimeLimit...);
    None once Slurm has forgotten the job (MinJobAge after its end)."""
    done = _run(["scontrol", "-o", "show", "job", job_id])
    if done.returncode != 0:
        if "Invalid job id" in done.stderr:
            return None
        raise LaunchError(f"scontrol show job {job_id}: {done.stderr.strip()}")
    fields = dict(_FIELD.findall(done.stdout))
    # "JobState=CANCELLED Reason=None ..." ; a state may carry a suffix ("CANCELLED by 0").
    fields["JobState"] = fields.get("JobState", "UNKNOWN").split()[0]
    return fields


def exit_status(info: dict[str, str]) -> int:
    """One exit status for the whole job: its code, or 128 + the signal that ended it."""
    code, _, sig = info.get("ExitCode", "0:0").partition(":")
    with contextlib.suppress(ValueError):
        if int(code):
            return int(code)
        if int(sig or 0):
            return 128 + int(sig)
    return 0 if info["JobState"] == "COMPLETED" else 1


class SlurmLaunch:
    """One submitted job. State is read at most every `poll_s` (each read asks slurmctld)."""

    def __init__(self, job_id: str, output: Path, nnodes: int, poll_s: float):
        self.job_id, self.output_path, self.nnodes, self.poll_s = job_id, output, nnodes, poll_s
        self.description = f"Slurm job {job_id} ({nnodes} node{'s' if nnodes > 1 else ''})"
        self.record = {"job_id": job_id, "output": str(output), "nnodes": str(nnodes)}
        self.info: dict[str, str] | None = None
        self.read_at = -math.inf
        self.cancelled = False  # by this launcher: not an engine's reason to report

    # -- state -------------------------------------------------------------------------------

    def _state(self, fresh: bool = False) -> dict[str, str]:
        ended = self.info is not None and self.info["JobState"] not in ACTIVE
        if not ended and (fresh or time.monotonic() - self.read_at >= self.poll_s):
            info = job_info(self.job_id)
            self.read_at = time.monotonic()
            # None: forgotten, it ended longer than MinJobAge ago, in a state we did not see.
            self.info = info or {**(self.info or {}), "JobState": "UNKNOWN"}
        assert self.info is not None
        return self.info

    def started(self) -> bool:
        return self._state()["JobState"] not in QUEUED

    def waiting_reason(self) -> str | None:
        info = self._state()
        if info["JobState"] in QUEUED:
            return f"Slurm: {info['JobState']} ({info.get('Reason', 'None')})"
        return None

    def poll(self) -> int | None:
        info = self._state()
        if info["JobState"] in ACTIVE:
            return None
        return exit_status(info)

    def wait(self, timeout_s: float) -> int | None:
        return poll_after(self, self.read_at + self.poll_s, timeout_s)

    def engine_reason(self) -> str | None:
        info = self._state()
        state = info["JobState"]
        if state not in ENGINE_ENDS or (state == "CANCELLED" and self.cancelled):
            return None
        text = f"Slurm: job {self.job_id} {state}, it {ENGINE_ENDS[state]}"
        if state == "TIMEOUT":
            text += f" ({info.get('TimeLimit', '?')}; infra.slurm.time)"
        elif info.get("Reason") not in (None, "None"):
            text += f" ({info['Reason']})"
        if info.get("NodeList"):
            text += f" on {info['NodeList']}"
        return text

    # -- output ------------------------------------------------------------------------------

    def output(self) -> Iterator[str]:
        """The job's output file, followed until the job ended and the file stopped growing
        (a shared file system may show the last writes a moment late)."""
        handle = None
        quiet_since: float | None = None
        partial = ""
        while True:
            if handle is None and self.output_path.exists():
                handle = open(self.output_path, encoding="utf-8", errors="replace")  # noqa: SIM115
            chunk = handle.read() if handle is not None else ""
            if chunk:
                quiet_since = None
                lines = (partial + chunk).split("\n")
                partial = lines.pop()
                for line in lines:
                    yield self._relabel(line) + "\n"
                continue
            if self.poll() is not None:
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since > 1.0:
                    break
            time.sleep(0.2)
        if partial:
            yield self._relabel(partial) + "\n"
        if handle is not None:
            handle.close()

    @staticmethod
    def _relabel(line: str) -> str:
        m = _LABEL.match(line)
        return f"[node {m.group(1)}] {m.group(2)}" if m else line

    # -- control -----------------------------------------------------------------------------

    def stop(self, grace_s: float, log: Log) -> None:
        """`scancel`, then wait until the job has left the queue (Slurm SIGTERMs every process
        of the job and SIGKILLs them after KillWait; COMPLETING lasts until all are gone)."""
        if self.poll() is not None:
            return
        log.warning("stage: cancelling %s", self.description)
        self.cancelled = True
        done = _run(["scancel", self.job_id])
        if done.returncode != 0:
            log.error("scancel %s: %s", self.job_id, done.stderr.strip())
        deadline = time.monotonic() + grace_s + 120.0
        while time.monotonic() < deadline:
            if self._state(fresh=True)["JobState"] not in ACTIVE:
                return
            time.sleep(0.5)
        log.error("%s is still in the queue %.0f s after scancel", self.description, grace_s + 120)

    def dump_stacks(self, hang: Hang, out_dir: Path) -> list[Path]:
        """SIGUSR1 to every process of the job's steps on every node (`scancel --signal`):
        ranks write their stacks (faulthandler); the torchrun agents die of it, which is
        fine, the stage is stopped next anyway."""
        done = _run(["scancel", "--signal=USR1", self.job_id])
        if done.returncode != 0:
            return []
        return wait_for_stacks([stack_file(out_dir, r.rank) for r in hang.ranks])


class SlurmLauncher:
    name = "slurm"

    def __init__(
        self, config: SlurmConfig, device: str, devices_per_node: int, python: str | None = None
    ):
        self.config, self.device, self.devices_per_node = config, device, devices_per_node
        self.python = config.python or python or sys.executable

    @classmethod
    def from_infra(cls, infra: dict[str, Any]) -> SlurmLauncher:
        return cls(
            SlurmConfig.model_validate(infra.get("slurm") or {}),
            str(infra.get("device", "cpu")),
            int(infra.get("devices_per_node", 1)),
        )

    # -- the job -----------------------------------------------------------------------------

    def time_limit(self, timeout_s: float) -> str:
        if self.config.time:
            return self.config.time
        return str(math.ceil(timeout_s / 60) + 5)  # minutes

    def sbatch_options(self, request: LaunchRequest) -> list[str]:
        stage, cfg = request.stage, self.config
        opts = [
            f"--job-name=posttrain-{stage.name}-{stage.fingerprint[:8]}",
            f"--nodes={stage.nnodes}",
            "--ntasks-per-node=1",
            f"--time={self.time_limit(stage.timeout_s)}",
            f"--output={request.log_dir / 'slurm-%j.out'}",
            "--open-mode=append",
            # Preempted = ended: the flow reports it and its re-run resumes from the newest
            # checkpoint, rather than the job silently starting over in the queue.
            "--no-requeue",
            "--export=ALL",
            f"--chdir={request.log_dir}",
        ]
        gpus = cfg.gpus_per_node
        if gpus is None:
            gpus = self.devices_per_node if self.device == "cuda" else 0
        if gpus:
            opts.append(f"--gpus-per-node={gpus}")
        flags = ("partition", "account", "qos", "cpus-per-task", "mem", "constraint")
        for flag in (*flags, "reservation"):
            if (value := getattr(cfg, flag.replace("-", "_"))) is not None:
                opts.append(f"--{flag}={value}")
        if cfg.exclusive:
            opts.append("--exclusive")
        if flow_run := request.labels.get("flow-run"):
            opts.append(f"--comment=posttrain-flow-run={flow_run}")
        return [*opts, *cfg.sbatch_args]

    def node_script(self, request: LaunchRequest) -> str:
        """What every node runs: the same command, its rank and the rendezvous host filled in
        by the shell from what srun and the batch script set."""
        stage = request.stage
        endpoint = "$POSTTRAIN_RDZV_ENDPOINT"
        cmd = planned_stage_command(
            stage, request.spec_path, "$SLURM_PROCID", endpoint, python=self.python
        )
        words = [f'"{w}"' if w.startswith("$") else shlex.quote(w) for w in cmd]
        return (
            "#!/bin/bash\n"
            f"# posttrain stage {stage.name}, launch {request.launch_id}: one node's share.\n"
            'export POSTTRAIN_NODE_RANK="$SLURM_PROCID"\n'
            "# A hang dump (scancel --signal=USR1) reaches every process of the step: the ranks\n"
            "# dump their stacks (faulthandler), torchrun's agent must ignore it, not die and\n"
            "# leave its ranks outside the step's process tree.\n"
            "trap '' USR1\n"
            f"exec {' '.join(words)}\n"
        )

    def batch_script(self, request: LaunchRequest, node_script: Path) -> str:
        """The job: its sbatch options as #SBATCH lines (so `sbatch <script>` by hand submits
        the same job again), setup, the rendezvous address, and one srun task per node."""
        port = self.config.rdzv_port or "$((20000 + SLURM_JOB_ID % 20000))"
        setup = "".join(f"{line}\n" for line in self.config.setup)
        return (
            "#!/bin/bash\n"
            f"# posttrain stage {request.stage.name} (fingerprint {request.stage.fingerprint}), "
            f"launch {request.launch_id}.\n"
            "# Written and submitted by the flow; `sbatch` of this file submits it again.\n"
            + "".join(f"#SBATCH {opt}\n" for opt in self.sbatch_options(request))
            + "set -eo pipefail\n"
            + setup
            + 'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
            + f'export POSTTRAIN_RDZV_ENDPOINT="$head:{port}"\n'
            'echo "posttrain: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, rendezvous at '
            '$POSTTRAIN_RDZV_ENDPOINT"\n'
            # --kill-on-bad-exit: one node's failure ends the others at once (the ranks there
            # would otherwise wait for a collective until infra.pg_timeout_s).
             + "exec srun --label --kill-on-bad-exit=1 --ntasks-per-node=1 "
            f"--nodes={request.stage.nnodes} bash {shlex.quote(str(node_script))}\n"
        )

    def start(self, request: LaunchRequest, log: Log) -> SlurmLaunch:
        tag = request.launch_id[:8]
        node = request.log_dir / f"slurm-{tag}.node.sh"
        batch = request.log_dir / f"slurm-{tag}.sbatch"
        node.write_text(self.node_script(request))
        batch.write_text(self.batch_script(request, node))
        cmd = ["sbatch", "--parsable", str(batch)]
        log.info("stage %s: %s", request.stage.name, shlex.join(cmd))
        env = project_pythonpath({**os.environ, **request.env})
        done = _run(cmd, env=env)
        if done.returncode != 0:
            raise LaunchError(f"sbatch refused the job: {done.stderr.strip() or done.stdout}")
        job_id = done.stdout.strip().split(";")[0]
        if not job_id.isdigit():
            raise LaunchError(f"sbatch printed no job id: {done.stdout!r}")
        output = request.log_dir / f"slurm-{job_id}.out"
        return SlurmLaunch(job_id, output, request.stage.nnodes, self.config.poll_s)

    def find(self, record: dict[str, str], log: Log) -> SlurmLaunch | None:
        job_id = record.get("job_id", "")
        if not job_id.isdigit():
            return None
        try:
            info = job_info(job_id)
        except LaunchError as exc:
            log.warning("could not ask Slurm about job %s: %s", job_id, exc)
            return None
        if info is None or info["JobState"] not in ACTIVE:
            return None
        output, nnodes = Path(record.get("output", "")), int(record.get("nnodes", "1"))
        launch = SlurmLaunch(job_id, output, nnodes, self.config.poll_s)
        launch.info, launch.read_at = info, time.monotonic()
        return launch


def cancel_flow_run_jobs(flow_run_id: str) -> int:
    """scancel every queued or running job a flow run submitted (its `--comment`); returns how
    many. For the flow's cancel and crash hooks: a flow process killed outright never ran its
    tasks' cleanup. No Slurm here: nothing to cancel."""
    try:
        listed = _run(["squeue", "--noheader", "--format=%i %k"])
    except LaunchError:
        return 0
    wanted = f"posttrain-flow-run={flow_run_id}"
    jobs = [
        parts[0]
        for parts in (line.split(None, 1) for line in listed.stdout.splitlines())
        if len(parts) == 2 and parts[1].strip() == wanted
    ]
    if jobs:
        _run(["scancel", *jobs])
    return len(jobs)
