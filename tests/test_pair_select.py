"""Online DPO's pair selection on hand-made score tables (k = 4 samples a prompt)."""

import pytest

from posttrain.rl.pair_select import PairSelection, judge_agreement, select_pairs

TABLE = [
    [0.1, 0.9, 0.4, 0.3],  # best 1 (0.9), worst 0 (0.1)
    [1.0, 1.0, 1.0, 1.0],  # all equal: skipped
    [0.0, 1.0, 1.0, 0.0],  # tied maxima 1, 2 and minima 0, 3: the first of each -> (1, 0)
    [-2.0, 0.5, -3.0, 0.5],  # negative scores are fine: best 1, worst 2
]


def test_best_and_worst_form_the_pair() -> None:
    sel = select_pairs(TABLE)
    assert sel.pairs == [(0, 1, 0), (2, 1, 0), (3, 1, 2)]
    assert (sel.informative, sel.all_equal) == (3, 1)
    assert sel.informative_frac == pytest.approx(3 / 4)


def test_tie_eps_skips_groups_within_the_judges_noise() -> None:
    # Spreads (best - worst): 0.8, 0, 1.0, 3.5.
    small = [[0.50, 0.52, 0.49, 0.51], *TABLE]  # spread 0.03
    sel = select_pairs(small, tie_eps=0.05)
    assert sel.pairs == [(1, 1, 0), (3, 1, 0), (4, 1, 2)]
    assert (sel.informative, sel.all_equal) == (3, 2)
    # Without tie_eps, 0.52 vs 0.49 is a pair (1, 2).
    assert select_pairs(small).pairs[0] == (0, 1, 2)
    # The margin must exceed tie_eps: a spread of exactly 1.0 at tie_eps 1.0 is skipped.
    sel = select_pairs(TABLE, tie_eps=1.0)
    assert sel.pairs == [(3, 1, 2)]
    assert (sel.informative, sel.all_equal) == (1, 3)


def test_all_equal_batch_and_empty_batch() -> None:
    sel = select_pairs([[0.0] * 4, [1.0] * 4])
    assert sel == PairSelection(pairs=[], informative=0, all_equal=2)
    assert sel.informative_frac == 0.0
    assert select_pairs([]).informative_frac == 0.0


def test_refusals() -> None:
    with pytest.raises(ValueError, match="k >= 2"):
        select_pairs([[0.1, 0.2], [0.3]])
    with pytest.raises(ValueError, match="NaN"):
        select_pairs([[0.1, float("nan"), 0.2, 0.3]])
    with pytest.raises(ValueError, match="tie_eps"):
        select_pairs(TABLE, tie_eps=-0.1)
    with pytest.raises(ValueError, match="prompts"):
        judge_agreement(TABLE, TABLE[:2])
    with pytest.raises(ValueError, match="prompt 1"):
        judge_agreement(TABLE[:2], [TABLE[0], [1.0, 1.0]])


def test_judge_agreement() -> None:
    # A reward model's scores and the verifiers' 0/1 rewards of the same samples.
    reward_model = [
        [0.1, 0.9, 0.4, 0.3],  # (1, 0)
        [0.2, 0.8, 0.7, 0.6],  # (1, 0)
        [0.9, 0.1, 0.5, 0.5],  # (0, 1)
        [0.3, 0.3, 0.3, 0.3],  # all equal: not informative to the reward model
        [0.6, 0.1, 0.2, 0.9],  # (3, 1)
    ]
    verifiers = [
        [0.0, 1.0, 1.0, 0.0],  # (1, 0): agrees
        [0.0, 0.0, 1.0, 1.0],  # (2, 0): differs (the reward model prefers 1)
        [1.0, 1.0, 1.0, 1.0],  # all equal: not informative to the verifiers
        [1.0, 0.0, 0.0, 0.0],  # (0, 1), but the reward model skipped it
        [0.0, 0.0, 0.0, 1.0],  # (3, 0): differs in the rejected sample (the first tied minimum)
    ]
    # Informative to both: prompts 0, 1, 4; the same pair on prompt 0 only -> 1/3.
    assert judge_agreement(reward_model, verifiers) == pytest.approx(1 / 3)
    assert judge_agreement(reward_model, reward_model) == 1.0
    # No prompt informative to both.
    assert (
        judge_agreement([[1.0] * 4, [0.1, 0.2, 0.3, 0.4]], [[0.1, 0.2, 0.3, 0.4], [0.0] * 4])
        is None
    )
    # tie_eps applies to both judges: at 0.35, the reward model's prompt 1 (spread 0.6) stays,
    # the verifiers' spreads of 1 stay too; prompt 4 (0.8) stays -> still 1/3.
    assert judge_agreement(reward_model, verifiers, tie_eps=0.35) == pytest.approx(1 / 3)
    # At 0.7 the reward model keeps prompts 0 (0.8), 2 (0.8) and 4 (0.8); both: 0 and 4 -> 1/2.
    assert judge_agreement(reward_model, verifiers, tie_eps=0.7) == pytest.approx(1 / 2)
