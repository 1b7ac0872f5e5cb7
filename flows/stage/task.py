"""The one generic Prefect task, `stage`, that every stage runs through, and `run_task`, how the
flow calls it.

Why a child process: a stage imports torch, may run under torchrun with several ranks, and may
need to be killed; the flow process stays light and outlives it. The task only wires Prefect
to `flows.stage.supervise.supervise_stage`, which does the work.

Prefect shows every stage as a task run with its state, logs and artifacts, but its result cache
is not used: whether a stage must run is decided by its artifact alone, once per launch, under
the artifact's lock (`posttrain.store.status`). A stage that did not need to run ends in a
Completed state named `Reused`, the word the terminal, the report, the graph and the trackers
use too.
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
    """Launch and supervise one stage. Returns its `Outcome` (status, ref, summary), in a
    Completed state named Reused when the artifact was already there. The result stays in
    this process (`persist_result=False`): Prefect stores nothing of it."""
    outcome = supervise_stage(stage, spec, kill_grace_s)
    if outcome.status == REUSED:
        return Completed(name="Reused", message=f"artifact {outcome.ref.uri}", data=outcome)
    return outcome


def run_task(stage: PlannedStage, spec: StageSpec) -> Outcome:
    """Run one stage through the task; returns its outcome. Raises the stage's error."""
    return stage_task(stage, spec, return_state=True).result()
