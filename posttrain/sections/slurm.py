"""`infra.slurm`: how a stage is submitted when `infra.launcher` is `slurm` (one `sbatch` job
per stage, one torchrun agent per node started by `srun`)."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from posttrain.sections.fields import _Section

# Slurm's --time forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
_SLURM_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+(:\d{1,2}){0,2})$")


class SlurmConfig(_Section):
    """Where and how big the Slurm job of each stage is. Every stage but ingest (which may need
    the internet that compute nodes often lack) is submitted; distributed stages span
    `infra.nnodes` nodes, the others one node."""

    partition: str | None = Field(None, description="`--partition`; null = the cluster default.")
    account: str | None = Field(None, description="`--account` the job is charged to.")
    qos: str | None = Field(None, description="`--qos`.")
    time: str | None = Field(
        None,
        description="`--time` limit (Slurm's forms: `90`, `4:00:00`, `2-00:00:00`). null = the "
        "stage's timeout (infra.timeouts) plus 5 minutes, so the flow's own timeout fires first "
        "with its clearer message. A job Slurm ends at its limit fails the stage with Slurm's "
        "reason; the re-run resumes from the newest checkpoint.",
    )
    gpus_per_node: int | None = Field(
        None,
        ge=0,
        description="`--gpus-per-node`. null = infra.devices_per_node when infra.device is "
        "cuda, else none.",
    )
    cpus_per_task: int | None = Field(
        None,
        ge=1,
        description="`--cpus-per-task` of the one task per node (the torchrun agent and all its "
        "ranks share it). null = the cluster default.",
    )
    mem: str | None = Field(
        None,
        description="`--mem` per node (`64G`; `0` = all of the node's memory).",
        pattern=r"^[0-9]+[KMGT]?$",
    )
    constraint: str | None = Field(None, description="`--constraint` (node features).")
    reservation: str | None = Field(None, description="`--reservation`.")
    exclusive: bool = Field(
        False, description="`--exclusive`: no other job shares the stage's nodes."
    )
    sbatch_args: list[str] = Field(
        default_factory=list,
        description="More sbatch options, each one `--name=value` (e.g. `--mail-type=FAIL`).",
    )
    setup: list[str] = Field(
        default_factory=list,
        description="Shell lines the batch script runs before starting the nodes (e.g. `module "
        "load cuda/12.4`, `source /shared/venv/bin/activate`).",
    )
    python: str | None = Field(
        None,
        description="Python on the compute nodes. null = the interpreter the flow runs in, "
        "which must then be on storage every node sees (a shared virtual environment).",
    )
    rdzv_port: int | None = Field(
        None,
        ge=1024,
        le=65535,
        description="Port of the c10d rendezvous on the allocation's first node. null = 20000 + "
        "job id mod 20000, so two jobs sharing a node do not collide.",
    )
    poll_s: float = Field(
        5.0,
        ge=0.2,
        description="Seconds between the flow's `squeue` queries about a running job (every "
        "query is a request to slurmctld).",
    )

    @field_validator("time")
    @classmethod
    def _time(cls, value: str | None) -> str | None:
        if value is not None and not _SLURM_TIME.match(value):
            raise ValueError(
                f"{value!r} is not a Slurm time (minutes, H:M:S or D-H:M:S, e.g. `4:00:00`)"
            )
        return value

    @field_validator("sbatch_args")
    @classmethod
    def _options(cls, value: list[str]) -> list[str]:
        for arg in value:
            if not re.match(r"^--[a-z][a-z-]*(=.*)?$", arg):
                raise ValueError(f"{arg!r} is not an sbatch option of the form --name=value")
        return value
