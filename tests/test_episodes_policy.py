"""An episode played by a real (tiny) policy through the rollout engine: the ids it ends with
are exactly the context each turn was generated from, so the log-probs an update computes on
them are those of the sampled tokens. Greedy decoding makes this checkable token by token:
every generated token is the argmax of the policy's logits at the position before it, read off
one forward over the whole episode."""

from __future__ import annotations

import pytest
import torch
from agent_fixtures import add, call
from fixtures_tiny import LORA_CFG, load_base, one_torch_thread, tiny_assets
from torch import nn

from posttrain.agents.episodes import (
    EpisodeLimits,
    Renderer,
    run_episodes,
    start_episodes,
)
from posttrain.agents.tools import describe
from posttrain.models.adapters import POLICY
from posttrain.models.lora import apply_lora
from posttrain.models.roles import RoleModel
from posttrain.models.tiny import IM_END
from posttrain.rl.rollout.engine import HFEngine
from posttrain.rl.rollout.multiturn import engine_turns
from posttrain.sections.shared import SamplingConfig


def test_a_policys_turns_were_generated_from_the_ids_the_episode_keeps(tmp_path_factory) -> None:
    tiny = tiny_assets(tmp_path_factory)
    tok = tiny.tokenizer
    with one_torch_thread():
        lm = apply_lora(load_base(tiny), LORA_CFG).eval()
        model = RoleModel(lm, nn.Linear(lm.get_base_model().config.hidden_size, 1), None)
        stop = tok.convert_tokens_to_ids(IM_END)
        policy = engine_turns(
            HFEngine(model, POLICY, world=1),
            SamplingConfig(name="greedy", strategy="greedy", max_new_tokens=8),
            [stop],
            tok.pad_token_id,
            seed=0,
        )
        scripted_first: list[bool] = []

        def generate(prompts: list[list[int]], max_new: int) -> list[list[int]]:
            # Turn 1 is a tool call (an untrained policy would not write one), then the policy.
            if not scripted_first:
                scripted_first.append(True)
                return [
                    [*tok(call(12, 30), add_special_tokens=False)["input_ids"], stop]
                    for _ in prompts
                ]
            return policy(prompts, max_new)

        renderer = Renderer(tok, IM_END)
        rows = [
            {"prompt": [{"role": "user", "content": q}]}
            for q in ("What is 12 + 30?", "Add 12 and 30.")
        ]
        runs = start_episodes(rows, renderer, {"add": add}, [describe(add, "add")])
        limits = EpisodeLimits(
            max_turns=2, max_new_tokens=8, max_episode_tokens=300, tool_timeout_s=5
        )
        run_episodes(runs, generate, renderer, "hermes", limits, [stop])

        for run in runs:
            assert run.turns == 2 and run.messages[2] == {
                "role": "tool",
                "name": "add",
                "tool_call_id": "call00000",
                "content": "42",
            }
            with torch.no_grad():
                logits = lm(torch.tensor([run.ids])).logits[0]  # [T, V]
            second = [
                i for i in range(len(run.ids)) if run.mask[i] and i >= _second_turn_start(run)
            ]
            assert second, "the policy generated nothing"
            for pos in second:
                assert int(logits[pos - 1].argmax()) == run.ids[pos], (
                    f"token {pos} was generated from other ids"
                )


def _second_turn_start(run) -> int:
    """Index of the first token of the episode's second generated turn."""
    seen_gap = False
    for i in range(run.prompt_len, len(run.ids)):
        if not run.mask[i]:
            seen_gap = True
        elif seen_gap:
            return i
    pytest.fail("no second turn")
