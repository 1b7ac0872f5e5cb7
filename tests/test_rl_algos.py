"""The GRPO family in the algorithm registry: each advantage function, loss aggregation and the
asymmetric clip against hand-computed numbers; presets on the grpo section; dynamic sampling's
pure parts (the group filter, Rollout.select / Rollout.cat); existing recipes' fingerprints."""

from __future__ import annotations

import math
import statistics
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from posttrain.kinds.grpo import GRPOConfig
from posttrain.kinds.ppo import PPOConfig
from posttrain.rl.algorithms import ALGORITHMS
from posttrain.rl.algorithms.advantages import (
    ADVANTAGES,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from posttrain.rl.losses import (
    clipped_policy_loss,
    informative_groups,
    leave_one_out_advantages,
    loss_weights,
)
from posttrain.rl.rollout.sample import Rollout
from tests.test_rl_losses import _rollout, close, t

ROOT = Path(__file__).resolve().parents[1]
L2 = math.log(2)


def _cfg(**kw: object) -> SimpleNamespace:
    return SimpleNamespace(
        missing_eos_penalty=None,
        kl=SimpleNamespace(estimator="k1"),
        rollout=SimpleNamespace(samples_per_prompt=2),
        scale_rewards=False,
        **kw,
    )


# --- pure functions ---------------------------------------------------------------------------


def test_clip_higher_widens_only_the_upper_side() -> None:
    # ratios 1.5, 1.25, 0.5, 0.5 with A = +1, +1, -1, +1; clip low 0.2, high 0.28: [0.8, 1.28].
    ratio = torch.tensor([[1.5, 1.25, 0.5, 0.5]])
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
    loss, clipped = clipped_policy_loss(ratio.log(), torch.zeros(1, 4), adv, 0.2, 0.28)
    # 1.5 -> max(-1.5, -1.28) = -1.28 clipped; 1.25 inside -> -1.25 (the symmetric clip would
    # give -1.2, clipped); 0.5, A<0 -> max(0.5, 0.8) = 0.8 clipped; 0.5, A>0 -> max(-0.5, -0.8).
    close(loss, [[-1.28, -1.25, 0.8, -0.5]])
    assert clipped.tolist() == [[True, False, True, False]]
    sym, sym_clipped = clipped_policy_loss(ratio.log(), torch.zeros(1, 4), adv, 0.2)
    close(sym, [[-1.2, -1.2, 0.8, -0.5]])
    assert sym_clipped.tolist() == [[True, True, True, False]]


# Per-token losses of two responses (3 and 1 tokens; 9s on padding that must not count).
LOSS = t([1, 2, 3, 9], [4, 9, 9, 9])
MASK = t([1, 1, 1, 0], [1, 0, 0, 0])


@pytest.mark.parametrize(
    "aggregation, want",
    [
        ("token_mean", (1 + 2 + 3 + 4) / 4),  # 2.5: every token the same
        ("sequence_mean", ((1 + 2 + 3) / 3 + 4 / 1) / 2),  # 3.0: each response's mean, averaged
        ("token_sum_norm", ((1 + 2 + 3) / 4 + 4 / 4) / 2),  # 1.25: sums over max_new_tokens 4
    ],
)
def test_loss_aggregation(aggregation: str, want: float) -> None:
    w, count = loss_weights(MASK, aggregation, max_new_tokens=4)
    assert float((LOSS * w).sum() / count) == pytest.approx(want)
    # The minibatch split over 2 ranks (one row each): each rank's share is its weighted sum
    # over the GLOBAL count (summed over ranks); the shares add up to the one-rank value.
    parts = [loss_weights(MASK[i : i + 1], aggregation, max_new_tokens=4) for i in range(2)]
    global_count = sum(c for _, c in parts)
    shares = [
        float((LOSS[i : i + 1] * w_i).sum() / global_count) for i, (w_i, _) in enumerate(parts)
    ]
    assert sum(shares) == pytest.approx(want)


def test_unknown_loss_aggregation_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="token_sum_norm"):
        loss_weights(MASK, "seq_mean", 4)


def test_leave_one_out_baseline() -> None:
    # Group [1, 2, 6]: the others' means are 4, 3.5, 1.5 -> -3, -1.5, 4.5 (= 3/2 (r - 3)).
    # Group [0, 0, 3]: 1.5, 1.5, 0 -> -1.5, -1.5, 3.
    adv = leave_one_out_advantages(torch.tensor([1.0, 2, 6, 0, 0, 3]), 3)
    close(adv, [-3, -1.5, 4.5, -1.5, -1.5, 3])
    with pytest.raises(ValueError):
        leave_one_out_advantages(torch.tensor([1.0, 2, 3]), 2)


def test_informative_groups_drop_groups_that_all_score_the_same() -> None:
    scores = torch.tensor([1.0, 1, 1, 0, 1, 0, 2, 2, 2, -1, 3, 3])
    assert informative_groups(scores, 3).tolist() == [False, True, False, True]
    with pytest.raises(ValueError):
        informative_groups(scores, 5)


# --- advantage functions on a scored rollout ----------------------------------------------------


def test_rloo_advantages_with_kl_in_the_reward() -> None:
    ro = _rollout([1.0, 3.0], [True, True])
    # A group of 2: each score minus the other's: -2, +2, at every response token.
    adv, returns = rloo_advantages(ro, _cfg(), 0.0, None)
    assert returns is None
    close(adv, [[-2, -2, -2], [2, 2, 0]])
    # k1 KL sums: both responses log 2; coef 1 shifts both scores equally: the same advantages.
    close(rloo_advantages(ro, _cfg(), 1.0, None)[0], adv)
    # Row 1 twice as far from the reference: k1 [log .25 - log .125, log .5 - log .25] sums to
    # 2 log 2, so with coef 1 the scores are 1 - log 2 and 3 - 2 log 2.
    ro.scored["ref_logps"] = torch.log(t([0.25, 0.5, 0.5], [0.125, 0.25, 1.0]))
    a = (1 - L2) - (3 - 2 * L2)  # = -2 + log 2
    close(rloo_advantages(ro, _cfg(), 1.0, None)[0], [[a, a, a], [-a, -a, 0]])


def test_reinforce_pp_return_to_go_whitened_over_the_batch() -> None:
    ro = _rollout([1.0, 2.0], [True, True])
    # k1 per token: row 0 [log 2, 0, 0], row 1 [0, log 2, pad]; coef 0.5: rewards row 0
    # [-0.5 log 2, 0, 1], row 1 [0, 2 - 0.5 log 2]. Return-to-go (gamma 1): row 0
    # [1 - 0.5 log 2, 1, 1], row 1 [2 - 0.5 log 2, 2 - 0.5 log 2, pad].
    a, b = 1 - 0.5 * L2, 2 - 0.5 * L2
    rtg = [a, 1.0, 1.0, b, b]
    mean, std = statistics.mean(rtg), statistics.stdev(rtg)  # unbiased, over the 5 tokens
    want = [[(a - mean) / std, (1 - mean) / std, (1 - mean) / std], [(b - mean) / std] * 2 + [0]]
    adv, returns = reinforce_pp_advantages(ro, _cfg(), 0.5, None)
    assert returns is None
    close(adv, want)
    # With `reduce`, the statistics are the global batch's: two identical ranks (every sum
    # doubled) keep the mean; the unbiased variance is over 10 tokens: pvariance x 10 / 9.
    sd2 = math.sqrt(statistics.pvariance(rtg) * 10 / 9)
    want2 = [[(v - mean) / sd2 for v in (a, 1.0, 1.0)], [(b - mean) / sd2] * 2 + [0]]
    close(reinforce_pp_advantages(ro, _cfg(), 0.5, lambda x: 2 * x)[0], want2)


# --- registry and presets ------------------------------------------------------------------------


def test_every_grpo_algorithm_is_registered_without_a_critic() -> None:
    names = typing.get_args(GRPOConfig.model_fields["algorithm"].annotation)
    assert set(names) == set(ALGORITHMS) - {"ppo"}
    assert not any(ALGORITHMS[n].critic for n in names)
    assert ALGORITHMS["rloo"].kl_placement == ALGORITHMS["reinforce_pp"].kl_placement == "reward"
    # Every preset names a field of the grpo section (a sub-field for dotted paths).
    for name in names:
        for path in ALGORITHMS[name].presets:
            head, _, leaf = path.partition(".")
            field = GRPOConfig.model_fields[head]
            assert not leaf or leaf in field.default_factory().model_fields, path
    # Every entry names its advantage function, and applies it.
    assert {a.advantage for a in ALGORITHMS.values()} == set(ADVANTAGES)
    assert ADVANTAGES[ALGORITHMS["dr_grpo"].advantage] is grpo_advantages


def test_validating_a_grpo_section_does_not_import_torch() -> None:
    # The flow process validates and plans recipes; torch is for the stage processes.
    import subprocess
    import sys

    code = (
        "import sys; from posttrain.kinds.grpo import GRPOConfig; "
        "GRPOConfig.model_validate({'data': {'synthetic': {}}, 'algorithm': 'dapo'}); "
        "assert 'torch' not in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _grpo(**kw: object) -> GRPOConfig:
    return GRPOConfig.model_validate({"data": {"synthetic": {}}, **kw})


@pytest.mark.parametrize(
    "algorithm, want",
    [
        ("grpo", dict(scale_rewards=True, loss_aggregation="token_mean", kl_coef=0.04)),
        ("dr_grpo", dict(scale_rewards=False, loss_aggregation="token_sum_norm", kl_coef=0.04)),
        (
            "dapo",
            dict(clip_range_high=0.28, kl_coef=0.0, dynamic_sampling=True, scale_rewards=True),
        ),
        ("rloo", dict(scale_rewards=False, loss_aggregation="token_mean")),
        ("reinforce_pp", dict(scale_rewards=False, loss_aggregation="token_mean")),
    ],
)
def test_presets_fill_what_the_recipe_left_out(algorithm: str, want: dict) -> None:
    c = _grpo(algorithm=algorithm)
    got = {k: c.kl.coef if k == "kl_coef" else getattr(c, k) for k in want}
    assert got == want
    # The validated section holds concrete values: validating its dump changes nothing.
    assert GRPOConfig.model_validate(c.model_dump()) == c


def test_fields_the_recipe_sets_win_over_presets() -> None:
    c = _grpo(
        algorithm="dapo",
        kl={"coef": 0.1},
        clip_range_high=0.3,
        dynamic_sampling=False,
        loss_aggregation="sequence_mean",
    )
    assert (c.kl.coef, c.clip_range_high, c.dynamic_sampling) == (0.1, 0.3, False)
    assert c.loss_aggregation == "sequence_mean"
    # A kl section without coef: the preset still sets coef, the estimator stays the recipe's.
    c = _grpo(algorithm="dapo", kl={"estimator": "k1"})
    assert (c.kl.estimator, c.kl.coef) == ("k1", 0.0)
    assert _grpo(algorithm="dr_grpo", scale_rewards=True).scale_rewards is True
    # ppo keeps None (its loop default, token_mean).
    assert PPOConfig.model_validate({"data": {"synthetic": {}}}).loss_aggregation is None


def test_preset_mistakes_name_the_field() -> None:
    with pytest.raises(ValueError, match="scale_rewards"):
        _grpo(algorithm="reinforce_pp", scale_rewards=True)
    with pytest.raises(ValueError, match="dynamic_sampling"):
        PPOConfig.model_validate({"data": {"synthetic": {}}, "dynamic_sampling": True})
    with pytest.raises(ValueError, match="algorithm"):
        _grpo(algorithm="ppo")


# --- Rollout.select / Rollout.cat ----------------------------------------------------------------


def _ro(prompts: list[list[int]], responses: list[list[int]], score0: float) -> Rollout:
    """A scored rollout: prompts left-padded (pad 0), responses right-padded, EOS 9."""
    from posttrain.rl.rollout.sample import left_pad, response_mask

    ids, pmask = left_pad(prompts, 0)
    width = max(len(r) for r in responses)
    resp = torch.tensor([r + [0] * (width - len(r)) for r in responses])
    mask, stopped = response_mask(resp, 9)
    n = len(prompts)
    ro = Rollout(
        ids, pmask, resp, mask, stopped, [[{"role": "user", "content": str(i)}] for i in range(n)]
    )
    ro.scored = {
        "scores": score0 + torch.arange(n, dtype=torch.float),
        "logps": -(resp.float() + 1) * mask,  # a value per token that says which token it is
    }
    return ro


def test_rollout_select_and_cat_keep_rows_aligned() -> None:
    a = _ro([[3, 4], [5]], [[6, 9], [7, 7, 9]], 0.0)  # P 2, R 3
    b = _ro([[1, 2, 3], [4]], [[8, 8, 8, 8], [9]], 10.0)  # P 3, R 4 (row 0 never stopped)
    sel = b.select([1])
    assert (
        sel.n == 1 and sel.messages == [b.messages[1]] and sel.scored["scores"].tolist() == [11.0]
    )
    c = Rollout.cat([a, b], pad_id=0)
    assert c.n == 4 and c.width == (3, 4)
    assert c.prompt_ids.tolist() == [[0, 3, 4], [0, 0, 5], [1, 2, 3], [0, 0, 4]]  # LEFT
    assert c.prompt_mask.tolist() == [[0, 1, 1], [0, 0, 1], [1, 1, 1], [0, 0, 1]]
    assert c.response.tolist() == [[6, 9, 0, 0], [7, 7, 9, 0], [8, 8, 8, 8], [9, 0, 0, 0]]
    assert c.mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert c.stopped.tolist() == [True, True, False, True]
    assert c.scored["scores"].tolist() == [0.0, 1.0, 10.0, 11.0]
    close(c.scored["logps"], -(c.response.float() + 1) * c.mask)  # each token's value kept
    assert c.messages == a.messages + b.messages
    # A row's model input keeps its real tokens and their positions (left padding skipped).
    for old, row in ((a, 1), (b, 0)):
        i = row if old is a else 2 + row
        x, y = old.inputs([row]), c.inputs([i])
        real_x = x["input_ids"][x["attention_mask"] == 1]
        real_y = y["input_ids"][y["attention_mask"] == 1]
        assert real_x.tolist() == real_y.tolist()
        assert (
            x["position_ids"][x["attention_mask"] == 1].tolist()
            == y["position_ids"][y["attention_mask"] == 1].tolist()
        )
    # The selected informative groups of a rollout, then the next round's, in one.
    again = Rollout.cat([a.select([0]), b.select([0, 1])])
    assert again.scored["scores"].tolist() == [0.0, 10.0, 11.0] and again.width == (3, 4)
    with pytest.raises(ValueError, match="scored"):
        b.scored.pop("logps")
        Rollout.cat([a, b])


# --- fingerprints --------------------------------------------------------------------------------


def test_another_algorithm_is_another_fingerprint() -> None:
    from posttrain.config.loader import load_recipe
    from posttrain.plan.planner import plan

    prints = {
        algo: next(
            p.fingerprint
            for p in plan(
                load_recipe(ROOT / "recipes/grpo.yaml", [f"grpo.algorithm={algo}"])
            ).stages
            if p.name == "grpo"
        )
        for algo in ("grpo", "dr_grpo", "rloo")
    }
    assert len(set(prints.values())) == 3
