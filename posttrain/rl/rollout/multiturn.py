"""Step 1 of online RL when the rollout is multi-turn (`rollout.tools` or `rollout.environment`):
each prompt row plays an episode (`posttrain.agents.episodes`) and becomes one sequence of the
Rollout - the first prompt, then everything after it as its "response". The policy's turns are
mask 1; tool results, observations and the template's turns between them are attended
(`Rollout.attn`) but trained on by nothing (mask 0). An episode cut by its token budget is not
`stopped` (so `missing_eos_penalty` applies) and, with `mask_truncated`, trains nothing.

Generation is a collective on several ranks: every rank plays turns until the episodes of all
ranks ended, a rank with fewer live episodes filling its turn with one-token rows
(`synced_turns`), so ranks whose episodes take different numbers of turns stay in step.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from posttrain.agents.environment import (
    ROUTE,
    EnvironmentClass,
    Episode,
    load_environment,
    no_reward,
    route_problem,
)
from posttrain.agents.episodes import (
    EpisodeLimits,
    EpisodeRun,
    Generate,
    Renderer,
    TemplateNotIncremental,
    run_episodes,
    start_episodes,
)
from posttrain.agents.tool_calls import require_format
from posttrain.agents.tool_runner import OUTCOMES, failure_counts
from posttrain.agents.tools import ToolLoadError, load_tools
from posttrain.data.chat import end_of_turn
from posttrain.data.errors import DataError
from posttrain.distributed.runtime import all_reduce_sum, min_max
from posttrain.rewards.extract import completion_text
from posttrain.rl.rollout.engine import RolloutEngine, left_pad, right_pad
from posttrain.rl.rollout.sample import Rollout

if TYPE_CHECKING:
    from posttrain.sections.shared import RolloutConfig, SamplingConfig


# (messages, columns, where) of a prompt row an episode is played from
PromptRow = tuple[list[dict[str, Any]], dict[str, Any], str]


@dataclass(frozen=True)
class EpisodeSetup:
    """What every episode of the stage is played with; fixed for the stage."""

    renderer: Renderer
    fmt: str | None  # the template's tool-call format (None: gym environments without tools)
    limits: EpisodeLimits
    tools: dict[str, Callable[..., Any]]  # rollout.tools by name (an environment brings its own)
    schemas: list[dict[str, Any]] | None
    envs: dict[str, EnvironmentClass]  # by name ({} without; a single class is "")
    mask_truncated: bool

    @property
    def routed(self) -> bool:
        """Whether each row names its environment class (`ROUTE` column)."""
        return bool(self.envs) and "" not in self.envs

    @property
    def env_rewards(self) -> bool:
        """Whether some environment class scores its episodes itself (get_reward or step)."""
        return any(e.rewards for e in self.envs.values())

    def environment(self, columns: dict[str, Any], where: str) -> EnvironmentClass | None:
        """The class a row with `columns` plays (None: no environment). Raises DataError
        naming the row when it names none of the stage's classes."""
        if not self.routed:
            return self.envs.get("")
        if problem := route_problem(self.envs, columns):
            raise DataError(f"{where}: {problem}")
        return self.envs[columns[ROUTE]]

    def start(self, prompts: Sequence[PromptRow]) -> tuple[list[dict], list[Episode] | None]:
        """`start_episodes`' rows and each row's environment instance (None without
        environments). A routed row's `environment` column picked its class; `reset` does not
        get it."""
        if not self.envs:
            return [{"prompt": m, **c} for m, c, _ in prompts], None
        envs, rows = [], []
        for messages, columns, where in prompts:
            env = self.environment(columns, where)
            assert env is not None
            envs.append(Episode(env, where))
            kept = {k: v for k, v in columns.items() if not (self.routed and k == ROUTE)}
            rows.append({"prompt": messages, **kept})
        return rows, envs

    def describe(self) -> dict[str, Any]:  # for reports
        refs = {name: e.ref for name, e in self.envs.items()}
        return {
            "tools": [s["function"]["name"] for s in self.schemas or []],
            "environment": (refs if self.routed else refs.get("")),
            "format": self.fmt,
            "max_turns": self.limits.max_turns,
            "max_episode_tokens": self.limits.max_episode_tokens,
        }


def episode_setup(
    cfg: RolloutConfig, tok: Any, stop_ids: list[int], model: str, rewarded: bool
) -> EpisodeSetup | None:
    """The episodes' setup (None: single-turn rollouts). `model` names the policy in the
    refusal of a template without tools; `rewarded`: reward functions score the episodes (an
    environment then needs no reward of its own; `validate` refuses the other case first)."""
    if not cfg.episodes:
        return None
    tools = load_tools(cfg.tools)
    envs = {name: load_environment(ref) for name, ref in cfg.environments.items()}
    for env in envs.values():
        if not env.rewards and not rewarded:
            raise ToolLoadError(f"rollout.environment {env.ref}: {no_reward(env, 'rewards')}")
    needs_tools = bool(tools) or any(e.tool_names for e in envs.values())
    fmt = require_format(tok.chat_template, model) if needs_tools else None
    limits = EpisodeLimits(
        cfg.max_turns, cfg.max_new_tokens, cfg.max_episode_tokens, cfg.tool_timeout_s
    )
    return EpisodeSetup(
        Renderer(tok, stop_text(tok, stop_ids)),
        fmt,
        limits,
        {t.name: t.fn for t in tools},
        [t.schema for t in tools] or None,
        envs,
        cfg.mask_truncated,
    )


def stop_text(tok: Any, stop_ids: list[int]) -> str:
    """The stop token the template closes an assistant turn with (`<|im_end|>`,
    `<|eot_id|>`, `</s>`): where a reply ends and the template's next text begins."""
    eot = end_of_turn(tok).strip()
    for i in stop_ids:
        text = tok.convert_ids_to_tokens(i)
        if text and eot.startswith(text):
            return text
    raise TemplateNotIncremental(
        f"the chat template ends an assistant turn with {eot!r}, which starts with none of the "
        f"stop tokens {[tok.convert_ids_to_tokens(i) for i in stop_ids]}: episodes need a turn "
        "to end at the token generation stops at"
    )


def engine_turns(
    engine: RolloutEngine,
    sampling: SamplingConfig,
    stop_ids: Sequence[int],
    pad_id: int,
    seed: int,
) -> Generate:
    """A rollout engine as the episode loop's `generate`: turn n is seeded `seed + n`, each
    row cut after its first stop token (the engine right-pads rows that stopped); the engine
    may keep its cache from turn to turn (`turns=True`; the caller `release()`s it)."""
    turn = itertools.count()
    stops = set(stop_ids)

    def generate(prompts: list[list[int]], max_new: int) -> list[list[int]]:
        cfg = sampling.model_copy(update={"max_new_tokens": max_new})
        out = engine.generate(prompts, cfg, list(stop_ids), pad_id, seed + next(turn), turns=True)
        rows = []
        for row in out.tolist():
            end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            rows.append(row[:end])
        return rows

    return generate


def synced_turns(
    generate: Generate, device: torch.device, filler: list[int]
) -> tuple[Generate, Callable[[bool], bool]]:
    """(`generate` kept in step over ranks, `sync` for `run_episodes`): every rank's call
    generates the most rows (`filler` rows added) and new tokens any rank asks for, then
    returns its own rows cut to its own cap."""

    def any_live(live: bool) -> bool:
        return all_reduce_sum(float(live), device) > 0

    def turn(prompts: list[list[int]], max_new: int) -> list[list[int]]:
        rows, new = min_max(len(prompts), device)[1], min_max(max_new, device)[1]
        out = generate([*prompts, *[filler] * (int(rows) - len(prompts))], int(new))
        return [row[:max_new] for row in out[: len(prompts)]]

    return turn, any_live


def play(
    e: EpisodeSetup,
    engine: RolloutEngine,
    sampling: SamplingConfig,
    tok: Any,
    stop_ids: list[int],
    device: torch.device,
    rows: list[dict[str, Any]],
    seed: int,
    versions: bool = True,
) -> Rollout:
    """One episode per prompt row, its turns sampled by `engine` under `seed`, as a Rollout
    stamped with the engine's policy version (`versions`). Ranks keep in step only when the
    engine's generation is a collective."""
    gen = engine_turns(engine, sampling, stop_ids, tok.pad_token_id, seed)
    sync = None
    if engine.collective:
        gen, sync = synced_turns(gen, device, rows[0]["ids"][:1])
    prompts, envs = e.start(
        [(r["messages"], r.get("columns", {}), r.get("where", "")) for r in rows]
    )
    runs = start_episodes(prompts, e.renderer, e.tools, e.schemas, envs)
    try:
        counts = run_episodes(runs, gen, e.renderer, e.fmt, e.limits, stop_ids, sync)
    finally:
        engine.release()
    ro = episode_rollout(runs, [r["messages"] for r in rows], tok.pad_token_id, e)
    ro.stats = counts | engine.take_counts()
    if versions:
        ro.versions = torch.full((len(rows),), engine.version, dtype=torch.long)
    return ro


def episode_rollout(
    runs: list[EpisodeRun], messages: list[Any], pad_id: int, e: EpisodeSetup
) -> Rollout:
    """The Rollout of played `runs` (module docstring; a truncated episode under
    mask_truncated has mask 0 everywhere)."""
    prompt_ids, prompt_mask = left_pad([r.ids[: r.prompt_len] for r in runs], pad_id)
    response = right_pad([r.ids[r.prompt_len :] for r in runs], pad_id)
    mask = torch.zeros(response.shape)
    attn = torch.zeros(response.shape)
    for i, r in enumerate(runs):
        n = r.spent
        attn[i, :n] = 1.0
        if not (e.mask_truncated and r.truncated):
            mask[i, :n] = torch.tensor(r.mask[r.prompt_len :], dtype=torch.float32)
    stopped = torch.tensor([not r.truncated for r in runs])
    return Rollout(prompt_ids, prompt_mask, response, mask, stopped, messages, {}, attn, runs)


# Per-episode counts summed by `episode_sums`: `failure_counts`' own.
TOOL_COUNTS = ("tool_calls", *OUTCOMES.values())


def episode_sums(ro: Rollout) -> dict[str, float]:  # none for a single-turn rollout
    if ro.episodes is None:
        return {}
    return played_sums(ro.episodes, float(ro.stats.get("tool_s", 0.0)))


def played_sums(episodes: Sequence[EpisodeRun], tool_s: float = 0.0) -> dict[str, float]:
    """Sums over played `episodes` (`tool_s`: the seconds they waited for tools)."""
    counts = failure_counts([row for e in episodes for row in e.results])
    return {
        "episodes": float(len(episodes)),
        "turns": float(sum(e.turns for e in episodes)),
        **{k: float(counts.get(k, 0)) for k in TOOL_COUNTS},
        "tool_malformed": float(sum(e.malformed for e in episodes)),
        "truncated": float(sum(e.truncated for e in episodes)),
        "tool_s": tool_s,
    }


def episode_metrics(t: dict[str, float]) -> dict[str, float]:
    """Means of reduced `episode_sums` (empty when there were none); a valid call is
    well-formed, of a known tool, with arguments it takes."""
    if not t.get("episodes"):
        return {}
    n, attempted = t["episodes"], t["tool_calls"] + t["tool_malformed"]
    invalid = t["tool_malformed"] + t["tool_unknown"] + t["tool_bad_arguments"]
    failed = invalid + t["tool_errors"] + t["tool_timeouts"]
    return {
        "turns_mean": t["turns"] / n,
        "tool_calls_mean": t["tool_calls"] / n,
        "tool_error_rate": failed / attempted if attempted else 0.0,
        "tool_call_validity": 1.0 - invalid / attempted if attempted else 1.0,
        "truncated_rate": t["truncated"] / n,
    }


def episode_record(run: EpisodeRun) -> dict[str, Any]:
    """A sample file's fields for a played episode (the prompt as the policy saw it)."""
    after = run.messages[run.n_prompt :]
    return {
        "prompt": run.messages[: run.n_prompt],
        "response": completion_text(after),
        "episode": after,
        "turns": run.turns,
        "ended": run.ended,
        "tool_calls": sum(len(t) for t in run.results),
    }
