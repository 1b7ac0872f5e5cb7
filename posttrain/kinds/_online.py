"""What the online-RL kinds (PPO, GRPO) share: their memory estimate and what their result
depends on besides their section."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

from posttrain.kinds._kind import MemoryInputs, StageKind, trainer
from posttrain.sections.shared import OnlineRLConfig


def rollout_memory(section: OnlineRLConfig, m: MemoryInputs, critic: bool) -> Any:
    """Policy, reference and frozen reward model (+ PPO's trainable value copy of the reward
    model), with generation rows and the response-only logits of an update."""
    from posttrain.memory.estimate import StageShape

    # No reward model (reward functions only): no reward adapter nor score head; the critic
    # then starts from the policy's adapter.
    adapters = tuple(a for a in (m.policy, m.reference, m.reward_model) if a is not None)
    if critic:
        start = m.reward_model if m.reward_model is not None else m.policy
        adapters += (replace(start, role="value", trainable=True),)
    r = section.rollout
    rank_rows = max(1, r.prompts_per_step // m.world) * r.samples_per_prompt
    rows = r.generation_batch_size or rank_rows
    # An episode's sequence is its prompt and everything after it (replies, tool turns), up
    # to max_episode_tokens; with the episode cache, every row's cache is kept between turns
    # besides the one batch being assembled from them.
    new = r.max_episode_tokens if r.episodes else r.max_new_tokens
    if r.episodes and r.episode_cache:
        rows = min(rank_rows, rows) + rank_rows
    prompt = section.data.max_prompt_len
    return StageShape(
        "rl",
        seq_len=prompt + new,
        adapters=adapters,
        score_head="frozen" if m.reward_model is not None else "none",
        value_head=critic,
        logit_positions=new,
        rollout_rows=rows,
        prompt_len=prompt,
        new_tokens=new,
        keep_gathered=r.keep_gathered,
        sampler_copy=r.engine == "fast",
        **m.common,
    )


def rollout_inputs(recipe: Any) -> dict[str, Any]:
    """Each rank samples its own share of the prompts with its own seed: the number of ranks
    changes the rollouts, so it is part of the fingerprint. (`recipe`: a ResolvedRecipe.)"""
    return {"dp_size": recipe.infra.dp_size()}


def online_kind(critic: bool, **kw: Any) -> StageKind:
    """A training kind that samples answers to its prompts each step (a value head: `critic`).
    Online DPO and distill take GRPO's shape (no critic); distill's teacher is added by the
    pre-flight from its base's shape."""
    memory = partial(rollout_memory, critic=critic)
    return trainer(data="prompts", inputs=rollout_inputs, memory=memory, **kw)


# Fields of the clipped policy-gradient update (ppo, grpo) that a one-step-per-rollout kind
# (online DPO, distill) has no use for: a recipe that changes one is told so rather than
# silently ignored. (By value, not `model_fields_set`: a recipe comes back fully dumped in a
# stage's spec.)
CLIPPED_UPDATE_FIELDS = (
    "update_epochs",
    "clip_range",
    "clip_range_high",
    "loss_aggregation",
    "entropy_coef",
)


def refuse_rl_fields(section: OnlineRLConfig, kind: str, constraint: str, step: str) -> None:
    """A ValueError naming the online-RL fields a one-step-per-rollout kind refuses: a KL
    penalty (`constraint`: what constrains it instead), sampling ahead of the policy, and the
    clipped update's fields (`step`: what its step is)."""
    if section.kl.coef > 0 or section.kl.adaptive:
        raise ValueError(
            f"kl.coef/kl.adaptive: {kind} adds no KL penalty; {constraint} (leave kl.coef at 0)"
        )
    if section.rollout.max_staleness:
        raise ValueError(
            f"rollout.max_staleness: {kind} samples each step's answers with the policy it "
            "updates (leave it at 0)"
        )
    fields = type(section).model_fields
    if given := [f for f in CLIPPED_UPDATE_FIELDS if getattr(section, f) != fields[f].default]:
        raise ValueError(
            f"{', '.join(given)}: fields of the clipped policy-gradient update (ppo, grpo); "
            f"{kind} takes {step}"
        )
