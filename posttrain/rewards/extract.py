"""Text helpers shared by the built-in reward functions: the completion's text, and its final answer.

A completion is either a plain string (TRL's standard form) or a list of chat messages
(`[{"role": "assistant", "content": text}]`, the conversational form); `completion_text` reads
both. The extractors pull a final answer out of free text in the forms models and datasets use:
GSM8K's `#### 72`, LaTeX's `\\boxed{...}`, an `<answer>...</answer>` tag, or the last number.
Each returns `None` when the form is absent; none of them raises on odd text.
"""

from __future__ import annotations

import re

__all__ = ["boxed", "completion_text", "hash_answer", "last_number", "tag"]

# Unicode minus (U+2212) and the other dashes models print in front of numbers.
_MINUS = str.maketrans({"\u2212": "-", "\u2013": "-", "\u2012": "-"})


def completion_text(completion: str | list | dict | None) -> str:
    """The text of one completion; of a list of messages, the last assistant message's (a
    multi-turn episode's final answer, not its tool calls and results), or all contents joined
    when no message is the assistant's."""
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return _content_text(completion.get("content"))
    if isinstance(completion, list):
        messages = [m for m in completion if isinstance(m, dict)]
        answers = [m for m in messages if m.get("role") == "assistant"]
        if answers:
            return _content_text(answers[-1].get("content"))
        return "".join(_content_text(m.get("content")) for m in messages)
    raise TypeError(
        f"a completion is a string or a list of chat messages, got {type(completion).__name__}"
    )


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multimodal parts: keep the text ones
        return "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return ""


def _drop_number_commas(text: str) -> str:
    # "1,234,567" -> "1234567"; a list "1, 2" keeps its comma (a space follows it).
    return re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)


def hash_answer(text: str) -> str | None:
    """GSM8K's final answer: the first line after the last `####` (not a model's sign-off on
    later lines), commas in numbers removed: `"... #### 1,234\\n"` -> `"1234"`."""
    _, sep, after = text.rpartition("####")
    if not sep:
        return None
    lines = [line.strip() for line in after.strip().splitlines()]
    answer = _drop_number_commas(lines[0]) if lines else ""
    return answer or None


_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


def boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` or `\\fbox{...}`, nested braces kept whole; None
    for a last box left open (a truncated reply never stated its answer)."""
    starts = [m.end() for m in _BOX_RE.finditer(text)]
    if not starts:
        return None
    start = starts[-1]
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{" and text[i - 1] != "\\":
            depth += 1
        elif text[i] == "}" and text[i - 1] != "\\":
            depth -= 1
            if depth == 0:
                return text[start:i].strip()
    return None


def tag(text: str, name: str = "answer") -> str | None:
    """The stripped content of the last `<name>...</name>` (across lines)."""
    n = re.escape(name)
    found = re.findall(rf"<{n}>(.*?)</{n}>", text, flags=re.DOTALL)
    return found[-1].strip() if found else None


# An optional sign (not a hyphen inside a word or after a digit), then 1,234 or 12 with an
# optional decimal part, or .5; then an optional /denominator (3/4).
_NUMBER_RE = re.compile(
    r"(?:(?<![\w)\]])-)?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)(?:/\d+(?!\.\d))?"
)


def last_number(text: str) -> str | None:
    """The last integer, decimal or fraction in the text, normalised: `-1,234.5` -> `-1234.5`
    (a unicode minus is a sign; a sentence's full stop is not a decimal point: "is 72.")."""
    found = _NUMBER_RE.findall(text.translate(_MINUS))
    return found[-1].replace(",", "") if found else None
