"""Several base models in one recipe (issue 31 point 1): `stages:` entries of kind `ingest` are
extra bases, planned, fingerprinted and resolved like the top-level `ingest:`; a graph stage
names the base it stands on with `base:` (or starts `from:` one), and a stage that starts from a
policy stands on that policy's base."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.cli import cmd_plan
from posttrain.config.loader import RecipeError, load_for_deployment, resolve, validate_recipe
from posttrain.plan.planner import plan
from posttrain.plan.selection import Selection, choose
from posttrain.runtime.preflight import model_shape
from tests.stage_helpers import TINY, run_inprocess, write_recipe

HEAD: dict[str, Any] = {
    "run": {"name": "bases", "workspace": "/tmp/posttrain-bases-test"},
    "infra": {"device": "cpu", "precision": "fp32"},
    "ingest": {"source": "from_config"},
}
DATA = {"data": {"synthetic": {}}}
TEACHER = {"kind": "ingest", "name": "teacher", "source": "from_config"}
TEACHER_SFT = {"kind": "sft", "name": "teacher_sft", "base": "teacher", **DATA}
REWARDS = {"rewards": [{"fn": "posttrain.rewards.math:answer_match"}]}


def recipe(*stages: dict[str, Any], **sections: Any) -> Any:
    data = {**copy.deepcopy(HEAD), "sft": DATA, **sections, "stages": list(stages)}
    return validate_recipe(data)


def errors(*stages: dict[str, Any], **sections: Any) -> list[str]:
    with pytest.raises(RecipeError) as exc:
        recipe(*stages, **sections)
    return exc.value.errors


def teacher(**from_config: Any) -> dict[str, Any]:
    return {**TEACHER, "from_config": {"hidden_size": 64, **from_config}}


def planned(r: Any) -> dict[str, Any]:
    return {s.name: s for s in plan(resolve(r)).stages}


def test_an_extra_base_is_planned_first_with_its_own_fingerprint_and_folder() -> None:
    r = recipe(teacher(), TEACHER_SFT)
    stages = plan(resolve(r)).stages
    assert [s.name for s in stages] == [
        "ingest", "teacher", "sft", "teacher_sft", "evaluate", "export"
    ]  # fmt: skip
    ingest, extra = stages[0], stages[1]
    assert extra.kind == "ingest" and extra.module == ingest.module and extra.roles == {}
    assert extra.fingerprint != ingest.fingerprint and extra.out_dir != ingest.out_dir
    assert extra.out_dir.parent == ingest.out_dir.parent  # the ingest kind's folder
    assert extra.launcher == "local" and extra.timeout_s == ingest.timeout_s == 1800
    # An extra base's fingerprint is ingest's rule: the same fields make the same artifact.
    same = recipe({**TEACHER, "from_config": HEAD["ingest"].get("from_config", {})})
    assert planned(same)["teacher"].fingerprint == planned(same)["ingest"].fingerprint
    assert r.stage("teacher").from_config.hidden_size == 64
    assert model_shape(r, base="teacher").hidden == 64


def test_a_stage_on_the_teacher_base_follows_that_base_only() -> None:
    r = recipe(teacher(), TEACHER_SFT)
    p = planned(r)
    assert p["teacher_sft"].roles == {"base": "teacher", "policy": "teacher"}
    assert set(p["teacher_sft"].parents) == {"teacher"}
    assert p["sft"].roles == {"base": "ingest", "policy": "ingest"}
    wider = planned(recipe(teacher(hidden_size=128), TEACHER_SFT))
    assert wider["teacher_sft"].fingerprint != p["teacher_sft"].fingerprint
    assert wider["sft"].fingerprint == p["sft"].fingerprint
    other = planned(recipe(teacher(), TEACHER_SFT, ingest={"source": "from_config", "from_config": {"num_layers": 2}}))  # fmt: skip
    assert other["teacher_sft"].fingerprint == p["teacher_sft"].fingerprint
    assert other["sft"].fingerprint != p["sft"].fingerprint
    # `from: teacher` is the same start as `base: teacher`.
    started = planned(recipe(teacher(), {"kind": "sft", "name": "teacher_sft", "from": "teacher", **DATA}))  # fmt: skip
    assert started["teacher_sft"].fingerprint == p["teacher_sft"].fingerprint


def test_a_stage_from_a_policy_inherits_its_base() -> None:
    grpo = {"kind": "grpo", "name": "t_grpo", "from": "teacher_sft", **REWARDS, **DATA}
    r = recipe(teacher(), TEACHER_SFT, grpo)
    g = r.graph()
    assert g.base_of("t_grpo") == "teacher" and g.base_of("sft") == "ingest"
    assert g.lineage("t_grpo") == ["t_grpo", "teacher_sft"] and g.parent("teacher_sft") == "teacher"
    roles = planned(r)["t_grpo"].roles
    assert roles == {"base": "teacher", "policy": "teacher_sft", "reference": "teacher_sft"}
    # Naming the same base it inherits is allowed.
    same = recipe(teacher(), TEACHER_SFT, {**grpo, "base": "teacher"})
    assert same.graph().base_of("t_grpo") == "teacher"


def test_base_on_a_stage_that_starts_from_a_policy_is_refused_naming_the_field() -> None:
    errs = errors(teacher(), {"kind": "sft", "name": "x", "from": "sft", "base": "teacher", **DATA})
    assert len(errs) == 1 and errs[0].startswith(
        "stages.x.base: 'teacher' is not this stage's base"
    )
    assert "'sft', the policy it starts from (`from`), stands on 'ingest'" in errs[0]
    errs = errors(teacher(), {"kind": "sft", "name": "x", "from": "ingest", "base": "teacher", **DATA})  # fmt: skip
    assert errs[0].startswith("stages.x.base:") and "starts from the base 'ingest'" in errs[0]


def test_an_unknown_base_is_named_with_the_bases() -> None:
    assert errors(teacher(), {"kind": "sft", "name": "x", "base": "techer", **DATA}) == [
        "stages.x.base: no base named 'techer' (bases: ingest, teacher)"
    ]
    assert errors({"kind": "sft", "name": "x", "base": "sft", **DATA}) == [
        "stages.x.base: 'sft' is a policy stage, not a base (bases: ingest)"
    ]
    # A link to an unknown stage lists the bases among the valid names.
    (err,) = errors(teacher(), {"kind": "sft", "name": "x", "from": "nope", **DATA})
    assert err.startswith("stages.x.from: no stage named 'nope'") and "ingest, teacher)" in err


def test_links_across_bases_are_refused() -> None:
    dpo = {"kind": "dpo", "name": "x", "from": "teacher_sft", "reference": "sft", **DATA}
    assert errors(teacher(), TEACHER_SFT, dpo) == [
        "stages.x.reference: 'sft' stands on the base 'ingest', this stage on 'teacher'; name a "
        "stage of base 'teacher'"
    ]
    # A kind that needs a trained adapter cannot start from any base.
    (err, _) = errors(teacher(), {"kind": "dpo", "name": "x", "from": "teacher", **DATA})
    assert err.startswith("stages.x.from: a dpo stage starts from a trained policy adapter")
    (err,) = errors(teacher(), TEACHER_SFT, evaluate={"policies": ["sft"]})
    assert err.startswith("evaluate.policies: 'sft' stands on the base 'ingest'")


def test_evaluate_and_export_take_the_base_of_their_policy() -> None:
    r = recipe(teacher(), TEACHER_SFT)
    p = planned(r)
    assert (
        p["evaluate"].roles["base"] == "teacher" and p["evaluate"].roles["policy"] == "teacher_sft"
    )
    assert "parent" not in p["evaluate"].roles  # it started from a base
    assert p["export"].roles["base"] == "teacher"
    assert "ingest" not in p["evaluate"].parents and "teacher" in p["evaluate"].parents
    shipped = planned(recipe(teacher(), TEACHER_SFT, export={"policy": "sft"}))
    assert shipped["export"].roles["base"] == "ingest"


def test_names_are_unique_across_bases_and_stages() -> None:
    assert errors({**TEACHER, "name": "sft"}) == [
        "sft: two stages are named 'sft'; give each a unique `name`",
        "stages.sft: two stages are named 'sft'; give each a unique `name`",
    ]
    assert errors({"kind": "ingest", "source": "from_config"}) == [
        "stages.ingest.name: an ingest entry is one more base: give it a name of its own "
        "('ingest' is the top-level ingest section's)"
    ]
    assert errors({**TEACHER, "name": "export"}) == [
        "stages.export.name: 'export' is reserved for the fixed stage of that name"
    ]
    (err,) = errors({**TEACHER, "from": "sft"})
    assert err.startswith("stages.teacher.from: unknown field")


def test_each_lineage_roots_at_its_own_base_template() -> None:
    own = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with_template = {**teacher(), "chat_template": own}

    def dpo(start: str, template: str) -> dict[str, Any]:
        return {"kind": "dpo", "name": "pref", "from": start, "chat_template": template, **DATA}

    recipe(with_template, TEACHER_SFT, dpo("teacher_sft", own))  # its base's template
    (err,) = errors(with_template, TEACHER_SFT, dpo("teacher_sft", own + " "))
    assert err.startswith("stages.pref.chat_template: differs from the template of 'teacher_sft'")
    # The default base writes no template: a stage of its lineage may set its own.
    recipe(with_template, TEACHER_SFT, dpo("sft", own + " "))


def test_selection_and_timeouts_know_the_bases() -> None:
    r = recipe(teacher(), TEACHER_SFT, infra={**HEAD["infra"], "timeouts": {"teacher": 60}})
    p = plan(resolve(r))
    assert p.stage("teacher").timeout_s == 60 and p.stage("ingest").timeout_s == 1800
    kept = choose(p, Selection(until=("teacher_sft",)))
    assert [s.name for s in kept.stages] == ["teacher", "teacher_sft"]


def test_an_extra_base_path_is_resolved_like_ingest(tmp_path: Path) -> None:
    model = tmp_path / "models" / "teacher"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    data = {
        **copy.deepcopy(HEAD),
        "sft": DATA,
        "stages": [{"kind": "ingest", "name": "teacher", "path": "models/teacher"}, TEACHER_SFT],
    }
    data["run"]["workspace"] = "ws"
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    r = load_for_deployment(path)
    assert r.stage("teacher").path == str(model.resolve())
    fps = planned(r)
    assert "files" in fps["teacher"].inputs  # the folder by its files' identity
    outside = {**data, "stages": [{"kind": "ingest", "name": "teacher", "path": "/etc"}]}
    path.write_text(yaml.safe_dump(outside))
    with pytest.raises(RecipeError) as exc:
        load_for_deployment(path)
    assert exc.value.errors[0].startswith("stages.teacher.path: /etc is outside the folders")


def test_plan_prints_both_bases(tmp_path: Path) -> None:
    data = {**copy.deepcopy(HEAD), "sft": DATA, "stages": [teacher(), TEACHER_SFT]}
    data["run"]["workspace"] = str(tmp_path / "ws")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    out, err = io.StringIO(), io.StringIO()
    assert cmd_plan(str(path), [], out, err) == 0, err.getvalue()
    text = out.getvalue()
    assert text.splitlines()[0] == "recipe ok: 6 stages, 6 to run"
    assert "stages.teacher: from_config (llama, 4 blocks, hidden 64" in text
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("stage "))
    rows = [line.split() for line in lines[start + 2 : start + 8]]
    assert [r[:2] for r in rows[:2]] == [["ingest", "ingest"], ["teacher", "ingest"]]
    assert rows[3][:4] == ["teacher_sft", "sft", "from", "teacher"]


@pytest.mark.slow
def test_an_sft_trains_on_each_of_two_bases(tmp_path: Path) -> None:
    """Two tiny from_config bases of one tokenizer config and different widths; an SFT on
    each, through the real stage entry points: each adapter has its own base's width."""
    from safetensors import safe_open

    data = copy.deepcopy(TINY)
    wide = copy.deepcopy(data["ingest"])
    wide["from_config"] |= {"hidden_size": 96, "intermediate_size": 192}
    sft = {k: v for k, v in data["sft"].items() if k != "max_steps"} | {"max_steps": 4}
    data["sft"] = sft
    data["stages"] = [
        {"kind": "ingest", "name": "teacher", **wide},
        {"kind": "sft", "name": "teacher_sft", "base": "teacher", **sft},
    ]
    data["evaluate"] = None
    data["export"] = None
    path = write_recipe(tmp_path, data)
    run_inprocess("ingest", path, name="ingest")
    run_inprocess("ingest", path, name="teacher")
    widths = {}
    for name in ("sft", "teacher_sft"):
        out = run_inprocess("sft", path, name=name)
        manifest = json.loads((out / "manifest.json").read_text())
        with safe_open(str(out / "adapter" / "adapter_model.safetensors"), "pt") as f:
            # lora_A is (r, in_features): the base's width (attention) or MLP width (down_proj).
            keys = [k for k in f.keys() if "lora_A" in k]  # noqa: SIM118
            widths[name] = {f.get_slice(k).get_shape()[1] for k in keys}
        spec = json.loads((out / "logs" / "spec.json").read_text())
        assert spec["stage"]["roles"]["base"] == ("ingest" if name == "sft" else "teacher")
        assert manifest["parents"] == [
            spec["parents"][spec["stage"]["roles"]["base"]]["fingerprint"]
        ]
    assert widths == {"sft": {64, 128}, "teacher_sft": {96, 192}}
