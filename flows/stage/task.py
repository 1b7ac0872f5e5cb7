"""The one generic Prefect task, `stage`, that every stage runs through, and `run_task`, how the
flow calls it.

A stage runs in a child process (it imports torch, may run under torchrun, may need killing);
the task only wires Prefect to `flows.stage.supervise.supervise_stage`. Prefect's result cache
is not used: whether a stage runs is decided by its artifact alone, under the artifact's lock. A
stage that did not need to run ends Completed, named `Reused` (the word used everywhere).
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, State

from flows.stage.procs import KILL_GRACE_S
from flows.stage.supervise import Outcome, supervise_stage
from posttrain.runtime.spec import PlannedStage, StageSpec

REUSED = "reused"


@task(name="stage", task_run_name="{stage.name}", cache_policy=NO_CACHE, persist_result=False)
def stage_task(
    stage: PlannedStage, spec: StageSpec, kill_grace_s: float = KILL_GRACE_S
) -> Outcome | State:
    """Launch and supervise one stage: its `Outcome`, in a Completed state named Reused when the
    artifact was there. Prefect stores nothing of it (`persist_result=False`)."""
    outcome = supervise_stage(stage, spec, kill_grace_s)
    if outcome.status == REUSED:
        return Completed(name="Reused", message=f"artifact {outcome.ref.uri}", data=outcome)
    return outcome


def run_task(stage: PlannedStage, spec: StageSpec) -> Outcome:
    """Run one stage through the task; returns its outcome. Raises the stage's error."""
    return stage_task(stage, spec, return_state=True).result()
