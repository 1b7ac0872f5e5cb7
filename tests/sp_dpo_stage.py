"""torchrun entry of tests/test_dpo_sequence_parallel.py: the dpo stage, with the recipe's sft
stage counted as wired for sequence parallelism (SFT's wiring is its own slice of issue 44;
the test's SFT parent ran unsplit, before, and is reused as it is)."""

from __future__ import annotations

from posttrain.config import sp_check
from posttrain.stages.common import stage_main
from posttrain.stages.dpo import run

sp_check.SP_WIRED_KINDS = sp_check.SP_WIRED_KINDS | {"sft"}

if __name__ == "__main__":
    stage_main(run)
