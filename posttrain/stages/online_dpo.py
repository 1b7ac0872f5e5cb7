"""online_dpo: DPO on the policy's own answers, judged as they are sampled. The stage runs the
online-RL loop with the DPO step: see `posttrain.rl.online_dpo`."""

from __future__ import annotations

from typing import Any

from posttrain.rl.online_dpo import run_online_dpo
from posttrain.runtime.context import StageContext
from posttrain.stages.common import stage_main


def run(ctx: StageContext) -> dict[str, Any]:
    return run_online_dpo(ctx)


if __name__ == "__main__":
    stage_main(run)
