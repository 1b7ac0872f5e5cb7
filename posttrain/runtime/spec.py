"""The one contract between whoever starts a stage process and the process: `spec.json`.

A stage process reads everything it needs from the file named by `--spec`: what to build (the
planned stage: its kind, fingerprint and folder, its inputs, its parents by role; the parents'
artifacts; the resolved recipe) and how this launch is held by the supervisor that started it
(`launch`: the launch id, the lock the supervisor holds for it, the device lock, what to watch
to notice the supervisor is gone, the earlier attempt's account). `docs/architecture.md` lists
the fields.

The environment carries only what the OS, torchrun, CUDA and the libraries read
(`PYTHONPATH`, `CUDA_VISIBLE_DEVICES`, `HF_HUB_OFFLINE`, ...), plus one process tag,
`POSTTRAIN_LAUNCH`: a file cannot mark a process, and every descendant of a launch (torchrun's
ranks in sessions of their own, their workers, a stray grandchild) inherits the environment,
so the tag is how the processes of a launch, or of a flow run, are found and stopped.

No torch, no Prefect: the flow writes this file, the stage reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from posttrain.store.artifacts import ArtifactRef, atomic_write_text

# The process tag every process of a launch inherits: `<launch id>` or `<launch id>@<flow run>`.
LAUNCH_TAG_ENV = "POSTTRAIN_LAUNCH"


@dataclass
class PlannedStage:
    """One stage as the run plans it (`posttrain.plan.planner`), the one description of a stage
    instance: the flow launches it, its spec carries it, the process's `StageContext` holds it."""

    name: str
    module: str
    fingerprint: str
    out_dir: Path
    parents: dict[str, str]  # parent stage name -> fingerprint
    nprocs: int  # processes per node
    timeout_s: float
    inputs: dict[str, Any] = field(repr=False, default_factory=dict)
    nnodes: int = 1
    rdzv_endpoint: str | None = None
    # Hang watch (training stages only; see flows.stage.supervise.supervise_stage): seconds without
    # any rank's heartbeat advancing, plus the allowance before the training loop's first beat.
    hang_timeout_s: float | None = None
    hang_startup_s: float = 0.0
    kind: str = ""
    # What its artifact is for the stages that consume it (the kind's `produces`).
    produces: str = ""
    # role -> parent stage name: "base", "policy" (what it starts from), "reference",
    # "reward_model", "teacher" and "teacher_base" (a distillation's teacher and the base it
    # stands on); evaluate and export also "parent" (the policy's own parent), "heldout" (where
    # held-out conversations come from) and "evaluation"; evaluate of a distilled policy also
    # its "teacher" and "teacher_base".
    roles: dict[str, str] = field(default_factory=dict)
    # GPUs this stage may use (CUDA_VISIBLE_DEVICES), set by the flow when stages run side by
    # side (infra.parallel_stages); None = all the machine has.
    visible_devices: str | None = None
    # What runs it (infra.launcher: local, slurm, kubernetes) and the infra section the launcher
    # reads its settings from (JSON-able: the stage travels as a Prefect task parameter).
    launcher: str = "local"
    infra: dict[str, Any] = field(repr=False, default_factory=dict)


class _Contract(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LaunchInfo(_Contract):
    """How one launch of a stage is held; written by its supervisor, read by every rank."""

    id: str = Field(description="This launch's id (also in the process tag and stage.log).")
    flow_run_id: str | None = Field(None, description="The Prefect flow run that launched it.")
    lock: str | None = Field(
        None,
        description="The artifact lock file the supervisor holds for this launch (node 0's, "
        "for another node's agent started by hand). A stage process refuses a spec without one.",
    )
    device_lock: str | None = Field(
        None, description="The device-set lock file the flow holds (infra.orphan=finish)."
    )
    supervisor_pid: int | None = Field(
        None, description="PID of the supervising process on this machine (local launches)."
    )
    supervisor_start: float | None = Field(
        None,
        description="When it started, in seconds after boot (kernel start ticks, unmoved by "
        "clock corrections; a PID can be reused).",
    )
    beat_file: str | None = Field(
        None,
        description="Remote launches: the file the supervisor rewrites while it follows the "
        "stage (the stage cannot see its PID on another machine).",
    )
    silence_s: float | None = Field(
        None, description="How long the beat file may stay unchanged before the stage acts."
    )
    earlier_attempt: str | None = Field(
        None,
        description="The supervisor's account of an unfinished earlier attempt (read before "
        "this launch cleared its heartbeats), for the stage's summary.",
    )

    def tag(self) -> str:
        """The value of `POSTTRAIN_LAUNCH` for this launch's processes."""
        return launch_tag(self.id, self.flow_run_id)


class StageSpec(_Contract):
    """What one stage process builds, and how its launch is held."""

    stage: PlannedStage = Field(
        description="The planned stage: name, kind, fingerprint (the manifest must match), "
        "folder, roles, inputs (what its fingerprint hashed), how it runs."
    )
    parents: dict[str, ArtifactRef] = Field(
        default_factory=dict, description="Parent stage name -> its artifact."
    )
    recipe: dict[str, Any] = Field(description="The resolved recipe.")
    launch: LaunchInfo | None = Field(
        None, description="Set by the supervisor that starts it; a stage refuses a spec without."
    )

    def write(self, path: Path) -> Path:
        """Atomically: a rank may read the file while a re-run of the same stage (under the
        artifact lock, so never concurrently with its own launch) replaces it."""
        atomic_write_text(path, self.model_dump_json(indent=2))
        return path


def read_spec(path: str | Path) -> StageSpec:
    return StageSpec.model_validate(json.loads(Path(path).read_text()))


def spec_path(out_dir: str | Path, node_rank: int = 0) -> Path:
    """Where a launch's spec lives: under logs/ (outside the manifest). Each node started by
    hand has its own supervisor, so nodes other than 0 write their own file."""
    name = "spec.json" if node_rank == 0 else f"spec-node{node_rank}.json"
    return Path(out_dir) / "logs" / name


def launch_tag(launch_id: str, flow_run_id: str | None = None) -> str:
    return f"{launch_id}@{flow_run_id}" if flow_run_id else launch_id


def tag_launch_id(tag: str | None) -> str | None:
    """The launch id of a `POSTTRAIN_LAUNCH` value."""
    return tag.split("@", 1)[0] if tag else None


def tag_flow_run_id(tag: str | None) -> str | None:
    """The flow run id of a `POSTTRAIN_LAUNCH` value, when it has one."""
    return tag.split("@", 1)[1] if tag and "@" in tag else None
