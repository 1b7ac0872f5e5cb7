"""Run a plan's stages in dependency order, several at once when the recipe allows.

`infra.parallel_stages` = 1 (CPU, multi-node, one GPU set): plan order, one at a time, in the
flow's own thread. Above 1: a stage starts as soon as its parents are done and a slot is free;
each slot owns `devices_per_node` GPUs (CUDA_VISIBLE_DEVICES), so stages never share a device.
A failure stops new launches; stages already running finish (their work is independent and
cached for the re-run), then the first failure is raised.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from posttrain.runtime.spec import PlannedStage
from posttrain.store.artifacts import ArtifactRef

# Runs one stage with its parents' refs and returns its ref (flows.post_train.PipelineRun).
RunOne = Callable[[PlannedStage, dict[str, ArtifactRef]], ArtifactRef]


def device_slots(parallel: int, per_stage: int, cuda: bool) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES for each of `parallel` slots (None on CPU: nothing to split)."""
    if not cuda or parallel == 1:
        return [None] * parallel
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(parallel * per_stage)]
    return [",".join(ids[i * per_stage : (i + 1) * per_stage]) for i in range(parallel)]


def run_stages(
    stages: list[PlannedStage],
    run_one: RunOne,
    parallel: int = 1,
    slots: list[str | None] | None = None,
) -> dict[str, ArtifactRef]:
    """Every stage's ref, by name. Raises the first stage error (after the others stop)."""
    refs: dict[str, ArtifactRef] = {}
    if parallel <= 1:
        for stage in stages:
            refs[stage.name] = run_one(stage, refs)
        return refs
    free = list(slots or [None] * parallel)
    pending = list(stages)
    running: dict[Future[ArtifactRef], tuple[PlannedStage, str | None]] = {}
    failure: BaseException | None = None
    with ThreadPoolExecutor(parallel, thread_name_prefix="posttrain-stage") as pool:
        while pending or running:
            while failure is None and free:
                ready = next((s for s in pending if all(p in refs for p in s.parents)), None)
                if ready is None:
                    break
                pending.remove(ready)
                slot = free.pop(0)
                ready.visible_devices = slot
                # The flow run's context (Prefect's run context, our context variables) goes
                # with the stage into its thread, as Prefect's own task runner does.
                ctx = contextvars.copy_context()
                running[pool.submit(ctx.run, run_one, ready, dict(refs))] = (ready, slot)
            if not running:
                break
            done, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for future in done:
                stage, slot = running.pop(future)
                free.append(slot)
                try:
                    refs[stage.name] = future.result()
                except BaseException as exc:
                    failure = failure or exc
    if failure is not None:
        raise failure
    return refs
