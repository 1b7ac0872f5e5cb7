"""Chat-template formatting and the assistant-token loss mask.

The mask comes from rendering the conversation prefix before and after each assistant turn and
keeping the tokens whose characters fall between the two. It works for any template that renders
prefixes consistently, needs no `{% generation %}` markers, and trains on the turn's end-of-turn
token so the model learns to stop.
"""

from __future__ import annotations

import hashlib
from typing import Any

IGNORE = -100  # label value cross-entropy skips


class TemplateError(ValueError):
    pass


def render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def assistant_char_spans(
    tokenizer: Any, messages: list[dict[str, str]]
) -> tuple[str, list[tuple[int, int]]]:
    """Full rendered text and the [start, end) character span of each assistant turn."""
    full = render(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        upto = render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (full.startswith(before) and full.startswith(upto)) or len(upto) <= len(before):
            raise TemplateError(
                "the chat template does not render conversation prefixes consistently, so the "
                "assistant tokens cannot be located; install a template that does (ingest.chat_template)"
            )
        spans.append((len(before), len(upto)))
    return full, spans


def encode_chat(
    tokenizer: Any, messages: list[dict[str, str]], max_len: int, on_too_long: str = "truncate"
) -> dict[str, list[int]] | None:
    """Tokenize one conversation -> {"input_ids": [T], "labels": [T]}, labels = IGNORE outside
    assistant turns. Returns None when the row is too long and on_too_long == "drop", or when
    truncation leaves no assistant token."""
    text, spans = assistant_char_spans(tokenizer, messages)
    # The template already contains every special token it wants; adding more would double BOS.
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = enc["input_ids"]
    labels = [IGNORE] * len(ids)
    for t, (start, _end) in enumerate(enc["offset_mapping"]):
        if any(s <= start < e for s, e in spans):
            labels[t] = ids[t]
    if len(ids) > max_len:
        if on_too_long == "drop":
            return None
        ids, labels = ids[:max_len], labels[:max_len]
    if all(x == IGNORE for x in labels[1:]):
        return None
    return {"input_ids": ids, "labels": labels}


def prompt_text(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, str]:
    """(templated prompt up to the last assistant turn, that turn's reference content)."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return render(tokenizer, messages[:last], add_generation_prompt=True), messages[last]["content"]


def template_sha256(tokenizer: Any) -> str:
    """Identity of the chat template a stage formatted its text with (recorded in manifests)."""
    return hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()
