"""Steps 1 and 2 of an online-RL step (`posttrain.rl.loop`): this rank's rollout, its
responses generated and then scored and rewarded, in rounds when DAPO's dynamic sampling asks
for more prompts.

A round draws this rank's share of `rollout.prompts_per_step` prompts (a pure function of seed,
step, round and rank, so a resumed run draws what an uninterrupted one would), samples
`samples_per_prompt` responses of each (a prompt's samples are consecutive rows: its group), then
scores them with every role (`posttrain.rl.rollout.sample.score`) and the reward
(`posttrain.rl.rewarder.Rewarder`). Dynamic sampling needs the scores of a round to decide
whether to draw another, which is why scoring runs per round rather than once per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from posttrain.data.batching import step_indices
from posttrain.distributed.runtime import all_reduce_sum
from posttrain.distributed.sequence_parallel import SequenceParallel
from posttrain.models.adapters import POLICY, REFERENCE
from posttrain.models.roles import VALUE
from posttrain.rl.losses import informative_groups
from posttrain.rl.rewarder import Rewarder
from posttrain.rl.rollout.engine import RolloutEngine
from posttrain.rl.rollout.multiturn import EpisodeSetup, play
from posttrain.rl.rollout.sample import Rollout, sample, sampling_of, score
from posttrain.rl.rollout.sp_shard import from_first


def rollout_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + rank * 104_729) % (2**31)


@dataclass(frozen=True)
class RolloutSetup:
    """What every rollout (and the held-out samples, `posttrain.rl.heldout`) is drawn
    and scored with; fixed for the stage."""

    model: torch.nn.Module  # the role model (`posttrain.models.roles`), sharded over the ranks
    tokenizer: Any
    cfg: Any  # the recipe section: rollout, data.max_prompt_len, dynamic sampling, kl, ...
    rewarder: Rewarder
    critic: bool  # score the critic's values too (PPO)
    stop_ids: list[int]  # a response ends at the first of these (EOS, end of turn)
    batch_size: int  # sequences per scoring forward and per held-out sampling batch
    chunk_tokens: int  # tokens per pass through the LM head (0 = full logits)
    seed: int
    # This rank's data-parallel group and their number: the ranks of a sequence-parallel
    # group deal and sample the same prompts (`DistInfo.dp_rank`, `dp_size`).
    rank: int
    world: int
    device: torch.device
    episodes: EpisodeSetup | None = None  # multi-turn rollouts (rollout.tools / environment)
    score_policy: bool = True  # False: the update's own log-probs are the old ones
    score_reference: bool = True  # False: the KL does not count (`setup.scoring_passes`)
    # The rollout engine of each role that samples (POLICY, REFERENCE for the held-out
    # baseline): in process, or a server's (`posttrain.rl.rollout.server_engine`).
    engines: dict[str, RolloutEngine] = field(default_factory=dict)
    packed: bool = False  # scoring and update forwards padding-free (`batch.padding_free`)
    by_tokens: int | None = None  # tokens per scoring and update forward (`batch.by_tokens`)
    # Sequence parallelism: the group that splits every scoring forward's packed rows (None:
    # none), and this rank's weight in summed metrics (1 on the group's first rank, 0 on the
    # others, which hold the same rows: counted once).
    sp: SequenceParallel | None = None
    counted: float = 1.0

    @property
    def all_ranks(self) -> int:
        """Every rank of the world, sequence-parallel ones included: an in-process engine keeps
        generation's forwards in step over all of them (each is a collective of the sharded
        model), not over the data-parallel `world`."""
        return self.world * (self.sp.size if self.sp is not None else 1)

    @property
    def roles(self) -> tuple[str, ...]:  # what a rollout is scored by
        logps = ((POLICY,) if self.score_policy else ()) + (
            (REFERENCE,) if self.score_reference else ()
        )
        return logps + self.rewarder.roles + ((VALUE,) if self.critic else ())


@dataclass(frozen=True)
class RolloutBatch:
    """One step's scored rollout on this rank, as the advantages and the update read it."""

    # N sequences: prompts [N, P], responses and mask [N, R]; scored: logps / ref_logps [N, R],
    # values [N, R] (critic), scores [N] (the summed reward), fn:<label> [N] per reward function
    rollout: Rollout
    generation_s: float  # seconds spent drawing prompts and generating, over every round
    scoring_s: float  # seconds spent scoring and rewarding, over every round
    # with groups (samples_per_prompt >= 2): informative_frac; with dynamic sampling also
    # sampling_rounds and topped_up_groups (over all ranks)
    sampling: dict[str, float] = field(default_factory=dict)


def round_prompts(
    s: RolloutSetup, prompts: list[dict[str, Any]], step: int, round_: int
) -> list[dict[str, Any]]:
    """This rank's prompt rows of round `round_` of step `step` (round 0: the step's own; later
    rounds of dynamic sampling: another seeded draw), each repeated samples_per_prompt times."""
    r = s.cfg.rollout
    idx = step_indices(
        len(prompts),
        step,
        micro=r.prompts_per_step // s.world,
        accum=1,
        dp_size=s.world,
        rank=s.rank,
        seed=s.seed + round_ * 1_000_003,
    )[0]
    return [prompts[i] for i in idx for _ in range(r.samples_per_prompt)]


def generate(s: RolloutSetup, rows: list[dict[str, Any]], seed: int, role: str = POLICY) -> Rollout:
    """Step 1: one sampled response per row from `role` under `seed` (with tools or an
    environment, one episode per row: `posttrain.rl.rollout.multiturn.play`)."""
    engine = s.engines[role]
    if s.episodes is not None:
        sampling = sampling_of(s.cfg.rollout)
        return play(
            s.episodes,
            engine,
            sampling,
            s.tokenizer,
            s.stop_ids,
            s.device,
            rows,
            seed,
            versions=role == POLICY,
        )
    return sample(
        engine,
        [x["ids"] for x in rows],
        [x["messages"] for x in rows],
        s.cfg.rollout,
        s.tokenizer.pad_token_id,
        s.stop_ids,
        seed,
        versions=role == POLICY,
        sp=s.sp,
    )


def score_rollout(
    s: RolloutSetup, ro: Rollout, rows: list[dict[str, Any]] | None, roles: tuple[str, ...]
) -> None:
    """Step 2: fill `ro.scored` with each of `roles` (no grad) and, given the prompt `rows` it
    answers, the reward of each response."""
    score(
        s.model,
        ro,
        s.tokenizer,
        s.batch_size,
        s.cfg.data.max_prompt_len,
        roles,
        s.chunk_tokens,
        s.cfg.rollout.temperature,
        s.packed,
        s.by_tokens,
        s.sp,
    )
    if rows is not None:
        reward(s, ro, rows)


def reward(s: RolloutSetup, ro: Rollout, rows: list[dict[str, Any]]) -> None:
    """The rewards of `ro` (`Rewarder`) in `ro.scored`, computed once per sequence-parallel
    group: its first rank calls the reward functions (a judge is asked, sandboxed code run,
    once per row) and the others take every entry it wrote (scores, each function's values,
    its counters, which the step's records count on the first rank only). The reward model's
    scores come from `score`'s forward, which every rank ran."""
    if s.sp is None or s.sp.size == 1:
        s.rewarder(ro, rows)
        return
    before = dict(ro.scored)
    if s.sp.rank == 0:
        s.rewarder(ro, rows)
    # The rewarder writes new tensors (overwriting "scores"): those not there before.
    written = {k: v for k, v in ro.scored.items() if before.get(k) is not v}
    ro.scored |= from_first(written, s.sp)


@dataclass(frozen=True)
class Generated:  # step 1 of one round, before scoring
    rows: list[dict[str, Any]]
    rollout: Rollout
    seconds: float  # drawing the prompts and generating


def generate_round(
    s: RolloutSetup, prompts: list[dict[str, Any]], step: int, round_: int
) -> Generated:
    """This rank's prompts of a round drawn and answered by the policy's engine (no forward
    of the trainer's model with a server's engine: `offpolicy` runs it in a thread then)."""
    t = time.perf_counter()
    rows = round_prompts(s, prompts, step, round_)
    ro = generate(s, rows, rollout_seed(s.seed + round_, step, s.rank))
    return Generated(rows, ro, time.perf_counter() - t)


def sampling_round(
    s: RolloutSetup,
    prompts: list[dict[str, Any]],
    step: int,
    round_: int,
    generated: Generated | None = None,
) -> RolloutBatch:
    """One round: generated (unless `generated` already holds it), scored and rewarded."""
    g = generated or generate_round(s, prompts, step, round_)
    t = time.perf_counter()
    score_rollout(s, g.rollout, g.rows, s.roles)
    return RolloutBatch(g.rollout, g.seconds, time.perf_counter() - t)


def collect_rollout(
    s: RolloutSetup,
    prompts: list[dict[str, Any]],
    step: int,
    generated: Generated | None = None,
) -> RolloutBatch:
    """Steps 1 and 2 of step `step` (0-based) on this rank; `generated`: its first round,
    generated ahead. With groups, the share of groups whose samples score differently
    (`informative_frac`, over all ranks); with dynamic sampling, rounds until the batch is
    made of such groups."""
    first = sampling_round(s, prompts, step, 0, generated)
    group = s.cfg.rollout.samples_per_prompt
    if group < 2:
        return first
    informative = informative_groups(first.rollout.scored["scores"], group)
    stats = {
        "informative_frac": all_reduce_sum(s.counted * float(informative.float().mean()), s.device)
        / s.world
    }
    if not s.cfg.dynamic_sampling:
        return replace(first, sampling=stats)
    filled = dynamic_sampling(s, prompts, step, first, informative)
    return replace(filled, sampling=stats | filled.sampling)


def dynamic_sampling(
    s: RolloutSetup,
    prompts: list[dict[str, Any]],
    step: int,
    first: RolloutBatch,
    informative: torch.Tensor,
) -> RolloutBatch:
    """DAPO's dynamic sampling after round 0 (`first`, its `informative` [groups] bool): groups
    whose samples all score the same are dropped and more prompts sampled, up to
    max_sampling_rounds rounds. Every rank runs the same number of rounds (generation is a
    collective), and a batch still short after the last round is topped up with dropped groups
    (zero advantage) so that every rank holds prompts_per_step / ranks groups."""
    group, per_rank = s.cfg.rollout.samples_per_prompt, s.cfg.rollout.prompts_per_step // s.world
    ro, t_gen, t_score = first.rollout, first.generation_s, first.scoring_s
    kept: list[Rollout] = []
    spare: list[Rollout] = []
    have, rounds = 0, 1
    while True:
        take = informative.nonzero().flatten()[: per_rank - have].tolist()
        kept.append(select_groups(ro, take, group))
        spare.append(select_groups(ro, (~informative).nonzero().flatten().tolist(), group))
        have += len(take)
        if rounds == s.cfg.max_sampling_rounds or not all_reduce_sum(
            float(have < per_rank), s.device
        ):
            break
        more = sampling_round(s, prompts, step, rounds)
        ro, rounds = more.rollout, rounds + 1
        t_gen, t_score = t_gen + more.generation_s, t_score + more.scoring_s
        informative = informative_groups(ro.scored["scores"], group)
    filler = top_up(spare, per_rank - have, group)
    topped = sum(f.n for f in filler) // group
    ro = Rollout.cat([k for k in kept + filler if k.n], s.tokenizer.pad_token_id)
    sampling = {
        "sampling_rounds": rounds,
        "topped_up_groups": all_reduce_sum(s.counted * topped, s.device),
    }
    return RolloutBatch(ro, t_gen, t_score, sampling)


def select_groups(ro: Rollout, which: list[int], group: int) -> Rollout:
    """The sequences of prompt groups `which` (consecutive runs of `group` samples), in order."""
    return ro.select([g * group + j for g in which for j in range(group)])


def top_up(spare: list[Rollout], missing: int, group: int) -> list[Rollout]:
    """Up to `missing` groups of `spare` (the rounds' dropped groups), each round's first
    groups first: what fills a batch the rounds left short."""
    out = []
    for extra in spare:
        n = min(extra.n // group, missing)
        if n:
            out.append(select_groups(extra, list(range(n)), group))
            missing -= n
    return out
