"""The promotion gate: compare a candidate with the champion rule by rule; the registry."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import yaml

from flows.cli import cmd_models
from posttrain.config.schema import PromotionConfig, PromotionRule
from posttrain.promotion import champions, compare, read_registry, record_decision

RULES = PromotionConfig().rules
CHAMPION = {"tuned_loss": 1.50, "exact_match_tuned": 0.40, "rm_accuracy": 0.70}


def test_first_candidate_is_promoted() -> None:
    d = compare(CHAMPION, None, RULES)
    assert d.promoted and d.reason == "first candidate of this pipeline"


def test_better_or_within_tolerance_is_promoted() -> None:
    better = {"tuned_loss": 1.40, "exact_match_tuned": 0.41, "rm_accuracy": 0.69}  # rm -0.01
    d = compare(better, CHAMPION, RULES)
    assert d.promoted and not d.regressions()
    rows = {r.metric: r for r in d.rows}
    assert rows["win_rate_vs_sft"].compared is False  # absent on both sides: skipped


def test_worse_is_refused_naming_every_regression() -> None:
    worse = {"tuned_loss": 1.60, "exact_match_tuned": 0.30, "rm_accuracy": 0.70}
    d = compare(worse, CHAMPION, RULES)
    assert not d.promoted
    assert [r.metric for r in d.regressions()] == ["tuned_loss", "exact_match_tuned"]
    assert "tuned_loss 1.6 vs champion 1.5 (higher beyond tolerance 0.02)" in d.reason
    assert "exact_match_tuned 0.3 vs champion 0.4 (lower beyond tolerance 0.02)" in d.reason


def test_custom_rule_direction_and_tolerance() -> None:
    rule = [PromotionRule(metric="decode_tok/s", direction="max", tolerance=10)]
    assert compare({"decode_tok/s": 291}, {"decode_tok/s": 300}, rule).promoted
    assert not compare({"decode_tok/s": 289}, {"decode_tok/s": 300}, rule).promoted


def test_registry_keeps_history_and_the_champion(tmp_path: Path) -> None:
    first = {"run_id": "r1", "metrics": CHAMPION, "export_path": "/e1", "lineage": {"sft": "a"}}
    record_decision(tmp_path, "pipe", first, compare(CHAMPION, None, RULES))
    worse = {**first, "run_id": "r2", "metrics": {**CHAMPION, "tuned_loss": 2.0}}
    record_decision(tmp_path, "pipe", worse, compare(worse["metrics"], CHAMPION, RULES))
    reg = read_registry(tmp_path, "pipe")
    assert reg["champion"]["run_id"] == "r1"
    assert [(h["run_id"], h["promoted"]) for h in reg["history"]] == [("r1", True), ("r2", False)]
    assert [c["run_id"] for c in champions(tmp_path)] == ["r1"]

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "run": {"name": "pipe", "workspace": str(tmp_path)},
                "ingest": {"source": "from_config"},
                "sft": {"data": {"synthetic": {}}},
            }
        )
    )
    out = io.StringIO()
    assert cmd_models(str(recipe), [], out, io.StringIO()) == 0
    text = out.getvalue()
    assert "pipe" in text and "r1" in text and "tuned_loss=1.5" in text
    assert "pipe lineage: sft@a" in text


@pytest.mark.parametrize(
    "bad", [{"metric": "x", "direction": "up"}, {"metric": "x", "tolerance": -1}]
)
def test_rule_validation(bad: dict) -> None:
    with pytest.raises(ValueError):
        PromotionRule.model_validate({"direction": "min", **bad})
