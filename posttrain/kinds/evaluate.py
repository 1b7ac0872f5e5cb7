"""evaluate: scores the final policy against its parent and the base (held-out loss, exact
match, samples, decode speed, reward-model accuracy and win-rate), and any listed policies side
by side."""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field, field_validator, model_validator

from posttrain.kinds._kind import StageKind
from posttrain.sections.fields import Result, _Section
from posttrain.sections.rewards import RewardSpec
from posttrain.sections.shared import SamplingConfig


def _default_sampling() -> list[SamplingConfig]:
    return [
        SamplingConfig(name="greedy", strategy="greedy"),
        SamplingConfig(name="beam4", strategy="beam", num_beams=4),
        SamplingConfig(name="t0.7-top_p0.9", strategy="sample", temperature=0.7, top_p=0.9),
        SamplingConfig(name="t1.0-top_k20", strategy="sample", temperature=1.0, top_k=20),
    ]


LM_EVAL_POLICIES = ("base", "sft", "final")


class LmEvalConfig(_Section):
    """lm-evaluation-harness tasks run in-process on the merged policies (decision 48)."""

    tasks: list[str] = Result(
        min_length=1,
        description="Harness task (or group) names, e.g. `[gsm8k, mmlu, ifeval]` (need the hub "
        "for their datasets) or tasks defined by YAML files in `include_path`.",
    )
    limit: int | None = Result(
        None,
        ge=1,
        description="Documents scored per task (the first ones); null = all. Standard tasks "
        "are large (mmlu: 14k questions): a limit keeps evaluate short, at the cost of noise.",
    )
    num_fewshot: int | None = Result(
        None, ge=0, description="Few-shot examples per prompt; null = each task's own default."
    )
    batch_size: int = Result(8, ge=1, description="Requests per forward pass in the harness.")
    bootstrap_iters: int = Result(
        0,
        ge=0,
        description="The harness's bootstrap draws for standard errors; 0 = none reported. Any "
        "value > 0 gives mean metrics (acc) their closed-form stderr; others (f1, bleu, ...) "
        "are bootstrapped with that many draws (the harness's own default, 100000, takes "
        "minutes).",
    )
    include_path: str | None = Result(
        None,
        source="files",
        description="A folder of custom task YAMLs, resolved like the recipe's other input "
        "paths (a relative path against the current directory; inside an allowed folder). "
        "Keep a task's local data files in it, so that their content is fingerprinted.",
    )
    policies: list[Literal["base", "sft", "final"]] = Result(
        default_factory=lambda: list(LM_EVAL_POLICIES),
        min_length=1,
        description="Which models to score: `base` (the ingested model), `sft` (the last SFT "
        "stage of the final policy's lineage, merged), `final` (the final policy, merged). The "
        "headline (`lm_eval/<task>/<metric>`) is the final policy's; base/sft go to eval.json.",
    )

    @field_validator("tasks")
    @classmethod
    def _unique_tasks(cls, v: list[str]) -> list[str]:
        if len(v) != len(set(v)):
            raise ValueError(f"task names must be unique, got {v}")
        return v

    @model_validator(mode="after")
    def _installed(self) -> LmEvalConfig:
        # Checked when the recipe loads, so a run without the extra fails before any stage
        # starts, with the fix, rather than with an ImportError traceback in evaluate.
        if importlib.util.find_spec("lm_eval") is None:
            raise ValueError(
                "lm-evaluation-harness is not installed; install the extra: "
                "pip install -e .[lm-eval]"
            )
        return self


class SpeedConfig(_Section):
    """The decode-speed test: one prompt cut from the held-out prompts, greedy-decoded by a bare
    forward + argmax loop after one untimed warm-up (posttrain/eval/inference.py)."""

    prompt_tokens: int = Result(32, ge=1, description="Prompt length, in tokens.")
    new_tokens: int = Result(32, ge=1, description="Tokens decoded per timed run.")
    repeats: int = Result(1, ge=1, description="Timed runs (the median is reported).")
    no_cache: bool = Result(
        False,
        description="Also time decoding without the KV cache (every step recomputes the whole "
        "sequence: the baseline the cache avoids, ~10x the cached time) and report the "
        "cache's speedup.",
    )


class EvaluateConfig(_Section):
    max_eval_rows: int = Result(256, ge=1, description="Held-out rows scored for loss/perplexity.")
    batch_size: int = Result(16, ge=1, description="Rows per forward pass when scoring.")
    num_prompts: int = Result(8, ge=1, description="Held-out prompts to generate from.")
    sampling: list[SamplingConfig] = Field(
        default_factory=_default_sampling, description="Decoding settings to sample under."
    )
    speed: SpeedConfig | None = Field(
        default_factory=SpeedConfig,
        description="Decode speed of the merged final policy (tokens/s, time to first token, "
        "time per output token; headline `decode_tok/s`). null = not measured.",
    )
    win_rate_prompts: int = Result(
        64,
        ge=1,
        description="Held-out prompts of the final policy's stage on which its answers are "
        "judged against its parent's (and each compared policy's against its parent's) by the "
        "reward model, when the run has one; also how many held-out reward prompts the "
        "promotion gate's head-to-head against the champion uses.",
    )
    policies: list[str] = Result(
        default_factory=list,
        description="Policy stages (by name) to score side by side in the report, each against "
        "its parent (held-out loss, exact match, reward-model win-rate): e.g. `[sft, dpo, grpo]` "
        "shows each link's gain. Empty = the final policy only (against its parent and the base).",
    )
    win_rate_sampling: SamplingConfig = Field(
        default_factory=lambda: SamplingConfig(name="win-rate", strategy="greedy"),
        description="Decoding used for the win-rate and head-to-head generations.",
    )

    verifiers: list[RewardSpec] | None = Field(
        None,
        description="Reward functions that judge an answer correct (each that applies must "
        "give at least `pass_threshold`) for the pass@1 / pass@k report. null = the first reward "
        "function of the nearest stage of the final policy's lineage that has `rewards` (list "
        "the correctness check first); [] = no verifier report.",
    )
    pass_threshold: float = Result(
        1.0, description="A verifier's value at or above this counts as correct."
    )
    pass_prompts: int = Result(
        100,
        ge=1,
        description="Held-out prompts with references (the verifier stage's held-out prompts, "
        "else the held-out conversations, whose last reply is the reference) scored for pass@k.",
    )
    pass_k: int = Result(4, ge=1, description="k of the sampled pass@k.")
    pass_samples: int = Result(
        8, ge=1, description="Samples per prompt for pass@k (n >= k; unbiased estimator)."
    )
    pass_k_policies: Literal["final", "all"] | list[str] = Result(
        "final",
        description="Which policies get the sampled pass@k (`pass_samples` answers to each of "
        "`pass_prompts` prompts: most of evaluate's time with verifiers). `final`: the final "
        "policy only; `all`: every policy the verifier report compares (the base, the parent, "
        "`policies`, a distilled policy's teacher), one more sampling pass each; or a list of "
        "those policies by stage name, sampled besides the final policy. Every compared policy "
        "gets the greedy pass@1 either way.",
    )
    pass_sampling: SamplingConfig = Field(
        default_factory=lambda: SamplingConfig(
            name="pass@k", strategy="sample", temperature=1.0, max_new_tokens=48
        ),
        description="Decoding of the pass@k samples; greedy pass@1 uses its max_new_tokens.",
    )

    lm_eval: LmEvalConfig | None = Field(
        None,
        description="lm-evaluation-harness tasks scored on the base, the SFT and the final "
        "policy (merged weights, HF backend); the final policy's scores become headline "
        "metrics `lm_eval/<task>/<metric>` that promotion rules can name. null = off. Needs "
        "the `lm-eval` extra.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> EvaluateConfig:
        if self.pass_k > self.pass_samples:
            raise ValueError(
                f"pass_k {self.pass_k} needs at least as many pass_samples ({self.pass_samples})"
            )
        names = [s.name for s in self.sampling]
        if len(names) != len(set(names)):
            raise ValueError(f"sampling names must be unique, got {names}")
        return self


KIND = StageKind(
    name="evaluate",
    section=EvaluateConfig,
    module="posttrain.stages.evaluate",
    help="Evaluation of the final policy (and `policies`).",
    order=900,
    produces="evaluation",
    # 2: scores against the policy's parent (parent_loss, win_rate_vs_parent), not SFT.
    # 4: sampled pass@k for the final policy only by default (`pass_k_policies`): the verifier
    # report of the other policies holds their greedy pass@1 alone.
    version="4",
    consumes=("policy",),
    placement="last",
    timeout_s=3600,
)
