"""A chained recipe through the real flow: SFT -> DPO -> GRPO (reward model beside them), then
evaluate along the chain and export; an edit of the DPO section re-runs DPO and what follows it
only; `export.policy` ships another stage of the chain."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from flows.post_train import post_train
from flows.report.plots import curve_spec
from flows.report.tables import RunResult
from posttrain.config.loader import load_recipe
from posttrain.telemetry.records import read_metrics
from tests.stage_helpers import SMALL_EVALUATE, write_recipe
from tests.test_preference_stages import PREF

pytestmark = pytest.mark.slow

CHAIN = copy.deepcopy(PREF)
CHAIN["run"]["name"] = "chain"
# This checks the wiring of the chain and what an edit re-runs, not what any link learns: a few
# steps of each stage, few held-out rows (scored before and after training) and a small
# evaluate; each stage is a process of its own, and most run twice.
CHAIN["ingest"]["from_config"]["pretrain_steps"] = 5
for _section in ("sft", "reward", "dpo"):
    CHAIN[_section]["max_steps"] = 2
CHAIN["sft"]["data"]["synthetic"]["n_examples"] = 80
CHAIN["dpo"]["data"]["synthetic"]["n_examples"] = 40
CHAIN["evaluate"] = copy.deepcopy(SMALL_EVALUATE)
# The promotion gate (a head-to-head stage against the champion on the re-run) is test_e2e's.
CHAIN["promotion"] = {"enabled": False}
CHAIN["stages"] = [
    {
        "kind": "grpo",
        "name": "grpo",
        "from": "dpo",
        "data": {"synthetic": {"n_examples": 60, "seed": 7}, "eval_fraction": 0.1},
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 2, "max_new_tokens": 8},
        "optim": {"lr": 5e-3},
        "batch": {"micro_batch_size": 8, "grad_accum_steps": 1},
        "max_steps": 2,
        "checkpoint_every": 0,
        "eval_prompts": 4,
    }
]
CHAIN["evaluate"] = {**CHAIN["evaluate"], "policies": ["sft", "dpo", "grpo"]}


def _statuses(result: RunResult) -> dict[str, str]:
    return {r.stage: r.status for r in result.stages}


def _summary(uri: str) -> dict:
    return json.loads((Path(uri) / "manifest.json").read_text())["summary"]


def _tags(card: str) -> list[str]:
    """The model card's front-matter tags."""
    return yaml.safe_load(card.split("---\n")[1])["tags"]


def test_chain_runs_evaluates_each_link_and_reruns_from_an_edit(
    prefect_harness: None, tmp_path: Path
) -> None:
    path = write_recipe(tmp_path, CHAIN)
    first = post_train(load_recipe(path))
    assert _statuses(first) == dict.fromkeys(
        ["ingest", "sft", "reward", "dpo", "grpo", "evaluate", "export"], "ran"
    )
    by = {s.stage: s for s in first.stages}
    # GRPO went on from DPO's policy, held to it, judged by the reward stage.
    grpo = json.loads((Path(by["grpo"].uri) / "reference.json").read_text())
    assert grpo["reference"] == "dpo adapter" and grpo["reward_model"] == "reward"
    grpo_parents = json.loads((Path(by["grpo"].uri) / "manifest.json").read_text())["parents"]
    assert Path(by["dpo"].uri).name in grpo_parents
    # Evaluate: the final policy against its parent and the base, and each link side by side.
    ev = _summary(by["evaluate"].uri)
    assert (ev["policy"], ev["parent"]) == ("grpo", "dpo")
    assert {"base_loss", "tuned_loss", "parent_loss", "win_rate_vs_parent"} <= set(ev["headline"])
    # The base first: sft started from it.
    assert list(ev["policies"]) == ["ingest", "sft", "dpo", "grpo"]
    assert [r["parent"] for r in ev["policies"].values()] == ["", "ingest", "sft", "dpo"]
    assert all("loss" in r and "exact_match" in r for r in ev["policies"].values())
    assert ev["policies"]["ingest"]["loss"] == pytest.approx(ev["headline"]["base_loss"], abs=1e-4)
    # A win-rate needs two adapters: not for the base, nor for SFT against it.
    assert [n for n, r in ev["policies"].items() if "win_rate_vs_parent" in r] == ["dpo", "grpo"]
    report = (Path(first.run_dir) / "report.md").read_text()
    assert "## Along the chain" in report and "| grpo | grpo | dpo |" in report
    # GRPO's KL is its recipe's estimator (k3, never negative), to the DPO policy, and the
    # report and its curve say both.
    assert "kl_estimator=k3" in report and _summary(by["grpo"].uri)["headline"]["eval_kl"] >= 0
    assert "- `grpo`: KL (k3) to the reference, stage `dpo`: " in report
    kl = curve_spec("grpo", read_metrics(Path(by["grpo"].uri) / "metrics.jsonl"))[-1]
    assert (kl.title, kl.ylabel) == ("grpo: KL to dpo (k3)", "KL to dpo (k3, nats/response)")
    assert (Path(first.run_dir) / "graph.png").stat().st_size > 10_000
    export = _summary(by["export"].uri)
    assert export["policy"] == "grpo"
    assert export["adapter_dir"] == str(Path(by["grpo"].uri) / "adapter")
    card = (Path(by["export"].uri) / "model" / "README.md").read_text()
    assert "pipeline: ingest -> sft -> dpo -> grpo -> evaluate -> export." in card
    assert _tags(card)[-3:] == ["sft", "dpo", "grpo"]

    # Editing DPO re-runs DPO and everything after it; ingest, sft and reward are reused. The
    # same run ships DPO's policy instead of the last link's (that this edit alone re-runs export
    # only is the planner's fingerprints: test_stage_graph.py).
    second = post_train(load_recipe(path, ["dpo.beta=0.2", "export.policy=dpo"]))
    assert _statuses(second) == {
        "ingest": "reused",
        "sft": "reused",
        "reward": "reused",
        "dpo": "ran",
        "grpo": "ran",
        "evaluate": "ran",
        "export": "ran",
    }
    by2 = {s.stage: s for s in second.stages}
    assert _summary(by2["export"].uri)["policy"] == "dpo"
    assert _summary(by2["export"].uri)["adapter_dir"] == str(Path(by2["dpo"].uri) / "adapter")
    card = (Path(by2["export"].uri) / "model" / "README.md").read_text()
    assert "pipeline: ingest -> sft -> dpo -> evaluate -> export." in card
    assert _tags(card)[-2:] == ["sft", "dpo"] and "grpo" not in _tags(card)
