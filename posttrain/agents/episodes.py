"""Multi-turn episodes with token ids kept exactly: what the policy generated stays as it was
generated (mask 1), and what comes between its turns (tool results, an environment's
observations, the next generation prompt) is the chat template's own rendering (mask 0).
Nothing is decoded and re-tokenised, so the log-probs an update trains are the sampled ones.

A turn of every live episode is generated together (one `generate` call per turn); the calls
of all of them run together (`tool_runner.run_calls`). An episode ends with a reply that makes
no call (`answer`), at `max_turns` (`max_turns`), or when its token budget is spent (`budget`,
marked truncated; so does a turn cut by `max_new_tokens`).

Between turns the template renders the conversation twice: up to the generation prompt the
reply answered, and with the reply, the new messages and the next generation prompt. The second
must extend the first (templates that re-render earlier turns differently are refused); the
tokens appended are those of the text after the end-of-turn marker that closes the reply, a
special token where tokenisation restarts, so tokenising the piece alone gives the ids the
whole conversation would have.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.agents.environment import Episode
from posttrain.agents.tool_calls import ParsedReply, ToolCall, parse_reply
from posttrain.agents.tool_runner import ToolResult, failure_counts, run_calls
from posttrain.errors import StageVerdict

# generate(prompts, max_new_tokens) -> each prompt's new ids, its stop token included if any
Generate = Callable[[list[list[int]], int], list[list[int]]]


class TemplateNotIncremental(StageVerdict, ValueError):
    """The chat template renders earlier turns differently once later messages follow."""


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int  # assistant turns
    max_new_tokens: int  # per turn
    max_episode_tokens: int  # everything after the prompt: generated and rendered
    tool_timeout_s: float


@dataclass
class EpisodeRun:
    """One episode: the conversation, its ids with the policy's mask, how it ended."""

    messages: list[dict[str, Any]]  # the prompt's n_prompt messages, then the episode's
    prompt_len: int
    ids: list[int]
    mask: list[int]  # 1 where the policy generated the token
    tools: dict[str, Callable[..., Any]]
    schemas: list[dict[str, Any]] | None
    env: Episode | None = None
    turns: int = 0
    ended: str | None = None  # "answer" | "max_turns" | "budget"
    step_reward: float = 0.0
    results: list[list[ToolResult]] = field(default_factory=list)
    malformed: int = 0
    n_prompt: int = 0  # messages of the prompt (an environment's reset text included)

    @property
    def spent(self) -> int:
        return len(self.ids) - self.prompt_len

    @property
    def truncated(self) -> bool:
        return self.ended == "budget"


class Renderer:
    """The chat template of `tok` with the episode's tools, as text and as ids."""

    def __init__(self, tok: Any, stop_text: str) -> None:
        self.tok, self.stop_text = tok, stop_text

    def text(self, messages: list[dict], tools: list[dict] | None, prompt: bool) -> str:
        return self.tok.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=prompt
        )

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        return self.tok(self.text(messages, tools, True), add_special_tokens=False)["input_ids"]

    def between(self, history: list[dict], new: list[dict], tools: list[dict] | None) -> list[int]:
        """Ids of what the template puts after the end-of-turn marker of `history`'s last
        (assistant) turn, through `new` messages and the next generation prompt. The assistant
        turn is found after the prompt that preceded it, not by comparing with a render that
        ends at it: Qwen3 adds an empty think block to a final assistant turn only."""
        before = self.text(history[:-1], tools, True)
        full = self.text([*history, *new], tools, True)
        if not full.startswith(before):
            raise TemplateNotIncremental(
                "the chat template renders earlier turns differently once later turns follow, "
                "so an episode's tokens cannot be kept as generated"
            )
        end = full.find(self.stop_text, len(before))
        if end < 0:
            raise TemplateNotIncremental(
                f"the chat template does not close an assistant turn with {self.stop_text!r}, "
                "the token that ends generation"
            )
        return self.tok(full[end + len(self.stop_text) :], add_special_tokens=False)["input_ids"]


def _call_id(call: ToolCall, i: int) -> str:
    """The id a call goes by in the conversation: its own (Mistral's), else one of the 9
    characters Mistral's template demands, so the call and its result pair up in any family."""
    return call.id or f"call{i:05d}"


def _assistant(parsed: ParsedReply, text: str) -> dict[str, Any]:
    if not parsed.calls:
        return {"role": "assistant", "content": text}
    calls = [
        {
            "type": "function",
            "id": _call_id(c, i),
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for i, c in enumerate(parsed.calls)
    ]
    return {"role": "assistant", "content": parsed.content, "tool_calls": calls}


def _tool_messages(results: Sequence[ToolResult], malformed: Sequence[str]) -> list[dict]:
    out = [
        dict(role="tool", name=r.call.name, tool_call_id=_call_id(r.call, i), content=r.content)
        for i, r in enumerate(results)
    ]
    # A call the model wrote but could not be read is told as an error too: it learns nothing
    # from silence.
    out += [
        {"role": "tool", "name": "error", "tool_call_id": f"error{i:04d}", "content": f"Error: {m}"}
        for i, m in enumerate(malformed)
    ]
    return out


def start_episodes(
    rows: Sequence[dict[str, Any]],
    renderer: Renderer,
    tools: dict[str, Callable[..., Any]],
    schemas: list[dict[str, Any]] | None,
    envs: Sequence[Episode] | None = None,
) -> list[EpisodeRun]:
    """An episode per prompt row (`{"prompt": [messages], **columns}`): with an environment,
    its `reset(**columns)` text is appended to the last user message and its methods are the
    episode's tools."""
    runs = []
    for i, row in enumerate(rows):
        messages = [dict(m) for m in row["prompt"]]
        ep_tools, ep_schemas, env = tools, schemas, None
        if envs is not None:
            env = envs[i]
            said = env.reset({k: v for k, v in row.items() if k != "prompt"})
            if said:
                messages[-1]["content"] = f"{messages[-1]['content']}{said}"
            if env.env.tool_names:
                ep_tools, ep_schemas = env.tools(), env.env.schemas
        ids = renderer.prompt_ids(messages, ep_schemas)
        run = EpisodeRun(messages, len(ids), ids, [0] * len(ids), ep_tools, ep_schemas, env)
        run.n_prompt = len(messages)
        runs.append(run)
    return runs


def _take_reply(run: EpisodeRun, new: list[int], budget: int, stops: set[int], tok: Any) -> str:
    """Append a reply's ids (cut to the budget) to `run`; its text without the stop token."""
    new = new[:budget]
    run.ids += new
    run.mask += [1] * len(new)
    run.turns += 1
    stopped = bool(new) and new[-1] in stops
    if not stopped:  # cut by the turn's or the episode's token cap: its turn never closed
        run.ended = "budget"
    return tok.decode(new[:-1] if stopped else new, skip_special_tokens=False)


def _answer_or_calls(
    run: EpisodeRun, text: str, fmt: str | None, max_turns: int
) -> ParsedReply | None:
    """The reply's calls to run, or None when the episode ends with this reply."""
    parsed = parse_reply(text, fmt) if fmt is not None else ParsedReply(text)
    run.messages.append(_assistant(parsed, text))
    if run.ended is not None:
        return None
    if run.env is not None and run.env.env.is_gym:
        return parsed  # the environment answers (see _observe)
    run.malformed += len(parsed.errors)
    if parsed.attempted == 0:
        run.ended = "answer"
    elif run.turns >= max_turns:
        run.ended = "max_turns"
    return parsed if run.ended is None else None


def _observe(run: EpisodeRun) -> list[dict[str, Any]] | None:
    """A gym-like environment's answer to the last reply (None: the episode is done)."""
    assert run.env is not None
    got = run.env.step(run.messages[-1])
    run.step_reward += got.reward
    if got.done:
        run.ended = "answer"
        return None
    return got.observations


def _append_context(
    run: EpisodeRun, new: list[dict], renderer: Renderer, limits: EpisodeLimits
) -> None:
    """Render `new` messages and the next generation prompt into `run` (mask 0), unless that
    would spend the budget or the turns are done."""
    if run.turns >= limits.max_turns:
        run.ended = "max_turns"
        return
    ids = renderer.between(run.messages, new, run.schemas)
    run.messages += new
    if run.spent + len(ids) >= limits.max_episode_tokens:
        run.ended = "budget"
        return
    run.ids += ids
    run.mask += [0] * len(ids)


def run_episodes(
    runs: list[EpisodeRun],
    generate: Generate,
    renderer: Renderer,
    fmt: str | None,
    limits: EpisodeLimits,
    stop_ids: Sequence[int],
    sync: Callable[[bool], bool] | None = None,
) -> dict[str, float]:
    """Play `runs` to their ends, a turn of every live episode at a time -> the batch's tool
    counts and `tool_s`, the seconds its turns waited for tools. `sync(this rank has live
    episodes) -> whether any rank has`: generation being a collective, a rank whose episodes all
    ended keeps calling `generate` (with no prompts) until every rank's have."""
    stops = set(stop_ids)
    tool_s = 0.0
    while True:
        live = [r for r in runs if r.ended is None]
        if not (sync(bool(live)) if sync is not None else live):
            break
        budgets = [limits.max_episode_tokens - r.spent for r in live]
        replies = generate(
            [r.ids for r in live], min(limits.max_new_tokens, max(budgets, default=1))
        )
        pending: list[tuple[EpisodeRun, ParsedReply]] = []
        for run, new, budget in zip(live, replies, budgets, strict=True):
            text = _take_reply(run, list(new), budget, stops, renderer.tok)
            parsed = _answer_or_calls(run, text, fmt, limits.max_turns)
            if parsed is None:
                continue
            if run.env is not None and run.env.env.is_gym:
                if (obs := _observe(run)) is not None:
                    _append_context(run, obs, renderer, limits)
            else:
                pending.append((run, parsed))
        t = time.perf_counter()
        results = run_calls(
            [p.calls for _, p in pending], [r.tools for r, _ in pending], limits.tool_timeout_s
        )
        tool_s += time.perf_counter() - t
        for (run, parsed), res in zip(pending, results, strict=True):
            run.results.append(res)
            _append_context(run, _tool_messages(res, parsed.errors), renderer, limits)
    counts: dict[str, float] = dict(failure_counts([row for r in runs for row in r.results]))
    counts["tool_malformed"] = sum(r.malformed for r in runs)
    counts["tool_s"] = tool_s
    return counts
