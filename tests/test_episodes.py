"""Multi-turn episodes, token by token: the ids are those of the whole conversation rendered at
once, the policy's mask covers exactly what it generated, every live episode generates
together, and each way an episode ends is what it says.

The policy here is scripted (each reply's ids are those of a fixed text): what is under test
is how the episode is assembled around the replies, not the sampling.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from agent_fixtures import add, call
from chat_template_fixtures import base_tokenizer, with_chat_tokens
from tool_templates import HERMES

from posttrain.agents.environment import Episode, load_environment
from posttrain.agents.episodes import EpisodeLimits, Renderer, run_episodes, start_episodes
from posttrain.agents.tools import describe

STOP = "<|im_end|>"


@pytest.fixture(scope="module")
def tok():
    return with_chat_tokens(base_tokenizer(), HERMES, ("<|im_start|>", STOP), None, STOP)


def scripted(tok, script: dict[str, list[str]], batches: list[int]):
    """A policy that answers the conversation asking `question` with script[question][turn]."""

    def generate(prompts: list[list[int]], max_new: int) -> list[list[int]]:
        batches.append(len(prompts))
        out = []
        for ids in prompts:
            text = tok.decode(ids, skip_special_tokens=False)
            question = next(q for q in script if q in text)
            turn = text.count("<|im_start|>assistant") - 1
            reply = tok(script[question][turn], add_special_tokens=False)["input_ids"]
            out.append([*reply, tok.convert_tokens_to_ids(STOP)][:max_new])
        return out

    return generate


def _play(tok, script, limits=None, rows=None, envs=None, tools=None):
    renderer = Renderer(tok, STOP)
    rows = rows or [{"prompt": [{"role": "user", "content": q}]} for q in script]
    tools = {"add": add} if tools is None else tools
    schemas = [describe(f, n) for n, f in tools.items()] or None
    runs = start_episodes(rows, renderer, tools, schemas, envs)
    batches: list[int] = []
    limits = limits or EpisodeLimits(
        max_turns=4, max_new_tokens=96, max_episode_tokens=400, tool_timeout_s=5
    )
    counts = run_episodes(
        runs,
        scripted(tok, script, batches),
        renderer,
        "hermes",
        limits,
        [tok.convert_tokens_to_ids(STOP)],
    )
    return runs, counts, batches


def test_an_episodes_ids_are_the_whole_conversation_and_its_mask_what_was_generated(tok) -> None:
    replies = [call(12, 30), "12 + 30 = 42."]
    (run,), counts, _ = _play(tok, {"What is 12 + 30?": replies})
    assert run.ended == "answer" and run.turns == 2 and not run.truncated
    assert [m["role"] for m in run.messages] == ["user", "assistant", "tool", "assistant"]
    assert run.messages[2]["content"] == "42"
    # The same ids as the conversation rendered and tokenised at once, up to the last reply's stop.
    whole = tok.apply_chat_template(run.messages, tools=run.schemas, tokenize=False)
    whole = whole[: whole.rindex(STOP) + len(STOP)]
    assert run.ids == tok(whole, add_special_tokens=False)["input_ids"]
    # Token by token: 1 exactly on the replies and their stop tokens, 0 on everything else.
    spans, current = [], []
    for i, m in zip(run.ids, run.mask, strict=True):
        if m:
            current.append(i)
        elif current:
            spans.append(current)
            current = []
    spans.append(current)
    assert [tok.decode(s, skip_special_tokens=False) for s in spans] == [r + STOP for r in replies]
    assert run.mask[: run.prompt_len] == [0] * run.prompt_len
    assert counts["tool_calls"] == 1 and counts["tool_errors"] == 0


def test_every_live_episode_generates_together_and_ends_its_own_way(tok) -> None:
    script = {
        "Say hi.": ["hi"],
        "What is 1 + 2?": [call(1, 2), "3"],
        "What is 2 + 2?": [call(2, 2), call(2, 2), call(2, 2), call(2, 2)],
    }
    runs, counts, batches = _play(tok, script, EpisodeLimits(3, 96, 400, 5))
    assert batches == [3, 2, 1]  # one generate per turn, over the episodes still running
    assert [(r.ended, r.turns) for r in runs] == [("answer", 1), ("answer", 2), ("max_turns", 3)]
    assert counts["tool_calls"] == 1 + 2  # the last turn's call is not run: the turns are spent


def test_the_token_budget_truncates(tok) -> None:
    (run,), _, _ = _play(
        tok, {"What is 5 + 5?": [call(5, 5), "5 + 5 = 10, " * 20]}, EpisodeLimits(4, 96, 120, 5)
    )
    assert run.ended == "budget" and run.truncated and run.spent <= 120
    assert len(run.ids) == len(run.mask)


def test_a_malformed_call_is_told_to_the_model_and_counted(tok) -> None:
    replies = ['<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>', call(1, 1), "2"]
    (run,), counts, _ = _play(tok, {"What is 1 + 1?": replies})
    assert run.ended == "answer" and counts["tool_malformed"] == 1 and counts["tool_calls"] == 1
    assert run.messages[2]["content"].startswith("Error: tool call 1: not JSON")


GUESS = """
class Guess:
    def reset(self, secret, **columns):
        self.secret = int(secret)
        return " Guess my number."

    def step(self, message):
        guess = int(message["content"])
        if guess == self.secret:
            return [], 1.0, True
        return ("higher" if guess < self.secret else "lower"), 0.0, False
"""


def test_a_gym_environment_answers_each_turn_until_done(tok, tmp_path: Path) -> None:
    (tmp_path / "games.py").write_text(GUESS)
    env = load_environment("games:Guess", [tmp_path])
    rows = [{"prompt": [{"role": "user", "content": "Play."}], "secret": 42}]
    envs = [Episode(env, "train.jsonl:1")]
    (run,), _, _ = _play(tok, {"Play.": ["50", "25", "42"]}, rows=rows, envs=envs, tools={})
    assert run.messages[0]["content"] == "Play. Guess my number."
    assert [m["content"] for m in run.messages[1:]] == ["50", "lower", "25", "higher", "42"]
    assert (run.ended, run.turns, run.step_reward) == ("answer", 3, 1.0)


def test_a_turn_cut_by_its_token_cap_ends_the_episode_truncated(tok) -> None:
    (run,), counts, _ = _play(tok, {"What is 3 + 4?": [call(3, 4)]}, EpisodeLimits(4, 20, 400, 5))
    assert (run.ended, run.turns, run.spent) == ("budget", 1, 20) and counts["tool_calls"] == 0


# Renders a final assistant turn with an empty think block, and only a final one (as Qwen3's
# template does): a render that ends at the reply is not a prefix of the next one.
LAST_THINKS = HERMES.replace(
    "{{ '<|im_start|>assistant' }}",
    "{{ '<|im_start|>assistant' }}{% if loop.last %}{{ '\n<think>\n\n</think>\n' }}{% endif %}",
)


def test_a_template_that_renders_the_last_turn_apart_keeps_the_same_ids(tok) -> None:
    other = with_chat_tokens(base_tokenizer(), LAST_THINKS, ("<|im_start|>", STOP), None, STOP)
    head = other.apply_chat_template(
        [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 1}}}
                ],
            },
        ],
        tokenize=False,
    )
    assert "<think>" in head  # the case under test: the final turn is rendered apart
    script = {"What is 12 + 30?": [call(12, 30), "12 + 30 = 42."]}
    (plain,), _, _ = _play(tok, script)
    (thinks,), _, _ = _play(other, script)
    assert thinks.ended == "answer" and thinks.ids == plain.ids and thinks.mask == plain.mask
