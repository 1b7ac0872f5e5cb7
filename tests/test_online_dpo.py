"""online_dpo: the section's checks, the judge's pairs on a hand-built rollout, the DPO step's
loss against hand-computed log-probs on a tiny model, and (slow) the stage end to end on one and
two ranks, its policy taken by evaluate."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from pydantic import ValidationError
from rl_tiny import MAX_PROMPT_LEN, prompt_rows, role_model, rollout_setup

from posttrain.config.batch import ResolvedBatch
from posttrain.kinds.online_dpo import OnlineDPOConfig
from posttrain.models.adapters import POLICY
from posttrain.rl.online_dpo import (
    bound_loss,
    check_shapes,
    dpo_update,
    group_scores,
    judge,
    sequence_logps,
)
from posttrain.rl.pair_select import judge_agreement, select_pairs
from posttrain.rl.rollout.collect import collect_rollout
from posttrain.rl.rollout.sample import Rollout, response_logps, row_tokens
from posttrain.telemetry.records import read_metrics
from posttrain.train.preference_losses import sigmoid_loss
from tests.stage_helpers import SMALL_EVALUATE, planned_dir, run_inprocess, run_torchrun
from tests.test_rl_stages import RL, parents, recipe_with, summary  # noqa: F401  (the shared fixture)

# The tiny model, a gloo world of one and one torch thread: the RL update tests' fixtures.
from tests.test_rl_update import _one_thread, _session, tiny, world  # noqa: F401

DATA = {"synthetic": {"n_examples": 16}, "max_prompt_len": MAX_PROMPT_LEN}


def section(**fields: object) -> OnlineDPOConfig:
    return OnlineDPOConfig.model_validate({"data": DATA, **fields})


# --- the section -------------------------------------------------------------------------------


def test_section_defaults_and_what_it_refuses() -> None:
    cfg = section()
    assert (cfg.loss, cfg.beta, cfg.tie_eps, cfg.kl.coef) == ("sigmoid", 0.1, 0.0, 0.0)
    assert cfg.rollout.samples_per_prompt == 4
    # A stage's spec carries the recipe fully dumped: it validates again as it is.
    OnlineDPOConfig.model_validate(cfg.model_dump(mode="json"))
    for fields, message in (
        ({"rollout": {"samples_per_prompt": 1}}, "best and worst"),
        ({"kl": {"coef": 0.05}}, "beta"),
        ({"kl": {"coef": 0.0, "adaptive": True}}, "beta"),
        ({"update_epochs": 2}, "clipped policy-gradient update"),
        ({"clip_range": 0.3}, "clipped policy-gradient update"),
        ({"loss": "kto"}, "loss"),
        ({"tie_eps": -0.1}, "tie_eps"),
    ):
        with pytest.raises(ValidationError, match=message):
            section(**fields)


def test_batch_shapes_one_step_per_rollout() -> None:
    cfg = section(rollout={"prompts_per_step": 4, "samples_per_prompt": 3})
    assert check_shapes("online_dpo", cfg, ResolvedBatch(8, 1, 16, 2), 2) == (6, 1)
    with pytest.raises(ValueError, match="multiple of the 3 ranks"):
        check_shapes("online_dpo", cfg, ResolvedBatch(8, 1, 24, 3), 3)
    with pytest.raises(ValueError, match="leave grad_accum_steps at 1"):
        check_shapes("online_dpo", cfg, ResolvedBatch(4, 2, 16, 2), 2)


# --- the judge ---------------------------------------------------------------------------------


def _judged_rollout(scores: list[float], rm: list[float] | None) -> Rollout:
    """A rollout of len(scores) one-token responses, summed rewards `scores` and, with `rm`,
    the reward model's own scores (weight 1) beside a reward function's (the rest)."""
    n = len(scores)
    ro = Rollout(
        torch.ones(n, 2, dtype=torch.long),
        torch.ones(n, 2, dtype=torch.long),
        torch.ones(n, 1, dtype=torch.long),
        torch.ones(n, 1),
        torch.tensor([True, False] * (n // 2)),
        [[{"role": "user", "content": "q"}]] * n,
    )
    ro.scored["scores"] = torch.tensor(scores)
    if rm is not None:
        ro.scored["rm_scores"] = torch.tensor(rm)
        ro.scored["fn:exact"] = torch.tensor(scores) - torch.tensor(rm)
    return ro


def test_judge_pairs_each_groups_best_and_worst_as_rollout_rows() -> None:
    # Three prompts of three samples: group 0's best is its 3rd, worst its 2nd; group 1 ties;
    # group 2's best is its 1st, worst its 3rd. Rows are group * 3 + sample.
    scores = [0.5, -1.0, 2.0, 0.7, 0.7, 0.7, 3.0, 1.0, 0.0]
    cfg = section(rollout={"samples_per_prompt": 3})
    judged = judge(_judged_rollout(scores, None), cfg, None)
    assert judged.rows == [(2, 1), (6, 8)]
    assert (judged.selection.informative, judged.selection.all_equal) == (2, 1)
    assert judged.agreement is None  # one judge
    # The same groups through select_pairs directly: the judge only maps them to rows.
    want = select_pairs(group_scores(torch.tensor(scores), 3), tie_eps=0.0)
    assert [(g * 3 + c, g * 3 + r) for g, c, r in want.pairs] == judged.rows
    # Best and worst within tie_eps of each other: a tie. Groups 0 and 2 spread by 3.
    wide = section(rollout={"samples_per_prompt": 3}, tie_eps=5.0)
    skipped = judge(_judged_rollout(scores, None), wide, None)
    assert skipped.rows == [] and skipped.selection.all_equal == 3


def test_judge_reads_the_missing_eos_penalty_and_both_judges() -> None:
    # Rows 0 and 2 stopped, 1 and 3 did not: -2 each makes the stopped answer win in both
    # groups, whatever the raw scores say.
    scores = [0.0, 1.0, 0.0, 1.5]
    rm = [1.0, 0.0, 0.0, 1.0]
    cfg = section(rollout={"samples_per_prompt": 2}, missing_eos_penalty=-2.0)
    judged = judge(_judged_rollout(scores, rm), cfg, 1.0)
    assert judged.rows == [(0, 1), (2, 3)]
    rest = [s - r for s, r in zip(scores, rm, strict=True)]
    assert judged.agreement == judge_agreement([rm[:2], rm[2:]], [rest[:2], rest[2:]], 0.0)


# --- the DPO step on a tiny model ----------------------------------------------------------------


def test_dpo_step_loss_is_sigmoid_loss_of_hand_set_log_ratios(tiny, world, tmp_path) -> None:  # noqa: F811
    """The reference's log-probs are set to the policy's minus a known offset per response, so
    each pair's log-ratio margin h is known by hand: the step's loss is -log sigmoid(beta h)
    averaged over the pairs, its accuracy and margin follow, however the pairs are split into
    forwards; a step with no pair takes no optimizer step."""
    cfg = section(
        rollout={"prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 4},
        beta=0.5,
        optim={"max_grad_norm": None},
    )
    model = role_model(tiny, False)
    s = rollout_setup(model, tiny.tokenizer, cfg, "alternating")
    ro = collect_rollout(s, prompt_rows(tiny.tokenizer, 4), 0).rollout
    rows = list(range(ro.n))
    with torch.no_grad():
        pol, _, _ = sequence_logps(model, ro, rows, 0, 1.0, False, torch.device("cpu"))
        tok_pol, _ = response_logps(model, POLICY, ro.inputs(rows), ro.response, ro.mask, 0)
    offsets = torch.tensor([1.0, -0.5, 2.0, 0.25])  # log pi - log ref of each response
    lengths = ro.mask.sum(1)
    ro.scored["ref_logps"] = (tok_pol - (offsets / lengths)[:, None]) * ro.mask
    pairs = [(0, 1), (3, 2)]  # chosen, rejected
    h = torch.tensor([1.0 - -0.5, 0.25 - 2.0])
    want_losses = -F.logsigmoid(0.5 * h)
    ref = torch.tensor([float(pol[i] - offsets[i]) for i in range(4)])
    by_fn, cr, rj = sigmoid_loss(pol[[0, 3]], pol[[1, 2]], ref[[0, 3]], ref[[1, 2]], beta=0.5)
    torch.testing.assert_close(by_fn, want_losses, atol=1e-5, rtol=0)
    norms = []
    # By tokens (`batch.by_tokens`): a budget of the longer pair's two rows, so each pair goes
    # alone (the shorter may not share), and one of both pairs, so they share a forward.
    pair_tokens = sorted(sum(row_tokens(ro)[i] for i in p) for p in pairs)
    for micro, by_tokens in ((2, None), (1, None), (2, pair_tokens[1]), (1, sum(pair_tokens))):
        model = role_model(tiny, False)
        tr = _session(tmp_path / f"m{micro}-{by_tokens}", world, model)
        before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
        stats = dpo_update(tr, ro, pairs, bound_loss(cfg), cfg, micro, step=1, by_tokens=by_tokens)
        assert (stats.pairs, stats.updates) == (2, 1)
        m = stats.means
        assert m["loss"] == pytest.approx(float(want_losses.mean()), abs=1e-5)
        assert m["accuracy"] == 0.5  # the first pair's chosen leads, the second's trails
        assert m["margin"] == pytest.approx(float((0.5 * h).mean()), abs=1e-5)
        assert m["chosen_reward"] == pytest.approx(float(cr.mean()), abs=1e-5)
        assert m["rejected_reward"] == pytest.approx(float(rj.mean()), abs=1e-5)
        after = [p.detach() for p in model.parameters() if p.requires_grad]
        assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
        norms.append(stats.grad_norm)
    assert norms == pytest.approx([norms[0]] * len(norms), rel=1e-5) and norms[0] > 0
    tr = _session(tmp_path / "none", world, role_model(tiny, False))
    none = dpo_update(tr, ro, [], bound_loss(cfg), cfg, 2, step=1)
    assert (none.pairs, none.updates, none.means) == (0, 0, {})
    assert math.isnan(none.grad_norm)


def test_bound_loss_takes_each_losss_hyperparameters() -> None:
    one, zero = torch.ones(1), torch.zeros(1)
    for loss in ("sigmoid", "ipo", "robust", "hinge", "simpo"):
        out = bound_loss(section(loss=loss))(zero, zero, zero, zero, one, one)
        assert len(out) == 3 and torch.isfinite(out[0]).all()


# --- the stage end to end (slow) ---------------------------------------------------------------


ODPO = {
    "data": {"synthetic": {"n_examples": 200, "seed": 7}, "eval_fraction": 0.1,
             "max_prompt_len": 40},
    "optim": {"lr": 5e-3},
    "batch": {"micro_batch_size": 8, "grad_accum_steps": 1},
    "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 12},
    "checkpoint_every": 0,
    "eval_prompts": 8,
}  # fmt: skip


def _check_run(out: Path, steps: int, prompts: int) -> list[dict]:
    train = read_metrics(out / "metrics.jsonl", "train")
    assert len(train) == steps
    for row in train:
        # Every prompt of the step either gave a pair or was skipped as all-equal.
        assert row["pairs"] + row["all_equal"] == prompts, row
        assert row["informative_frac"] == pytest.approx(row["pairs"] / prompts)
        assert math.isfinite(row["score_mean"]) and "kl" not in row
        if row["pairs"]:
            assert row["updates"] == 1
            for key in ("loss", "accuracy", "margin", "chosen_reward", "rejected_reward"):
                assert math.isfinite(row[key]), (key, row)
        else:
            assert row["updates"] == 0 and row["loss"] is None
    return train


@pytest.mark.slow
def test_online_dpo_trains_on_one_rank_and_evaluate_takes_it(parents) -> None:  # noqa: F811
    """Judged by the reward model and a token-overlap check together: the pairs train the
    policy (its adapter moves), both judges' agreement is logged, evaluate and export take the
    online-DPO policy."""
    from safetensors.torch import load_file

    entry = {
        "kind": "online_dpo",
        "name": "odpo",
        "reward_model": "reward",  # named: it joins the reward functions in the judgement
        **ODPO,
        # Graded (exact match would score the tiny policy's answers all 0: no order to agree on)
        "rewards": [{"fn": "posttrain.rewards.match:token_similarity"}],
        "max_steps": 3,
    }
    data = copy.deepcopy(RL) | {"stages": [entry]}
    data["run"]["workspace"] = str(parents["folder"] / "ws")
    data["evaluate"] = copy.deepcopy(SMALL_EVALUATE)  # it takes the policy: no quality asked
    recipe = parents["folder"] / "odpo1.yaml"
    recipe.write_text(yaml.safe_dump(data))
    out = run_inprocess("online_dpo", recipe, name="odpo")
    train = _check_run(out, 3, 4)
    assert sum(r["pairs"] for r in train) > 0
    assert all(0.0 <= r["judge_agreement"] <= 1.0 for r in train)
    s = summary(out)
    assert s["loss_type"] == "sigmoid" and math.isfinite(s["eval_final"]["kl"])
    before = load_file(parents["sft"] / "adapter" / "adapter_model.safetensors")
    after = load_file(out / "adapter" / "adapter_model.safetensors")
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    ev = run_inprocess("evaluate", recipe)
    assert summary(ev)["policy"] == "odpo"
    assert out.name in (ev / "manifest.json").read_text()


@pytest.mark.slow
def test_online_dpo_on_two_ranks_counts_the_groups_it_skips(parents) -> None:  # noqa: F811
    """Judged by exact match alone (no reward model): most groups answer alike (all wrong or
    all right) and are skipped and counted, over both ranks' prompts."""
    section_ = {
        **ODPO,
        "rewards": [{"fn": "posttrain.rewards.match:exact_match"}],
        "max_steps": 2,
    }
    recipe = recipe_with(parents, "online_dpo", section_, "odpo2")
    over = (
        "infra.devices_per_node=2",
        *(f"{s}.batch.micro_batch_size=4" for s in ("sft", "reward")),
    )
    proc = run_torchrun("online_dpo", recipe, 2, *over)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = planned_dir("online_dpo", recipe, *over)
    start = read_metrics(out / "metrics.jsonl", "start")[0]
    assert start["world_size"] == 2 and start["roles"] == "policy,reference"
    train = _check_run(out, 2, 4)
    assert sum(r["all_equal"] for r in train) > 0
    assert "judge_agreement" not in train[0]
    assert (out / "adapter" / "adapter_model.safetensors").exists()
