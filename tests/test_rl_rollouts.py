"""Steps 1-2 of an online-RL step (posttrain.rl.rollout.collect): the prompts a round draws,
the scored rollout `collect_rollout` hands on, and DAPO's dynamic sampling (which groups it
keeps, how many rounds, what tops a short batch up), on a tiny real model; the group selection
and top-up on hand-made rollouts."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from fixtures_tiny import TinyAssets, one_torch_thread, tiny_assets
from rl_tiny import prompt_rows, role_model, rollout_setup, section

from posttrain.data.batching import step_indices
from posttrain.models.adapters import POLICY
from posttrain.rl.losses import informative_groups
from posttrain.rl.rollout.collect import (
    collect_rollout,
    rollout_seed,
    round_prompts,
    select_groups,
    top_up,
)
from posttrain.rl.rollout.sample import Rollout, sample


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyAssets:
    return tiny_assets(tmp_path_factory)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


def _rows(n: int) -> Rollout:
    """n hand-made rows; row i's prompt id and score are i."""
    ids = torch.arange(n)[:, None]
    return Rollout(
        ids,
        torch.ones(n, 1, dtype=torch.long),
        ids + 100,
        torch.ones(n, 1),
        torch.ones(n, dtype=torch.bool),
        [[{"role": "user", "content": str(i)}] for i in range(n)],
        {"scores": torch.arange(n, dtype=torch.float32)},
    )


def test_select_groups_takes_whole_groups_in_the_order_asked() -> None:
    got = select_groups(_rows(6), [2, 0], group=2)  # groups (0 1) (2 3) (4 5)
    assert got.scored["scores"].tolist() == [4, 5, 0, 1]
    assert got.prompt_ids.flatten().tolist() == [4, 5, 0, 1]
    assert select_groups(_rows(6), [], group=2).n == 0


def test_top_up_takes_the_first_groups_of_each_round_in_order() -> None:
    round0, round1 = select_groups(_rows(6), [0, 2], 2), select_groups(_rows(6), [1], 2)
    # Round 0 spared groups (0 1) and (4 5), round 1 spared (2 3).
    fill = top_up([round0, round1], missing=3, group=2)
    assert [f.scored["scores"].tolist() for f in fill] == [[0, 1, 4, 5], [2, 3]]
    fill = top_up([round0, round1], missing=1, group=2)
    assert [f.scored["scores"].tolist() for f in fill] == [[0, 1]]
    assert top_up([round0, round1], missing=0, group=2) == []
    assert top_up([_rows(0), round1], missing=2, group=2)[0].scored["scores"].tolist() == [2, 3]


def test_round_prompts_repeat_each_drawn_prompt_for_its_group(tiny) -> None:
    rows = prompt_rows(tiny.tokenizer, 8)
    cfg = section("grpo", rollout={"prompts_per_step": 2, "samples_per_prompt": 3})
    s = rollout_setup(role_model(tiny, critic=False), tiny.tokenizer, cfg, "length")
    for round_ in (0, 1):
        want = step_indices(8, 5, micro=2, accum=1, dp_size=1, rank=0, seed=3 + round_ * 1_000_003)
        got = round_prompts(s, rows, step=5, round_=round_)
        assert got == [rows[i] for i in want[0] for _ in range(3)]
    # Another round draws other prompts (seeded differently), not the step's own again.
    assert round_prompts(s, rows, 5, 0) != round_prompts(s, rows, 5, 1)


def test_collect_rollout_samples_scores_and_rewards_the_steps_prompts(tiny) -> None:
    """Without groups: one round; the responses are `sample`'s for the step's seed, every
    role scored them (policy = reference at the start: equal log-probs; the zero value head:
    values 0) and the reward is the reward function's."""
    rows = prompt_rows(tiny.tokenizer, 8)
    cfg = section("ppo", rollout={"prompts_per_step": 4, "max_new_tokens": 6})
    model = role_model(tiny, critic=True)
    s = rollout_setup(model, tiny.tokenizer, cfg, "length")
    rb = collect_rollout(s, rows, step=2)
    ro = rb.rollout
    drawn = round_prompts(s, rows, 2, 0)
    assert ro.n == 4 and ro.messages == [r["messages"] for r in drawn]
    want = sample(
        s.engines[POLICY],
        [r["ids"] for r in drawn],
        [r["messages"] for r in drawn],
        cfg.rollout,
        tiny.tokenizer.pad_token_id,
        s.stop_ids,
        rollout_seed(3, 2, 0),
    )
    assert torch.equal(ro.response, want.response) and torch.equal(ro.mask, want.mask)
    assert set(ro.scored) == {
        "logps",
        "ref_logps",
        "values",
        "scores",
        "fn:length",
        "count:reward_fn_s",  # seconds inside the functions, per row
    }
    torch.testing.assert_close(ro.scored["logps"], ro.scored["ref_logps"], atol=1e-6, rtol=0)
    assert (ro.scored["logps"] * ro.mask < 0).sum() == ro.mask.sum()  # log p < 0 on tokens
    assert torch.equal(ro.scored["values"], torch.zeros_like(ro.mask))
    assert ro.scored["scores"].tolist() == ro.mask.sum(1).tolist()  # `length`: tokens
    assert rb.sampling == {} and rb.generation_s > 0 and rb.scoring_s > 0


def _dapo(tiny: TinyAssets, informative: list[bool]) -> tuple:
    cfg = section(
        "grpo",
        algorithm="dapo",
        max_sampling_rounds=3,
        rollout={"prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 4},
    )
    s = rollout_setup(role_model(tiny, critic=False), tiny.tokenizer, cfg, "alternating")
    rows = prompt_rows(tiny.tokenizer, len(informative), informative)
    return s, rows, collect_rollout(s, rows, step=0)


def test_dynamic_sampling_keeps_a_batch_of_informative_groups_in_one_round(tiny) -> None:
    s, rows, rb = _dapo(tiny, [True] * 8)
    assert rb.sampling == {"informative_frac": 1.0, "sampling_rounds": 1, "topped_up_groups": 0}
    assert rb.rollout.messages == [r["messages"] for r in round_prompts(s, rows, 0, 0)]
    assert rb.rollout.scored["scores"].tolist() == [0.0, 1.0, 0.0, 1.0]


def test_dynamic_sampling_tops_up_with_round_0s_groups_when_rounds_run_out(tiny) -> None:
    s, rows, rb = _dapo(tiny, [False] * 8)
    # No group ever scores differently: all 3 rounds run, and the 2 groups per rank come from
    # round 0's dropped ones (zero advantage), so the batch keeps its shape.
    assert rb.sampling == {"informative_frac": 0.0, "sampling_rounds": 3, "topped_up_groups": 2}
    assert rb.rollout.n == 4
    assert rb.rollout.messages == [r["messages"] for r in round_prompts(s, rows, 0, 0)]


def test_dynamic_sampling_fills_the_batch_from_later_rounds(tiny) -> None:
    informative = [i % 2 == 0 for i in range(8)]
    s, rows, rb = _dapo(tiny, informative)
    ro, stats = rb.rollout, rb.sampling
    # The case at hand: round 0 drew an uninformative prompt, so another round ran.
    assert ro.n == 4 and stats["informative_frac"] < 1 and 1 < stats["sampling_rounds"] <= 3
    # Round 0's share of informative groups, then whole groups: informative ones first, the
    # ones topped up (all equal scores) only as many as `topped_up_groups`.
    first = round_prompts(s, rows, 0, 0)
    assert stats["informative_frac"] == sum(r["columns"]["informative"] for r in first) / 4
    kept = informative_groups(ro.scored["scores"], 2)
    assert (~kept).sum() == stats["topped_up_groups"] and kept[: int(kept.sum())].all()
    # A group kept for its scores is an informative prompt's.
    flag = {json.dumps(r["messages"]): r["columns"]["informative"] for r in rows}
    assert len(flag) == len(rows)
    assert [flag[json.dumps(ro.messages[2 * g])] for g in range(2)] == kept.tolist()
