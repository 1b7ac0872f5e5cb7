"""ppo: PPO against the reward model, with policy, reference, critic and reward model co-located
on one base under FSDP2. The loop is shared with GRPO: see `posttrain.rl.update`."""

from __future__ import annotations

from typing import Any

from posttrain.rl.update import run_online_rl
from posttrain.runtime.context import StageContext
from posttrain.stages.common import stage_main


def run(ctx: StageContext) -> dict[str, Any]:
    return run_online_rl(ctx, "ppo")


if __name__ == "__main__":
    stage_main(run)
