"""Chat-template formatting and the assistant-token loss mask.

The mask covers what the template renders for each assistant turn, from where the generation
prompt ends (what a model is given at inference) through the turn's end-of-turn text (what it
must emit to stop). Three strategies find those character spans; the first that serves a
template is its strategy (`template_strategy`, chosen once per template on SAMPLE_CHAT):

- "generation": the template marks assistant text with `{% generation %}`; its spans are used.
- "prefix": rendering the conversation up to each turn gives prefixes of the full render. The
  span is then exact: render(prefix, generation prompt) .. render(prefix + turn). A row on which
  the prefixes disagree falls back to "search" (which agrees with "prefix" where both apply).
- "search": one full render, each boundary located by a probe. Templates that render prefixes
  differently from the full conversation need it: an EOS after every render (Phi-3.5), a think
  tail in the generation prompt (DeepSeek-R1), think blocks only after the last user turn
  (Qwen3), the system message moved into the last user turn (Mistral v0.3).

Messages may carry `reasoning_content` on assistant turns; it is passed to the template, which
keeps, moves or drops it (and `<think>` text inside content) as it was written to.

Tool-use traces (OpenAI/TRL shape): assistant turns may carry `tool_calls` (content often
empty) and `tool` messages answer them; a conversation's `tools` (JSON schemas) go to the
template as `tools=`. An assistant turn's span covers the call text the template renders for it
and its end-of-turn; tool results and their framing are never in a span. "prefix" and
"generation" need nothing more; "search" cannot probe a tool-call turn's content (templates drop
or move it), so such a turn ends at the last end-of-turn before the next message's content.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IGNORE = -100  # label value cross-entropy skips

# Appended to one message's content to find where the template put that content's end. Letters
# only: no template trims, splits on or escapes them.
PROBE = "PtProbeQx"

# The conversation every template is checked on (ingest) and its strategy chosen with: a system
# turn, then two exchanges, so that "only the last turn" behaviours show.
SAMPLE_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hi"},
    {"role": "user", "content": "again"},
    {"role": "assistant", "content": "yes"},
]

# Special-looking text a template writes: <|im_start|>, <｜User｜>, <start_of_turn>, </s>, [INST].
MARKER = re.compile(r"<\|[^<>|\s]*\|>|<｜[^<>｜]*｜>|</?[A-Za-z][\w.-]*>|\[/?[A-Z][A-Z_]*\]")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# A template that pipes call arguments (or the whole function) through `tojson` needs them as an
# object: a JSON string there would render as a quoted string. One that tests `is string`
# renders either as given.
ARGS_TOJSON = re.compile(r"(arguments|function)\s*\|\s*tojson")
ARGS_IS_STRING = re.compile(r"arguments\s+is\s+string")


class TemplateError(ValueError):
    pass


def render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The template's text for `messages` (and `tools`, JSON schemas); a template that refuses
    them (raise_exception, e.g. "System role not supported") raises TemplateError with its
    message."""
    from jinja2 import TemplateError as JinjaError

    try:
        return tokenizer.apply_chat_template(
            for_template(tokenizer.chat_template, messages),
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
    except JinjaError as exc:
        raise TemplateError(f"the chat template refuses this conversation: {exc}") from exc


def for_template(template: str | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with tool-call arguments given as JSON strings decoded to objects when the
    template pipes them through `tojson` (Qwen2.5, Llama 3.1, Mistral); as given otherwise.
    Rows are checked on reading (`posttrain.data.loading`), so the strings decode."""
    if not template or not ARGS_TOJSON.search(template) or ARGS_IS_STRING.search(template):
        return messages
    if not any(m.get("tool_calls") for m in messages):
        return messages
    return [_decoded_calls(m) if m.get("tool_calls") else m for m in messages]


def _decoded_calls(message: dict[str, Any]) -> dict[str, Any]:
    calls = []
    for c in message["tool_calls"]:
        fn = c["function"]
        if isinstance(fn.get("arguments"), str):
            fn = {**fn, "arguments": json.loads(fn["arguments"] or "{}")}
        calls.append({**c, "function": fn})
    return {**message, "tool_calls": calls}


# ---- strategies -------------------------------------------------------------------------------


def _generation_spans(
    tokenizer: Any, messages: list[dict], tools: list[dict] | None = None
) -> tuple[str, list[tuple[int, int]]]:
    from jinja2 import TemplateError as JinjaError
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        rendered, indices = render_jinja_template(
            conversations=[for_template(tokenizer.chat_template, messages)],
            tools=tools or None,
            chat_template=tokenizer.chat_template,
            return_assistant_tokens_mask=True,
            add_generation_prompt=False,
            **tokenizer.special_tokens_map,
        )
    except JinjaError as exc:
        raise TemplateError(f"the chat template refuses this conversation: {exc}") from exc
    return rendered[0], [tuple(x) for x in indices[0]]


def _prefix_spans(
    tokenizer: Any, messages: list[dict], tools: list[dict] | None = None
) -> tuple[str, list[tuple[int, int]]] | None:
    """Exact spans from prefix renders, or None when the prefixes are not prefixes of the full
    render (the template renders earlier turns differently once more follow). A tool-call turn
    needs nothing special: render(.., turn) - render(.., generation prompt) is its call text."""
    full = render(tokenizer, messages, False, tools)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], True, tools) if i else ""
        upto = render(tokenizer, messages[: i + 1], False, tools)
        if not (full.startswith(before) and full.startswith(upto)) or len(upto) <= len(before):
            return None
        spans.append((len(before), len(upto)))
    return full, spans


def _lcp(a: str, b: str) -> int:
    """Length of the common prefix (binary search on slice equality: C-speed comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _marker_start(text: str, i: int, specials: tuple[str, ...]) -> int | None:
    """Start of the marker (or special token) that position i falls strictly inside, if any."""
    lo = max(0, i - 64)
    window = text[lo : i + 64]
    for m in MARKER.finditer(window):
        if lo + m.start() < i < lo + m.end():
            return lo + m.start()
    for s in specials:
        j = text.find(s, max(0, i - len(s) + 1))
        if j != -1 and j < i < j + len(s):
            return j
    return None


def common_text(a: str, b: str, specials: tuple[str, ...] = ()) -> int:
    """Length of the common prefix of a and b, cut back so that it does not end inside a marker
    of either (`<|end|>\\n<|endoftext|>` and `<|end|>\\n<|user|>` share `<|end|>\\n`, not `<|`)."""
    n = _lcp(a, b)
    while n:
        cut = [x for x in (_marker_start(a, n, specials), _marker_start(b, n, specials)) if x]
        if not cut:
            break
        n = min(cut)
    return n


def _specials(tokenizer: Any) -> tuple[str, ...]:
    try:
        added = tuple(tokenizer.get_added_vocab())
    except (AttributeError, NotImplementedError):
        added = ()
    return tuple(s for s in added if len(s) > 1)


def _content_end(
    tokenizer: Any,
    messages: list[dict],
    j: int,
    gen: bool,
    text: str,
    tools: list[dict] | None = None,
    at_start: bool = False,
) -> int:
    """Where message j's content ends (`at_start`: begins) in `text` (= render(messages, gen,
    tools)): render again with a probe appended (prepended) to that content and see where the
    two renders differ."""
    probed = [dict(m) for m in messages]
    content = probed[j].get("content") or ""
    probed[j]["content"] = PROBE + content if at_start else content + PROBE
    other = render(tokenizer, probed, gen, tools)
    e = min(_lcp(text, other), len(text) - _lcp(text[::-1], other[::-1]))
    inserted = other[e : len(other) - (len(text) - e)]
    # Whitespace the template trims shows up beside the probe; anything else means the
    # template does not render this content as one run of text.
    if not (other.startswith(text[:e]) and other.endswith(text[e:])) or inserted.strip() != PROBE:
        raise TemplateError(
            f"the chat template does not render message {j} ({messages[j]['role']}) as one run "
            "of text, so its turn cannot be located"
        )
    return e


def _turn_start(
    tokenizer: Any, messages: list[dict], k: int, full: str, tools: list[dict] | None
) -> int:
    """Where assistant turn k starts in `full`: the generation prompt's text after the previous
    message's content (its end-of-turn and the assistant header) is what the turn follows; the
    span starts where the full render stops agreeing with it. DeepSeek's trailing `<think>\n`,
    absent from the full render, is so left to the generation prompt."""
    if k == 0:
        return 0
    prompt = render(tokenizer, messages[:k], True, tools)
    tail = prompt[_content_end(tokenizer, messages[:k], k - 1, True, prompt, tools) :]
    prev = _content_end(tokenizer, messages, k - 1, False, full, tools)
    return prev + common_text(tail, full[prev:], _specials(tokenizer))


def _calls_turn_end(
    tokenizer: Any, messages: list[dict], k: int, full: str, lo: int, tools: list[dict] | None
) -> int:
    """End of tool-call turn k in `full`, its turn starting at `lo`: after the last end-of-turn
    text before the next message's content (or the end of the render). Its content cannot be
    probed for this: Llama 3.1 drops it, others put the calls after it."""
    nxt = k + 1 < len(messages)
    hi = _content_end(tokenizer, messages, k + 1, False, full, tools, True) if nxt else len(full)
    eot = end_of_turn(tokenizer)
    at = full.rfind(eot, lo, hi) if eot else -1
    if at < 0:
        raise TemplateError(
            f"the chat template writes no end of turn ({eot!r}) after the tool calls of "
            f"assistant message {k}, so its turn cannot be located"
        )
    return at + len(eot)


def _search_spans(
    tokenizer: Any, messages: list[dict], tools: list[dict] | None = None
) -> tuple[str, list[tuple[int, int]]]:
    full = render(tokenizer, messages, False, tools)
    eot, specials = end_of_turn(tokenizer), _specials(tokenizer)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = max(_turn_start(tokenizer, messages, k, full, tools), cursor)
        if m.get("tool_calls"):
            e = end = _calls_turn_end(tokenizer, messages, k, full, start, tools)
        else:
            e = _content_end(tokenizer, messages, k, False, full, tools)
            end = e + common_text(eot, full[e:], specials)
        if e < cursor:
            raise TemplateError(f"assistant message {k} renders before the turn it follows")
        spans.append((min(start, e), end))
        cursor = end
    return full, spans


# ---- per-template facts (cached: every row of a dataset shares them) --------------------------


@dataclass(frozen=True)
class TemplateInfo:
    strategy: str  # "generation" | "prefix" | "search"
    system_role: bool  # False: the template refuses a system message
    end_of_turn: str  # text after every assistant turn's content (in the mask)


_INFO: dict[tuple[str, str, str], TemplateInfo] = {}
_EOT: dict[tuple[str, str, str], str] = {}


def _key(tokenizer: Any) -> tuple[str, str, str]:
    return (
        tokenizer.chat_template or "",
        str(getattr(tokenizer, "bos_token", "")),
        str(getattr(tokenizer, "eos_token", "")),
    )


def end_of_turn(tokenizer: Any) -> str:
    """The text a template writes after an assistant turn's content and before whatever comes
    next: what follows the content both when the turn ends the conversation and when a user turn
    follows (Phi-3.5's final EOS and the next header are not part of it)."""
    key = _key(tokenizer)
    if key not in _EOT:
        convo = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        alone = render(tokenizer, convo, False)
        more = [*convo, {"role": "user", "content": "v"}]
        followed = render(tokenizer, more, False)
        x_end = alone[_content_end(tokenizer, convo, 1, False, alone) :]
        x_next = followed[_content_end(tokenizer, more, 1, False, followed) :]
        _EOT[key] = x_end[: common_text(x_end, x_next, _specials(tokenizer))]
    return _EOT[key]


def _sample(system_role: bool) -> list[dict[str, str]]:
    return SAMPLE_CHAT if system_role else [m for m in SAMPLE_CHAT if m["role"] != "system"]


def _accepts_system(tokenizer: Any) -> bool:
    try:
        render(tokenizer, SAMPLE_CHAT, add_generation_prompt=False)
    except TemplateError:
        # Only a template that renders the sample once the system turn is gone lacks just the
        # system role; one that refuses both is broken, and says so on the second render.
        render(tokenizer, _sample(False), add_generation_prompt=False)
        return False
    return True


def template_info(tokenizer: Any) -> TemplateInfo:
    """Strategy, system-role support and end-of-turn text of the tokenizer's template, decided on
    SAMPLE_CHAT (without its system turn when the template refuses one). Raises TemplateError
    saying why when no strategy serves the template."""
    key = _key(tokenizer)
    if key in _INFO:
        return _INFO[key]
    if not tokenizer.chat_template:
        raise TemplateError("the tokenizer has no chat template")
    system_role = _accepts_system(tokenizer)
    sample = _sample(system_role)
    if GENERATION_TAG.search(tokenizer.chat_template):
        strategy = "generation"
        _, spans = _generation_spans(tokenizer, sample)
        if len(spans) != 2:
            raise TemplateError(
                f"the chat template's {{% generation %}} blocks mark {len(spans)} spans in a "
                "conversation with 2 assistant turns"
            )
    elif _prefix_spans(tokenizer, sample) is not None:
        strategy = "prefix"
    else:
        strategy = "search"
        try:
            _search_spans(tokenizer, sample)
        except TemplateError as exc:
            raise TemplateError(
                "the chat template renders conversation prefixes inconsistently and its "
                f"assistant turns cannot be located in one render either ({exc}); install a "
                "template that does (ingest.chat_template)"
            ) from exc
    info = TemplateInfo(strategy, system_role, end_of_turn(tokenizer))
    _INFO[key] = info
    return info


def template_strategy(tokenizer: Any) -> str:
    return template_info(tokenizer).strategy


def check_system_role(tokenizer: Any, located: list[tuple[str, list[dict[str, str]]]]) -> None:
    """Refuse, naming its location, the first conversation with a system message when the
    template refuses the system role (Gemma-2). Not folded into the first user turn: that would
    train on text neither the data nor the template wrote."""
    if template_info(tokenizer).system_role:
        return
    for where, messages in located:
        if any(m["role"] == "system" for m in messages):
            raise TemplateError(
                f"{where}: a system message, but the chat template refuses the system role; "
                "merge it into the first user message or drop it"
            )


def assistant_char_spans(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """Full rendered text and the [start, end) character span of each assistant turn: from the
    end of the generation prompt through the turn's end-of-turn text (a tool-call turn: through
    its rendered calls and end-of-turn). `tools`: the row's JSON schemas, given to the
    template."""
    strategy = template_strategy(tokenizer)
    if strategy == "generation":
        return _generation_spans(tokenizer, messages, tools)
    if strategy == "prefix":
        out = _prefix_spans(tokenizer, messages, tools)
        if out is not None:
            return out
    return _search_spans(tokenizer, messages, tools)


def encode_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    max_len: int,
    on_too_long: str = "truncate",
    tools: list[dict[str, Any]] | None = None,
) -> dict[str, list[int]] | None:
    """Tokenize one conversation -> {"input_ids": [T], "labels": [T]}, labels = IGNORE outside
    assistant turns. Returns None when the row is too long and on_too_long == "drop", or when
    truncation leaves no assistant token."""
    return fit_chat(encode_chat_uncut(tokenizer, messages, tools), max_len, on_too_long)


def encode_chat_uncut(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> dict[str, list[int]]:
    """One conversation's every token -> {"input_ids": [T], "labels": [T]}, labels = IGNORE
    outside assistant turns; `fit_chat` then holds it to a length."""
    text, spans = assistant_char_spans(tokenizer, messages, tools)
    # The template already contains every special token it wants; adding more would double BOS.
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = enc["input_ids"]
    labels = [IGNORE] * len(ids)
    for t, (start, _end) in enumerate(enc["offset_mapping"]):
        if any(s <= start < e for s, e in spans):
            labels[t] = ids[t]
    return {"input_ids": ids, "labels": labels}


def fit_chat(
    enc: dict[str, list[int]], max_len: int, on_too_long: str = "truncate"
) -> dict[str, list[int]] | None:
    """An `encode_chat_uncut` encoding held to `max_len` tokens: cut at the right, or None when
    it is longer and on_too_long == "drop", or when no assistant token is left (after the
    first: a label at position 0 predicts nothing)."""
    ids, labels = enc["input_ids"], enc["labels"]
    if len(ids) > max_len:
        if on_too_long == "drop":
            return None
        ids, labels = ids[:max_len], labels[:max_len]
    if all(x == IGNORE for x in labels[1:]):
        return None
    return {"input_ids": ids, "labels": labels}


def prompt_text(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> tuple[str, str]:
    """(templated prompt up to the last assistant turn, that turn's reference content). In a
    tool trace the prompt holds the calls and results before the final answer."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return render(tokenizer, messages[:last], True, tools), messages[last]["content"]


def template_sha256(tokenizer: Any) -> str:
    """Identity of the chat template a stage formatted its text with (recorded in manifests)."""
    return hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()


def looks_like_template_file(value: str) -> bool:
    """A chat_template value that is a file path rather than Jinja text: one line without `{`,
    ending in .jinja, holding a /, or naming an existing file."""
    if "\n" in value or "{" in value or len(value) > 4096:
        return False
    return value.endswith(".jinja") or "/" in value or Path(value).expanduser().is_file()


def read_template(value: str, field: str) -> tuple[str, str | None]:
    """(template text, file it was read from or None) for a recipe's chat_template value: Jinja
    text, or the path of a file holding it. A path that names no file is an error naming
    `field`."""
    if not looks_like_template_file(value):
        return value, None
    path = Path(value).expanduser()
    if not path.is_file():
        raise TemplateError(f"{field}: {value!r} looks like a template file, but no such file")
    return path.read_text(encoding="utf-8"), str(path.resolve())


def template_markers(tokenizer: Any, messages: list[dict[str, str]]) -> list[str]:
    """Special-looking markers the template writes for `messages` (not found in their content)
    that the tokenizer does not encode as one token: each costs several tokens per turn and the
    model sees the template's structure through pieces."""
    text = render(tokenizer, messages, add_generation_prompt=True)
    contents = " ".join(str(m.get("content", "")) for m in messages)
    found = sorted({m.group() for m in MARKER.finditer(text)})
    return [
        m
        for m in found
        if m not in contents and len(tokenizer(m, add_special_tokens=False)["input_ids"]) != 1
    ]
