"""One update behind (posttrain.rl.rollout.offpolicy,
posttrain.rl.losses.truncated_importance_weights): the weights by hand, the staleness check,
the policy snapshot on a tiny real role model, and the background generation's hand-over."""

from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import pytest
import torch
from fixtures_tiny import TinyAssets, tiny_assets
from rl_tiny import role_model

from posttrain.models.adapters import POLICY
from posttrain.rl.losses import truncated_importance_weights
from posttrain.rl.rollout.offpolicy import PolicySnapshot, Prefetch, StaleRollout, staleness
from posttrain.rl.rollout.sample import Rollout
from posttrain.rl.update import policy_terms


def t(x: list) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyAssets:
    return tiny_assets(tmp_path_factory)


def test_truncated_importance_weights_by_hand() -> None:
    # Row 0 lagged: p_now / p_sampled = 0.5 / 0.25 = 2 (under the cap 3), 0.9 / 0.1 = 9
    # (truncated to 3), 0.2 / 0.4 = 0.5. Row 1 was sampled by the update's own weights: 1.
    old = t([[0.5, 0.9, 0.2], [0.3, 0.3, 0.3]]).log()
    behaviour = t([[0.25, 0.1, 0.4], [0.9, 0.01, 0.3]]).log()
    w, truncated = truncated_importance_weights(old, behaviour, torch.tensor([True, False]), 3.0)
    close(w, t([[2.0, 3.0, 0.5], [1.0, 1.0, 1.0]]))
    assert truncated.tolist() == [[False, True, False], [False, False, False]]


def test_policy_terms_weight_the_lagged_rows_surrogate() -> None:
    """The rollout's only update (old = the update's own log-probs: ratio 1), row 0 sampled one
    update behind with p_sampled = p_now / 2 on token 0 and 4 x p_now on token 1: weights
    min(2, 1.5) = 1.5 (truncated) and 0.25; row 1 fresh, weight 1. The surrogate -A x ratio is
    multiplied by the weight, and so is its gradient: -A x w."""
    cfg = SimpleNamespace(
        clip_range=0.2,
        clip_range_high=None,
        entropy_coef=0.0,
        kl=SimpleNamespace(estimator="k1"),
        rollout=SimpleNamespace(importance_weight_cap=1.5),
    )
    logp = t([[0.4, 0.2], [0.5, 0.5]]).log().requires_grad_(True)
    behaviour = t([[0.2, 0.8], [0.1, 0.1]]).log()
    adv = t([[1.0, -1.0], [2.0, 2.0]])
    lagged = (behaviour, torch.tensor([True, False]))
    per_token, stats = policy_terms(logp, torch.zeros(2, 2), None, None, adv, cfg, 0.0, lagged)
    close(per_token, t([[-1.5, 0.25], [-2.0, -2.0]]))
    close(stats["is_weight"], t([[1.5, 0.25], [1.0, 1.0]]))
    close(stats["is_clip_frac"], t([[1.0, 0.0], [0.0, 0.0]]))
    close(stats["policy_loss"], per_token)
    per_token.sum().backward()
    close(logp.grad, t([[-1.5, 0.25], [-2.0, -2.0]]))
    # Without lagged rows: the synchronous loop's terms exactly.
    plain, plain_stats = policy_terms(logp, torch.zeros(2, 2), None, None, adv, cfg, 0.0)
    close(plain, -adv)
    assert "is_weight" not in plain_stats


def _rollout(versions: list[int] | None) -> Rollout:
    n = 2 if versions is None else len(versions)
    z = torch.zeros(n, 1, dtype=torch.long)
    ro = Rollout(z, z, z, z.float(), torch.ones(n, dtype=torch.bool), [[]] * n)
    ro.versions = None if versions is None else torch.tensor(versions)
    return ro


def test_staleness_is_measured_per_row_and_refused_past_the_limit() -> None:
    assert staleness(_rollout([4, 3, 4]), 4, 1).tolist() == [0, 1, 0]
    assert staleness(_rollout([4, 4]), 4, 0).tolist() == [0, 0]
    with pytest.raises(StaleRollout, match=r"versions \[3\] reached the update of version 4"):
        staleness(_rollout([3]), 4, 0)
    with pytest.raises(StaleRollout, match="max_staleness is 1"):
        staleness(_rollout([2, 4]), 4, 1)
    with pytest.raises(StaleRollout, match=r"versions \[5\]"):
        staleness(_rollout([5]), 4, 1)  # from weights the trainer never had
    with pytest.raises(StaleRollout, match="without the version"):
        staleness(_rollout(None), 4, 1)


def test_the_snapshot_scores_with_the_policy_as_it_was(tiny: TinyAssets) -> None:
    model = role_model(tiny, critic=False)
    ids = torch.tensor([[5, 6, 7, 8]])
    inp = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": ids * 0}
    inp["position_ids"] = torch.arange(4)[None]

    def logits() -> torch.Tensor:
        with torch.no_grad():
            return model(POLICY, **inp)

    before = logits()
    snap = PolicySnapshot(model)
    assert snap.params and all(p.requires_grad for p in snap.params)
    snap.take()
    with torch.no_grad():
        for p in snap.params:
            p.add_(0.05)  # an update
    after = logits()
    assert not torch.allclose(before, after)
    with snap.active():
        close(logits(), before)
    close(logits(), after)  # the update's weights are back


def test_prefetch_hands_over_its_result_or_its_error() -> None:
    pre = Prefetch()
    assert pre.take(3) is None  # nothing started for that step
    gate = threading.Event()
    pre.start(3, lambda: gate.wait(5) and "rollout 3")
    assert pre.take(2) is None
    gate.set()
    assert pre.take(3) == "rollout 3" and pre.seconds >= 0
    pre.start(4, lambda: math.sqrt(-1))
    pre.wait()
    with pytest.raises(ValueError, match="math domain"):
        pre.take(4)
