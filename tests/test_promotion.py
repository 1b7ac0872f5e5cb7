"""The promotion gate: compare a candidate with the champion rule by rule; the registry."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import yaml

from flows.cli import cmd_models
from posttrain.config.schema import PromotionConfig, PromotionRule, Recipe
from posttrain.store.artifacts import ArtifactRef
from posttrain.workspace.promotion import (
    WIN_RATE_VS_CHAMPION,
    Decision,
    RuleResult,
    Unmeasured,
    champions,
    compare,
    comparison_markdown,
    head_to_head_stage,
    read_registry,
    record_decision,
)


def _regressions(d: Decision) -> list[RuleResult]:
    return [r for r in d.rows if r.regressed]


RULES = PromotionConfig().rules
CHAMPION = {"tuned_loss": 1.50, "exact_match_tuned": 0.40, "rm_accuracy": 0.70}


def test_first_candidate_is_promoted() -> None:
    d = compare(CHAMPION, None, RULES)
    assert d.promoted and d.reason == "first candidate of this pipeline"


def test_better_or_within_tolerance_is_promoted() -> None:
    better = {"tuned_loss": 1.40, "exact_match_tuned": 0.41, "rm_accuracy": 0.69}  # rm -0.01
    d = compare(better, CHAMPION, RULES)
    assert d.promoted and not _regressions(d)
    rows = {r.metric: r for r in d.rows}
    assert rows["win_rate_vs_parent"].compared is False  # absent on both sides: skipped


def test_worse_is_refused_naming_every_regression() -> None:
    worse = {"tuned_loss": 1.60, "exact_match_tuned": 0.30, "rm_accuracy": 0.70}
    d = compare(worse, CHAMPION, RULES)
    assert not d.promoted
    assert [r.metric for r in _regressions(d)] == ["tuned_loss", "exact_match_tuned"]
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


# --- win_rate_vs_champion: measured against the champion itself ---------------------------------

H2H = [PromotionRule(metric="win_rate_vs_champion", direction="max", tolerance=0.05)]


def test_default_rules_judge_the_head_to_head_with_tolerance_005() -> None:
    rule = next(r for r in RULES if r.metric == WIN_RATE_VS_CHAMPION)
    assert (rule.direction, rule.tolerance) == ("max", 0.05)


def test_head_to_head_is_compared_with_a_draw_not_the_champions_record() -> None:
    # The champion recorded 0.9 when it beat the champion before it; what it scores against
    # itself is a draw, 0.5. Hand-computed: 0.5 - 0.46 = 0.04 <= 0.05 (kept), 0.5 - 0.44 = 0.06.
    champion = {**CHAMPION, "win_rate_vs_champion": 0.9}
    kept = compare({**CHAMPION, "win_rate_vs_champion": 0.46}, champion, H2H)
    assert kept.promoted and (kept.rows[0].candidate, kept.rows[0].champion) == (0.46, 0.5)
    refused = compare({**CHAMPION, "win_rate_vs_champion": 0.44}, champion, H2H)
    assert not refused.promoted and refused.rows[0].regressed
    assert refused.reason == (
        "regressed: win_rate_vs_champion 0.44 vs champion 0.5 (lower beyond tolerance 0.05)"
    )
    # Above 0.5 is better than the champion, whatever it recorded.
    assert compare({"win_rate_vs_champion": 0.6}, champion, H2H).promoted
    # The champion's side is 0.5 even when its metrics never had the key.
    assert compare({"win_rate_vs_champion": 0.5}, CHAMPION, H2H).rows[0].champion == 0.5


def test_first_candidate_has_no_champion_side_for_the_head_to_head() -> None:
    d = compare(CHAMPION, None, RULES)
    row = next(r for r in d.rows if r.metric == WIN_RATE_VS_CHAMPION)
    assert d.promoted and row.champion is None and not row.compared


def test_a_skipped_head_to_head_is_na_with_its_reason() -> None:
    why = {WIN_RATE_VS_CHAMPION: Unmeasured("the recipe has no reward stage to judge with")}
    d = compare(CHAMPION, CHAMPION, RULES, why)
    row = next(r for r in d.rows if r.metric == WIN_RATE_VS_CHAMPION)
    assert d.promoted and not row.compared and row.note == why[WIN_RATE_VS_CHAMPION].reason
    table = "\n".join(comparison_markdown(d))
    assert "| win_rate_vs_champion | higher | 0.05 | - | 0.5 | n/a | the recipe has no" in table


def test_a_failed_head_to_head_refuses_promotion_and_says_why() -> None:
    failed = "head-to-head against the champion failed: stage 'head_to_head' exited with code 1"
    why = {WIN_RATE_VS_CHAMPION: Unmeasured(failed, blocks=True)}
    d = compare(CHAMPION, CHAMPION, RULES, why)
    assert not d.promoted and d.reason == failed and not _regressions(d)
    # With a regression as well, both are named, the regression first.
    worse = compare({**CHAMPION, "tuned_loss": 2.0}, CHAMPION, RULES, why)
    assert worse.reason.startswith("regressed: tuned_loss 2 vs champion 1.5") and failed in (
        worse.reason
    )
    # A blocking reason for a metric the candidate has after all, or no rule uses, is ignored.
    assert compare({**CHAMPION, WIN_RATE_VS_CHAMPION: 0.5}, CHAMPION, RULES, why).promoted
    assert compare(CHAMPION, CHAMPION, RULES[:1], why).promoted


def test_decision_notes_follow_the_table() -> None:
    d = compare(CHAMPION, CHAMPION, RULES)
    d.notes.append("head-to-head against champion r1: 3 wins")
    lines = comparison_markdown(d)
    assert lines[-1] == "- head-to-head against champion r1: 3 wins" and lines[-2] == ""


def _ref(stage: str, fp: str) -> ArtifactRef:
    return ArtifactRef(stage=stage, uri=f"/x/{fp}", fingerprint=fp, sha256="0" * 64)


def test_head_to_head_stage_fingerprint_and_folder(tmp_path: Path) -> None:
    recipe = Recipe.model_validate(
        {
            "run": {"name": "pipe", "workspace": str(tmp_path)},
            "ingest": {"source": "from_config"},
            "sft": {"data": {"synthetic": {}}},
            "infra": {"timeouts": {"head_to_head": 90}},
        }
    )
    parents = {
        "candidate": _ref("export", "c" * 16),
        "champion": _ref("export", "d" * 16),
        "reward_model": _ref("reward", "r" * 16),
        "base": _ref("ingest", "i" * 16),
    }
    stage = head_to_head_stage(recipe, parents)
    assert stage.out_dir == tmp_path / "artifacts" / "head_to_head" / stage.fingerprint
    assert (stage.module, stage.nprocs, stage.timeout_s) == (
        "posttrain.stages.head_to_head",
        1,
        90,
    )
    assert stage.parents == {k: v.fingerprint for k, v in parents.items()}
    # Same inputs: same artifact (a re-run reuses it).
    assert head_to_head_stage(recipe, dict(parents)).fingerprint == stage.fingerprint
    # Each parent, the roles, and the evaluate fields it reads change it; others do not.
    for role in parents:
        other = {**parents, role: _ref(parents[role].stage, "e" * 16)}
        assert head_to_head_stage(recipe, other).fingerprint != stage.fingerprint, role
    swapped = {**parents, "candidate": parents["champion"], "champion": parents["candidate"]}
    assert head_to_head_stage(recipe, swapped).fingerprint != stage.fingerprint

    def fp(**evaluate: object) -> str:
        changed = recipe.model_copy(
            update={"evaluate": recipe.evaluate.model_copy(update=evaluate)}
        )
        return head_to_head_stage(changed, parents).fingerprint

    assert fp(win_rate_prompts=7) != stage.fingerprint
    assert fp(batch_size=3) != stage.fingerprint
    sampling = recipe.evaluate.win_rate_sampling.model_copy(update={"max_new_tokens": 5})
    assert fp(win_rate_sampling=sampling) != stage.fingerprint
    assert fp(max_eval_rows=3) == stage.fingerprint
    with pytest.raises(ValueError, match="champion"):
        head_to_head_stage(recipe, {k: v for k, v in parents.items() if k != "champion"})


def test_verifier_accuracy_is_a_default_rule() -> None:
    """evaluate's headline `pass@1` (greedy accuracy under the verifiers) gates promotion when
    both runs have it; a run without verifiers skips the rule."""
    champion = {**CHAMPION, "pass@1": 0.31}
    worse = {**CHAMPION, "pass@1": 0.25}
    d = compare(worse, champion, RULES)
    assert not d.promoted and [r.metric for r in _regressions(d)] == ["pass@1"]
    assert "pass@1 0.25 vs champion 0.31 (lower beyond tolerance 0.02)" in d.reason
    assert compare({**CHAMPION, "pass@1": 0.30}, champion, RULES).promoted
    rows = {r.metric: r for r in compare(CHAMPION, CHAMPION, RULES).rows}
    assert rows["pass@1"].compared is False
