"""The `train` record of an online-RL step (posttrain.rl.metrics) on a hand-made
rollout: the totals over ranks, the FLOPs and the record's fields, by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from posttrain.rl.metrics import UpdateStats, rollout_totals, step_flops, train_metrics
from posttrain.rl.rollout.collect import RolloutBatch
from tests.test_rl_losses import _rollout

L2 = math.log(2)


def _scored() -> object:
    """Two responses of 3 and 2 tokens (the first stopped), scores 1 and 3, per-response KL
    (k1) log 2 each; a reward function `exact` that applies to the first only (value 1)."""
    ro = _rollout([1.0, 3.0], [True, False])
    ro.scored["fn:exact"] = torch.tensor([1.0, math.nan])
    return ro


def test_rollout_totals_by_hand() -> None:
    totals = rollout_totals(_scored(), torch.device("cpu"), "k1")
    assert list(totals) == [
        *("reward_fn_exact", "count_fn_exact", "n", "score", "score_sq", "kl", "length"),
        "stopped",
    ]
    assert totals["reward_fn_exact"] == 1.0 and totals["count_fn_exact"] == 1.0
    assert (totals["n"], totals["score"], totals["score_sq"]) == (2.0, 4.0, 10.0)
    assert totals["kl"] == pytest.approx(2 * L2)
    assert (totals["length"], totals["stopped"]) == (5.0, 1.0)


def test_the_step_s_kl_is_the_recipe_s_estimator() -> None:
    # Per-token log-ratio log 2 on one token of each response: k1 log 2, k2 (log 2)^2 / 2,
    # k3 exp(-log 2) - 1 + log 2 = log 2 - 1/2 per response. Without the reference's pass the
    # rollout has no KL to report.
    ro, cpu = _scored(), torch.device("cpu")
    want = {"k1": L2, "k2": 0.5 * L2**2, "k3": L2 - 0.5}
    for estimator, per_response in want.items():
        totals = rollout_totals(ro, cpu, estimator)
        assert totals["kl"] == pytest.approx(2 * per_response), estimator
    del ro.scored["ref_logps"]
    assert "kl" not in rollout_totals(ro, cpu, "k3")


def test_step_flops_by_hand() -> None:
    ro = _scored()  # prompts 2 x 2 real tokens, responses 3 wide (3 + 2 real): 9 tokens
    config = SimpleNamespace(num_hidden_layers=1, hidden_size=4)
    tr = SimpleNamespace(n_matmul=10, n_trainable=2, model=SimpleNamespace(config=config))
    # generation 2 x 10 x (4 prompt tokens + 2 rows x 3 steps) = 200; scoring by 3 roles
    # 2 x 10 x 9 x 3 = 540; training per token 4 x 10 + 2 x 2 + 12 x 1 layer x int(9 / 2) x 4
    # = 236, over 9 tokens, 2 epochs, twice with a critic: 8496.
    assert step_flops(ro, tr, 3, 2, critic=True) == 200 + 540 + 8496
    assert step_flops(ro, tr, 3, 2, critic=False) == 200 + 540 + 8496 / 2


def test_train_metrics_by_hand() -> None:
    ro = _scored()
    totals = rollout_totals(ro, torch.device("cpu"), "k1")
    rb = RolloutBatch(ro, 1.0, 0.5, {"informative_frac": 0.5})
    stats = UpdateStats({"policy_loss": -0.25, "kl_loss": 0.125}, 3.0, 1e-3, 2)
    got = train_metrics(totals, 0.1, (2.0, 3.0), rb, 2.0, 4.0, stats)
    assert got == {
        "score_mean": 2.0,
        "reward_fn_exact": 1.0,
        "score_std": 1.0,  # sqrt(10 / 2 - 2 ** 2)
        "kl": pytest.approx(L2),
        "kl_coef": 0.1,
        "response_len": 2.5,
        "stop_rate": 0.5,
        "gen_width_min": 2.0,
        "gen_width_max": 3.0,
        "generation_s": 1.0,
        "scoring_s": 0.5,
        "training_s": 2.0,
        "generation_share": 0.25,
        "update_share": 0.5,
        "informative_frac": 0.5,
        "policy_loss": -0.25,
        "kl_loss": 0.125,
        "updates": 2,
    }
    # In this order in the record; grad_norm and lr are record_step's own arguments.
    assert list(got)[:3] == ["score_mean", "reward_fn_exact", "score_std"]
    assert list(got)[-3:] == ["policy_loss", "kl_loss", "updates"]
