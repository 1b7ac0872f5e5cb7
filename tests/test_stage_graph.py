"""Recipes as stage graphs: links and their defaults, validation before anything runs, what the
planner makes of a graph (roles, fingerprints, what an edit re-runs), and the registry as the
one place that lists stage kinds."""

from __future__ import annotations

import ast
import copy
from pathlib import Path
from typing import Any

import pytest

from posttrain.config.loader import RecipeError, load_recipe, resolve, validate_recipe
from posttrain.kinds import KINDS, graph_kinds
from posttrain.plan.planner import plan

ROOT = Path(__file__).resolve().parents[1]
BASE: dict[str, Any] = {
    "run": {"name": "graph", "workspace": "/tmp/posttrain-graph-test"},
    "infra": {"device": "cpu", "precision": "fp32"},
    "ingest": {"source": "from_config"},
}
DATA = {"data": {"synthetic": {}}}


def recipe(*stages: dict[str, Any], **sections: Any) -> Any:
    return validate_recipe({**copy.deepcopy(BASE), **sections, "stages": list(stages)})


def errors(*stages: dict[str, Any], **sections: Any) -> list[str]:
    with pytest.raises(RecipeError) as exc:
        recipe(*stages, **sections)
    return exc.value.errors


def sft(name: str = "sft", **kw: Any) -> dict[str, Any]:
    return {"kind": "sft", "name": name, **DATA, **kw}


def stage(kind: str, name: str | None = None, **kw: Any) -> dict[str, Any]:
    return {"kind": kind, **({"name": name} if name else {}), **DATA, **kw}


def fps(r: Any) -> dict[str, str]:
    return {p.name: p.fingerprint for p in plan(resolve(r)).stages}


def test_default_links_follow_the_chain() -> None:
    r = recipe(sft(), stage("reward"), stage("dpo"), stage("grpo"), stage("sft", "rs_sft"))
    g = r.graph()
    assert g.names() == ["sft", "reward", "dpo", "grpo", "rs_sft"]
    assert g.get("sft").links == {"policy": "ingest"}
    assert g.get("reward").links == {"policy": "sft"}
    assert g.get("dpo").links == {"policy": "sft", "reference": "sft"}
    assert g.get("grpo").links == {"policy": "dpo", "reference": "dpo", "reward_model": "reward"}
    assert g.get("rs_sft").links == {"policy": "grpo"}
    assert g.final_policy() == "rs_sft" and g.lineage("rs_sft") == ["rs_sft", "grpo", "dpo", "sft"]
    assert g.adapter_origin("grpo").name == "sft" and g.heldout_source("grpo") == "sft"


def test_explicit_links_and_run_order() -> None:
    # Written out of order: each stage runs after what it links to. (Defaults look back in
    # written order, so the SFT written last names the base.)
    r = recipe(
        stage("dpo", "dpo2", **{"from": "dpo1", "reference": "sft"}),
        stage("dpo", "dpo1", **{"from": "sft"}),
        sft(**{"from": "ingest"}),
    )
    g = r.graph()
    assert g.names() == ["sft", "dpo1", "dpo2"]
    assert g.get("dpo2").links == {"policy": "dpo1", "reference": "sft"}


def test_shorthand_and_stages_make_one_graph_with_the_same_fingerprints() -> None:
    short = validate_recipe({**BASE, "sft": DATA, "reward": DATA, "dpo": DATA})
    long = recipe(sft(), stage("reward"), stage("dpo"))
    assert fps(short) == fps(long)
    # A stage's own name is not part of what it computes: renamed, the same artifact.
    renamed = recipe(sft("sft_round1"), stage("reward", "rm"), stage("dpo", "pref"))
    assert list(fps(renamed).values()) == list(fps(long).values())


def test_editing_a_stage_reruns_it_and_what_follows_only() -> None:
    stages = [sft(), stage("reward"), stage("dpo"), stage("grpo")]
    before = fps(recipe(*stages))
    edited = copy.deepcopy(stages)
    edited[2]["beta"] = 0.2
    after = fps(recipe(*edited))
    changed = sorted(n for n in before if before[n] != after[n])
    assert changed == ["dpo", "evaluate", "export", "grpo"]


def test_shipping_another_link_reruns_export_only() -> None:
    stages = [sft(), stage("reward"), stage("dpo"), stage("grpo")]
    before, after = fps(recipe(*stages)), fps(recipe(*stages, export={"policy": "dpo"}))
    assert sorted(n for n in before if before[n] != after[n]) == ["export"]


def test_roles_enter_the_fingerprint_where_parents_alone_do_not_say() -> None:
    a = recipe(sft(), stage("dpo", "d1"), stage("dpo", "d2", reference="sft"))
    b = recipe(sft(), stage("dpo", "d1"), stage("dpo", "d2", reference="d1"))
    assert fps(a)["d2"] != fps(b)["d2"]  # the same two parents, in other roles
    assert plan(resolve(a)).stages[3].roles == {
        "base": "ingest",
        "policy": "d1",
        "reference": "sft",
    }
    assert plan(resolve(b)).stages[3].roles["reference"] == "d1"  # the default: where it starts


def test_evaluate_and_export_roles_along_a_chain() -> None:
    r = recipe(
        sft(),
        stage("reward"),
        stage("dpo"),
        stage("grpo"),
        evaluate={"policies": ["sft", "dpo", "grpo"]},
        export={"policy": "dpo"},
    )
    by = {p.name: p for p in plan(resolve(r)).stages}
    assert by["evaluate"].roles == {
        "base": "ingest",
        "policy": "grpo",
        "parent": "dpo",
        "heldout": "sft",
        "reward_model": "reward",
        # The RL stage's held-out prompts: what verifiers (if any) judge.
        "verifier": "grpo",
    }
    assert list(by["evaluate"].parents) == ["ingest", "sft", "reward", "dpo", "grpo"]
    assert by["export"].roles == {
        "base": "ingest",
        "policy": "dpo",
        "parent": "sft",
        "heldout": "sft",
        "evaluation": "evaluate",
    }


@pytest.mark.parametrize(
    ("stages", "expected"),
    [
        ([sft(), stage("dpo", **{"from": "nope"})], "stages.dpo.from: no stage named 'nope'"),
        (
            [sft(), stage("reward"), stage("grpo", **{"from": "reward"})],
            "stages.grpo.from: 'reward' produces a reward_model, not a policy to start from",
        ),
        (
            [sft(), stage("ppo")],
            "stages.ppo.reward_model: a ppo stage needs a reward: add a reward stage",
        ),
        (
            [sft(), stage("reward"), stage("ppo", reward_model="sft")],
            "stages.ppo.reward_model: 'sft' is a policy stage, not a reward model",
        ),
        ([sft(reference="sft")], "stages.sft.reference: a sft stage takes no reference"),
        ([sft(), sft()], "stages.sft: two stages are named 'sft'"),
        ([sft("evaluate")], "stages.evaluate.name: 'evaluate' is reserved"),
        (
            [stage("dpo", **{"from": "ingest"})],
            "stages.dpo.from: a dpo stage starts from a trained policy adapter, not the base",
        ),
        ([sft(**{"from": "sft"})], "stages.sft.from: a stage cannot take its own output"),
        (
            [sft(), stage("dpo", reference="ingest")],
            "stages.dpo.reference: the raw base is not a reference",
        ),
        (
            [sft("a", **{"from": "b"}), sft("b", **{"from": "a"})],
            "stages.a: the stages a -> b -> a wait on each other (a cycle)",
        ),
        (
            # dpo's `from` is not written: it defaults to sft, written before it.
            [sft(**{"from": "dpo"}), stage("dpo")],
            "stages.dpo: the stages sft -> dpo (dpo's default from) -> sft wait on each other "
            "(a cycle); dpo's from is not written, so it defaults to the stage before it in the "
            "recipe: set stages.dpo.from",
        ),
    ],
)
def test_bad_graphs_are_refused_naming_the_stage_and_field(
    stages: list[dict[str, Any]], expected: str
) -> None:
    errs = errors(*stages)
    assert any(expected in e for e in errs), errs


def test_template_drift_along_a_chain_is_refused_before_anything_runs() -> None:
    other = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    # The base's template is the tokenizer's (unknown until ingest runs): the stage compares
    # the recorded sha256 when it runs.
    recipe(sft(), stage("dpo", chat_template=other))
    base = {**BASE, "ingest": {"source": "from_config", "chat_template": "{{ messages }}"}}
    data = {**base, "stages": [sft(), stage("dpo", chat_template=other)]}
    with pytest.raises(RecipeError) as exc:
        validate_recipe(data)
    assert exc.value.errors == [
        "stages.dpo.chat_template: differs from the template of 'sft', the policy it starts "
        "from; set allow_template_change: true if that is on purpose"
    ]
    data["stages"][1]["allow_template_change"] = True
    validate_recipe(data)
    # A policy formatting with one template, judged by a reward model trained with another.
    data = {
        **base,
        "stages": [
            sft(),
            stage("reward", chat_template=other, allow_template_change=True),
            stage("grpo"),
        ],
    }
    with pytest.raises(RecipeError) as exc:
        validate_recipe(data)
    assert exc.value.errors[0].startswith("stages.grpo.reward_model: 'reward' was trained with")


def test_field_errors_inside_stage_entries_name_the_entry() -> None:
    errs = errors(sft(), stage("dpo", "dpo2", beta=-1, lr=1))
    assert sorted(e.split(":")[0] for e in errs) == ["stages.dpo2.beta", "stages.dpo2.lr"]
    errs = errors(sft(), {"kind": "nope", "name": "x"})
    assert errs == [
        "stages.x.kind: expected one of: ingest, sft, reward, dpo, orpo, kto, ppo, grpo, online_dpo, distill; got 'nope'"
    ]


def test_timeouts_policies_and_export_policy_name_existing_stages() -> None:
    r = recipe(sft(), stage("dpo", "d2"), infra={"timeouts": {"d2": 60, "train": 100}})
    by = {p.name: p for p in plan(resolve(r)).stages}
    assert (by["d2"].timeout_s, by["sft"].timeout_s, by["evaluate"].timeout_s) == (60, 100, 3600)
    errs = errors(
        sft(),
        infra={"timeouts": {"dpo": 5}},
        evaluate={"policies": ["sft", "nope"]},
        export={"policy": "ghost"},
    )
    assert sorted(e.split(":")[0] for e in errs) == [
        "evaluate.policies",
        "export.policy",
        "infra.timeouts.dpo",
    ]


def test_pass_k_policies_name_policies_evaluate_compares() -> None:
    """`evaluate.pass_k_policies` takes `final`, `all` or stage names among the policies the
    verifier report compares (base, parent, final, `evaluate.policies`): another policy stage is
    refused with the fix, an unknown name with the names it may take."""
    chain = (sft(), stage("reward"), stage("dpo"), stage("grpo"))
    for ok, listed in (("final", []), ("all", []), (["ingest", "dpo"], []), (["sft"], ["sft"])):
        r = recipe(*chain, evaluate={"pass_k_policies": ok, "policies": listed})
        assert r.evaluate.pass_k_policies == ok
    assert errors(*chain, evaluate={"pass_k_policies": ["sft", "gpro"]}) == [
        "evaluate.pass_k_policies: 'sft' is not compared (the policies evaluate compares: "
        "ingest, dpo, grpo); add it to evaluate.policies to compare it",
        "evaluate.pass_k_policies: no policy named 'gpro' (the policies evaluate compares: "
        "ingest, dpo, grpo; or write `final` or `all` without brackets)",
    ]
    assert errors(*chain, evaluate={"pass_k_policies": "sft"}) == [
        "evaluate.pass_k_policies.literal['final','all']: expected one of: final, all; got 'sft'",
        "evaluate.pass_k_policies.list[str]: expected a list, got 'sft'",
    ]


def test_shipped_chain_recipe_reuses_the_quickstart_stages() -> None:
    quick = {
        p.name: p.fingerprint for p in plan(load_recipe(ROOT / "recipes/quickstart.yaml")).stages
    }
    chain = load_recipe(ROOT / "recipes/chain.yaml")
    planned = {p.name: p.fingerprint for p in plan(resolve(chain)).stages}
    for name in ("ingest", "sft", "reward", "dpo"):
        assert planned[name] == quick[name], name
    g = chain.graph()
    assert g.get("grpo").links["policy"] == "dpo" and g.final_policy() == "grpo"


# Modules that may spell stage kinds: the registry, and each kind's own stage module.
ALLOWED = {ROOT / "posttrain" / "kinds"}


def _kind_literals(path: Path, names: set[str]) -> list[str]:
    """Places in `path` that list (tuple, list, set, dict keys) two or more stage kinds."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            spelled = [
                e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names
            ]
            if len(spelled) >= 2:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} lists {spelled}")
        if isinstance(node, ast.Dict):
            spelled = [
                k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in names
            ]
            if len(spelled) >= 2:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} maps {spelled}")
    return found


def test_no_module_but_the_registry_lists_stage_kinds() -> None:
    """Adding a kind touches the registry, not lists of stage names spread over the code."""
    names = set(graph_kinds())
    found = []
    for folder in ("posttrain", "flows"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if any(path.is_relative_to(a) for a in ALLOWED):
                continue
            found += _kind_literals(path, names)
    assert not found, "stage kinds spelled outside posttrain/kinds:\n" + "\n".join(found)


def test_every_kind_is_complete() -> None:
    for name, kind in KINDS.items():
        assert kind.section.__doc__ is not None or kind.help, name
        for field_name, field in kind.section.model_fields.items():
            assert field.description, f"{name}.{field_name} has no description"
        if kind.trains:
            assert kind.memory is not None, f"{name} trains but has no memory estimate"
        module = ROOT / (kind.module.replace(".", "/") + ".py")
        assert module.is_file(), f"{name}: no stage module {kind.module}"
