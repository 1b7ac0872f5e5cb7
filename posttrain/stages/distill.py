"""distill: on-policy distillation, the student's own samples scored token by token by a frozen
teacher. The stage runs the online-RL loop with the distillation step: see
`posttrain.rl.distill`."""

from __future__ import annotations

from typing import Any

from posttrain.rl.distill import run_distill
from posttrain.runtime.context import StageContext
from posttrain.stages.common import stage_main


def run(ctx: StageContext) -> dict[str, Any]:
    return run_distill(ctx)


if __name__ == "__main__":
    stage_main(run)
