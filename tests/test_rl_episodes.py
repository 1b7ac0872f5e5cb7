"""Episodes as the RL stages see them (`posttrain.rl.rollout.multiturn`): the Rollout of played
episodes token by token (what is trained, what is only attended), truncated episodes under
mask_truncated, the reward over whole episodes (functions given the messages, the environment's
own), and the per-episode metrics by hand."""

from __future__ import annotations

import math

import torch

from posttrain.agents.environment import EnvironmentClass, Episode
from posttrain.agents.episodes import EpisodeRun
from posttrain.agents.tool_calls import ToolCall
from posttrain.agents.tool_runner import ToolResult
from posttrain.rewards.combine import RewardFunction
from posttrain.rl.rewarder import Rewarder
from posttrain.rl.rollout.multiturn import (
    EpisodeSetup,
    episode_metrics,
    episode_rollout,
    episode_sums,
    synced_turns,
)

PAD = 0


def _run(prompt: list[int], after: list[tuple[int, int]], ended: str, **kw) -> EpisodeRun:
    """An episode of `prompt` ids, then (id, policy?) pairs."""
    ids = prompt + [t for t, _ in after]
    mask = [0] * len(prompt) + [m for _, m in after]
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    run = EpisodeRun(messages, len(prompt), ids, mask, {}, None, ended=ended, **kw)
    run.n_prompt = 1
    return run


def _setup(mask_truncated: bool) -> EpisodeSetup:
    return EpisodeSetup(None, None, None, {}, None, {}, mask_truncated)  # type: ignore[arg-type]


def _episodes() -> list[EpisodeRun]:
    # Row 0: a 2-token prompt, a call (7, 8 policy), a tool result (20, 21), an answer (9 policy).
    # Row 1: a 3-token prompt, 4 policy tokens, cut by the budget (truncated).
    return [
        _run([1, 2], [(7, 1), (8, 1), (20, 0), (21, 0), (9, 1)], "answer", turns=2),
        _run([3, 4, 5], [(6, 1), (6, 1), (6, 1), (6, 1)], "budget", turns=1),
    ]


def test_an_episodes_rollout_trains_the_policys_tokens_and_attends_every_one() -> None:
    ro = episode_rollout(_episodes(), [[], []], PAD, _setup(False))
    assert ro.prompt_ids.tolist() == [[PAD, 1, 2], [3, 4, 5]]  # left-padded
    assert ro.prompt_mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    assert ro.response.tolist() == [[7, 8, 20, 21, 9], [6, 6, 6, 6, PAD]]
    assert ro.mask.tolist() == [[1, 1, 0, 0, 1], [1, 1, 1, 1, 0]]
    assert ro.attn.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert ro.stopped.tolist() == [True, False]  # the truncated one never closed its turn
    inp = ro.inputs([0, 1])
    # The tool result is attended (attention 1) and positions run on through it.
    assert inp["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 1, 1, 1], [1] * 7 + [0]]
    assert inp["position_ids"][0].tolist() == [0, 0, 1, 2, 3, 4, 5, 6]
    assert ro.tokens() == 5 + 5 + 4  # prompts, then everything after them


def test_mask_truncated_leaves_a_truncated_episode_out_of_the_loss() -> None:
    ro = episode_rollout(_episodes(), [[], []], PAD, _setup(True))
    assert ro.mask.tolist() == [[1, 1, 0, 0, 1], [0, 0, 0, 0, 0]]
    assert ro.attn[1].tolist() == [1, 1, 1, 1, 0]


def test_select_and_cat_keep_the_episodes_and_their_attention() -> None:
    ro = episode_rollout(_episodes(), [[], []], PAD, _setup(False))
    ro.stats = {"tool_s": 1.5}
    both = type(ro).cat([ro.select([1]), ro.select([0])], PAD)
    assert [e.turns for e in both.episodes] == [1, 2]
    assert both.attn.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert both.stats == {"tool_s": 3.0}


class _Scored:
    """A tool environment whose get_reward is the number of calls it served."""

    def reset(self, **columns):
        self.calls = 0

    def lookup(self, key: str) -> str:
        """Look a key up.

        Args:
            key: The key.
        """
        self.calls += 1
        return key

    def get_reward(self) -> float:
        return float(self.calls) + 0.5


def test_episodes_are_rewarded_over_their_messages_and_by_their_environment() -> None:
    env = EnvironmentClass("t:_Scored", _Scored, "sha", ["lookup"])
    runs = _episodes()
    for i, run in enumerate(runs):
        run.env = Episode(env, f"t.jsonl:{i + 1}")
        run.env.reset({})
    runs[0].env.instance.lookup("k")
    runs[1].step_reward = -0.25  # a gym-like step's rewards add up too
    seen = {}

    def final_is_a(prompts, completions, **kw):
        seen["prompts"], seen["completions"] = prompts, completions
        return [float(c[-1]["content"] == "a") for c in completions]

    ro = episode_rollout(runs, [[], []], PAD, _setup(False))
    rows = [{"messages": [], "columns": {}, "where": "t"}] * 2
    reward = RewardFunction("final", "f:final", 2.0, final_is_a, "sha")
    Rewarder([reward], None, None, env_rewards=True)(ro, rows)
    assert seen["prompts"] == [[{"role": "user", "content": "q"}]] * 2
    assert seen["completions"] == [[{"role": "assistant", "content": "a"}]] * 2
    assert ro.scored["fn:environment"].tolist() == [1.5, 0.25]
    assert ro.scored["scores"].tolist() == [2.0 + 1.5, 2.0 + 0.25]


def test_episode_metrics_by_hand() -> None:
    runs = _episodes()
    call = ToolCall("add", {"a": 1})
    runs[0].results = [[ToolResult(call, "2", None, 0.1), ToolResult(call, "E", "timeout", 5)]]
    runs[1].results = [[ToolResult(ToolCall("nope", {}), "E", "unknown_tool", 0.0)]]
    runs[1].malformed = 1
    ro = episode_rollout(runs, [[], []], PAD, _setup(False))
    ro.stats = {"tool_s": 5.0}
    sums = episode_sums(ro)
    assert sums == {
        "episodes": 2.0,
        "turns": 3.0,
        "tool_calls": 3.0,
        "tool_errors": 0.0,
        "tool_timeouts": 1.0,
        "tool_unknown": 1.0,
        "tool_bad_arguments": 0.0,
        "tool_malformed": 1.0,
        "truncated": 1.0,
        "tool_s": 5.0,
    }
    # 4 attempted calls (3 + 1 malformed): 2 invalid (unknown, malformed), 3 failed (+ timeout).
    assert episode_metrics(sums) == {
        "turns_mean": 1.5,
        "tool_calls_mean": 1.5,
        "tool_error_rate": 0.75,
        "tool_call_validity": 0.5,
        "truncated_rate": 0.5,
    }
    assert episode_metrics({}) == {}


def test_synced_turns_on_one_process_return_the_rows_asked_for() -> None:
    calls = []

    def generate(prompts: list[list[int]], max_new: int) -> list[list[int]]:
        calls.append((len(prompts), max_new))
        return [[5] * max_new for _ in prompts]

    turn, any_live = synced_turns(generate, torch.device("cpu"), [1])
    assert turn([[1, 2], [3]], 3) == [[5, 5, 5], [5, 5, 5]]
    assert any_live(True) and not any_live(False)
    assert turn([], 2) == [] and calls[-1] == (0, 2)


class _Unscored:
    def reset(self, **columns):
        return None

    def lookup(self, key: str) -> str:
        """Look a key up.

        Args:
            key: The key.
        """
        return key


def test_only_an_episode_whose_class_scores_itself_gets_an_environment_reward() -> None:
    """Two classes in one stage (TRL's multi-environment shape): the one without get_reward
    gives NaN (not applicable, as a function's None), which adds nothing to the score."""
    scored = EnvironmentClass("t:_Scored", _Scored, "sha", ["lookup"])
    unscored = EnvironmentClass("t:_Unscored", _Unscored, "sha", ["lookup"])
    runs = _episodes()
    for i, (run, cls) in enumerate(zip(runs, (scored, unscored), strict=True)):
        run.env = Episode(cls, f"t.jsonl:{i + 1}")
        run.env.reset({})
    ro = episode_rollout(runs, [[], []], PAD, _setup(False))
    rows = [{"messages": [], "columns": {}, "where": "t"}] * 2
    one = RewardFunction("one", "f:one", 1.0, lambda completions, **kw: [1.0, 1.0], "sha")
    Rewarder([one], None, None, env_rewards=True)(ro, rows)
    env = ro.scored["fn:environment"].tolist()
    assert env[0] == 0.5 and math.isnan(env[1])
    assert ro.scored["scores"].tolist() == [1.5, 1.0]
