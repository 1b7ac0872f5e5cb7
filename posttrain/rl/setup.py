"""Online RL before its first step (`posttrain.rl.loop`): the recipe's shapes and the
chat templates checked, the reward and the prompts loaded, the four roles built on one base and
the training session started (or resumed, with its KL coefficient)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from posttrain.config.batch import ResolvedBatch
from posttrain.config.loader import section_batch
from posttrain.data.pref_prepare import guard_template
from posttrain.data.prompts import PromptData, prepare_prompts
from posttrain.data.sft_data import write_rows
from posttrain.distributed.fsdp import forward_method
from posttrain.distributed.runtime import all_reduce_tensor
from posttrain.errors import RecipeVerdict
from posttrain.models.adapters import POLICY, REFERENCE
from posttrain.models.lora import prepare_for_training
from posttrain.models.roles import RoleModel, build_roles
from posttrain.models.stop_tokens import model_stop_token_ids
from posttrain.rewards.combine import load_rewards
from posttrain.rewards.judge_server import judge_servers
from posttrain.rl.losses import KLController, Reduce
from posttrain.rl.rewarder import Rewarder
from posttrain.rl.rollout.collect import RolloutSetup
from posttrain.rl.rollout.engine import RolloutEngine
from posttrain.rl.rollout.engines import build_engine
from posttrain.rl.rollout.multiturn import episode_setup
from posttrain.runtime.context import StageContext, training_base
from posttrain.telemetry import heartbeat
from posttrain.train.loop import sequence_split
from posttrain.train.micro_batches import padding_free
from posttrain.train.session import TrainSession, start_session

log = logging.getLogger("posttrain.rl")


def _local_sequences(where: str, cfg: Any, world: int) -> int:
    """Sequences per rank per rollout, or a RecipeVerdict when the prompts do not split evenly
    over the ranks (their number is known only once the stage runs)."""
    r = cfg.rollout
    if r.prompts_per_step % world:
        raise RecipeVerdict(
            "rollout.prompts_per_step",
            f"{r.prompts_per_step} must be a multiple of the {world} ranks (each rank rolls out "
            "the same number of prompts)",
            where,
        )
    return r.prompts_per_step // world * r.samples_per_prompt


def check_shapes(where: str, cfg: Any, batch: Any, world: int) -> tuple[int, int]:
    """(sequences per rank per rollout, optimizer updates per rollout), or a RecipeVerdict
    naming the fields that do not fit together. `where`: the section's path (`ppo`)."""
    local = _local_sequences(where, cfg, world)
    per_update = batch.micro_batch_size * batch.grad_accum_steps
    if local % per_update:
        raise RecipeVerdict(
            "batch",
            f"one update takes micro {batch.micro_batch_size} x accum "
            f"{batch.grad_accum_steps} = {per_update} sequences per rank, but a rollout gives "
            f"{local} per rank (prompts_per_step / ranks x samples_per_prompt); make it a "
            f"multiple",
            where,
        )
    return local, cfg.update_epochs * local // per_update


def one_step_shapes(kind: str, unit: str) -> Shapes:
    """The shapes of a kind that takes one optimizer step per rollout over all of it (online
    DPO, distill): nothing to accumulate. `unit`: what a step takes, for the message."""

    def shapes(where: str, cfg: Any, batch: ResolvedBatch, world: int) -> tuple[int, int]:
        local = _local_sequences(where, cfg, world)
        if batch.grad_accum_steps != 1:
            raise RecipeVerdict(
                "batch.grad_accum_steps",
                f"{kind} takes one optimizer step per rollout over all its {unit}, "
                "micro_batch_size sequences per forward; leave grad_accum_steps at 1 (got "
                f"{batch.grad_accum_steps})",
                where,
            )
        return local, 1

    return shapes


def scoring_passes(cfg: Any, placement: str, updates_per_rollout: int) -> tuple[bool, bool]:
    """(score the policy, score the reference) before the update: the passes a step needs.

    The policy's log-probs under the weights that sampled (the ratio's denominator) are the
    update's own, detached, when the rollout gets exactly one optimizer step (one epoch, one
    minibatch): nothing has changed the weights before that step's forward. Unless the KL goes
    into the rewards, whose advantages are computed before the update. The reference is needed
    only when the KL counts (a coefficient above 0, or an adaptive one)."""
    kl = cfg.kl.coef > 0 or cfg.kl.adaptive
    own = updates_per_rollout == 1 and not (kl and placement == "reward")
    return not own, kl


@dataclass(frozen=True)
class RLRun:
    """The stage's parts that every step reads, built once by `setup`."""

    ctx: StageContext
    critic: bool  # the kind trains a critic (the value role: PPO)
    placement: str  # where the KL penalty goes: "reward" or "loss"
    data: PromptData  # training and held-out prompt rows
    batch: ResolvedBatch  # one update: micro x accum x ranks sequences
    n_rollouts: int  # logged steps of the stage
    tr: TrainSession
    rollouts: RolloutSetup
    ctl: KLController  # the KL coefficient, updated after each rollout
    reduce: Reduce  # sums a small tensor over ranks
    template_sha: str  # the policy's chat template, as the SFT stage recorded it


# (section path, section, batch, ranks) -> (sequences per rank per rollout, optimizer updates per
# rollout), or a RecipeVerdict: `check_shapes`.
Shapes = Callable[[str, Any, ResolvedBatch, int], tuple[int, int]]
# (section, KL placement, updates per rollout) -> (score the policy, score the reference):
# `scoring_passes`.
Passes = Callable[[Any, str, int], tuple[bool, bool]]


def setup(
    ctx: StageContext,
    stack: ExitStack,
    critic: bool = False,
    kl_placement: str = "loss",
    shapes: Shapes = check_shapes,
    passes: Passes | None = None,
) -> RLRun:
    """Everything before the first step (a rollout server's: `stack` stops it when the stage
    ends). `kl_placement`: where `kl.placement: auto` puts the KL. `shapes` and `passes`: how
    the update consumes a rollout (`scoring_passes` looked up when called so that a benchmark
    can force every pass)."""
    cfg, name, d = ctx.section, ctx.stage.name, ctx.dist
    base, tok, weights = training_base(ctx)
    template_sha = check_template(ctx, tok, "policy")
    rewarder = stage_rewarder(ctx, tok, stack)
    has_rm = rewarder.rm_weight is not None
    data = load_prompts(ctx, tok)
    batch = section_batch(ctx.recipe, name)
    # Prompts are dealt to data-parallel groups: a sequence-parallel group shares its rows.
    local_seqs, updates_per_rollout = shapes(ctx.where, cfg, batch, d.dp_size)
    n_rollouts = cfg.max_steps or max(
        1, math.ceil(cfg.epochs * len(data.train) / cfg.rollout.prompts_per_step)
    )
    placement = kl_placement if cfg.kl.placement == "auto" else cfg.kl.placement
    tr = start_session(
        ctx,
        build_role_model(ctx, base, critic),
        cfg.optim,
        batch,
        n_rollouts,
        schedule_steps=n_rollouts * updates_per_rollout,
        weights=weights,
        algorithm=name,
        roles="policy,reference" + (",reward" if has_rm else "") + (",value" if critic else ""),
        reward_functions=",".join(f.label for f in rewarder.funcs),
        kl_placement=placement,
        # What the records' `kl` and `eval_kl` measure: the recipe's estimator, and the stage
        # the reference is (the report's KL panel names both).
        kl_estimator=cfg.kl.estimator,
        reference=ctx.stage.roles["reference"],
        updates_per_rollout=updates_per_rollout,
        sequences_per_rollout=local_seqs * d.dp_size,
        **data.stats,
    )
    ctl = KLController(cfg.kl.coef, cfg.kl.adaptive, cfg.kl.target, cfg.kl.horizon)
    ctl.coef = tr.resume_meta.get("kl_coef", ctl.coef)
    rollouts = rollout_setup(
        ctx,
        tr.model,
        tok,
        rewarder,
        critic,
        batch.micro_batch_size,
        (passes or scoring_passes)(cfg, placement, updates_per_rollout),
    )
    if rollouts.episodes is not None:  # a row naming no environment fails here, not mid-run
        for r in data.train + data.eval:
            rollouts.episodes.environment(r["columns"], r["where"])
    engines = rollout_engines(ctx, rollouts, tr.start_step, stack)
    packed = padding_free(cfg.batch, tr.model)
    rollouts = replace(
        rollouts,
        engines=engines,
        packed=packed,
        by_tokens=ctx.by_tokens,
        sp=sequence_split(tr, packed),
        counted=d.counted,
    )
    # Statistics summed over ranks (whitening): a sequence-parallel group's rows once.
    reduce = partial(counted_sum, counted=rollouts.counted, device=d.device)
    return RLRun(
        ctx, critic, placement, data, batch, n_rollouts, tr, rollouts, ctl, reduce, template_sha
    )


def stage_rewarder(ctx: StageContext, tok: Any, stack: ExitStack) -> Rewarder:
    """The stage's reward functions and judges (a judge's server opened or started now, stopped
    with `stack`), and the reward model's weight when the stage has one."""
    has_rm = ctx.has_role("reward_model")
    if has_rm:
        check_template(ctx, tok, "reward_model")
    # Imported from the files the resolved recipe points at (the flow checked where from).
    funcs = load_rewards(ctx.section.rewards, where=f"{ctx.where}.rewards")
    stack.enter_context(
        judge_servers(funcs, ctx.stage.out_dir, lambda: heartbeat.beat(phase="judge"))
    )
    return Rewarder(funcs, ctx.section.reward_model_weight if has_rm else None, tok)


def counted_sum(t: torch.Tensor, counted: float, device: torch.device) -> torch.Tensor:
    """`t` x `counted` summed over ranks (`RolloutSetup.counted`)."""
    return all_reduce_tensor(t * counted, device)


def check_template(ctx: StageContext, tok: Any, role: str) -> str:
    """The sha256 of the tokenizer's chat template, checked against the one `role` trained with."""
    recorded = ctx.role_manifest(role)["summary"].get("chat_template_sha256")
    return guard_template(tok, recorded, ctx.stage.name, ctx.section, ctx.stage.roles[role])


def load_prompts(ctx: StageContext, tok: Any) -> PromptData:
    """The section's prompts, encoded and split; the main rank writes both splits to data/."""
    data: PromptData = prepare_prompts(ctx.section.data, tok, ctx.recipe.run.seed)
    if ctx.is_main:
        (ctx.stage.out_dir / "data").mkdir(parents=True, exist_ok=True)
        for split, rows in (("train", data.train), ("eval", data.eval)):
            write_rows(
                ctx.stage.out_dir / "data" / f"{split}.jsonl",
                [{"prompt": r["messages"], **r["columns"]} for r in rows],
            )
    if not data.eval:
        raise RecipeVerdict(
            "data.eval_fraction",
            f"{ctx.section.data.eval_fraction} and no data.eval_path leave no held-out prompts "
            f"(of {len(data.train)}); set eval_fraction > 0 or give eval_path",
            ctx.where,
        )
    return data


def build_role_model(ctx: StageContext, base: PreTrainedModel, critic: bool) -> RoleModel:
    prepare_for_training(base, ctx.section.activation_checkpointing)
    policy_dir, reference_dir = ctx.adapter_dir("policy"), ctx.adapter_dir("reference")
    assert policy_dir is not None and reference_dir is not None  # the graph checks both
    return build_roles(
        base,
        policy_dir,
        ctx.role_dir("reward_model") / "adapter" if ctx.has_role("reward_model") else None,
        critic=critic,
        reference_adapter=reference_dir,
    )


def rollout_setup(
    ctx: StageContext,
    model: torch.nn.Module,
    tok: Any,
    rewarder: Rewarder,
    critic: bool,
    batch_size: int,
    passes: tuple[bool, bool] = (True, True),
) -> RolloutSetup:
    """What the rollouts and held-out samples are drawn with, on the session's `model`.
    `passes`: whether a rollout is scored by the policy and by the reference."""
    d = ctx.dist
    forward_method(model, "generate")
    # Responses end at any stop id (EOS, generation_config eos ids, the template's end of turn):
    # the response mask, the reward's input and `missing_eos_penalty` all follow it.
    stop_ids = model_stop_token_ids(model, tok)
    log.info("rollouts stop at token ids %s", stop_ids)
    episodes = episode_setup(
        ctx.section.rollout,
        tok,
        stop_ids,
        f"{ctx.stage.name}'s policy ({ctx.stage.roles['policy']})",
        rewarded=bool(getattr(ctx.section, "rewards", None)),
    )
    why = {
        "policy": "one update per rollout, whose own log-probs are the sampling policy's",
        "reference": "kl.coef 0, the KL does not count",
    }
    for name, keep in zip(why, passes, strict=True):
        if not keep:
            log.info("no %s scoring pass: %s", name, why[name])
    if episodes is not None:
        rewarder = replace(rewarder, env_rewards=episodes.env_rewards)
    return RolloutSetup(
        model,
        tok,
        ctx.section,
        rewarder,
        critic,
        stop_ids,
        batch_size,
        ctx.recipe.infra.logits_chunk_tokens,
        ctx.recipe.run.seed,
        d.dp_rank,
        d.dp_size,
        d.device,
        episodes,
        *passes,
    )


def rollout_engines(
    ctx: StageContext, s: RolloutSetup, version: int, stack: ExitStack
) -> dict[str, RolloutEngine]:
    """The policy's and the reference's rollout engines, the policy's at `version` (the
    updates before a resume): in process, or a server's, stopped by `stack`."""
    cfg = ctx.section.rollout
    # Every rank keeps generation's forwards in step (each is a collective of the sharded
    # model), a sequence-parallel group's too: not the data-parallel `s.world`.
    world = ctx.dist.world_size
    if cfg.engine == "fast":
        # The policy samples from a merged copy of its own; the reference (held-out baseline
        # samples only) from the trainer's model, which a second full copy would not repay.
        hf = cfg.model_copy(update={"engine": "hf"})
        engines = {
            POLICY: build_engine(cfg, s.model, POLICY, world, s.chunk_tokens),
            REFERENCE: build_engine(hf, s.model, REFERENCE, world),
        }
        engines[POLICY].version = version
        return engines
    if cfg.engine == "hf":
        engines = {r: build_engine(cfg, s.model, r, world) for r in (POLICY, REFERENCE)}
        engines[POLICY].version = version
        return engines
    from posttrain.models.stop_tokens import end_of_turn_token
    from posttrain.rl.rollout.sample import sampling_of
    from posttrain.rl.rollout.server_engine import ServerEngine
    from posttrain.rl.rollout.server_probe import ServerCheck
    from posttrain.serving.server import rollout_server

    eot = end_of_turn_token(s.tokenizer)
    server = stack.enter_context(
        rollout_server(
            cfg.server,
            ctx.stage.out_dir,
            Path(ctx.role_manifest("base")["summary"]["model_dir"]),
            ctx.role_dir("base") / "tokenizer",
            s.tokenizer,
            eot if eot in s.stop_ids else s.stop_ids[0],
            lambda: heartbeat.beat(phase="server"),
        )
    )
    reference = ctx.adapter_dir("reference")
    assert reference is not None  # the graph checks it
    server.load_reference(reference)
    log.info(
        "rollout server: policy version %d synced in %.2f s", version, server.sync(s.model, version)
    )
    check = ServerCheck(
        cfg.server.api, server.api.exact, sampling_of(cfg), cfg.sampler_probe_tolerance
    )
    return {
        POLICY: ServerEngine(server, "policy", check),
        REFERENCE: ServerEngine(server, "reference"),
    }
