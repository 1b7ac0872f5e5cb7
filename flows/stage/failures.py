"""Why a stage did not complete, or stopped the run: the errors the supervisor and the flow
raise, and the one-line account of a failed launch (which rank failed first, how it ended,
where its last heartbeat was)."""

from __future__ import annotations

from flows.stage.rank_exit import describe_beat, describe_exit, how_it_ended, root_causes
from posttrain.runtime.spec import PlannedStage
from posttrain.telemetry.heartbeat import read_heartbeats


class StageFailed(RuntimeError):
    """A stage process exited non-zero, was killed, or left an incomplete artifact."""


class StageTimeout(StageFailed):
    """A stage ran past its `infra.timeouts.<stage>` limit and was killed."""


class QualityGateFailed(RuntimeError):
    """A stage completed but its result is below a quality bar the recipe sets."""


def failure_headline(
    stage: PlannedStage, rc: int, recent: list[str], engine_reason: str | None = None
) -> str:
    """What ended a failed launch, in one line: the engine's reason when it ended the stage (the
    ranks' account is then only the consequence), else the rank torchrun's summary blames first
    (the agent's own exit code says nothing), how it ended and where its last heartbeat was."""
    beats = read_heartbeats(stage.out_dir)
    every = ", ".join(f"rank {k}: {describe_beat(b)}" for k, b in sorted(beats.items()))
    if engine_reason:
        text = f"stage '{stage.name}' was ended by {engine_reason}"
        return text + f"; last heartbeats: {every}" if beats else text
    causes = root_causes(recent)
    if causes:
        first = "; ".join(describe_exit(c, beats) for c in causes)
        return f"stage '{stage.name}' failed: {first}. torchrun stopped the other ranks"
    text = f"stage '{stage.name}' {how_it_ended(rc)}"
    if stage.nprocs <= 1 and stage.nnodes <= 1 and 0 in beats:
        text += f"; its last heartbeat: {describe_beat(beats[0])}"
    elif beats:
        text += f"; last heartbeats: {every}"
    return text
