"""SFT data: read or generate rows, split off a held-out set, tokenize with the chat template."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.agents.tool_calls import format_of_template
from posttrain.data.calculator import calculator_sft_rows
from posttrain.data.chat import (
    IGNORE,
    TemplateError,
    check_system_role,
    encode_chat_uncut,
    fit_chat,
    template_info,
    template_sha256,
)
from posttrain.data.code_tasks import code_sft_rows
from posttrain.data.errors import RowsTooLong
from posttrain.data.guess import guess_sft_rows
from posttrain.data.loading import (
    DataError,
    check_sft_row,
    data_source,
    load_sft_rows,
    read_rows,
    seeded_split,
)
from posttrain.data.synthetic import quickstart_sft_rows
from posttrain.data.tool_rows import has_tools
from posttrain.sections.shared import DataConfig


@dataclass
class SFTData:
    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    train: list[dict[str, list[int]]] = field(default_factory=list)  # tokenized
    eval: list[dict[str, list[int]]] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)


def read_split(cfg: DataConfig, seed: int) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows) in conversational form. The split is a seeded shuffle, so it is
    the same in every process and every run with the same seed."""
    if cfg.synthetic is not None:
        rows = synthetic_rows(cfg)
    else:
        assert cfg.path is not None
        rows = load_sft_rows(data_source(cfg, "path"))
    if cfg.eval_path:
        return rows, load_sft_rows(data_source(cfg, "eval_path"))
    return seeded_split(rows, seed, cfg.eval_fraction)


def synthetic_rows(cfg: DataConfig) -> list[dict]:
    """The rows of `cfg.synthetic`'s task, in the columns a stage keeps: the quickstart's
    messages; the calculator's messages, tools and answer (for exact match); the number
    games' and the code requests' messages."""
    s = cfg.synthetic
    assert s is not None
    if s.task == "guess":
        return [{"messages": r["messages"]} for r in guess_sft_rows(s.n_examples, s.seed)]
    if s.task == "code":
        return [{"messages": r["messages"]} for r in code_sft_rows(s.n_examples, s.seed)]
    if s.task == "calculator":
        keep = ("messages", "tools", "answer")
        return [{k: r[k] for k in keep} for r in calculator_sft_rows(s.n_examples, s.seed)]
    return [{"messages": r["messages"]} for r in quickstart_sft_rows(s.n_examples, s.seed)]


@dataclass(frozen=True)
class RowFit:
    """One row as `tokenize_rows` met it: its token counts before any cut, and its fate."""

    tokens: int  # the whole conversation
    prompt: int | None  # tokens before the first assistant token; None: no assistant token
    kept: bool  # False: dropped (too long under `drop`, or no assistant token left)


def tokenize_rows(
    rows: list[dict], tokenizer: Any, cfg: DataConfig, fits: list[RowFit] | None = None
) -> tuple[list[dict[str, list[int]]], dict[str, int]]:
    """Encoded rows held to `cfg.max_seq_len` and {rows, dropped, at_max_len}; `fits`, when
    given, gets each row's `RowFit` (what `posttrain validate --full` counts)."""
    out, dropped, truncated = [], 0, 0
    for r in rows:
        uncut = encode_chat_uncut(tokenizer, r["messages"], tools=r.get("tools"))
        enc = fit_chat(uncut, cfg.max_seq_len, cfg.on_too_long)
        if fits is not None:
            prompt = next((i for i, x in enumerate(uncut["labels"]) if i and x != IGNORE), None)
            fits.append(RowFit(len(uncut["input_ids"]), prompt, enc is not None))
        if enc is None:
            dropped += 1
            continue
        truncated += len(enc["input_ids"]) == cfg.max_seq_len
        out.append(enc)
    return out, {"rows": len(rows), "dropped": dropped, "at_max_len": truncated}


def length_report(rows: list[dict], tokenizer: Any, cfg: DataConfig) -> str:
    """Why no row of `rows` survived tokenization, in numbers (an error path only)."""
    fits: list[RowFit] = []
    tokenize_rows(rows, tokenizer, cfg, fits)
    return no_fit_text(fits, cfg)


def no_fit_text(fits: list[RowFit], cfg: DataConfig) -> str:
    """The `RowsTooLong` message for training rows of which none was kept (`fits`)."""
    head = f"sft.data: none of the {len(fits)} training rows fits sft.data.max_seq_len"
    head += f" {cfg.max_seq_len} (on_too_long: {cfg.on_too_long})"
    return f"{head}: {'; '.join(fit_advice(fits, cfg))}"


def fit_advice(fits: list[RowFit], cfg: DataConfig) -> list[str]:
    """What max_seq_len would keep the rows of `fits`. A row needs its whole length under
    `on_too_long: drop`, and under `truncate` its prompt (everything before the first assistant
    token: system prompt and tool schemas included) plus one assistant token."""
    labeled = [(f.tokens, f.prompt) for f in fits if f.prompt is not None]
    need = sorted(tokens if cfg.on_too_long == "drop" else prompt + 1 for tokens, prompt in labeled)
    parts = []
    if need:
        longest = max(prompt for _, prompt in labeled)
        p90 = need[min(len(need) - 1, (9 * len(need) + 9) // 10 - 1)]
        parts.append(
            f"their longest prompt before the first assistant token is {longest} tokens; "
            f"max_seq_len {p90} would keep 90% of them, {need[-1]} all"
        )
    if unlabeled := len(fits) - len(labeled):
        parts.append(f"{unlabeled} have no assistant tokens at any length")
    return parts


def located_rows(cfg: DataConfig) -> list[tuple[str, dict]]:
    """(location, checked row) of every row, read again: only an error message needs them."""
    if cfg.synthetic is not None:
        return [(f"sft.data.synthetic row {i}", r) for i, r in enumerate(synthetic_rows(cfg))]
    paths = [p for p in (cfg.path, cfg.eval_path) if p]
    return [(w, check_sft_row(r, w)) for p in paths for w, r in read_rows(p)]


def check_tool_template(cfg: DataConfig, tokenizer: Any, rows: list[dict]) -> None:
    """Refuse tool-use traces under a template that renders no tool calls (Gemma-2, Phi-3.5
    ignore `tool_calls` silently: the model would learn empty turns), in one line naming the
    first such row, the field that sets the template and the template."""
    if not any(has_tools(r) for r in rows) or format_of_template(tokenizer.chat_template):
        return
    where = next(w for w, r in located_rows(cfg) if has_tools(r))
    name = getattr(tokenizer, "name_or_path", "") or "the base model"
    raise DataError(
        f"sft.data: {where} is a tool-use trace (tool_calls, tool messages or tools), but the "
        f"chat template of {name} (sha256 {template_sha256(tokenizer)[:12]}) renders no tool "
        "calls; set ingest.chat_template to one that does (hermes <tool_call>, Llama 3.1 JSON, "
        "Mistral [TOOL_CALLS])"
    )


def prepare(
    cfg: DataConfig,
    tokenizer: Any,
    seed: int,
    rewrite: Callable[[list[dict]], list[dict]] | None = None,
) -> SFTData:
    """The section's rows split, checked and tokenized. `rewrite`: replaces the training rows
    after the split (a teacher's answers in place of the data's: the held-out rows stay)."""
    train_rows, eval_rows = read_split(cfg, seed)
    if rewrite is not None:
        train_rows = rewrite(train_rows)
    check_tool_template(cfg, tokenizer, train_rows + eval_rows)
    has_system = any(m["role"] == "system" for r in train_rows + eval_rows for m in r["messages"])
    if has_system and not template_info(tokenizer).system_role:
        try:
            check_system_role(tokenizer, [(w, r["messages"]) for w, r in located_rows(cfg)])
        except TemplateError as exc:
            raise DataError(f"sft.data: {exc}") from None
    data = SFTData(train_rows, eval_rows)
    data.train, tstats = tokenize_rows(train_rows, tokenizer, cfg)
    data.eval, estats = tokenize_rows(eval_rows, tokenizer, cfg)
    if not data.train:
        raise RowsTooLong(length_report(train_rows, tokenizer, cfg))
    data.stats = {f"train_{k}": v for k, v in tstats.items()} | {
        f"eval_{k}": v for k, v in estats.items()
    }
    return data


def write_splits(out_dir: Path, train_rows: list[dict], eval_rows: list[dict]) -> None:
    """Record exactly what a stage trained on and held out: data/{train,eval}.jsonl."""
    write_rows(out_dir / "data" / "train.jsonl", train_rows)
    write_rows(out_dir / "data" / "eval.jsonl", eval_rows)


def saved_split(out_dir: Path, split: str) -> list[dict]:
    """The rows `write_splits` recorded for `split` ("train" or "eval"); [] for an empty split."""
    text = (out_dir / "data" / f"{split}.jsonl").read_text(encoding="utf-8")
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def write_rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
