"""reward and dpo stages on a tiny model, and evaluate's preference metrics."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from flows.post_train import check_gate
from flows.report.tables import StageRecord
from flows.stage.failures import QualityGateFailed
from posttrain.store.artifacts import ref_from_manifest
from posttrain.store.summary import read_summary
from posttrain.telemetry.records import read_metrics
from tests.stage_helpers import (
    TINY,
    planned_dir,
    run_inprocess,
    run_shared,
    run_torchrun,
    write_recipe,
)

pytestmark = pytest.mark.slow

PAIRS = {
    "synthetic": {"n_examples": 200},
    "eval_fraction": 0.2,
    "max_seq_len": 64,
    "max_prompt_len": 40,
}
PREF = copy.deepcopy(TINY)
# A tiny base cannot learn these preferences in seconds (the quickstart shows held-out accuracy
# rising at real length); here the reward model must at least fit its 32 training pairs.
PREF["reward"] = {
    "data": {**PAIRS, "synthetic": {"n_examples": 40}},
    "lora": {"r": 8, "alpha": 16},
    "optim": {"lr": 1e-2},
    "batch": {"micro_batch_size": 8, "grad_accum_steps": 1},
    "max_steps": 20,
    "checkpoint_every": 0,
}
PREF["dpo"] = {
    "data": {**PAIRS, "synthetic": {"n_examples": 200, "seed": 5}},
    "optim": {"lr": 2e-3},
    "batch": {"micro_batch_size": 8, "grad_accum_steps": 1},
    "max_steps": 8,
    "checkpoint_every": 0,
    "sft_weight": 0.5,
    "eval_every": 4,  # held-out figures at steps 0, 4 and 8
}
PREF["evaluate"] = {**TINY["evaluate"], "win_rate_prompts": 8}


@pytest.fixture(scope="module")
def pref(tmp_path_factory, shared_parents: Path) -> dict:
    recipe = write_recipe(tmp_path_factory.mktemp("pref"), PREF)
    out = {"recipe": recipe}
    # ingest, sft and reward are TINY's and test_rl_stages's too: built once per session.
    for stage in ("ingest", "sft", "reward"):
        out[stage] = run_shared(stage, recipe, shared_parents)
    out["dpo"] = run_inprocess("dpo", recipe)
    return out


def summary(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())["summary"]


def test_reward_trains_and_reports(pref) -> None:
    train = read_metrics(pref["reward"] / "metrics.jsonl", "train")
    assert len(train) == 20
    assert {"accuracy", "margin", "reward_chosen", "reward_rejected", "mfu"} <= set(train[0])
    first, last = (sum(r["loss"] for r in rs) / 4 for rs in (train[:4], train[-4:]))
    assert last < first - 0.1, (first, last)
    s = summary(pref["reward"])
    assert s["eval_start"]["pairs"] == s["eval_final"]["pairs"] == 8
    assert {"accuracy", "margin", "chosen_mean", "chosen_std", "rejected_mean"} <= set(
        s["eval_final"]
    )
    assert s["gate"] == {"passed": True}
    from safetensors.torch import load_file

    weights = load_file(pref["reward"] / "adapter" / "adapter_model.safetensors")
    assert any("score" in k for k in weights), "the score head is saved with the adapter"


def test_reward_gate_stops_the_pipeline(pref) -> None:
    over = ("reward.min_accuracy=1.0", "reward.max_steps=2")
    out = run_inprocess("reward", pref["recipe"], *over)
    gate = summary(out)["gate"]
    assert gate["passed"] is False and "< reward.min_accuracy 1.0" in gate["message"]
    record = StageRecord("reward", "f", "ran", 1.0)
    with pytest.raises(QualityGateFailed, match="stopping before any RL stage"):
        check_gate(read_summary(out), record)
    assert record.error.startswith("quality gate:")


def test_dpo_reference_is_the_sft_policy(pref) -> None:
    """The stage's frozen reference gives the log-probs of a separately loaded SFT model, and at
    step 0 the policy equals it (margin exactly 0: not the raw base)."""
    from peft import PeftModel

    from posttrain.config.loader import load_recipe
    from posttrain.data.pref_prepare import prepare
    from posttrain.models.adapters import policy_with_reference
    from posttrain.models.loading import load_causal_lm, load_tokenizer
    from posttrain.models.reward import pair_batch
    from posttrain.stages.dpo import reference_logps
    from posttrain.train.forward_logps import pair_logps

    recipe = load_recipe(pref["recipe"])
    tok = load_tokenizer(pref["ingest"] / "tokenizer")
    pairs = prepare(recipe.dpo.data, tok, 0).eval[:6]
    adapter = pref["sft"] / "adapter"
    colocated = policy_with_reference(load_causal_lm(pref["ingest"] / "model"), adapter).eval()
    with torch.no_grad():
        for n, p in colocated.named_parameters():  # move the policy away from the reference
            if "lora_B.default" in n:
                p.add_(0.1)
    got = reference_logps(colocated, pairs, tok.pad_token_id, 4, torch.device("cpu"), 0, 1)
    sft = PeftModel.from_pretrained(load_causal_lm(pref["ingest"] / "model"), str(adapter)).eval()
    with torch.no_grad():
        c, r, _, _ = pair_logps(sft, pair_batch(pairs, tok.pad_token_id))
    assert torch.allclose(got[:, 0].float(), c, atol=1e-5)
    assert torch.allclose(got[:, 1].float(), r, atol=1e-5)
    s = summary(pref["dpo"])
    assert s["eval_start"]["margin"] == 0.0 and s["eval_start"]["loss"] == pytest.approx(
        0.693147, abs=1e-6
    )
    # At step 0 the policy is its reference: every pair ties, and a tie counts half (chance),
    # not as wrong.
    assert s["eval_start"]["ties"] == 1.0 and s["eval_start"]["accuracy"] == 0.5
    assert s["eval_final"]["accuracy"] > 0.5 and s["eval_final"]["ties"] == 0.0


def test_dpo_writes_a_held_out_record_at_every_evaluation(pref) -> None:
    """eval_every 4 of 8 steps: a record at the start, at step 4 and at the end, each a point
    of the curves; the first at chance (0.5: the policy is its reference, every pair ties)."""
    evals = read_metrics(pref["dpo"] / "metrics.jsonl", "eval")
    assert [r["step"] for r in evals] == [0, 4, 8]
    assert {"eval_accuracy", "eval_margin", "eval_loss", "eval_ties"} <= set(evals[1])
    assert evals[0]["eval_accuracy"] == 0.5 and evals[0]["eval_ties"] == 1.0
    assert evals[-1]["eval_accuracy"] == summary(pref["dpo"])["eval_final"]["accuracy"]


def test_precomputed_reference_matches_online_and_is_reused(pref) -> None:
    over = ("dpo.max_steps=2",)
    online = run_inprocess("dpo", pref["recipe"], *over)
    pre = run_inprocess("dpo", pref["recipe"], *over, "dpo.precompute_reference=true")
    assert summary(pre)["reference_cache"] == "miss"
    a = read_metrics(online / "metrics.jsonl", "train")
    b = read_metrics(pre / "metrics.jsonl", "train")
    assert b[0]["loss"] == pytest.approx(a[0]["loss"], abs=1e-5)
    assert b[0]["ref_chosen_logps"] == pytest.approx(a[0]["ref_chosen_logps"], abs=1e-4)
    # Another run with the same reference, data and template (different beta) reuses the table.
    again = run_inprocess(
        "dpo", pref["recipe"], *over, "dpo.precompute_reference=true", "dpo.beta=0.3"
    )
    assert summary(again)["reference_cache"] == "hit"


@pytest.mark.parametrize("loss", ["ipo", "robust", "hinge", "simpo"])
def test_every_loss_trains(pref, loss: str) -> None:
    extra = ("dpo.label_smoothing=0.1",) if loss == "robust" else ()
    out = run_inprocess("dpo", pref["recipe"], "dpo.max_steps=2", f"dpo.loss={loss}", *extra)
    train = read_metrics(out / "metrics.jsonl", "train")
    assert len(train) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in train)
    if loss == "simpo":
        assert train[0]["ref_chosen_logps"] == 0.0, "reference-free: no reference forward"


def test_template_change_is_refused_unless_allowed(pref) -> None:
    from posttrain.data.chat import TemplateError
    from posttrain.data.pref_prepare import guard_template
    from posttrain.models.loading import load_tokenizer
    from posttrain.sections.shared import TemplateGuard

    other = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    sha = summary(pref["sft"])["chat_template_sha256"]
    tok = load_tokenizer(pref["ingest"] / "tokenizer")
    assert guard_template(tok, sha, "dpo", TemplateGuard()) == sha
    with pytest.raises(TemplateError, match="differs from the one recorded by 'sft'"):
        guard_template(tok, sha, "dpo", TemplateGuard(chat_template=other), "sft")
    guard_template(tok, sha, "dpo", TemplateGuard(chat_template=other, allow_template_change=True))
    over = (f"dpo.chat_template={json.dumps(other)}",)
    with pytest.raises(SystemExit):
        run_inprocess("dpo", pref["recipe"], *over)
    err = (planned_dir("dpo", pref["recipe"], *over) / "logs" / "error.txt").read_text()
    assert "dpo.allow_template_change: true" in err and "recorded by 'sft'" in err


def test_dpo_by_tokens_changes_only_the_forwards(pref) -> None:
    """Pairs regrouped into forwards of at most 100 tokens (both replies count) take the same
    pairs per step: the same pair-normalised loss and gradient as micro-batches of 8 pairs."""
    runs = []
    for extra in ((), ("dpo.batch.by_tokens=100",)):
        out = run_inprocess("dpo", pref["recipe"], "dpo.max_steps=2", *extra)
        runs.append(read_metrics(out / "metrics.jsonl", "train"))
        shutil.rmtree(out)  # the layout is not fingerprinted: the next run would reuse this
    rows, budget = runs
    assert all(r["forwards"] == 1 for r in rows) and all(r["forwards"] > 2 for r in budget)
    for x, y in zip(rows, budget, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], abs=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)


def test_dpo_two_ranks_match_one(pref) -> None:
    # A short SFT keeps the two-rank variant cheap; the one-rank side uses the same SFT recipe.
    over = ("sft.max_steps=2", "dpo.max_steps=2")
    run_inprocess("sft", pref["recipe"], *over)
    one = read_metrics(run_inprocess("dpo", pref["recipe"], *over) / "metrics.jsonl", "train")
    # The 2-rank run reuses the 1-rank SFT (same global batch: how it is split over ranks is not
    # a fingerprint input); a different step count keeps its DPO a separate artifact, and the
    # first step, computed before any update, must match.
    two_over = (
        "sft.max_steps=2",
        "dpo.max_steps=3",
        "infra.devices_per_node=2",
        "dpo.batch.micro_batch_size=4",
        "sft.batch.micro_batch_size=4",
        "reward.batch.micro_batch_size=4",
    )
    assert planned_dir("sft", pref["recipe"], *two_over) == planned_dir(
        "sft", pref["recipe"], *over
    )
    proc = run_torchrun("dpo", pref["recipe"], 2, *two_over)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    two = read_metrics(planned_dir("dpo", pref["recipe"], *two_over) / "metrics.jsonl", "train")
    # Same pairs in the same global batch, split over two ranks: same reference, same loss.
    assert two[0]["ref_chosen_logps"] == pytest.approx(one[0]["ref_chosen_logps"], abs=1e-4)
    assert two[0]["loss"] == pytest.approx(one[0]["loss"], abs=1e-4)


def test_evaluate_reports_preference_metrics(pref) -> None:
    out = run_inprocess("evaluate", pref["recipe"])
    s = summary(out)
    assert s["policy"] == "dpo"
    assert 0 <= s["reward_model"]["accuracy"] <= 1 and s["reward_model"]["pairs"] == 8
    assert 0 <= s["dpo_implicit"]["accuracy"] <= 1
    wr = s["win_rate_vs_parent"]
    assert wr["wins"] + wr["losses"] + wr["ties"] == wr["n"] == 8
    assert {"rm_accuracy", "dpo_accuracy", "win_rate_vs_parent", "parent_loss"} <= set(
        s["headline"]
    )
    assert (out / "win_rate_samples.jsonl").exists()


def test_second_sft_round_continues_the_policy_adapter(pref, tmp_path: Path) -> None:
    """`stages: [{kind: sft, name: sft2, from: dpo}]`: a second SFT round (rejection-sampling
    SFT, say) trains the DPO policy's adapter further, its shape kept, from its weights."""
    import yaml
    from safetensors.torch import load_file

    data = yaml.safe_load(pref["recipe"].read_text())
    data["stages"] = [
        {**copy.deepcopy(PREF["sft"]), "kind": "sft", "name": "sft2", "from": "dpo", "max_steps": 2}
    ]
    data["stages"][0]["lora"] = {"r": 2, "alpha": 4}  # ignored: the adapter is DPO's
    recipe = tmp_path / "round2.yaml"
    recipe.write_text(yaml.safe_dump(data))
    out = run_inprocess("sft", recipe, name="sft2")
    manifest = json.loads((out / "manifest.json").read_text())
    assert ref_from_manifest(pref["dpo"]).fingerprint in manifest["parents"]
    dpo = load_file(pref["dpo"] / "adapter" / "adapter_model.safetensors")
    mine = load_file(out / "adapter" / "adapter_model.safetensors")
    assert mine.keys() == dpo.keys()
    key = next(k for k in dpo if "lora_A" in k)
    assert mine[key].shape == dpo[key].shape and mine[key].shape[0] == 8  # DPO's (SFT's) rank
    # Trained on from DPO's weights: every tensor moved, and by far less than DPO's B matrices
    # are from zero (a fresh adapter would start with B = 0).
    moved = max((mine[k] - dpo[k]).abs().max().item() for k in dpo)
    b_size = max(dpo[k].abs().max().item() for k in dpo if "lora_B" in k)
    assert 0 < moved < 0.5 * b_size, (moved, b_size)  # measured: 0.015 vs 0.095
