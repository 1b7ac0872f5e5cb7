"""Preference data: read (prompt, chosen, rejected) rows, normalise, validate, tokenize pairs.

Accepted row formats (the common ones on the hub):
  (a) {"prompt": str, "chosen": str, "rejected": str}
  (b) {"prompt": [messages], "chosen": [messages] | str, "rejected": [messages] | str}
  (c) {"chosen": [full conversation], "rejected": [full conversation]}  (implicit prompt: the
      longest common prefix of messages; the two must then differ only in a final assistant reply)
Every row is normalised to {"prompt": [{role, content}, ...], "chosen": str, "rejected": str},
the response being the text of one final assistant turn.

Unpaired feedback (KTO) reads {"prompt", "completion", "label": bool} rows, and paired rows as
they are, each expanded to a desirable and an undesirable row (`check_unpaired_row`).

A bad row raises `PreferenceDataError` (a `DataError`) naming `<file>:<line>` or `<file> row <n>`
and the problem; its `.reason` is one of REASONS, which is what `on_invalid: skip` counts.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn

from posttrain.data.chat import IGNORE, TemplateError, assistant_char_spans
from posttrain.data.loading import ROLES, DataError, DataSource, clean_message, read_rows
from posttrain.data.synthetic import SYSTEM_PROMPT, quickstart_triples

log = logging.getLogger(__name__)

Messages = list[dict[str, str]]
OnInvalid = Literal["error", "skip"]

REASONS = (
    "wrong_type",  # row or field of the wrong type, bad role
    "missing_field",  # no chosen / rejected, or no prompt where one is needed
    "empty_response",  # chosen or rejected is blank
    "identical",  # chosen == rejected: no preference to learn
    "no_user_turn",  # the prompt has no non-empty user message
    "prompt_end_not_user",  # the prompt ends with a system/assistant turn
    "not_final_reply",  # chosen and rejected differ in more than one final assistant reply
    "no_room",  # (tokenization) the prompt leaves no room for a response token
    "bad_label",  # (unpaired rows) `label` missing or not a boolean
)


class PreferenceDataError(DataError):
    """A bad preference row; `reason` (one of REASONS) is what skip mode counts."""

    def __init__(self, where: str, reason: str, problem: str) -> None:
        assert reason in REASONS, reason
        super().__init__(f"{where}: {problem}")
        self.reason = reason


def _fail(where: str, reason: str, problem: str) -> NoReturn:
    raise PreferenceDataError(where, reason, problem)


def _messages(value: Any, field: str, where: str) -> Messages:
    """A validated copy of a message list, keeping role, content and an assistant turn's
    reasoning_content (the chat template keeps or drops it)."""
    if not isinstance(value, list) or not value:
        _fail(where, "wrong_type", f"'{field}' must be a non-empty list of {{role, content}}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            _fail(where, "wrong_type", f"{field}[{i}] must be an object, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            _fail(where, "wrong_type", f"{field}[{i}].role must be one of {ROLES}, got {role!r}")
        if not isinstance(content, str):
            _fail(
                where,
                "wrong_type",
                f"{field}[{i}].content must be a string, got {type(content).__name__}",
            )
        reasoning = m.get("reasoning_content")
        if reasoning is not None and (role != "assistant" or not isinstance(reasoning, str)):
            _fail(
                where,
                "wrong_type",
                f"{field}[{i}].reasoning_content must be a string on an assistant message",
            )
        out.append(clean_message(m))
    return out


def _as_conversation(value: Any, field: str, where: str) -> Messages:
    # A bare string response is one assistant turn.
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    _string_or_list(value, field, where)
    return _messages(value, field, where)


def prompt_messages(prompt: Any, where: str) -> Messages:
    """A prompt given as text (one user turn) or as messages, checked."""
    _string_or_list(prompt, "prompt", where)
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return _messages(prompt, "prompt", where)


def _string_or_list(value: Any, field: str, where: str) -> None:
    if not isinstance(value, str | list):
        _fail(
            where,
            "wrong_type",
            f"'{field}' must be a string or a list of messages, got {type(value).__name__}",
        )


def _split_final_replies(
    chosen: Messages, rejected: Messages, where: str
) -> tuple[Messages, str, str]:
    """(shared prompt, chosen reply, rejected reply) from two full conversations."""
    if chosen == rejected:
        _fail(where, "identical", "chosen and rejected are identical: no preference to learn")
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    for field, rest in (("chosen", chosen[n:]), ("rejected", rejected[n:])):
        if rest and "reasoning_content" in rest[-1]:
            # A pair side is one reply string; reasoning kept apart would be lost silently.
            _fail(
                where,
                "wrong_type",
                f"'{field}': reasoning_content on the final reply is not supported in preference "
                "rows; write it into content as <think>...</think> (the template keeps or strips it)",
            )
        if len(rest) != 1 or rest[0]["role"] != "assistant":
            roles = [m["role"] for m in rest]
            _fail(
                where,
                "not_final_reply",
                f"chosen and rejected must differ only in one final assistant reply; after the "
                f"{n} shared messages, '{field}' continues with roles {roles}",
            )
    return chosen[:n], chosen[n]["content"], rejected[n]["content"]


def check_prompt_end(msgs: Messages, where: str) -> None:
    """A prompt needs a non-empty user turn and must end with one (the response answers it)."""
    if not any(m["role"] == "user" and m["content"].strip() for m in msgs):
        _fail(where, "no_user_turn", "the prompt has no non-empty user turn")
    if msgs[-1]["role"] != "user":
        _fail(
            where,
            "prompt_end_not_user",
            f"the prompt must end with a user turn (the response answers it), "
            f"it ends with {msgs[-1]['role']!r}",
        )


def check_preference_row(row: Any, where: str) -> dict[str, Any]:
    """Validate one preference row (format a, b or c) and return it normalised to
    {"prompt": [messages], "chosen": str, "rejected": str}. Raises PreferenceDataError."""
    if not isinstance(row, dict):
        _fail(where, "wrong_type", f"row must be a JSON object, got {type(row).__name__}")
    # None counts as absent: Parquet and saved datasets fill missing columns with None.
    for key in ("chosen", "rejected"):
        if row.get(key) is None:
            _fail(where, "missing_field", f"missing '{key}' (got keys {sorted(row)})")
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    if prompt is None:
        if isinstance(chosen, str) or isinstance(rejected, str):
            _fail(
                where,
                "missing_field",
                "missing 'prompt': without one, 'chosen' and 'rejected' must be full "
                "conversations (lists of messages)",
            )
        msgs, chosen_text, rejected_text = _split_final_replies(
            _messages(chosen, "chosen", where), _messages(rejected, "rejected", where), where
        )
    else:
        msgs = prompt_messages(prompt, where)
        if isinstance(chosen, str) and isinstance(rejected, str):
            chosen_text, rejected_text = chosen, rejected
        else:
            # Lists may hold more than the reply (e.g. a repeated prompt tail): compare whole
            # conversations so only the final, differing assistant turn is the response.
            msgs, chosen_text, rejected_text = _split_final_replies(
                msgs + _as_conversation(chosen, "chosen", where),
                msgs + _as_conversation(rejected, "rejected", where),
                where,
            )
    for field, text in (("chosen", chosen_text), ("rejected", rejected_text)):
        if not text.strip():
            _fail(where, "empty_response", f"'{field}' is empty, nothing to compare")
    if chosen_text == rejected_text:
        _fail(where, "identical", "chosen and rejected are identical: no preference to learn")
    check_prompt_end(msgs, where)
    return {"prompt": msgs, "chosen": chosen_text, "rejected": rejected_text}


def check_unpaired_row(row: Any, where: str) -> list[dict[str, Any]]:
    """Validate one row for an unpaired-feedback stage (KTO) and return it as labelled rows
    {"prompt": [messages], "completion": str, "desirable": bool, "pair": str | None}.

    Accepted: {"prompt", "completion", "label": true | false} (prompt as text or messages,
    completion as text or messages ending with the assistant reply; earlier completion messages
    join the prompt), giving one row; or any paired row `check_preference_row` accepts, expanded to
    two rows (chosen -> desirable, rejected -> undesirable) that share `pair` = `where`, so a
    held-out split can keep them together and score pair accuracy. Raises PreferenceDataError.
    """
    if not isinstance(row, dict):
        _fail(where, "wrong_type", f"row must be a JSON object, got {type(row).__name__}")
    if "completion" not in row and "label" not in row:
        return expand_pair(check_preference_row(row, where), where)
    label = row.get("label")
    if label is None:
        _fail(where, "bad_label", "missing 'label' (true = desirable, false = undesirable)")
    if not isinstance(label, bool):
        _fail(where, "bad_label", f"'label' must be true or false, got {label!r}")
    prompt, completion = row.get("prompt"), row.get("completion")
    for key, value in (("prompt", prompt), ("completion", completion)):
        if value is None:
            _fail(where, "missing_field", f"missing '{key}' (got keys {sorted(row)})")
        _string_or_list(value, key, where)
    msgs = prompt_messages(prompt, where)
    reply = _as_conversation(completion, "completion", where)
    if reply[-1]["role"] != "assistant":
        _fail(where, "not_final_reply", "'completion' must end with an assistant message")
    if "reasoning_content" in reply[-1]:
        _fail(
            where,
            "wrong_type",
            "'completion': reasoning_content on the final reply is not supported; write it into "
            "content as <think>...</think> (the template keeps or strips it)",
        )
    msgs, text = msgs + reply[:-1], reply[-1]["content"]
    if not text.strip():
        _fail(where, "empty_response", "'completion' is empty, nothing to judge")
    check_prompt_end(msgs, where)
    return [{"prompt": msgs, "completion": text, "desirable": label, "pair": None}]


def _check_on_invalid(on_invalid: str) -> None:
    if on_invalid not in ("error", "skip"):
        raise ValueError(f"on_invalid must be 'error' or 'skip', got {on_invalid!r}")


def read_checked_rows(
    path: str | Path | DataSource,
    check: Callable[[Any, str], Any],
    on_invalid: OnInvalid = "error",
    what: str = "preference",
) -> tuple[list[tuple[str, Any]], dict[str, int]]:
    """(location, checked row) pairs and {reason: rows dropped}, `check(raw, where)` raising
    PreferenceDataError for a bad row.

    "error": the first bad row raises. "skip": bad rows are dropped and counted by reason (the
    first of each reason is logged with its location). Unreadable files and invalid JSON lines
    raise in both modes: they are not rows. Raises DataError when no valid row is left.
    """
    _check_on_invalid(on_invalid)
    out, dropped = [], Counter()
    for where, raw in read_rows(path):
        try:
            out.append((where, check(raw, where)))
        except PreferenceDataError as exc:
            if on_invalid == "error":
                raise
            if not dropped[exc.reason]:
                log.warning("skipping invalid %s rows, first %s: %s", what, exc.reason, exc)
            dropped[exc.reason] += 1
    if not out:
        name = path.path if isinstance(path, DataSource) else path
        raise DataError(f"{name}: no valid {what} row (dropped: {dict(dropped)})")
    return out, dict(dropped)


def read_preference_rows(
    path: str | Path | DataSource, on_invalid: OnInvalid = "error"
) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, int]]:
    """(location, normalised row) pairs and {reason: rows dropped}; see `read_checked_rows`."""
    return read_checked_rows(path, check_preference_row, on_invalid, "preference")


def read_unpaired_rows(
    path: str | Path | DataSource, on_invalid: OnInvalid = "error"
) -> tuple[list[tuple[str, list[dict[str, Any]]]], dict[str, int]]:
    """(location, [labelled rows]) per source row and {reason: rows dropped}; see
    `check_unpaired_row` and `read_checked_rows`."""
    return read_checked_rows(path, check_unpaired_row, on_invalid, "unpaired feedback")


def _tokenize_side(
    tokenizer: Any, prompt: Messages, reply: str
) -> tuple[list[int], int, list[bool]]:
    """(token ids, number of prompt tokens, is-response flag per token) for prompt + reply."""
    text, spans = assistant_char_spans(
        tokenizer, prompt + [{"role": "assistant", "content": reply}]
    )
    start, end = spans[-1]  # the final assistant turn, its end-of-turn text included
    # The template already holds every special token it wants; adding more would double BOS/EOS.
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    n_prompt = next((t for t, (s, _) in enumerate(offsets) if s >= start), len(offsets))
    return enc["input_ids"], n_prompt, [start <= s < end for s, _ in offsets]


def keep_prompt_tail(tokenizer: Any, prompt_ids: list[int], max_prompt_len: int) -> list[int]:
    """A prompt cut to its last max_prompt_len tokens: the end is the question being answered.
    A leading BOS is kept too, since models are trained to always see it at position 0."""
    if len(prompt_ids) <= max_prompt_len:
        return prompt_ids
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and prompt_ids[0] == bos and max_prompt_len >= 2:
        return [bos] + prompt_ids[len(prompt_ids) - max_prompt_len + 1 :]
    return prompt_ids[len(prompt_ids) - max_prompt_len :]


def encode_reply(tokenizer: Any, prompt: Messages, reply: str, max_prompt_len: int) -> list[int]:
    """Token ids of prompt + one assistant reply exactly as a pair side is encoded (the reply's
    end-of-turn text included, the prompt cut to its tail): what a reward model trained on these
    pairs scores."""
    ids, n_prompt, _ = _tokenize_side(tokenizer, prompt, reply)
    return keep_prompt_tail(tokenizer, ids[:n_prompt], max_prompt_len) + ids[n_prompt:]


# One row's token counts before any cut: (prompt, prompt + response; a pair's longer side).
Uncut = tuple[int, int]
# What encoding one row gives: (encoded or None for no room, prompt truncated, response
# truncated, its Uncut counts).
Encoded = tuple[dict[str, Any] | None, bool, bool, Uncut]


def _encode_pair(tokenizer: Any, row: dict[str, Any], max_len: int, max_prompt_len: int) -> Encoded:
    """(encoded pair or None for no room, prompt was truncated, a response was truncated,
    uncut counts)."""
    sides = {k: _tokenize_side(tokenizer, row["prompt"], row[k]) for k in ("chosen", "rejected")}
    (c_ids, c_np, _), (r_ids, r_np, _) = sides["chosen"], sides["rejected"]
    prompt_ids = c_ids[:c_np]
    uncut = (c_np, max(len(c_ids), len(r_ids)))
    if prompt_ids != r_ids[:r_np]:
        raise TemplateError(
            "the prompt tokenizes differently before the chosen and the rejected response (a "
            "token spans the end of the generation prompt); use a template whose generation "
            "prompt ends at a token boundary"
        )
    prompt_truncated = len(prompt_ids) > max_prompt_len
    prompt_ids = keep_prompt_tail(tokenizer, prompt_ids, max_prompt_len)
    if len(prompt_ids) >= max_len:
        return None, prompt_truncated, False, uncut
    out: dict[str, Any] = {"prompt_len": len(prompt_ids)}
    response_truncated = False
    for key, (ids, n_prompt, is_response) in sides.items():
        rest = ids[n_prompt:]
        labels = [i if r else IGNORE for i, r in zip(rest, is_response[n_prompt:], strict=True)]
        room = max_len - len(prompt_ids)
        response_truncated |= len(rest) > room
        out[f"{key}_ids"] = prompt_ids + rest[:room]
        out[f"{key}_labels"] = [IGNORE] * len(prompt_ids) + labels[:room]
        if all(x == IGNORE for x in labels[:room]):
            return None, prompt_truncated, response_truncated, uncut
    return out, prompt_truncated, response_truncated, uncut


def _encode_completion(
    tokenizer: Any, row: dict[str, Any], max_len: int, max_prompt_len: int
) -> Encoded:
    """As `_encode_pair`, for one labelled row encoded as one side of a pair is: the prompt's
    tail kept, the response cut to fit max_len, labels IGNORE on the prompt."""
    ids, n_prompt, is_response = _tokenize_side(tokenizer, row["prompt"], row["completion"])
    prompt_ids = keep_prompt_tail(tokenizer, ids[:n_prompt], max_prompt_len)
    rest = ids[n_prompt:][: max(0, max_len - len(prompt_ids))]
    labels = [t if r else IGNORE for t, r in zip(rest, is_response[n_prompt:], strict=False)]
    uncut = (n_prompt, len(ids))
    if all(x == IGNORE for x in labels):
        return None, False, False, uncut
    enc = {
        "ids": prompt_ids + rest,
        "labels": [IGNORE] * len(prompt_ids) + labels,
        "prompt_len": len(prompt_ids),
        "desirable": row["desirable"],
        "pair": row["pair"],
    }
    return enc, n_prompt > max_prompt_len, len(ids) - n_prompt > len(rest), uncut


def _encode_rows(
    encode_one: Callable[..., Encoded],
    count: str,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    max_len: int,
    max_prompt_len: int,
    on_invalid: OnInvalid,
    wheres: Sequence[str] | None,
    uncut: list[Uncut] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """(encoded rows, stats {count: rows in, "no_room", "prompt_truncated",
    "response_truncated"}). A no-room row raises PreferenceDataError naming its location
    (`wheres[i]`, "row i" without) when on_invalid == "error", and is dropped otherwise.
    `uncut`, when given, gets each row's token counts before any cut."""
    _check_on_invalid(on_invalid)
    assert wheres is None or len(wheres) == len(rows)
    out, stats = [], Counter({count: len(rows), "no_room": 0, "prompt_truncated": 0})
    stats["response_truncated"] = 0
    for i, row in enumerate(rows):
        enc, prompt_cut, response_cut, counts = encode_one(tokenizer, row, max_len, max_prompt_len)
        if uncut is not None:
            uncut.append(counts)
        if enc is None:
            if on_invalid == "error":
                _fail(
                    wheres[i] if wheres is not None else f"row {i}",
                    "no_room",
                    f"the prompt (kept to max_prompt_len={max_prompt_len} tokens) leaves no room "
                    f"for a response within max_len={max_len}; set max_prompt_len < max_len",
                )
            stats["no_room"] += 1
            continue
        stats["prompt_truncated"] += prompt_cut
        stats["response_truncated"] += response_cut
        out.append(enc)
    return out, dict(stats)


def encode_completions(
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    max_len: int,
    max_prompt_len: int,
    on_invalid: OnInvalid = "error",
    wheres: Sequence[str] | None = None,
    uncut: list[Uncut] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Encode labelled rows (`check_unpaired_row`) as one side of a pair is -> (encoded, stats):
    {"ids", "labels": [T] lists, "prompt_len": int, "desirable": bool, "pair": str | None};
    stats, no-room rows and `uncut` as in `_encode_rows`."""
    args = (max_len, max_prompt_len, on_invalid, wheres, uncut)
    return _encode_rows(_encode_completion, "rows", tokenizer, rows, *args)


def encode_pair(
    tokenizer: Any, row: dict[str, Any], max_len: int, max_prompt_len: int
) -> dict[str, Any] | None:
    """Tokenize one normalised row -> {"chosen_ids", "chosen_labels", "rejected_ids",
    "rejected_labels": [T_c] / [T_r] lists, "prompt_len": int}, or None ("no_room").

    Each side is the prompt messages plus the reply rendered through the chat template, tokenized
    with add_special_tokens=False. Labels equal the ids on the final assistant turn (the response
    and its end-of-turn token, so the model is also preferred to stop) and IGNORE elsewhere; both
    sides share the same first `prompt_len` tokens. A prompt longer than max_prompt_len keeps its
    last max_prompt_len tokens (plus a leading BOS); then each response is cut so the sequence
    fits max_len. None when the prompt leaves no response token, which only happens when
    max_prompt_len >= max_len.
    """
    return _encode_pair(tokenizer, row, max_len, max_prompt_len)[0]


def encode_pairs(
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    max_len: int,
    max_prompt_len: int,
    on_invalid: OnInvalid = "error",
    wheres: Sequence[str] | None = None,
    uncut: list[Uncut] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Encode normalised rows with `encode_pair` -> (encoded pairs, stats); see `_encode_rows`
    (`wheres` from `read_preference_rows`)."""
    args = (max_len, max_prompt_len, on_invalid, wheres, uncut)
    return _encode_rows(_encode_pair, "pairs", tokenizer, rows, *args)


def quickstart_preference_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """n normalised rows from the quickstart tasks: chosen = the correct answer, rejected = a
    plausible wrong one. Every third prompt has a system turn, as in the SFT data; prompts come in
    both formats (a) and (b) before normalisation, so both paths are exercised."""
    rows = []
    for i, (_task, prompt, correct, wrong) in enumerate(quickstart_triples(n, seed)):
        if i % 3 == 0:
            raw: dict[str, Any] = {
                "prompt": [
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": prompt},
                ],
                "chosen": [{"role": "assistant", "content": correct}],
                "rejected": [{"role": "assistant", "content": wrong}],
            }
        else:
            raw = {"prompt": prompt, "chosen": correct, "rejected": wrong}
        rows.append(check_preference_row(raw, f"quickstart row {i}"))
    return rows


def expand_pair(row: dict[str, Any], pair: str) -> list[dict[str, Any]]:
    """A normalised pair as two labelled rows (chosen desirable, rejected undesirable) sharing
    the pair id `pair`: the unpaired form `check_unpaired_row` returns."""
    return [
        {"prompt": row["prompt"], "completion": row[side], "desirable": ok, "pair": pair}
        for side, ok in (("chosen", True), ("rejected", False))
    ]


def quickstart_unpaired_rows(n: int, seed: int) -> list[list[dict[str, Any]]]:
    """`quickstart_preference_rows` expanded, per pair: [desirable row, undesirable row]."""
    return [
        expand_pair(row, f"synthetic row {i}")
        for i, row in enumerate(quickstart_preference_rows(n, seed))
    ]
