"""ppo and grpo stages on a tiny model: the shared-trunk roles, sharded rollouts on two ranks,
reward gain within a KL bound, exact resume, and evaluate/export taking the RL policy."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from posttrain.rl.heldout import quality_gate
from posttrain.telemetry.records import read_metrics
from tests.rl_two_rank_worker import two_rank_records
from tests.stage_helpers import (
    crash_after,
    planned_dir,
    run_inprocess,
    run_shared,
    run_torchrun,
    write_recipe,
)
from tests.test_preference_stages import PREF

pytestmark = pytest.mark.slow

RL = copy.deepcopy(PREF)
RL.pop("dpo")
PROMPTS = {"synthetic": {"n_examples": 200, "seed": 7}, "eval_fraction": 0.1, "max_prompt_len": 40}
COMMON = {
    "data": PROMPTS,
    "optim": {"lr": 5e-3},
    "batch": {"micro_batch_size": 8, "grad_accum_steps": 1},
    "max_steps": 12,
    "checkpoint_every": 0,
    "eval_prompts": 16,
    "max_kl": 20.0,
}
PPO = {**COMMON, "rollout": {"prompts_per_step": 8, "max_new_tokens": 16}}
GRPO = {
    **COMMON,
    "rollout": {"prompts_per_step": 8, "samples_per_prompt": 4, "max_new_tokens": 16},
    # Adaptive coefficient with a low target and short horizon, so it visibly moves.
    "kl": {"estimator": "k3", "coef": 0.04, "adaptive": True, "target": 0.5, "horizon": 64},
}


@pytest.fixture(scope="module")
def parents(tmp_path_factory, shared_parents: Path) -> dict:
    """ingest, sft and reward artifacts shared by every RL test (one workspace); they are
    test_preference_stages's too, built once per session."""
    folder = tmp_path_factory.mktemp("rl")
    recipe = write_recipe(folder, {**RL, "ppo": PPO})
    out = {"folder": folder, "recipe": recipe}
    for stage in ("ingest", "sft", "reward"):
        out[stage] = run_shared(stage, recipe, shared_parents)
    return out


def recipe_with(parents: dict, name: str, section: dict, tag: str) -> Path:
    """A recipe with an RL section, in the fixture's workspace (its parents are reused)."""
    data = copy.deepcopy(RL) | {name: section}
    data["run"]["workspace"] = str(parents["folder"] / "ws")
    path = parents["folder"] / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def summary(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())["summary"]


def test_shared_trunk_roles_match_standalone_models(parents) -> None:
    """One base with four adapters reproduces the stand-alone SFT policy and reward model."""
    from peft import PeftModel

    from posttrain.models.adapters import POLICY, REFERENCE
    from posttrain.models.loading import load_base
    from posttrain.models.reward import load_reward_model
    from posttrain.models.roles import REWARD, VALUE, build_roles

    ingest = json.loads((parents["ingest"] / "manifest.json").read_text())
    base, tok = load_base(parents["ingest"], ingest)
    roles = build_roles(base, parents["sft"] / "adapter", parents["reward"] / "adapter", True)
    trainable = {n for n, p in roles.named_parameters() if p.requires_grad}
    assert trainable and all(
        (".default." in n or ".value." in n or "value_head" in n) for n in trainable
    )
    assert any("value_head" in n for n in trainable)

    texts = [
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n2 + 3 = 5.<|im_end|>\n",
        "<|im_start|>user\nSort ascending: 3 1 2<|im_end|>\n<|im_start|>assistant\n1 2 3<|im_end|>\n",
    ]
    enc = tok(
        texts, add_special_tokens=False, padding=True, padding_side="right", return_tensors="pt"
    )
    ids, mask = enc["input_ids"], enc["attention_mask"]
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        shared = roles(REWARD, ids, mask, pos)
        rm = load_reward_model(
            ingest["summary"]["model_dir"], parents["reward"] / "adapter", tok.pad_token_id
        )
        alone = rm(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
        torch.testing.assert_close(shared, alone, atol=1e-5, rtol=0)

        base2, _ = load_base(parents["ingest"], ingest)
        sft = PeftModel.from_pretrained(base2, str(parents["sft"] / "adapter")).eval()
        want = sft(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        torch.testing.assert_close(roles(POLICY, ids, mask, pos), want, atol=1e-5, rtol=0)
        torch.testing.assert_close(roles(REFERENCE, ids, mask, pos), want, atol=1e-5, rtol=0)
        # The critic starts as the reward model: its value at the last token is the score.
        last = mask.sum(1) - 1
        values = roles(VALUE, ids, mask, pos)
        torch.testing.assert_close(values[torch.arange(2), last], alone, atol=1e-5, rtol=0)


def test_sharded_rollout_with_ranks_stopping_at_different_lengths(parents) -> None:
    """Without synced generation this crashes (gloo sees mismatched collectives) or hangs; the
    same for the rollout engine's decode loop (`rollout.drop_finished`). Read off the one
    2-rank worker launch test_agent_rl's episodes share (tests/rl_two_rank_worker.py)."""
    records = two_rank_records(
        *(parents[s] for s in ("ingest", "sft", "reward")), parents["folder"]
    )
    rows = records["rollouts"]
    assert len(rows) == 8
    for r in rows:
        assert r["width"] == (2 if r["rank"] == 0 else 10), r
        assert r["scored"] == ["logps", "ref_logps", "scores", "values"] and r["finite"]
        assert r["same_tokens"], r  # the decode loop samples what generate samples
    # Rows ending at different steps within each rank, through the decode loop that drops them.
    stops = records["stops"]
    assert sorted(r["stop_rank"] for r in stops) == [0, 1]
    for r in stops:
        assert r["same_tokens"] and r["stopped"][0], r


def test_ppo_step_on_two_ranks_with_four_sharded_roles(parents) -> None:
    recipe = recipe_with(parents, "ppo", PPO, "ppo2")
    over = (
        "infra.devices_per_node=2",
        *(f"{s}.batch.micro_batch_size=4" for s in ("sft", "reward")),
        "ppo.batch.micro_batch_size=2",
        "ppo.max_steps=1",
    )
    # SFT and reward come from the 1-rank fixture: same global batch, same artifact. PPO's own
    # result depends on the rank count (rollouts are per rank), so it runs in its own folder.
    assert planned_dir("sft", recipe, *over) == parents["sft"]
    proc = run_torchrun("ppo", recipe, 2, *over)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = planned_dir("ppo", recipe, *over)
    start = read_metrics(out / "metrics.jsonl", "start")[0]
    assert start["world_size"] == 2 and start["roles"] == "policy,reference,reward,value"
    (row,) = read_metrics(out / "metrics.jsonl", "train")
    for key in (
        "score_mean",
        "score_std",
        "kl",
        "clip_frac",
        "approx_kl",
        "value_loss",
        "explained_var",
        "entropy",
        "response_len",
        "generation_s",
        "scoring_s",
        "training_s",
        "generation_share",
        "tokens_per_s",
        "tokens_per_s_per_device",
        "mfu",
        "mem_peak_rss_gib",
    ):
        assert key in row, key
    # 4 prompts per rank over micro-batches of 2 and accumulation 1: 2 updates per rollout.
    assert row["updates"] == 2
    assert (out / "adapter" / "adapter_model.safetensors").exists()
    from safetensors.torch import load_file

    critic = load_file(out / "critic" / "critic.safetensors")
    assert "value_head.weight" in critic and any(".lora_A.value." in k for k in critic)
    assert not any(".default." in k or ".reward." in k for k in critic)


@pytest.fixture(scope="module")
def ppo_run(parents) -> Path:
    return run_inprocess("ppo", recipe_with(parents, "ppo", PPO, "ppo1"))


@pytest.fixture(scope="module")
def grpo_run(parents) -> Path:
    return run_inprocess("grpo", recipe_with(parents, "grpo", GRPO, "grpo1"))


@pytest.mark.parametrize("run", ["ppo_run", "grpo_run"])
def test_rl_raises_heldout_reward_within_kl_bound(run, request) -> None:
    out = request.getfixturevalue(run)
    s = summary(out)
    final, sft = s["eval_final"], s["eval_sft"]
    assert final["prompts"] == sft["prompts"] == 16
    assert final["reward"] > sft["reward"], (final, sft)
    assert final["reward_gain"] == pytest.approx(final["reward"] - sft["reward"])
    assert 0 < final["kl"] <= 20.0
    assert s["gate"] == {"passed": True}
    train = read_metrics(out / "metrics.jsonl", "train")
    assert len(train) == 12
    assert train[0]["kl"] == pytest.approx(0.0, abs=1e-5)  # the policy starts as the reference
    first, last = (sum(r["score_mean"] for r in rs) / 4 for rs in (train[:4], train[-4:]))
    assert last > first, (first, last)


def test_grpo_trains_no_critic_and_puts_kl_in_the_loss(grpo_run) -> None:
    start = read_metrics(grpo_run / "metrics.jsonl", "start")[0]
    assert start["roles"] == "policy,reference,reward" and start["kl_placement"] == "loss"
    # The KL it reports, gates and adapts to is the recipe's estimator, to the SFT stage.
    assert (start["kl_estimator"], start["reference"]) == ("k3", "sft")
    s = summary(grpo_run)
    assert s["kl_estimator"] == "k3" and s["headline"]["kl_estimator"] == "k3"
    assert s["eval_final"]["kl"] >= 0  # k3 is never negative
    train = read_metrics(grpo_run / "metrics.jsonl", "train")
    assert "value_loss" not in train[0] and train[-1]["kl_loss"] > 0
    # The KL rises above the 0.5 target, so the adaptive controller raises the coefficient.
    coefs = [r["kl_coef"] for r in train]
    assert coefs[0] == 0.04 and coefs[-1] > coefs[0]
    assert summary(grpo_run)["kl_coef_final"] >= coefs[-1]
    assert not (grpo_run / "critic").exists()


@pytest.mark.parametrize("algorithm", ["dr_grpo", "dapo", "rloo", "reinforce_pp"])
def test_grpo_family_algorithms_train_the_policy(parents, algorithm) -> None:
    """Each GRPO-family algorithm runs the real stage for a few rollouts: it completes, its
    metrics are finite and the policy's adapter moved away from the SFT one."""
    from safetensors.torch import load_file

    section = {
        **COMMON,
        "algorithm": algorithm,
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 2, "max_new_tokens": 8},
        "max_steps": 2,
        "eval_prompts": 4,
        "max_kl": None,
    }
    out = run_inprocess("grpo", recipe_with(parents, "grpo", section, f"algo-{algorithm}"))
    start = read_metrics(out / "metrics.jsonl", "start")[0]
    assert start["roles"] == "policy,reference,reward"
    want = "reward" if algorithm in ("rloo", "reinforce_pp") else "loss"
    assert start["kl_placement"] == want
    train = read_metrics(out / "metrics.jsonl", "train")
    assert len(train) == 2
    # DAPO has no KL (its preset's coefficient is 0): its rollouts are not scored by the
    # reference, and no KL is logged.
    keys = ("loss", "policy_loss", "entropy", "clip_frac", "score_mean")
    for row in train:
        assert ("kl" in row) is (algorithm != "dapo"), row
        for key in keys + (("kl",) if algorithm != "dapo" else ()):
            assert math.isfinite(row[key]), (key, row)
    assert math.isfinite(summary(out)["eval_final"]["reward"])
    before = load_file(parents["sft"] / "adapter" / "adapter_model.safetensors")
    after = load_file(out / "adapter" / "adapter_model.safetensors")
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_grpo_without_kl_and_one_update_runs_no_scoring_pass(parents, capfd) -> None:
    """kl.coef 0 and one update per rollout (8 sequences, micro 8): neither the policy nor the
    reference scores the rollout; the stage says so, trains, and logs no KL."""
    section = {
        **COMMON,
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 2, "max_new_tokens": 8},
        "kl": {"coef": 0.0},
        "max_steps": 3,
        "eval_prompts": 4,
    }
    out = run_inprocess("grpo", recipe_with(parents, "grpo", section, "no-passes"))
    log = capfd.readouterr().out  # stage_main logs to stdout
    assert "no policy scoring pass: one update per rollout" in log
    assert "no reference scoring pass: kl.coef 0" in log
    train = read_metrics(out / "metrics.jsonl", "train")
    assert len(train) == 3 and all(r["updates"] == 1 for r in train)
    assert all("kl" not in r and "kl_loss" not in r for r in train)
    assert all(r["clip_frac"] == 0.0 and math.isfinite(r["policy_loss"]) for r in train)
    assert math.isfinite(summary(out)["eval_final"]["kl"])  # held out, still measured


def test_grpo_by_tokens_scores_and_updates_as_by_rows(parents) -> None:
    """`batch.by_tokens` on GRPO: the scoring passes and the update's forwards regrouped into
    at most 40 tokens (a few rows each) instead of 8 rows: the same rollout, KL, loss and
    gradient at the first step (the sampler's weights are the same; later steps may sample
    differently once float rounding of the updates differs)."""
    section = {
        **COMMON,
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 2, "max_new_tokens": 8},
        "update_epochs": 2,  # a second update: the policy scoring pass runs too
        "max_steps": 1,
        "eval_prompts": 4,
    }
    runs = []
    for tag, extra in (("rows", {}), ("tokens", {"by_tokens": 40})):
        s = {**section, "batch": {"micro_batch_size": 8, "grad_accum_steps": 1, **extra}}
        out = run_inprocess("grpo", recipe_with(parents, "grpo", s, f"by-{tag}"))
        start = read_metrics(out / "metrics.jsonl", "start")[0]
        assert start["by_tokens"] == extra.get("by_tokens")
        runs.append(read_metrics(out / "metrics.jsonl", "train")[0])
        shutil.rmtree(out)  # the layout is not fingerprinted: the next run would reuse this
    rows, tokens = runs
    assert rows["score_mean"] == tokens["score_mean"]  # the same samples
    for key in ("loss", "policy_loss", "kl", "entropy"):
        assert tokens[key] == pytest.approx(rows[key], abs=1e-5), key
    assert tokens["grad_norm"] == pytest.approx(rows["grad_norm"], rel=1e-4)


def test_gates_stop_on_kl_and_reward_gain(parents, ppo_run) -> None:
    from flows.post_train import check_gate
    from flows.report.tables import StageRecord
    from flows.stage.failures import QualityGateFailed
    from posttrain.kinds.ppo import PPOConfig
    from posttrain.store.summary import read_summary

    check_gate(read_summary(ppo_run), StageRecord("ppo", "f", "ran", 1.0))  # passed
    s = summary(ppo_run)
    cfg = PPOConfig.model_validate({"data": PROMPTS, "min_reward_gain": 1e6})
    assert "below min_reward_gain" in quality_gate(cfg, s["eval_final"], s["eval_sft"])["message"]
    out = run_inprocess(
        "ppo", recipe_with(parents, "ppo", {**PPO, "max_steps": 2, "max_kl": 1e-3}, "ppo_gate")
    )
    gate = summary(out)["gate"]
    assert gate["passed"] is False and "exceeds max_kl 0.001" in gate["message"]
    record = StageRecord("ppo", "f", "ran", 1.0)
    with pytest.raises(QualityGateFailed, match="max_kl"):
        check_gate(read_summary(out), record)
    assert record.error.startswith("quality gate:")


def test_ppo_crash_resumes_to_the_same_trajectory(parents) -> None:
    section = {**PPO, "max_steps": 4, "checkpoint_every": 2}
    recipe = recipe_with(parents, "ppo", section, "ppo_resume")
    out = run_inprocess("ppo", recipe)
    full = read_metrics(out / "metrics.jsonl", "train")
    ckpt = json.loads((out / "checkpoints" / "step_0000002" / "meta.json").read_text())
    assert "kl_coef" in ckpt and ckpt["data"]["samples_seen"] == 2 * 8  # prompts
    # A crash during step 3: no outputs, metrics up to step 3, the step-2 checkpoint on disk.
    crash_after(out, 3, ("adapter", "critic"))
    run_inprocess("ppo", recipe)
    resumed = read_metrics(out / "metrics.jsonl", "train")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(full[2:], resumed[2:], strict=True):
        for key in ("score_mean", "kl", "loss", "value_loss", "response_len"):
            assert b[key] == pytest.approx(a[key], abs=1e-6), key


def test_evaluate_and_export_take_the_rl_policy(parents, ppo_run) -> None:
    """Downstream of ppo, evaluate compares the PPO policy with the SFT policy (win-rate judged
    by the reward model) and export merges the PPO adapter, not the SFT one."""
    recipe = recipe_with(parents, "ppo", PPO, "ppo1")
    ev = run_inprocess("evaluate", recipe)
    s = summary(ev)
    assert s["policy"] == "ppo" and "dpo_implicit" not in s
    wr = s["win_rate_vs_parent"]
    assert wr["wins"] + wr["losses"] + wr["ties"] == wr["n"] > 0
    manifest = json.loads((ev / "manifest.json").read_text())
    assert ppo_run.name in manifest["parents"]
    ex = run_inprocess("export", recipe)
    card = (ex / "model" / "README.md").read_text()
    assert ppo_run.name in card  # the lineage names the PPO artifact
    assert summary(ex)["policy"] == "ppo"
    assert summary(ex)["adapter_dir"] == str(ppo_run / "adapter")
    assert summary(ex)["verification"]["max_abs_logit_diff"] < 1e-3


def test_grpo_on_the_fast_engine_samples_as_the_hf_engine(parents) -> None:
    """`rollout.engine: fast` runs the whole GRPO stage: its merged fp32 copy samples the first
    rollout the `hf` engine samples (same rewards and lengths), and every step logs the probe
    that compared the refreshed copy with the trainer."""
    section = {
        **COMMON,
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 2, "max_new_tokens": 8},
        "max_steps": 2,
        "eval_prompts": 4,
        "max_kl": None,
    }
    fast = {**section, "rollout": {**section["rollout"], "engine": "fast"}}
    runs = {
        tag: read_metrics(
            run_inprocess("grpo", recipe_with(parents, "grpo", s, f"engine-{tag}"))
            / "metrics.jsonl",
            "train",
        )
        for tag, s in (("hf", section), ("fast", fast))
    }
    hf, fa = runs["hf"][0], runs["fast"][0]
    for key in ("score_mean", "response_len"):
        assert fa[key] == pytest.approx(hf[key], abs=1e-6), key
    assert all(r["sampler_probe_mean"] < 1e-3 for r in runs["fast"])
    assert all(r["sampler_probe_max"] < 1e-2 for r in runs["fast"])
    assert "sampler_probe_mean" not in hf


def test_grpo_on_the_fast_engine_on_two_sharded_ranks(parents) -> None:
    """Under FSDP2 on 2 ranks each rank's copy is gathered whole from the shards
    (`DTensor.full_tensor`, a collective at every refresh), samples on its own (no collective),
    and passes the probe after every update."""
    section = {
        **COMMON,
        "rollout": {
            "prompts_per_step": 4,
            "samples_per_prompt": 2,
            "max_new_tokens": 8,
            "engine": "fast",
        },
        "batch": {"micro_batch_size": 2, "grad_accum_steps": 1},
        "max_steps": 2,
        "eval_prompts": 4,
        "max_kl": None,
    }
    recipe = recipe_with(parents, "grpo", section, "fast2")
    over = (
        "infra.devices_per_node=2",
        *(f"{s}.batch.micro_batch_size=4" for s in ("sft", "reward")),
    )
    proc = run_torchrun("grpo", recipe, 2, *over)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = planned_dir("grpo", recipe, *over)
    train = read_metrics(out / "metrics.jsonl", "train")
    assert len(train) == 2
    assert all(r["sampler_probe_mean"] < 1e-3 for r in train), train
