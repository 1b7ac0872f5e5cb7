"""grpo: group-relative policy optimisation against the reward model: several samples per prompt,
advantages normalised within each prompt's group, no critic. The loop is shared with PPO: see
`posttrain.rl.update`."""

from __future__ import annotations

from typing import Any

from posttrain.rl.update import run_online_rl
from posttrain.runtime.context import StageContext
from posttrain.stages.common import stage_main


def run(ctx: StageContext) -> dict[str, Any]:
    return run_online_rl(ctx, ctx.section.algorithm)


if __name__ == "__main__":
    stage_main(run)
