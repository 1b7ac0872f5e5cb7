"""A refused recipe's errors point at the fix: the field probably meant (spelling, the names of
TRL/axolotl/LLaMA-Factory, one level up or down), where links go, the value found in plain
words, the YAML line, and a fix line that fits the problem (issue 29)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from flows.cli import load_or_report
from posttrain.config.aliases import ALIASES, STAGE
from posttrain.config.error_text import shown
from posttrain.config.field_hints import exists
from posttrain.config.loader import RecipeError, apply_overrides, validate_recipe
from posttrain.kinds import graph_kinds

ROOT = Path(__file__).resolve().parents[1]
PREFS = {"synthetic": {}}
MINIMAL = {
    "ingest": {"source": "from_config"},
    "sft": {"data": {"synthetic": {}}},
    "dpo": {"data": PREFS},
}


def errors_of(overrides: list[str], data: dict | None = None) -> list[str]:
    with pytest.raises(RecipeError) as exc:
        validate_recipe(apply_overrides(data or MINIMAL, overrides))
    return exc.value.errors


@pytest.mark.parametrize(
    ("override", "error"),
    [
        # An alias from docs/migrating.md (TRL's learning_rate).
        (
            "sft.optim.learning_rate=1e-4",
            "sft.optim.learning_rate: unknown field; did you mean sft.optim.lr?",
        ),
        # Spelling.
        ("sft.max_step=3", "sft.max_step: unknown field; did you mean sft.max_steps?"),
        ("sfft.epochs=1", "sfft: unknown section; did you mean sft?"),
        # The same name one level down, or up.
        ("sft.lr=1e-4", "sft.lr: unknown field; did you mean sft.optim.lr?"),
        (
            "sft.optim.max_steps=3",
            "sft.optim.max_steps: unknown field; did you mean sft.max_steps?",
        ),
        ("sft.lora_alpha=8", "sft.lora_alpha: unknown field; did you mean sft.lora.alpha?"),
        # The section's name joined to the key is another trainer's name (TRL's lora_rank).
        ("sft.lora.rank=8", "sft.lora.rank: unknown field; did you mean sft.lora.r?"),
        # DPO has no lora (it continues its parent's adapter): no lookalike (orpo_alpha -> beta).
        (
            "dpo.lora_alpha=8",
            "dpo.lora_alpha: unknown field (check the spelling; docs/recipes.md lists every field)",
        ),
        ("sft.num_train_epochs=2", "sft.num_train_epochs: unknown field; did you mean sft.epochs?"),
    ],
)
def test_unknown_fields_name_the_field_meant(override: str, error: str) -> None:
    assert errors_of([override]) == [error]


def test_an_alias_is_suggested_only_where_its_field_exists() -> None:
    grpo = {"data": {"synthetic": {}}, "rewards": [{"fn": "posttrain.rewards.match:exact_match"}]}
    data = {**MINIMAL, "grpo": grpo}
    assert errors_of(["grpo.beta=0.1", "grpo.loss_type=dapo"], data) == [
        "grpo.beta: unknown field; did you mean grpo.kl.coef?",
        "grpo.loss_type: unknown field; did you mean grpo.algorithm?",
    ]
    # SFT has no KL: no suggestion rather than a field that does not exist.
    assert errors_of(["sft.beta=0.1"]) == [
        "sft.beta: unknown field (check the spelling; docs/recipes.md lists every field)"
    ]


def test_stages_entries_are_named_and_their_fields_suggested() -> None:
    entry = {"kind": "dpo", "name": "dpo2", "frm": "sft", "learning_rate": 1e-5, "data": PREFS}
    assert errors_of([], {**MINIMAL, "stages": [entry]}) == [
        "stages.dpo2.frm: unknown field; did you mean stages.dpo2.from?",
        "stages.dpo2.learning_rate: unknown field; did you mean stages.dpo2.optim.lr?",
    ]
    typo = {"kind": "dpoo", "name": "dpo2", "data": PREFS}
    assert errors_of([], {**MINIMAL, "stages": [typo]}) == [
        "stages.dpo2.kind: expected one of: ingest, sft, reward, dpo, orpo, kto, ppo, grpo, online_dpo, distill; got 'dpoo'; "
        "did you mean dpo?"
    ]


def test_a_link_in_a_shorthand_section_points_at_stages() -> None:
    assert errors_of(["dpo.from=sft"]) == [
        "dpo.from: unknown field; links between stages are set in a stages: entry, e.g. "
        "stages: [{kind: dpo, name: dpo, from: sft}] in place of the dpo: section "
        "(docs/stage-graphs.md)"
    ]


@pytest.mark.parametrize(
    ("override", "error"),
    [
        (
            "sft.lora=16",
            "sft.lora: expected a mapping of lora settings (r, alpha, dropout, ...), got 16",
        ),
        ("sft.optim.lr=fast", "sft.optim.lr: expected a number, got 'fast'"),
        ("sft.max_steps=-3", "sft.max_steps: must be >= 1, got -3"),
        ("sft.epochs=[1]", "sft.epochs: expected a number, got [1]"),
        (
            "sft.activation_checkpointing=maybe",
            "sft.activation_checkpointing: expected true or false, got 'maybe'",
        ),
        (
            "dpo.loss=sigmod",
            "dpo.loss: expected one of: sigmoid, ipo, robust, hinge, simpo; got 'sigmod'; "
            "did you mean sigmoid?",
        ),
    ],
)
def test_type_errors_echo_the_value_in_plain_words(override: str, error: str) -> None:
    (got,) = errors_of([override])
    assert got == error
    assert "Config" not in got and "Input should" not in got


def test_secret_looking_values_are_never_echoed() -> None:
    token = "hf_" + "aB3dE5gH7jK9mN1pQ3sT5vW7yZ9bC1dE3"
    assert shown(token) is None
    assert shown("x" * 200) == repr("x" * 200)[:57] + "..."
    assert shown(16) == "16" and shown(None) == "null"


def test_every_alias_maps_to_a_real_field_and_is_on_the_migrating_page() -> None:
    page = (ROOT / "docs" / "migrating.md").read_text()
    rows = [line.split("|")[1:3] for line in page.splitlines() if line.startswith("| `")]
    kinds = list(graph_kinds())
    for name, targets in ALIASES.items():
        for target in targets:
            head, _, rest = target.partition(".")
            if head == STAGE:
                assert any(exists((k, *rest.split("."))) for k in kinds), target
            else:
                assert exists(tuple(target.split("."))), target
            # The page names the alias on the left and the field on the right of one row.
            mine = [r for r in rows if re.search(rf"`(?:\w+\.)?{name}\b", r[0])]
            last = target.rsplit(".", 1)[-1]
            assert any(last in r[1] for r in mine), f"{name} -> {target} not in migrating.md"


def _report(path: Path | str) -> list[str]:
    err = io.StringIO()
    assert load_or_report(str(path), [], err) is None
    return err.getvalue().splitlines()


def test_fix_lines_fit_the_problem(tmp_path: Path) -> None:
    missing = _report(tmp_path / "nope.yaml")
    assert missing[1:] == [
        f"  {tmp_path / 'nope.yaml'}: no such recipe file",
        "  fix:  check the path (run from the folder that holds it, or give an absolute path)",
    ]
    broken = tmp_path / "broken.yaml"
    broken.write_text("run:\n  name: x\n  seed: [1, 2\ningest: {source: from_config}\n")
    assert _report(broken)[1:] == [
        f"  {broken} line 4, column 7: expected ',' or ']', but got ':' "
        "(while parsing a flow sequence that starts at line 3)",
        "  fix:  fix the YAML at the line shown",
    ]
    fields = tmp_path / "fields.yaml"
    fields.write_text("ingest: {source: from_config}\nsft: {data: {synthetic: {}}, max_step: 3}\n")
    assert _report(fields)[1:] == [
        "  sft.max_step: unknown field; did you mean sft.max_steps?",
        "  fix:  correct the fields named above (docs/recipes.md lists every field); "
        "`posttrain validate` checks a recipe without running it",
    ]
