"""Choosing which stages run (issue 29 point 4): `--until`/`--only` on real plans, evaluate and
export turned off in the recipe, and what the CLI, the gate and the report make of both."""

from __future__ import annotations

import copy
import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from flows.cli import main
from flows.gate import promote
from flows.report.tables import StageRecord, markdown_report
from posttrain.config.loader import RecipeError, load_recipe, resolve, validate_recipe
from posttrain.plan.planner import plan
from posttrain.plan.selection import (
    Selection,
    SelectionError,
    choose,
    complete_stages,
    select_stages,
)
from posttrain.store.artifacts import write_manifest
from posttrain.store.summary import Summary

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
ORDER = ["ingest", "sft", "reward", "dpo", "evaluate", "export"]
DATA = {"data": {"synthetic": {}}}
CHAIN: dict[str, Any] = {
    "run": {"name": "chain", "workspace": "/tmp/posttrain-selection-test"},
    "infra": {"device": "cpu", "precision": "fp32"},
    "ingest": {"source": "from_config"},
    "stages": [
        {"kind": "sft", **DATA},
        {"kind": "reward", **DATA},
        {"kind": "dpo", **DATA},
        {"kind": "grpo", **DATA},
        {"kind": "sft", "name": "rs_sft", **DATA},
    ],
}


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> Any:
    ws = tmp_path_factory.mktemp("ws")
    return plan(load_recipe(QUICKSTART, [f"run.workspace={ws}"]))


def chosen(run_plan: Any, until=(), only=(), complete=()) -> list[str]:
    stages = select_stages(run_plan.stages, Selection(tuple(until), tuple(only)), set(complete))
    return [s.name for s in stages]


def test_until_keeps_the_stage_and_what_it_reads_upstream_only(quickstart) -> None:
    assert chosen(quickstart) == ["ingest", "sft", "reward", "dpo", "evaluate", "export"]
    assert chosen(quickstart, until=["sft"]) == ["ingest", "sft"]
    # The quickstart's DPO starts from SFT and uses no reward model: reward is not upstream.
    assert chosen(quickstart, until=["dpo"]) == ["ingest", "sft", "dpo"]
    # evaluate reads the reward model (accuracy, win-rate) and the final policy.
    assert chosen(quickstart, until=["evaluate"]) == ["ingest", "sft", "reward", "dpo", "evaluate"]
    assert chosen(quickstart, until=["reward", "dpo"]) == ["ingest", "sft", "reward", "dpo"]


def test_only_reuses_complete_inputs_and_names_the_missing_ones(quickstart) -> None:
    done = {"ingest", "sft", "reward", "dpo"}
    assert chosen(quickstart, only=["evaluate"], complete=done) == [
        *sorted(done, key=ORDER.index),
        "evaluate",
    ]
    # Two names: an --only stage may feed another; only the rest must be complete.
    assert chosen(quickstart, only=["dpo", "evaluate"], complete={"ingest", "sft", "reward"}) == [
        "ingest",
        "sft",
        "reward",
        "dpo",
        "evaluate",
    ]
    with pytest.raises(SelectionError) as exc:
        select_stages(
            quickstart.stages,
            Selection(only=("evaluate",)),
            {"ingest", "sft"},
            "posttrain run recipes/quickstart.yaml",
        )
    assert str(exc.value) == (
        "--only evaluate: reward, dpo are not complete in this workspace (evaluate needs them); "
        "run `posttrain run recipes/quickstart.yaml --until evaluate` to run or reuse what "
        "evaluate needs"
    )
    with pytest.raises(SelectionError, match=r"^--only sft: ingest is not complete .*needs it\)"):
        select_stages(quickstart.stages, Selection(only=("sft",)), set())
    # --until covers what an --only stage needs: nothing must be complete then.
    assert chosen(quickstart, until=["sft"], only=["reward"]) == ["ingest", "sft", "reward"]


def test_selection_on_a_chain_of_stages_entries() -> None:
    run_plan = plan(resolve(validate_recipe(copy.deepcopy(CHAIN))))
    assert chosen(run_plan, until=["grpo"]) == ["ingest", "sft", "reward", "dpo", "grpo"]
    assert chosen(run_plan, until=["reward"]) == ["ingest", "sft", "reward"]
    assert chosen(
        run_plan, only=["rs_sft"], complete={"ingest", "sft", "reward", "dpo", "grpo"}
    ) == [
        "ingest",
        "sft",
        "reward",
        "dpo",
        "grpo",
        "rs_sft",
    ]
    with pytest.raises(SelectionError, match=r"--only rs_sft: grpo is not complete"):
        select_stages(
            run_plan.stages, Selection(only=("rs_sft",)), {"ingest", "sft", "reward", "dpo"}
        )


def test_unknown_and_switched_off_stages_are_refused_with_the_list(quickstart) -> None:
    with pytest.raises(SelectionError) as exc:
        select_stages(quickstart.stages, Selection(("sfft",), ("evalute", "zzz")), set())
    assert str(exc.value) == (
        "--until sfft: no stage of that name (did you mean sft?); "
        "--only evalute: no stage of that name (did you mean evaluate?); "
        "--only zzz: no stage of that name; "
        "stages: ingest, sft, reward, dpo, evaluate, export"
    )
    off = plan(resolve(validate_recipe({**copy.deepcopy(CHAIN), "export": None})))
    with pytest.raises(SelectionError, match=r"--until export: export is off in this recipe"):
        select_stages(off.stages, Selection(until=("export",)), set())


def test_flags_repeat_and_take_commas() -> None:
    s = Selection.of(["dpo,evaluate", " export "], None)
    assert s == Selection(only=(), until=("dpo", "evaluate", "export"))
    assert not Selection.of(None, []) and s.flags() == "--until dpo --until evaluate --until export"


def test_choose_reads_completeness_from_the_workspace(tmp_path: Path) -> None:
    run_plan = plan(load_recipe(QUICKSTART, [f"run.workspace={tmp_path}"]))
    assert complete_stages(run_plan.stages) == set()
    for stage in run_plan.stages[:3]:  # a manifest of the planned fingerprint = done
        stage.out_dir.mkdir(parents=True)
        # reward's manifest names another fingerprint: not what this plan asks for.
        fp = "0" * 16 if stage.name == "reward" else stage.fingerprint
        write_manifest(stage.out_dir, stage="x", fp=fp, parents=[], section={}, seed=0, summary={})
    assert complete_stages(run_plan.stages) == {"ingest", "sft"}
    narrowed = choose(run_plan, Selection(only=("dpo",)))
    assert [s.name for s in narrowed.stages] == ["ingest", "sft", "dpo"]
    assert narrowed.not_selected == ["reward", "evaluate", "export"]
    assert choose(run_plan, Selection()) is run_plan


# --- evaluate and export off ------------------------------------------------------------------


def fingerprints(data: dict[str, Any]) -> dict[str, str]:
    return {
        s.name: s.fingerprint for s in plan(resolve(validate_recipe(copy.deepcopy(data)))).stages
    }


def test_evaluate_and_export_may_be_null_without_moving_other_fingerprints() -> None:
    full = fingerprints(CHAIN)
    no_export = fingerprints({**CHAIN, "export": None})
    assert list(no_export) == ["ingest", "sft", "reward", "dpo", "grpo", "rs_sft", "evaluate"]
    assert no_export == {n: fp for n, fp in full.items() if n != "export"}
    neither = fingerprints({**CHAIN, "evaluate": None, "export": None})
    assert neither == {n: fp for n, fp in full.items() if n not in ("evaluate", "export")}
    # Export without evaluate reads no evaluation: another artifact than the full recipe's.
    no_eval = plan(resolve(validate_recipe({**copy.deepcopy(CHAIN), "evaluate": None})))
    assert "evaluation" not in no_eval.stage("export").roles
    assert no_eval.stage("export").fingerprint != full["export"]


def test_evaluate_null_turns_the_gate_off_and_an_explicit_gate_is_refused() -> None:
    r = validate_recipe({**copy.deepcopy(CHAIN), "evaluate": None})
    assert r.evaluate is None and not r.promotion.enabled
    # The dumped recipe (a served run's parameter) validates again to the same.
    again = validate_recipe(r.model_dump(mode="json"))
    assert again.evaluate is None and not again.promotion.enabled
    with pytest.raises(RecipeError) as exc:
        validate_recipe({**copy.deepcopy(CHAIN), "evaluate": None, "promotion": {"enabled": True}})
    assert any(
        e.startswith("promotion.rules: compare the evaluate stage's metrics (tuned_loss,")
        and e.endswith("but `evaluate` is null: keep evaluate, or set promotion.enabled: false")
        for e in exc.value.errors
    ), exc.value.errors
    no_rules = {"enabled": True, "rules": []}
    assert validate_recipe({**copy.deepcopy(CHAIN), "evaluate": None, "promotion": no_rules})


# --- the CLI, the gate and the report ---------------------------------------------------------


def test_plan_shows_what_a_selection_runs(tmp_path: Path, capsys) -> None:
    ws = f"run.workspace={tmp_path}"
    # Overrides may follow the flags.
    assert main(["plan", str(QUICKSTART), "--until", "dpo", ws]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "recipe ok: 6 stages, 3 to run"  # ingest, sft, dpo: not selected don't
    table = lines.index(next(x for x in lines if x.startswith("stage ")))
    rows = {line.split()[0]: line for line in lines[table + 2 : table + 8]}
    assert rows["sft"].endswith("missing") and rows["dpo"].endswith("missing")
    for name in ("reward", "evaluate", "export"):
        assert rows[name].endswith("not selected")
    assert main(["run", str(QUICKSTART), ws, "--only", "dpo"]) == 2
    assert capsys.readouterr().err == (
        "posttrain: --only dpo: ingest, sft are not complete in this workspace (dpo needs "
        f"them); run `posttrain run {QUICKSTART} --until dpo` to run or reuse what dpo needs\n"
    )
    assert main(["plan", str(QUICKSTART), ws, "--until", "sfft"]) == 2
    assert "did you mean sft?" in capsys.readouterr().err


def record(stage: str, fp: str = "f") -> StageRecord:
    return StageRecord(stage, fp, "ran", 1.0, summary=Summary(headline={"tuned_loss": 1.0}))


def test_a_run_that_left_out_evaluate_or_export_is_not_promoted(tmp_path: Path) -> None:
    r = validate_recipe({**copy.deepcopy(CHAIN), "run": {"name": "x", "workspace": str(tmp_path)}})
    upstream = [record(n) for n in ("ingest", "sft", "reward", "dpo")]
    assert promote(r, "run1", upstream) is None
    assert promote(r, "run1", [*upstream, record("evaluate")]) is None  # export not selected
    assert not (tmp_path / "registry").exists()


def test_the_report_names_the_stages_left_out() -> None:
    text = markdown_report("q", "run1", [record("ingest"), record("sft")], None, None, ["dpo"])
    assert "Not selected (left out of this run): dpo." in text
    assert "| dpo |" not in text


# --- on the real quickstart -------------------------------------------------------------------

# reward.min_accuracy=0: two reward steps cannot pass the quickstart's gate (0.6), which would stop
# the run; this checks which stages run, not what they learn: a tenth of the quickstart's SFT and
# reward data (fewer rows to build, tokenize and score on held-out data before and after the few
# steps), no warm-up of the base, and its tokenizer trained on a tenth of the corpus (the
# quickstart's 4,000 examples cost ingest ~5 s of BPE training).
QUICK = [
    "ingest.from_config.pretrain_steps=0",
    "ingest.from_config.corpus_examples=400",
    "sft.max_steps=3",
    "sft.data.synthetic.n_examples=300",
    "reward.max_steps=2",
    "reward.min_accuracy=0",
    "reward.data.synthetic.n_examples=200",
]


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.mark.slow
def test_quickstart_until_sft_then_only_what_is_complete(
    prefect_harness: None, tmp_path: Path
) -> None:
    args = (str(QUICKSTART), f"run.workspace={tmp_path}", *QUICK)
    code, out, err = _cli("run", *args, "--until", "sft")
    assert code == 0, err[-3000:]
    rows = out.split("\n\n")[0].splitlines()[2:]
    assert [r.split()[:2] for r in rows[:2]] == [["ingest", "ran"], ["sft", "ran"]]
    assert "Not selected (left out of this run): reward, dpo, evaluate, export." in out
    assert "exported model" not in out and "promotion:" not in out
    assert sorted(p.name for p in (tmp_path / "artifacts").iterdir()) == ["ingest", "sft"]
    run_dir = Path(out.split("run folder:")[1].split()[0])
    lineage = json.loads((run_dir / "lineage.json").read_text())
    assert [a["stage"] for a in lineage["artifacts"]] == ["ingest", "sft"]
    assert lineage["not_selected"] == ["reward", "dpo", "evaluate", "export"]
    # evaluate reads the reward model and the DPO policy: neither exists yet.
    code, out, err = _cli("run", *args, "--only", "evaluate")
    assert code == 2 and out == ""
    assert err.startswith("posttrain: --only evaluate: reward, dpo are not complete")
    assert f"run `posttrain run {QUICKSTART} --until evaluate`" in err
    # reward alone: ingest and sft are reused, nothing else runs.
    code, out, err = _cli("run", *args, "--only", "reward")
    assert code == 0, err[-3000:]
    rows = out.split("\n\n")[0].splitlines()[2:]
    assert [r.split()[:2] for r in rows[:3]] == [
        ["ingest", "reused"], ["sft", "reused"], ["reward", "ran"],
    ]  # fmt: skip
    assert "Not selected (left out of this run): dpo, evaluate, export." in out
