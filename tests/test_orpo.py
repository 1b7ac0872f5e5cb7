"""ORPO: the loss against numbers worked out by hand (fast), and the stage on a tiny model (slow)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import yaml

from posttrain.train.preference_losses import log1mexp, orpo_loss

LN2, LN3 = math.log(2), math.log(3)


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


def test_orpo_by_hand() -> None:
    # Pair 0: chosen 2 tokens at p = 1/2 each (summed logp 2 ln 1/2), rejected 4 tokens at
    # p = 1/4 (summed 4 ln 1/4): mean logps ln 1/2 and ln 1/4.
    #   log-odds chosen   = ln((1/2) / (1/2)) = 0
    #   log-odds rejected = ln((1/4) / (3/4)) = -ln 3
    #   ratio = ln 3 -> sigmoid = 3/4 -> L_OR = ln(4/3);  NLL = -ln 1/2 = ln 2
    # Pair 1: the same two responses swapped (chosen p = 1/4 over 4 tokens, rejected 1/2 over 2):
    #   ratio = -ln 3 -> sigmoid = 1/4 -> L_OR = ln 4;  NLL = ln 4
    beta = 0.1
    losses, m = orpo_loss(t(-2 * LN2, -8 * LN2), t(-8 * LN2, -2 * LN2), t(2, 4), t(4, 2), beta=beta)
    want = [LN2 + beta * math.log(4 / 3), 2 * LN2 + beta * 2 * LN2]
    assert losses.tolist() == pytest.approx(want, abs=1e-6)
    assert m["nll"].tolist() == pytest.approx([LN2, 2 * LN2], abs=1e-6)
    assert m["or_loss"].tolist() == pytest.approx([math.log(4 / 3), 2 * LN2], abs=1e-6)
    assert m["log_odds_chosen"].tolist() == pytest.approx([0.0, -LN3], abs=1e-6)
    assert m["log_odds_rejected"].tolist() == pytest.approx([-LN3, 0.0], abs=1e-6)
    assert m["log_odds_ratio"].tolist() == pytest.approx([LN3, -LN3], abs=1e-6)
    # Rewards are beta x mean logp: -0.1 ln 2 and -0.2 ln 2; margin +-0.1 ln 2.
    assert m["chosen_reward"].tolist() == pytest.approx([-0.1 * LN2, -0.2 * LN2], abs=1e-6)
    assert m["rejected_reward"].tolist() == pytest.approx([-0.2 * LN2, -0.1 * LN2], abs=1e-6)
    assert m["margin"].tolist() == pytest.approx([0.1 * LN2, -0.1 * LN2], abs=1e-6)
    assert m["correct"].tolist() == [1.0, 0.0]
    assert all(not v.requires_grad for v in m.values())


def test_orpo_gradients_by_hand() -> None:
    # Pair 0 above. d log-odds / d m = 1 / (1 - p); d L_OR / d ratio = -(1 - 3/4) = -1/4.
    #   d loss / d sum_c = (1/2) * (-1 + 0.1 * -1/4 * 1/(1 - 1/2)) = (1/2) * -1.05 = -0.525
    #   d loss / d sum_r = (1/4) * 0.1 * (-1/4) * -(1 / (1 - 1/4)) = (1/4) * 0.1 / 3 = 1/120
    pc, pr = t(-2 * LN2).requires_grad_(), t(-8 * LN2).requires_grad_()
    losses, _ = orpo_loss(pc, pr, t(2), t(4), beta=0.1)
    losses.sum().backward()
    assert pc.grad.item() == pytest.approx(-0.525, abs=1e-6)
    assert pr.grad.item() == pytest.approx(1 / 120, abs=1e-6)


def test_beta_zero_is_sft_on_chosen() -> None:
    # Without the odds-ratio term only the chosen NLL is left (beta must be > 0: use a tiny one).
    losses, _ = orpo_loss(t(-3.0), t(-0.5), t(3), t(1), beta=1e-12)
    assert losses.item() == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="beta must be > 0"):
        orpo_loss(t(-3.0), t(-0.5), t(3), t(1), beta=0.0)


def test_log1mexp_matches_float64_and_stays_finite() -> None:
    x = torch.tensor([-1e-7, -1e-3, -0.5, -0.6931, -0.7, -2.0, -20.0, -80.0], dtype=torch.float64)
    want = torch.log(1 - torch.exp(x))  # exact enough in float64 over this range
    got = log1mexp(x.float()).double()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_certain_and_hopeless_responses_give_finite_loss_and_gradients() -> None:
    # Mean logp 0.0 (the model is certain; happens in fp32) has infinite odds unless capped, and
    # -60 per token has odds ~e^-60: both must give finite losses and gradients.
    pc, pr = t(0.0, -600.0).requires_grad_(), t(-600.0, 0.0).requires_grad_()
    losses, m = orpo_loss(pc, pr, t(10, 10), t(10, 10), beta=0.1)
    losses.sum().backward()
    assert torch.isfinite(losses).all() and torch.isfinite(pc.grad).all()
    assert torch.isfinite(pr.grad).all()
    assert m["correct"].tolist() == [1.0, 0.0]
    assert m["log_odds_chosen"][0].item() == pytest.approx(-math.log(1e-6), rel=1e-3)


def test_half_precision_inputs_are_upcast() -> None:
    losses, _ = orpo_loss(t(-2 * LN2).bfloat16(), t(-8 * LN2).bfloat16(), t(2), t(4), beta=0.1)
    assert losses.dtype == torch.float32
    assert losses.item() == pytest.approx(LN2 + 0.1 * math.log(4 / 3), abs=1e-2)


# --- the stage on a tiny model ---

PAIRS = {
    "synthetic": {"n_examples": 200, "seed": 5},
    "eval_fraction": 0.2,
    "max_seq_len": 64,
    "max_prompt_len": 40,
}


def _orpo_recipe() -> dict:
    from tests.stage_helpers import TINY

    recipe = copy.deepcopy(TINY)
    recipe["orpo"] = {
        "data": PAIRS,
        # A strong odds-ratio weight and lr: the tiny base must visibly separate the pairs in
        # 20 steps (measured: held-out accuracy 0.625 -> 0.70, margin x2; lr 2e-2 overshoots).
        "beta": 1.0,
        "optim": {"lr": 1e-2},
        "batch": {"micro_batch_size": 8, "grad_accum_steps": 1},
        "max_steps": 20,
        "checkpoint_every": 0,
    }
    return recipe


@pytest.fixture(scope="module")
def orpo_ws(tmp_path_factory, shared_parents) -> dict:
    from tests.stage_helpers import run_inprocess, run_shared, write_recipe

    recipe = write_recipe(tmp_path_factory.mktemp("orpo"), _orpo_recipe())
    out = {"recipe": recipe}
    for stage in ("ingest", "sft"):  # TINY's, built once per session
        out[stage] = run_shared(stage, recipe, shared_parents)
    out["orpo"] = run_inprocess("orpo", recipe)
    return out


@pytest.mark.slow
def test_orpo_stage_trains_without_a_reference(orpo_ws) -> None:
    from safetensors.torch import load_file

    from posttrain.store.artifacts import verify
    from posttrain.telemetry.records import read_metrics

    out = orpo_ws["orpo"]
    assert verify(out)[0], "a complete, verified artifact"
    weights = load_file(out / "adapter" / "adapter_model.safetensors")
    assert weights and not any("reference" in k for k in weights), "one adapter, no reference"
    sft = load_file(orpo_ws["sft"] / "adapter" / "adapter_model.safetensors")
    assert any(not torch.equal(weights[k], sft[k]) for k in sft), "continued from SFT and moved"
    assert set(weights) == set(sft)

    train = read_metrics(out / "metrics.jsonl", "train")
    assert len(train) == 20
    assert {"accuracy", "margin", "nll", "or_loss", "log_odds_ratio", "chosen_reward"} <= set(
        train[0]
    )
    assert all(math.isfinite(r["loss"]) for r in train)
    start = read_metrics(out / "metrics.jsonl", "start")[0]
    assert start["start"] == "sft adapter" and start["params_trainable"] < start["params_total"]

    s = json.loads((out / "manifest.json").read_text())["summary"]
    first, final = s["eval_start"], s["eval_final"]
    assert s["start"] == "sft adapter" and s["beta"] == 1.0
    # 40 held-out pairs: more of them ranked right, the odds ratio and margin clearly up, the
    # loss and the chosen NLL down.
    assert final["accuracy"] >= first["accuracy"] + 0.05, (first, final)
    assert final["log_odds_ratio"] > 1.5 * first["log_odds_ratio"] > 0, (first, final)
    assert final["margin"] > 1.5 * first["margin"], (first, final)
    assert final["loss"] < first["loss"] and final["nll"] < first["nll"], (first, final)
    assert s["headline"]["eval_pref_accuracy"] == pytest.approx(final["accuracy"], abs=1e-4)


@pytest.mark.slow
def test_orpo_from_the_base_starts_a_fresh_lora(orpo_ws) -> None:
    """`from: ingest`: no adapter to continue, the stage trains a new LoRA of its own `lora`
    shape on the base (the same workspace: ingest is reused)."""
    from safetensors.torch import load_file

    from tests.stage_helpers import run_inprocess

    data = yaml.safe_load(orpo_ws["recipe"].read_text())
    section = data.pop("orpo")
    data["stages"] = [{"kind": "orpo", "name": "orpo_base", "from": "ingest", **section}]
    data["stages"][0] |= {"max_steps": 2, "lora": {"r": 4, "alpha": 8}}
    recipe = orpo_ws["recipe"].with_name("from_base.yaml")
    recipe.write_text(yaml.safe_dump(data))
    out = run_inprocess("orpo", recipe)
    weights = load_file(out / "adapter" / "adapter_model.safetensors")
    a = next(v for k, v in weights.items() if "lora_A" in k)
    assert a.shape[0] == 4, "the orpo.lora rank, not the SFT adapter's (8)"
    s = json.loads((out / "manifest.json").read_text())["summary"]
    assert s["start"] == "fresh lora" and s["total_steps"] == 2
