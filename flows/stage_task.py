"""The one generic Prefect task, `run-stage`, that every stage runs through, and `launch`, how
the flow calls it (a cache hit whose files are gone is rebuilt).

Why a child process: a stage imports torch, may run under torchrun with several ranks, and may
need to be killed; the flow process stays light and outlives it. The task only wires Prefect
(cache key, result storage) to `flows.stage_supervise.supervise_stage`, which does the work.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import Task, task
from prefect.cache_policies import CachePolicy
from prefect.context import TaskRunContext
from prefect.logging import get_run_logger

from flows.stage_procs import KILL_GRACE_S
from flows.stage_supervise import supervise_stage
from posttrain.artifacts import ArtifactRef, verify
from posttrain.planner import PlannedStage


@dataclass
class StageFingerprintPolicy(CachePolicy):
    """Cache key = stage name + fingerprint, so an unchanged stage hits across flow runs.

    Prefect's DEFAULT policy hashes the flow-run id in, so it never hits across runs.
    """

    def compute_key(
        self,
        task_ctx: TaskRunContext,
        inputs: dict[str, Any],
        flow_parameters: dict[str, Any],
        **kwargs: Any,
    ) -> str | None:
        stage = inputs.get("stage")
        if not isinstance(stage, PlannedStage):
            return None
        return f"posttrain-{stage.name}-{stage.fingerprint}"


@task(
    name="run-stage",
    task_run_name="{stage.name}",
    cache_policy=StageFingerprintPolicy(),
    persist_result=True,
    result_serializer="json",
)
def run_stage(
    stage: PlannedStage, spec_path: Path, kill_grace_s: float = KILL_GRACE_S
) -> dict[str, Any]:
    """Launch and supervise one stage. Returns `{"status": "ran"|"reused", "ref": {...}}`."""
    return supervise_stage(stage, spec_path, kill_grace_s).to_dict()


def results_dir(workspace: str | os.PathLike[str]) -> Path:
    """Prefect results and cache records live in the workspace, next to the artifacts they
    point at, not in ~/.prefect/storage (shared by every run and test on the machine)."""
    return Path(workspace) / ".prefect" / "results"


def stage_task_for(workspace: str | os.PathLike[str]) -> Task[..., dict[str, Any]]:
    """`run_stage` with its results stored inside `workspace`.

    A Path, not a `LocalFileSystem` block: Prefect refuses unsaved blocks as task result
    storage, and saving one per workspace would litter the server with blocks. Prefect turns
    the path into a local file system itself.
    """
    return run_stage.with_options(result_storage=results_dir(workspace))


def launch(
    launcher: Task[..., dict[str, Any]], stage: PlannedStage, spec: Path
) -> tuple[str, ArtifactRef]:
    """Run one stage through the task; returns (status, ref). Raises the stage's error."""
    state = launcher(stage, spec, return_state=True)
    outcome = state.result()  # raises StageFailed / StageTimeout when the task failed
    if state.name == "Cached":
        ref = ArtifactRef.model_validate(outcome["ref"])
        ok, why = verify(ref.path)
        if ok and ref.fingerprint == stage.fingerprint:
            return "cached", ref
        # The cache record outlived its files (deleted or edited): rebuild, and overwrite the
        # record so the next run hits again.
        get_run_logger().warning(
            "cached %s artifact is not valid (%s); re-running", stage.name, why
        )
        state = launcher.with_options(refresh_cache=True)(stage, spec, return_state=True)
        outcome = state.result()
    return outcome["status"], ArtifactRef.model_validate(outcome["ref"])
