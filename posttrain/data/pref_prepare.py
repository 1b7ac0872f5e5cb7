"""Preference pairs for a training stage: read or generate, split, check the template, encode."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from posttrain.data.chat import (
    TemplateError,
    check_system_role,
    read_template,
    template_sha256,
)
from posttrain.data.loading import DataSource, data_source, seeded_split
from posttrain.data.preference import (
    encode_completions,
    encode_pairs,
    quickstart_preference_rows,
    quickstart_unpaired_rows,
    read_preference_rows,
    read_unpaired_rows,
)
from posttrain.errors import RecipeVerdict
from posttrain.sections.shared import PreferenceDataConfig, TemplateGuard


@dataclass
class PreferenceData:
    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    train: list[dict[str, Any]] = field(default_factory=list)  # encoded pairs
    eval: list[dict[str, Any]] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)


def guard_template(
    tokenizer: Any,
    recorded_sha: str | None,
    stage: str,
    guard: TemplateGuard,
    parent: str = "its parent",
) -> str:
    """Install the stage's template override, if any, and refuse a template that differs from
    the one `parent` (the policy it starts from, or its reward model) recorded, unless the
    recipe says so on purpose. Returns the sha256 of the template in use."""
    if guard.chat_template:
        tokenizer.chat_template, _ = read_template(guard.chat_template, f"{stage}.chat_template")
    sha = template_sha256(tokenizer)
    if recorded_sha and sha != recorded_sha and not guard.allow_template_change:
        raise TemplateError(
            f"{stage}: the chat template differs from the one recorded by {parent!r} (sha256 "
            f"{sha[:12]} vs {recorded_sha[:12]}); formatting data with another template than "
            f"the model learnt silently costs accuracy. Remove {stage}.chat_template or set "
            f"{stage}.allow_template_change: true"
        )
    return sha


Located = list[tuple[str, Any]]  # (where, row) pairs


def read_and_split(
    cfg: Any,
    seed: int,
    read: Callable[[DataSource, str], tuple[Located, dict[str, int]]],
    synthetic: Callable[[int, int], list[Any]],
) -> tuple[Located, Located, dict[str, int]]:
    """(train, held-out, {reason: rows dropped}) for a data section with path / synthetic /
    eval_path / eval_fraction / on_invalid (and the DataSourceFields: split, revision, subset,
    columns). `read(source, on_invalid)` returns located rows;
    `synthetic(n, seed)` generates rows. Without eval_path the held-out share is a seeded split."""
    if cfg.synthetic is not None:
        rows = synthetic(cfg.synthetic.n_examples, cfg.synthetic.seed)
        located, dropped = [(f"synthetic row {i}", r) for i, r in enumerate(rows)], {}
    else:
        assert cfg.path is not None
        located, dropped = read(data_source(cfg, "path"), cfg.on_invalid)
    if cfg.eval_path:
        held, more = read(data_source(cfg, "eval_path"), cfg.on_invalid)
        dropped = {k: dropped.get(k, 0) + more.get(k, 0) for k in {*dropped, *more}}
        return located, held, dropped
    return (*seeded_split(located, seed, cfg.eval_fraction), dropped)


def prepare(cfg: PreferenceDataConfig, tokenizer: Any, seed: int) -> PreferenceData:
    train, held, dropped = read_and_split(
        cfg, seed, read_preference_rows, quickstart_preference_rows
    )
    check_system_role(tokenizer, [(w, r["prompt"]) for w, r in train + held])
    data = PreferenceData([r for _, r in train], [r for _, r in held])
    return _encode(data, encode_pairs, "pair", cfg, tokenizer, train, held, dropped)


def _encode(
    data: PreferenceData,
    encode: Callable[..., tuple[list[dict[str, Any]], dict[str, int]]],
    what: str,
    cfg: PreferenceDataConfig,
    tokenizer: Any,
    train: Located,
    held: Located,
    dropped: dict[str, int],
) -> PreferenceData:
    """`data` with both splits encoded and its stats: dropped, train and eval counts."""
    limits = (cfg.max_seq_len, cfg.max_prompt_len, cfg.on_invalid)
    data.train, tstats = encode(tokenizer, data.train_rows, *limits, [w for w, _ in train])
    data.eval, estats = encode(tokenizer, data.eval_rows, *limits, [w for w, _ in held])
    if not data.train:
        raise RecipeVerdict("data", _none_left(what, cfg, tstats, dropped))
    data.stats = (
        {f"dropped_{k}": v for k, v in dropped.items()}
        | {f"train_{k}": v for k, v in tstats.items()}
        | {f"eval_{k}": v for k, v in estats.items()}
    )
    return data


def _none_left(
    what: str, cfg: PreferenceDataConfig, encoded: dict[str, int], dropped: dict[str, int]
) -> str:
    """Why no training row is left, by count: encoding dropped every row the split kept (only
    `no_room` rows, and only under `on_invalid: skip`: validation keeps max_prompt_len below
    max_seq_len, so it takes a template whose response tokens carry no label), after what
    reading dropped, by reason."""
    text = (
        f"none of the {encoded[f'{what}s']} training {what}s is left after encoding: "
        f"{encoded.get('no_room', 0)} have no response token within max_seq_len "
        f"{cfg.max_seq_len} (prompts kept to max_prompt_len {cfg.max_prompt_len})"
    )
    if read_out := {k: v for k, v in dropped.items() if v}:
        text += f"; reading dropped {sum(read_out.values())} more rows: {read_out}"
    return f"{text}; set on_invalid: error to stop at the first such row, named by file and line"


def prepare_unpaired(cfg: PreferenceDataConfig, tokenizer: Any, seed: int) -> PreferenceData:
    """Labelled single completions (unpaired feedback, KTO): `train`/`eval` hold
    `encode_completions` rows. Paired sources are expanded before encoding, and the held-out
    split is drawn over source rows, so both halves of a pair land on the same side."""
    train, held, dropped = read_and_split(cfg, seed, read_unpaired_rows, quickstart_unpaired_rows)
    train = [(w, r) for w, rows in train for r in rows]
    held = [(w, r) for w, rows in held for r in rows]
    check_system_role(tokenizer, [(w, r["prompt"]) for w, r in train + held])
    data = PreferenceData([r for _, r in train], [r for _, r in held])
    data = _encode(data, encode_completions, "row", cfg, tokenizer, train, held, dropped)
    desirable = sum(r["desirable"] for r in data.train)
    data.stats |= {"train_desirable": desirable, "train_undesirable": len(data.train) - desirable}
    return data
