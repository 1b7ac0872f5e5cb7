"""Steps 3-4 of an online-RL step (posttrain.rl.update): where the KL goes in the
advantages, the policy's per-token objective against hand-computed values, and the update on a
tiny real model: one optimizer step per minibatch whose gradient is that of the minibatch's
global mean, however the minibatch is split into micro-batches."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fixtures_tiny import TinyAssets, one_torch_thread, tiny_assets
from rl_tiny import prompt_rows, role_model, rollout_setup, section

from posttrain.config.batch import ResolvedBatch
from posttrain.config.schema import Recipe
from posttrain.distributed.runtime import DistInfo, init_distributed, shutdown
from posttrain.models.adapters import POLICY
from posttrain.models.roles import VALUE, RoleModel
from posttrain.rl.algorithms import ALGORITHMS
from posttrain.rl.algorithms.advantages import sequence_kl
from posttrain.rl.losses import clipped_policy_loss, clipped_value_loss, kl_penalty
from posttrain.rl.rollout.collect import collect_rollout
from posttrain.rl.rollout.sample import Rollout, forward_groups, response_logps, score
from posttrain.rl.update import Advantages, compute_advantages, policy_terms, update
from posttrain.runtime.context import StageContext
from posttrain.runtime.spec import PlannedStage
from posttrain.sections.shared import OptimConfig
from posttrain.train.session import TrainSession, start_session
from tests.stage_helpers import TINY
from tests.test_rl_losses import _rollout, close, t

L2 = math.log(2)


# --- pure: advantages and the policy's per-token objective --------------------------------------


def _grpo_cfg() -> SimpleNamespace:
    return SimpleNamespace(
        missing_eos_penalty=None,
        kl=SimpleNamespace(estimator="k1"),
        rollout=SimpleNamespace(samples_per_prompt=2),
        scale_rewards=False,
    )


def test_grpo_advantages_take_the_kl_in_the_reward_or_leave_it_to_the_loss() -> None:
    # Two samples of one prompt, 3 and 2 tokens, scores 1 and 3; row 0's KL (k1) is log 2 (its
    # first token), row 1's is made 0.
    ro = _rollout([1.0, 3.0], [True, True])
    ro.scored["ref_logps"][1] = ro.scored["logps"][1]
    mask = ro.mask  # [[1, 1, 1], [1, 1, 0]]
    loss = compute_advantages(ALGORITHMS["grpo"], ro, _grpo_cfg(), 1.0, "loss", None)
    # Scores as they are: minus the group mean 2 -> -1, +1 at every token.
    close(loss.advantages, t([-1, -1, -1], [1, 1, 0]))
    assert (loss.returns, loss.kl_coef, loss.kl_in_loss) == (None, 1.0, 1.0)
    reward = compute_advantages(ALGORITHMS["grpo"], ro, _grpo_cfg(), 1.0, "reward", None)
    # Scores minus 1 x KL: 1 - log 2 and 3, mean 2 - log 2 / 2 -> -/+ (1 + log 2 / 2).
    a = 1 + L2 / 2
    close(reward.advantages, t([-a, -a, -a], [a, a, 0]))
    assert (reward.kl_coef, reward.kl_in_loss) == (1.0, 0.0)
    assert torch.equal(reward.advantages, reward.advantages * mask)


def test_ppo_advantages_hand_on_the_value_targets() -> None:
    ro = _rollout([1.0, 2.0], [True, True])
    cfg = SimpleNamespace(
        missing_eos_penalty=None,
        kl=SimpleNamespace(estimator="k1"),
        gamma=1.0,
        lam=1.0,
        whiten_advantages=False,
    )
    # KL in the loss: rewards are the scores alone, at the last token; gamma = lam = 1, so the
    # value target at t is the score.
    loss = compute_advantages(ALGORITHMS["ppo"], ro, cfg, 0.5, "loss", None)
    assert loss.returns is not None and loss.kl_in_loss == 0.5
    close(loss.returns, t([1, 1, 1], [2, 2, 0]))
    close(loss.advantages, loss.returns - ro.scored["values"] * ro.mask)
    # In the reward: -0.5 x KL at each token (log 2 on row 0's first, row 1's second token).
    reward = compute_advantages(ALGORITHMS["ppo"], ro, cfg, 0.5, "reward", None)
    assert reward.returns is not None and reward.kl_in_loss == 0.0
    close(reward.returns, t([1 - 0.5 * L2, 1, 1], [2 - 0.5 * L2, 2 - 0.5 * L2, 0]))


def test_policy_terms_by_hand() -> None:
    cfg = SimpleNamespace(
        clip_range=0.2, clip_range_high=0.28, entropy_coef=0.1, kl=SimpleNamespace(estimator="k1")
    )
    logp, old, ref = t([0.5, 0.25]).log(), t([0.25, 0.25]).log(), t([0.5, 0.5]).log()
    adv, ent = t([1.0, -1.0]), t([1.0, 2.0])
    per_token, stats = policy_terms(logp, ent, old, ref, adv, cfg, kl_in_loss=0.5)
    # Ratios 2 and 1. Token 0: max(-1 x 2, -1 x clip(2, 0.8, 1.28)) = -1.28, clipped; token 1:
    # max(1, 1) = 1. Minus 0.1 x entropy: -1.38, 0.8. KL (k1) to the reference: 0 and
    # log(0.25 / 0.5) = -log 2, half of it added: -1.38, 0.8 - log 2 / 2.
    close(per_token, t([-1.38, 0.8 - L2 / 2]))
    close(stats["policy_loss"], t([-1.28, 1.0]))
    close(stats["entropy"], ent)
    close(stats["clip_frac"], t([1.0, 0.0]))
    close(stats["approx_kl"], t([0.5 * L2**2, 0.0]))  # half the squared log-ratio to `old`
    close(stats["kl_loss"], t([0.0, -L2]))
    close(stats["tokens"], t([1.0, 1.0]))
    assert list(stats) == ["policy_loss", "entropy", "clip_frac", "approx_kl", "kl_loss", "tokens"]
    # KL placed in the reward: reported, not in the objective.
    no_kl, _ = policy_terms(logp, ent, old, ref, adv, cfg, kl_in_loss=0.0)
    close(no_kl, t([-1.38, 0.8]))


def test_policy_terms_with_the_updates_own_logps_and_no_reference() -> None:
    """The rollout's only update, no KL: the old log-probs are the update's own, detached
    (ratio 1, nothing clipped, the gradient of -advantage x log-prob), and no KL is reported."""
    cfg = SimpleNamespace(
        clip_range=0.2, clip_range_high=None, entropy_coef=0.1, kl=SimpleNamespace(estimator="k1")
    )
    logp = t([0.5, 0.25]).log().requires_grad_(True)
    adv, ent = t([1.0, -2.0]), t([1.0, 2.0])
    per_token, stats = policy_terms(logp, ent, None, None, adv, cfg, kl_in_loss=0.0)
    close(per_token, t([-1.0 - 0.1, 2.0 - 0.2]))
    assert list(stats) == ["policy_loss", "entropy", "clip_frac", "approx_kl", "tokens"]
    close(stats["clip_frac"], t([0.0, 0.0]))
    close(stats["approx_kl"], t([0.0, 0.0]))
    per_token.sum().backward()
    close(logp.grad, -adv)  # d/dlogp of -adv x exp(logp - stop_grad(logp)) at ratio 1


@pytest.mark.parametrize(
    "coef,adaptive,placement,updates,want",
    [
        (0.0, False, "loss", 1, (False, False)),  # GRPO, no KL, one update: no pass at all
        (0.05, False, "loss", 1, (False, True)),  # KL in the loss: the update's logps serve
        (0.05, False, "reward", 1, (True, True)),  # KL in the rewards: needed before the update
        (0.0, False, "reward", 1, (False, False)),  # PPO without KL
        (0.0, True, "loss", 1, (False, True)),  # adaptive: the KL is measured to steer it
        (0.0, False, "loss", 2, (True, False)),  # a second update needs the sampling logps
    ],
)
def test_scoring_passes_by_case(coef, adaptive, placement, updates, want) -> None:
    from posttrain.rl.setup import scoring_passes

    cfg = SimpleNamespace(kl=SimpleNamespace(coef=coef, adaptive=adaptive))
    assert scoring_passes(cfg, placement, updates) == want


# --- the update on a tiny real model ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyAssets:
    return tiny_assets(tmp_path_factory)


@pytest.fixture(scope="module")
def world() -> Iterator[DistInfo]:
    """A gloo world of one: what a one-process stage runs in (the session needs its mesh)."""
    d = init_distributed("cpu", 60, 1)
    yield d
    shutdown()


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


def _session(tmp_path: Path, d: DistInfo, model: RoleModel) -> TrainSession:
    data = copy.deepcopy(TINY)
    data["run"]["workspace"] = str(tmp_path / "ws")
    data["infra"].update(precision="fp32", threads_per_rank=1)
    recipe = Recipe.model_validate(data)
    sft = PlannedStage("sft", "posttrain.stages.sft", "f" * 16, tmp_path / "out", {}, 1, 60.0)
    ctx = StageContext(sft, recipe, {})
    ctx.stage.out_dir.mkdir(parents=True)
    ctx.dist = d
    batch = ResolvedBatch(8, 1, 8, 1)  # the start record's; `update` takes its own
    return start_session(ctx, model, OptimConfig(lr=1e-3), batch, total_steps=1)


def _reference_grad_norm(
    model: RoleModel, ro: Rollout, adv: Advantages, cfg: object, aggregation: str
) -> float:
    """The gradient norm of the objective over all rows in one forward, written out: the
    policy's clipped loss - entropy bonus + KL and vf_coef x the value loss, each a mean over
    tokens (token_mean) or of each response's token mean (sequence_mean)."""
    inp, mask = ro.inputs(list(range(ro.n))), ro.mask
    logp, ent = response_logps(model, POLICY, inp, ro.response, mask, 0, entropy=True)
    pg, _ = clipped_policy_loss(logp, ro.scored["logps"], adv.advantages, cfg.clip_range)
    per_token = pg - cfg.entropy_coef * ent
    per_token = per_token + adv.kl_in_loss * kl_penalty(logp, ro.scored["ref_logps"], "k1")
    vf, _ = clipped_value_loss(
        model(VALUE, **inp), ro.scored["values"], adv.returns, cfg.value_clip
    )

    def mean(x: torch.Tensor) -> torch.Tensor:
        if aggregation == "token_mean":
            return (x * mask).sum() / mask.sum()
        return ((x * mask).sum(1) / mask.sum(1)).mean()

    (mean(per_token) + cfg.vf_coef * mean(vf)).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = float(torch.sqrt(sum((g**2).sum() for g in grads)))
    model.zero_grad(set_to_none=True)
    return norm


def _rollout_of_varied_lengths(tiny: TinyAssets, cfg: object) -> Rollout:
    """A scored 4-row rollout whose responses end at different lengths: stop ids taken from
    the tokens a run without stops sampled (row 0's 2nd, row 2's 4th), sampled again with the
    same seed."""
    rows = prompt_rows(tiny.tokenizer, 8)
    s = rollout_setup(role_model(tiny, True), tiny.tokenizer, cfg, "length")
    full = collect_rollout(replace(s, stop_ids=[-1]), rows, 0).rollout.response
    stops = [int(full[0, 1]), int(full[2, 3])]
    ro = collect_rollout(replace(s, stop_ids=stops), rows, 0).rollout
    assert len(set(ro.mask.sum(1).tolist())) > 1, ro.mask
    return ro


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_update_steps_on_the_minibatchs_global_mean_however_it_is_split(
    tiny, world, tmp_path, aggregation
) -> None:
    cfg = section(
        "ppo",
        rollout={"prompts_per_step": 4, "max_new_tokens": 6},
        entropy_coef=0.01,
        loss_aggregation=aggregation,
        optim={"max_grad_norm": None},
    )
    ro = _rollout_of_varied_lengths(tiny, cfg)
    # Hand-set advantages and value targets (rows differ in sign and size); KL in the loss.
    adv = Advantages(
        t([1.0], [-2.0], [0.5], [3.0]) * ro.mask, t([1.0], [0.0], [-1.0], [2.0]) * ro.mask, 0.1, 0.1
    )
    want = _reference_grad_norm(role_model(tiny, True), ro, adv, cfg, aggregation)
    # The policy starts as the sampling policy and the reference: ratio 1, nothing clipped,
    # no KL; so the policy loss is -advantage and the critic's (values 0) half the squared
    # return, reported as token means whatever the objective's aggregation.
    mask = ro.mask
    policy_loss = float(-(adv.advantages * mask).sum() / mask.sum())
    value_loss = float((0.5 * adv.returns**2 * mask).sum() / mask.sum())
    # By tokens: a budget of the longest row (each row alone or with a short one), and of two.
    longest = int((ro.prompt_mask.sum(1) + ro.response_attn.sum(1)).max())
    splits = [(4, 1, False, None), (2, 2, False, None), (1, 4, False, None), (4, 1, True, None)]
    splits += [(4, 1, True, longest), (4, 1, False, 2 * longest), (1, 4, True, 2 * longest)]
    # Through the chunked head (its scored positions taken on the host), padded and packed.
    splits += [(2, 2, False, None, 3), (1, 4, True, 2 * longest, 3)]
    for micro, accum, packed, by_tokens, *chunk in splits:
        model = role_model(tiny, True)
        before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
        name = f"{aggregation}-{micro}-{packed}-{by_tokens}-{chunk}"
        tr = _session(tmp_path / name, world, model)
        batch = ResolvedBatch(micro, accum, micro * accum, 1)
        chunk_tokens = chunk[0] if chunk else 0
        stats = update(tr, ro, adv, cfg, batch, 0, 1, chunk_tokens, packed, by_tokens)
        assert stats.updates == 1 and stats.lr == pytest.approx(1e-3)
        assert stats.grad_norm == pytest.approx(want, rel=1e-5), (micro, accum, packed, by_tokens)
        m = stats.means
        assert list(m) == ["policy_loss", "entropy", "clip_frac", "approx_kl", "kl_loss"] + [
            "value_loss",
            "value_clip_frac",
        ]
        assert m["policy_loss"] == pytest.approx(policy_loss, abs=1e-5)
        assert m["clip_frac"] == 0.0 and m["value_clip_frac"] == 0.0
        assert m["approx_kl"] == pytest.approx(0.0, abs=1e-10)
        assert m["kl_loss"] == pytest.approx(0.0, abs=1e-6)
        assert m["value_loss"] == pytest.approx(value_loss, rel=1e-6)
        after = [p.detach() for p in model.parameters() if p.requires_grad]
        assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert policy_loss != 0.0 and value_loss > 0.0


def test_rows_laid_end_to_end_score_as_padded_ones(tiny) -> None:
    """`Rollout.packed_inputs`: the policy's log-probs and entropies and the critic's values of
    every row equal the padded forward's, for replies of different lengths and for episodes
    whose tool turns sit between the policy's (attended, not scored)."""
    cfg = section("ppo", rollout={"prompts_per_step": 4, "max_new_tokens": 6})
    ro = _rollout_of_varied_lengths(tiny, cfg)
    episode = replace(ro, attn=ro.response_attn.clone().float(), mask=ro.mask.clone())
    episode.mask[:, 1] = 0.0  # a "tool" token after each reply's first: context only
    model = role_model(tiny, True).eval()
    for r in (ro, episode):
        rows = [3, 0, 2]
        padded, packed = r.inputs(rows), r.packed_inputs(rows)
        n_real = int(r.prompt_mask[rows].sum() + r.response_attn[rows].sum())
        assert packed["input_ids"].shape == (1, n_real)  # not one padding token
        with torch.no_grad():
            for inp in (padded, packed):
                inp["logp"], inp["ent"] = response_logps(
                    model, POLICY, inp, r.response[rows], r.mask[rows], 8, entropy=True
                )
            values = [model(VALUE, **{k: v for k, v in i.items() if k not in ("logp", "ent")})
                      for i in (padded, packed)]  # fmt: skip
        m = r.mask[rows]
        torch.testing.assert_close(packed["logp"] * m, padded["logp"] * m, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed["ent"] * m, padded["ent"] * m, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values[1] * m, values[0] * m, atol=1e-5, rtol=1e-5)


def test_scoring_by_tokens_scores_every_row_as_by_rows(tiny) -> None:
    """`score` with a token budget: forwards regrouped longest first (`forward_groups`), the
    log-probs and values put back in row order, equal to micro-batches of rows."""
    cfg = section("ppo", rollout={"prompts_per_step": 4, "max_new_tokens": 6})
    ro = _rollout_of_varied_lengths(tiny, cfg)
    model = role_model(tiny, True)
    lengths = (ro.prompt_mask.sum(1) + ro.response_attn.sum(1)).tolist()
    budget = int(max(lengths))
    groups = forward_groups(ro, torch.arange(ro.n), 2, budget, torch.device("cpu"))
    assert sorted(i for g in groups for i in g) == list(range(ro.n))
    assert groups != [[0, 1], [2, 3]] and all(sum(lengths[i] for i in g) <= budget or len(g) == 1
                                              for g in groups)  # fmt: skip
    by_rows, by_tokens = replace(ro, scored={}), replace(ro, scored={})
    roles = (POLICY, VALUE)
    for r, budget_ in ((by_rows, None), (by_tokens, budget)):
        score(model, r, tiny.tokenizer, 2, 64, roles, 0, 1.0, True, budget_)
    for k in ("logps", "values"):
        torch.testing.assert_close(by_tokens.scored[k], by_rows.scored[k], atol=1e-5, rtol=1e-5)


def test_the_only_update_without_scoring_passes_steps_as_with_them(tiny, world, tmp_path) -> None:
    """One update per rollout, no KL: a rollout scored without the policy and reference passes
    (`RolloutSetup.score_policy/score_reference` off) trains the same step as one scored with
    them: the update's own log-probs equal the scoring pass's, up to rounding."""
    cfg = section("grpo", rollout={"prompts_per_step": 2, "samples_per_prompt": 2}, kl={"coef": 0})
    rows = prompt_rows(tiny.tokenizer, 4)
    steps = []
    for passes in ((True, True), (False, False)):
        model = role_model(tiny, False)
        s = replace(
            rollout_setup(model, tiny.tokenizer, cfg, "alternating"), score_policy=passes[0]
        )
        s = replace(s, score_reference=passes[1])
        ro = collect_rollout(s, rows, 0).rollout
        assert ("logps" in ro.scored, "ref_logps" in ro.scored) == passes
        adv = compute_advantages(ALGORITHMS["grpo"], ro, cfg, 0.0, "loss", None)
        tr = _session(tmp_path / str(passes[0]), world, model)
        stats = update(tr, ro, adv, cfg, ResolvedBatch(4, 1, 4, 1), seed=5, step=1)
        assert stats.updates == 1
        steps.append((stats, [p.detach().clone() for p in model.parameters() if p.requires_grad]))
    (full, after_full), (own, after_own) = steps
    assert own.grad_norm == pytest.approx(full.grad_norm, rel=1e-5) and own.grad_norm > 0
    assert own.means["policy_loss"] == pytest.approx(full.means["policy_loss"], abs=1e-6)
    assert "kl_loss" in full.means and "kl_loss" not in own.means
    for a, b in zip(after_full, after_own, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_without_a_policy_pass_the_rollout_s_kl_is_the_update_s_own(tiny, world, tmp_path) -> None:
    """KL in the loss, one update per rollout: the policy pass is skipped, the reference's is
    not. The rollout's KL to the reference (the step's `kl`, the adaptive controller's input)
    is then measured from the update's own log-probs, equal to a scoring pass's, never 0."""
    kl = {"coef": 0.04, "placement": "loss"}
    cfg = section("grpo", rollout={"prompts_per_step": 2, "samples_per_prompt": 2}, kl=kl)
    rows = prompt_rows(tiny.tokenizer, 4)
    kls = []
    for score_policy in (True, False):
        model = role_model(tiny, False)
        s = replace(
            rollout_setup(model, tiny.tokenizer, cfg, "alternating"), score_policy=score_policy
        )
        ro = collect_rollout(s, rows, 0).rollout
        assert ("logps" in ro.scored) == score_policy and "ref_logps" in ro.scored
        # A reference the policy has moved away from (at the start they are equal: KL 0).
        ro.scored["ref_logps"] = ro.scored["ref_logps"] - 0.1 * ro.mask
        adv = compute_advantages(ALGORITHMS["grpo"], ro, cfg, 0.04, "loss", None)
        tr = _session(tmp_path / str(score_policy), world, model)
        update(tr, ro, adv, cfg, ResolvedBatch(4, 1, 4, 1), seed=5, step=1)
        kls.append(sequence_kl(ro, "k1"))
    scored, own = kls
    assert float(scored.abs().sum()) > 0
    torch.testing.assert_close(own, scored, rtol=1e-4, atol=1e-6)


def test_update_makes_one_optimizer_step_per_minibatch_and_epoch(tiny, world, tmp_path) -> None:
    cfg = section(
        "grpo",
        update_epochs=2,
        rollout={"prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 4},
    )
    model = role_model(tiny, False)
    s = rollout_setup(model, tiny.tokenizer, cfg, "alternating")
    ro = collect_rollout(s, prompt_rows(tiny.tokenizer, 4), 0).rollout
    adv = compute_advantages(ALGORITHMS["grpo"], ro, cfg, cfg.kl.coef, "loss", None)
    tr = _session(tmp_path, world, model)
    stats = update(tr, ro, adv, cfg, ResolvedBatch(1, 2, 2, 1), seed=5, step=1)
    # 4 sequences, minibatches of 2: 2 updates per epoch, 2 epochs; no critic, no value stats.
    assert stats.updates == 4 and "value_loss" not in stats.means
    assert math.isfinite(stats.grad_norm) and stats.grad_norm > 0


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "padding-free"])
def test_the_update_reads_the_device_once_per_optimizer_step(tiny, world, tmp_path, packed) -> None:
    """No host sync per micro-batch (issue 42): once a minibatch's micro-batches are laid out
    (`lay_out`, host work), their forwards and backwards (policy through the chunked head,
    critic, KL in the loss) read nothing; the optimizer step reads the guard's (loss, grad
    norm) once, and the statistics of the whole update come over in one more read."""
    from test_no_host_sync import _count_host_reads

    from posttrain.rl.losses import loss_weights
    from posttrain.rl.update import Minibatch, device_rows, lay_out, minibatch_backward

    cfg = section("ppo", rollout={"prompts_per_step": 4, "max_new_tokens": 6}, entropy_coef=0.01)
    ro = _rollout_of_varied_lengths(tiny, cfg)
    adv = Advantages(t([1.0], [-2.0], [0.5], [3.0]) * ro.mask, ro.mask.clone(), 0.1, 0.1)
    tr = _session(tmp_path, world, role_model(tiny, True))
    rows = torch.arange(ro.n)
    weights, count = loss_weights(ro.mask, "token_mean", 6)
    micros = lay_out(
        ro, Minibatch(rows, weights, 1 / count), [[0], [1], [2, 3]], packed, tr.dist.device
    )
    dev, sums = device_rows(ro, adv, tr.dist.device), {}
    mp = pytest.MonkeyPatch()
    calls = _count_host_reads(mp)
    try:
        share = minibatch_backward(tr, dev, adv, micros, cfg, 3, sums)
        # Padded: transformers' SDPA mask builder checks each padding mask for padding (as in
        # the SFT step's test), which posttrain leaves be; padding-free reads nothing.
        assert calls == ([] if packed else ["__bool__"] * len(calls)), calls
        assert packed or 0 < len(calls) <= 2 * 2 * len(micros), "at most 2 per forward"
        calls.clear()
        tr.optimizer_step(1.0, loss=share, step=1)
        assert calls == ["tolist"], "one read: the guard's (loss, grad norm)"
        from posttrain.distributed.runtime import all_reduce_sums

        all_reduce_sums(sums, tr.dist.device)
        assert calls == ["tolist"] * 2
    finally:
        mp.undo()
    assert sorted(sums) == sorted(
        ["policy_loss", "entropy", "clip_frac", "approx_kl", "kl_loss", "tokens"]
        + ["value_loss", "value_clip_frac"]
    )
    assert float(sums["tokens"]) == float(ro.mask.sum())
