"""What a k-turn tool-using rollout costs beside single-turn generation of the same new tokens
(issue 27; target: k-turn time, tool time excluded, at most 1.3x single-turn).

One process, fp32, a random-init Llama (--hidden/--layers) behind the in-process rollout engine
(`HFEngine`) as the RL stage builds it (a LoRA policy adapter in a `RoleModel`), a byte-level
BPE trained as the from-config ingest trains it, and a hermes-style tools template written here.
--batch episodes of --turns turns each.

A random-weight policy writes no tool calls, so each turn is forced through the real episode
loop (`start_episodes` / `run_episodes`: rendering, parsing, tool runs and context growth are
the project's own): the engine samples --new-tokens tokens per row, the first ones freely (no
special token), the last ones forced to a canned `<tool_call>` block and `<|im_end|>` (turns
before the last) or a short answer and `<|im_end|>` (the last turn). Forced means sampled from
logits that allow only that token (`ForcedRoleModel.decode`), so the ids the episode keeps are
the ids the engine sampled, as in a real episode, and its KV cache can be kept between turns.

Single-turn: one `generate` call from the same prompts (rendered by the same template) for
--turns x --new-tokens tokens, the same batch and the same total new tokens, through the
engine's single-turn path (transformers' `generate`), and through its decode loop
(`drop_finished`) for reference.

Printed, medians of --repeats after one warm-up of each:
- k-turn s:   `start_episodes` + `run_episodes` minus the time in `run_calls` (tools s, shown),
              with the KV cache kept between turns (`rollout.episode_cache`, the default)
- no cache s: the same without it: every turn re-prefills the whole conversation
- single s:   prompt rendering + the one `generate` call; ratio = k-turn / single (the median
              of each repeat's ratio)
- gen / render / other: shares of k-turn time in the engine, in the template (`Renderer`),
  and the rest (decode of replies, parsing, bookkeeping)
- prefilled: prompt tokens each side ran through the model (the cache's reused ones left out)

    python bench/agent_rollout.py [--batch 8] [--turns 4] [--new-tokens 64] [--repeats 3]
                                  [--hidden 256] [--layers 4] [--threads 2] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from posttrain.agents import episodes
from posttrain.agents.episodes import (
    EpisodeLimits,
    EpisodeRun,
    Generate,
    Renderer,
    run_episodes,
    start_episodes,
)
from posttrain.agents.tools import describe
from posttrain.data.synthetic import pretrain_corpus
from posttrain.kinds.ingest import FromConfigModel
from posttrain.models.adapters import POLICY
from posttrain.models.lora import apply_lora
from posttrain.models.roles import RoleModel
from posttrain.models.tiny import IM_END, build_model, train_tokenizer
from posttrain.rl.rollout.engine import HFEngine
from posttrain.rl.rollout.multiturn import engine_turns
from posttrain.sections.shared import LoraConfig, SamplingConfig

# Qwen-style tools template, compact: the tool schemas in a system turn, calls as <tool_call>
# JSON blocks, tool results as a user turn of <tool_response> blocks.
TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\nTools you may call, one <tool_call></tool_call> JSON "
    "block each:\n' }}{% for t in tools %}{{ t | tojson }}{{ '\n' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m.role + '\n' + (m.content or '') }}"
    "{% for c in m.tool_calls or [] %}"
    '{{ \'\n<tool_call>\n{"name": "\' + c.function.name + \'", "arguments": \' }}'
    "{{ c.function.arguments | tojson }}{{ '}\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CALL = '\n<tool_call>\n{"name": "lookup", "arguments": {"key": "capital"}}\n</tool_call>'
ANSWER = "\nThe answer is Paris."
QUESTIONS = ("What is the capital of France?", "Look up the capital, then answer.")


def lookup(key: str) -> str:
    """Look a key up in the bench's table.

    Args:
        key: What to look up.
    """
    return f"{key}: Paris is the capital and largest city of France."


SCHEMAS = [describe(lookup, "lookup")]


class ForcedRoleModel(RoleModel):
    """The policy, its decode loop steered: after `free` steps of a call, the logits allow only
    the next token of `tail`; before, no special token (which would end the turn or confuse
    the template). Set `plan = (free, tail)` before each `generate` call; None = unsteered."""

    plan: tuple[int, list[int]] | None = None
    specials: list[int] = []
    _step = 0

    def steer(self, free: int, tail: list[int]) -> None:
        self.plan, self._step = (free, tail), 0

    def decode(self, role: str, *args: Any) -> torch.Tensor:
        logits = super().decode(role, *args)  # [n, V]
        if self.plan is None:
            return logits
        free, tail = self.plan
        i, self._step = self._step, self._step + 1
        if i >= free:
            forced = torch.full_like(logits, float("-inf"))
            forced[:, tail[min(i - free, len(tail) - 1)]] = 0.0
            return forced
        logits[:, self.specials] = float("-inf")
        return logits


def policy(args: argparse.Namespace) -> tuple[Any, ForcedRoleModel]:
    """The tokenizer (with the tools template) and a random-init LoRA policy on `args.device`."""
    torch.manual_seed(0)
    # Tool-call text in the corpus too, so its JSON is a few tokens as in a real tokenizer.
    chat = [CALL, ANSWER, lookup("capital"), *QUESTIONS] * 50
    tok = train_tokenizer([*pretrain_corpus(400, seed=0), *chat], args.vocab)
    tok.chat_template = TEMPLATE
    shape = FromConfigModel(
        architecture="llama",
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=max(1, args.hidden // 64),
        intermediate_size=args.hidden * 8 // 3,
        vocab_size=args.vocab,
        max_position_embeddings=8192,
    )
    lm = apply_lora(build_model(shape, tok), LoraConfig(r=8, alpha=16)).to(args.device).eval()
    model = ForcedRoleModel(lm, None, None)
    model.specials = list(tok.all_special_ids)
    return tok, model


class Clock:
    """Seconds spent in each named part of a run."""

    def __init__(self) -> None:
        self.s: dict[str, float] = {}

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.s[name] = self.s.get(name, 0.0) + time.perf_counter() - t0


class TimedRenderer(Renderer):
    """The project's renderer, its template time on the clock (same ids, same calls)."""

    def __init__(self, tok: Any, stop_text: str, clock: Clock) -> None:
        super().__init__(tok, stop_text)
        self.clock = clock

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        with self.clock.part("render"):
            return super().prompt_ids(messages, tools)

    def between(self, history: list[dict], new: list[dict], tools: list[dict] | None) -> list[int]:
        with self.clock.part("render"):
            return super().between(history, new, tools)


@contextmanager
def tools_timed(clock: Clock) -> Iterator[None]:
    """Put the episode loop's tool runs (`run_calls`, threads included) on the clock: tool time
    is the environment's, not the rollout's, so the comparison leaves it out. The loop looks
    `run_calls` up in its module at each turn, so swapping the name there is enough."""
    real = episodes.run_calls

    def timed(*a: Any, **kw: Any) -> Any:
        with clock.part("tools"):
            return real(*a, **kw)

    episodes.run_calls = timed
    try:
        yield
    finally:
        episodes.run_calls = real


def never_stops(tok: Any) -> list[int]:
    """A stop id one past the vocabulary: the model cannot sample it, so every row runs to its
    max_new_tokens (a random-weight policy would otherwise stop at random)."""
    return [len(tok)]


def forced_turns(
    engine: HFEngine, model: ForcedRoleModel, tok: Any, args: argparse.Namespace, clock: Clock
) -> Generate:
    """The episode loop's `generate`: the engine samples --new-tokens per row, its last ones
    forced to a canned tool call (turns before the last) or answer closed by `<|im_end|>`."""
    sampling = SamplingConfig(name="t1", strategy="sample", max_new_tokens=args.new_tokens)
    stop = tok.convert_tokens_to_ids(IM_END)
    sample = engine_turns(engine, sampling, [stop], tok.pad_token_id, seed=args.seed)
    call, answer = (tok(t, add_special_tokens=False)["input_ids"] + [stop] for t in (CALL, ANSWER))
    if len(call) >= args.new_tokens:
        raise SystemExit(f"--new-tokens must exceed the canned call's {len(call)} tokens")
    turn = 0

    def generate(prompts: list[list[int]], max_new: int) -> list[list[int]]:
        nonlocal turn
        turn += 1
        tail = answer if turn == args.turns else call
        model.steer(max_new - len(tail), tail)
        try:
            with clock.part("gen"):
                return sample(prompts, max_new)
        finally:
            model.plan = None

    return generate


def rows_of(batch: int) -> list[dict[str, Any]]:
    return [{"prompt": [{"role": "user", "content": QUESTIONS[i % 2]}]} for i in range(batch)]


def k_turn(
    tok: Any, model: ForcedRoleModel, args: argparse.Namespace, cache: bool
) -> dict[str, float]:
    """One batch of k-turn episodes: seconds per part, context and prefilled tokens."""
    clock = Clock()
    renderer = TimedRenderer(tok, IM_END, clock)
    # The decode loop either way (a turn with the cache runs it): forcing steers its logits.
    engine = HFEngine(model, POLICY, world=1, drop_finished=True, keep_turns=cache)
    generate = forced_turns(engine, model, tok, args, clock)
    limits = EpisodeLimits(
        max_turns=args.turns,
        max_new_tokens=args.new_tokens,
        max_episode_tokens=1 << 20,
        tool_timeout_s=30.0,
    )
    stop = tok.convert_tokens_to_ids(IM_END)
    contexts: list[int] = []
    with tools_timed(clock), clock.part("total"):
        runs = start_episodes(rows_of(args.batch), renderer, {"lookup": lookup}, SCHEMAS)
        counting = _counting(generate, contexts)
        run_episodes(runs, counting, renderer, "hermes", limits, [stop])
    engine.release()
    check(runs, args)
    s = clock.s
    return {
        "k_turn": s["total"] - s.get("tools", 0.0),
        "tools": s.get("tools", 0.0),
        "gen": s["gen"],
        "render": s["render"],
        "context": float(statistics.mean(len(r.ids) for r in runs)),
        "generated": float(statistics.mean(sum(r.mask) for r in runs)),
        "first_context": float(statistics.mean(len(r.ids[: r.prompt_len]) for r in runs)),
        "prefilled": float(sum(contexts) - engine.reused),
    }


def _counting(generate: Generate, contexts: list[int]) -> Generate:
    """`generate`, adding each call's prompt tokens to `contexts`."""

    def counted(prompts: list[list[int]], max_new: int) -> list[list[int]]:
        contexts.append(sum(len(p) for p in prompts))
        return generate(prompts, max_new)

    return counted


def check(runs: list[EpisodeRun], args: argparse.Namespace) -> None:
    """Every episode played its k turns and ran its k - 1 calls, as forced."""
    for r in runs:
        ok = [len(x) for x in r.results] == [1] * (args.turns - 1) and r.turns == args.turns
        if not ok or r.ended != "answer" or sum(r.mask) != args.turns * args.new_tokens:
            raise SystemExit(f"an episode did not play as forced: {r.turns} turns, {r.ended}")


def single_turn(tok: Any, model: RoleModel, args: argparse.Namespace, loop: bool) -> float:
    """Seconds for the same prompts, rendered by the same template, generating all k x n new
    tokens in one call (`loop`: through the decode loop instead of `generate`)."""
    t0 = time.perf_counter()
    renderer = Renderer(tok, IM_END)
    prompts = [renderer.prompt_ids(r["prompt"], SCHEMAS) for r in rows_of(args.batch)]
    n = args.turns * args.new_tokens
    sampling = SamplingConfig(name="t1", strategy="sample", max_new_tokens=n)
    engine = HFEngine(model, POLICY, world=1, drop_finished=loop)
    out = engine.generate(prompts, sampling, never_stops(tok), tok.pad_token_id, args.seed)
    seconds = time.perf_counter() - t0
    assert out.shape == (args.batch, n), out.shape
    return seconds


def measure(tok: Any, model: ForcedRoleModel, args: argparse.Namespace) -> dict[str, float]:
    """Medians over --repeats of each side, alternated (after one warm-up each) so a slow
    spell of a shared machine falls on all of them."""
    k_turn(tok, model, args, cache=True)
    k_turn(tok, model, args, cache=False)
    single_turn(tok, model, args, loop=False)
    single_turn(tok, model, args, loop=True)
    rows = []
    for _ in range(args.repeats):
        parts = k_turn(tok, model, args, cache=True)
        nocache = k_turn(tok, model, args, cache=False)
        parts["no_cache"], parts["prefilled_no_cache"] = nocache["k_turn"], nocache["prefilled"]
        parts["single"] = single_turn(tok, model, args, loop=False)
        parts["single_loop"] = single_turn(tok, model, args, loop=True)
        # A repeat's sides ran back to back: their ratio is steadier on a shared machine than
        # the ratio of two medians.
        parts["ratio"] = parts["k_turn"] / parts["single"]
        parts["ratio_no_cache"] = parts["no_cache"] / parts["single"]
        rows.append(parts)
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def report(m: dict[str, float], args: argparse.Namespace) -> None:
    ratio = m["ratio"]
    other = m["k_turn"] - m["gen"] - m["render"]
    print(
        "batch | k | tok/turn | k-turn s | no cache s | tools s (excl.) | single s | ratio | "
        "no cache | gen | render | other"
    )
    print(
        f"{args.batch:5d} | {args.turns} | {args.new_tokens:8d} | {m['k_turn']:8.3f} | "
        f"{m['no_cache']:10.3f} | {m['tools']:15.3f} | {m['single']:8.3f} | {ratio:.2f}x | "
        f"{m['ratio_no_cache']:7.2f}x | {100 * m['gen'] / m['k_turn']:2.0f}% | "
        f"{100 * m['render'] / m['k_turn']:5.1f}% | {100 * other / m['k_turn']:4.1f}%"
    )
    first = m["first_context"] * args.batch
    print(
        f"prefilled tokens: k-turn {m['prefilled']:.0f} with the cache, "
        f"{m['prefilled_no_cache']:.0f} without, single {first:.0f}; single-turn through the "
        f"decode loop {m['single_loop']:.3f} s"
    )
    print(
        f"context per episode: {m['first_context']:.0f} prompt tokens -> {m['context']:.0f} at "
        f"the end, {m['generated']:.0f} generated ({args.turns} x {args.new_tokens}); "
        f"target ratio <= 1.30x: {'met' if ratio <= 1.3 else 'not met'}"
    )


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64, help="generated per turn")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tok, model = policy(args)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"hidden {args.hidden}, {args.layers} layers, vocab {len(tok)} "
        f"({n_params / 1e6:.1f}M parameters), {args.device}, {args.threads} threads, "
        f"medians of {args.repeats} after a warm-up"
    )
    m = measure(tok, model, args)
    report(m, args)
    return m


if __name__ == "__main__":
    main()
