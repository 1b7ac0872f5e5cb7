"""The DPO stage's held-out preference metrics and evaluate's implicit-reward accuracy give the
same numbers on the same model and pairs: both go through `implicit_rewards` (tiny real model,
policy and reference as two adapters on one base, as in the stage; no mocks)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from fixtures_tiny import MAX_LEN, TinyAssets, load_base, one_torch_thread, tiny_assets
from peft import PeftModel

from posttrain.data.preference import encode_pairs, quickstart_preference_rows
from posttrain.eval.preference_eval import implicit_reward_accuracy
from posttrain.models.adapters import POLICY, REFERENCE, active_adapter, policy_with_reference
from posttrain.models.reward import pair_batch
from posttrain.stages.dpo import heldout_preferences, pair_logps
from posttrain.train.preference_losses import preference_loss

HPARAMS = {"sigmoid": {"beta": 0.1}, "simpo": {"beta": 2.0, "gamma": 0.5}}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[PeftModel, list[dict], int]:
    """(policy + reference adapters with the policy moved off the reference, 10 encoded
    held-out pairs, pad id)."""
    assets: TinyAssets = tiny_assets(tmp_path_factory)
    tok = assets.tokenizer
    model = policy_with_reference(load_base(assets), assets.adapter_trained).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if f"lora_B.{POLICY}" in n:
                p.add_(0.5 * torch.randn_like(p))
    pairs = encode_pairs(tok, quickstart_preference_rows(10, seed=3), MAX_LEN, 48)[0]
    assert len(pairs) == 10
    return model, pairs, tok.pad_token_id


@pytest.mark.parametrize("loss", sorted(HPARAMS))
def test_dpo_heldout_and_evaluate_agree(setup, loss: str) -> None:
    model, pairs, pad = setup
    beta = HPARAMS[loss]["beta"]
    stage = heldout_preferences(
        model,
        pairs,
        preference_loss(loss, **HPARAMS[loss]),
        pad,
        4,  # batches of 4 + 4 + 2 here, 3 + 3 + 3 + 1 below: batching must not matter
        torch.device("cpu"),
        0,
        1,
        loss=loss,
        beta=beta,
    )
    evaluate = implicit_reward_accuracy(model, POLICY, REFERENCE, pairs, pad, beta, 3, loss=loss)
    assert evaluate["pairs"] == len(pairs)
    assert stage["accuracy"] == evaluate["accuracy"]
    assert stage["margin"] == pytest.approx(evaluate["margin"], rel=1e-5, abs=1e-6)

    # And the shared number is the loss's own reward, worked out here from the log-probs.
    with torch.no_grad():
        pc, pr, lc, lr = pair_logps(model, pair_batch(pairs, pad))
        if loss == "simpo":
            rc, rr = beta * pc / lc, beta * pr / lr
        else:
            with active_adapter(model, REFERENCE):
                qc, qr, _, _ = pair_logps(model, pair_batch(pairs, pad))
            rc, rr = beta * (pc - qc), beta * (pr - qr)
    assert stage["margin"] == pytest.approx((rc - rr).mean().item(), rel=1e-4, abs=1e-6)
    # No pair within rounding of a tie, so the two batchings cannot flip a comparison.
    assert (rc - rr).abs().min() > 1e-4
    assert stage["accuracy"] == (rc > rr).sum().item() / len(pairs) and stage["ties"] == 0.0
    assert abs(stage["margin"]) > 1e-3  # the policy was moved: a real margin, not a tie


def test_simpo_and_dpo_rewards_differ_on_the_same_pairs(setup) -> None:
    # The disagreement this file exists to prevent: evaluate used the DPO reward for SimPO runs.
    model, pairs, pad = setup
    simpo = implicit_reward_accuracy(model, POLICY, REFERENCE, pairs, pad, 2.0, 4, loss="simpo")
    dpo = implicit_reward_accuracy(model, POLICY, REFERENCE, pairs, pad, 2.0, 4, loss="sigmoid")
    assert simpo["margin"] != pytest.approx(dpo["margin"], rel=1e-3)
