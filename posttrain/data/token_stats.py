"""How a stage's rows tokenize, for `posttrain validate --full`: per section (train, eval) the
rows the stage would drop or cut, and their token counts before any cut (p50/p95/max) against
the section's limits.

Every row goes through the stage's own encoding (`sft_data.tokenize_rows`,
`preference.encode_pairs` / `encode_completions`, `prompts.prompt_ids`), which hands back each
row's uncut counts, after the stage's own split (`loading.seeded_split`), so the counts are the
ones the stage will meet.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from posttrain.data.chat import TemplateError, check_system_role
from posttrain.data.errors import DataError
from posttrain.data.loading import seeded_split
from posttrain.data.preference import PreferenceDataError, encode_completions, encode_pairs
from posttrain.data.prompts import prompt_ids
from posttrain.data.scan import FullPeek
from posttrain.data.sft_data import RowFit, fit_advice, no_fit_text, tokenize_rows
from posttrain.errors import RecipeVerdict

Located = list[tuple[str, Any]]  # (where, checked row)


@dataclass
class StageTokens:
    lines: list[str] = field(default_factory=list)  # `sft train: 900 rows: ...`
    problems: list[str] = field(default_factory=list)  # what would stop the stage
    rows: int = 0  # rows tokenized


def split_sections(where: str, shape: str, cfg: Any, seed: int, peek: FullPeek) -> dict:
    """{"train": rows, "eval": rows or None (not read: a hub dataset not in the cache)} as the
    stage splits them: `eval_path`'s rows, else a seeded share of the training rows. Raises
    RecipeVerdict (the stage's) when nothing is left to train on."""
    if peek.generated is not None:
        rows: Located = [(f"synthetic row {i}", r) for i, r in enumerate(peek.generated)]
    else:
        rows = peek.sources.get("path", [])
    held: Located | None
    if cfg.eval_path:
        train, held = rows, peek.sources.get("eval_path")
    else:
        try:
            train, held = seeded_split(rows, seed, cfg.eval_fraction)
        except RecipeVerdict as exc:  # the stage's own refusal, named by this stage's field
            exc.section = where
            raise
    if shape == "unpaired":  # split over source rows, so both halves of a pair stay together
        train = [(w, r) for w, many in train for r in many]
        held = None if held is None else [(w, r) for w, many in held for r in many]
    return {"train": train, "eval": held}


def stage_tokens(
    where: str, shape: str, section: Any, seed: int, peek: FullPeek, tokenizer: Any
) -> StageTokens:
    """Each section of one stage's rows (`peek`, read by `scan.scan_data`) tokenized by the
    stage's own encoding with `tokenizer` (its template installed): one line per section."""
    out, cfg = StageTokens(), section.data
    try:
        parts = split_sections(where, shape, cfg, seed, peek)
        every = [(w, _conversation(r)) for rows in parts.values() for w, r in rows or []]
        check_system_role(tokenizer, every)
    except (ValueError, TemplateError) as exc:
        out.problems.append(f"{where}.data: {exc}" if isinstance(exc, TemplateError) else str(exc))
        return out
    for name, rows in parts.items():
        if not rows:  # None: a hub dataset the cache does not hold
            text = "no rows" if rows is not None else "read when the stage runs (not cached here)"
            out.lines.append(f"{where} {name}: {text}")
            continue
        try:
            text, problems = MEASURES[shape](tokenizer, cfg, rows, name == "train")
        except (TemplateError, DataError) as exc:  # a row the template or its encoding refuses
            text, problems = "stopped: the stage would fail here too", [f"{where}.data: {exc}"]
        if shape == "prompts" and name == "train":  # online RL: its answers are sampled
            limit = section.rollout.max_new_tokens
            text += f"; completions up to rollout.max_new_tokens {limit}, sampled when it runs"
        out.lines.append(f"{where} {name}: {text}")
        out.problems += problems
        out.rows += len(rows)
    return out


def _conversation(row: dict[str, Any]) -> list[dict[str, Any]]:
    # SFT and prompt rows have messages, pair and labelled rows a prompt.
    return row.get("messages") or row.get("prompt") or []


def counted(n: int, thing: str) -> str:
    """`1 row`, `3 rows`."""
    return f"{n} {thing}{'s' * (n != 1)}"


def spread(lengths: list[int]) -> str:
    """`p50 80, p95 240, max 1020` (nearest rank) of token counts."""
    if not lengths:
        return "no rows"
    ranked = sorted(lengths)
    at = lambda q: ranked[max(0, math.ceil(q * len(ranked)) - 1)]  # noqa: E731
    return f"p50 {at(0.5)}, p95 {at(0.95)}, max {ranked[-1]}"


def _messages(tok: Any, cfg: Any, rows: Located, train: bool) -> tuple[str, list[str]]:
    """An SFT section: rows dropped (no assistant token; too long to keep), truncated, and
    their lengths against max_seq_len, by `tokenize_rows`."""
    fits: list[RowFit] = []
    _, stats = tokenize_rows([r for _, r in rows], tok, cfg, fits)
    unlabeled = sum(f.prompt is None for f in fits)
    cut = sum(f.kept and f.tokens > cfg.max_seq_len for f in fits)
    dropped = stats["dropped"]
    reasons = {"no assistant tokens": unlabeled, "too long to keep": dropped - unlabeled}
    why = ", ".join(f"{n} {reason}" for reason, n in reasons.items() if n)
    what = f"{dropped} dropped ({why})" if dropped else "none dropped"
    what += f", {cut} truncated to {cfg.max_seq_len} tokens"
    text = f"{counted(len(rows), 'row')}: {what}; tokens {spread([f.tokens for f in fits])} "
    text += f"(max_seq_len {cfg.max_seq_len}, on_too_long: {cfg.on_too_long})"
    if dropped or cut:
        text += "; " + "; ".join(fit_advice(fits, cfg))
    problems = [no_fit_text(fits, cfg)] if train and rows and dropped == len(rows) else []
    return text, problems


def _pairs(tok: Any, cfg: Any, rows: Located, train: bool) -> tuple[str, list[str]]:
    return _preference(tok, cfg, rows, train, paired=True)


def _unpaired(tok: Any, cfg: Any, rows: Located, train: bool) -> tuple[str, list[str]]:
    return _preference(tok, cfg, rows, train, paired=False)


def _preference(
    tok: Any, cfg: Any, rows: Located, train: bool, paired: bool
) -> tuple[str, list[str]]:
    """A pair (or labelled-row: not `paired`) section: no-room rows, prompts and responses
    cut, and lengths against max_prompt_len / max_seq_len, by the stage's `encode_pairs`
    (`encode_completions`)."""
    encode, what = (encode_pairs, "pairs") if paired else (encode_completions, "rows")
    uncut: list[tuple[int, int]] = []
    limits = (cfg.max_seq_len, cfg.max_prompt_len, cfg.on_invalid)
    try:
        encoded, stats = encode(tok, [r for _, r in rows], *limits, [w for w, _ in rows], uncut)
    except PreferenceDataError as exc:  # no room for a response, under on_invalid: error
        return f"stopped after {len(uncut)} of {len(rows)} {what}", [str(exc)]
    text = (
        f"{counted(len(rows), what[:-1])}: {stats['no_room']} no room, {stats['prompt_truncated']} prompts "
        f"cut to their last {cfg.max_prompt_len} tokens, {stats['response_truncated']} "
        f"responses cut to fit {cfg.max_seq_len}; prompt tokens {spread([p for p, _ in uncut])} "
        f"(max_prompt_len {cfg.max_prompt_len}), prompt + {'longer ' * paired}response "
        f"{spread([n for _, n in uncut])} (max_seq_len {cfg.max_seq_len})"
    )
    left = [f"no training {what[:-1]} left after validation and encoding"]
    return text, left if train and rows and not encoded else []


def _prompts(tok: Any, cfg: Any, rows: Located, train: bool) -> tuple[str, list[str]]:
    """A prompt section (online RL): prompts cut to their tail, and lengths against
    max_prompt_len, by the stage's `prompt_ids`."""
    lengths = [len(prompt_ids(tok, r["messages"])) for _, r in rows]
    cut = sum(n > cfg.max_prompt_len for n in lengths)
    text = f"{counted(len(rows), 'prompt')}: {cut} cut to their last {cfg.max_prompt_len} tokens; tokens "
    return text + f"{spread(lengths)} (max_prompt_len {cfg.max_prompt_len})", []


# A kind's data shape (posttrain.kinds) -> (tokenizer, data section, rows, is train) ->
# (section text, problems).
MEASURES: dict[str, Callable[[Any, Any, Located, bool], tuple[str, list[str]]]] = {
    "messages": _messages,
    "pairs": _pairs,
    "unpaired": _unpaired,
    "prompts": _prompts,
}
