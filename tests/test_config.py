"""Recipe schema, overrides, batch arithmetic and resolution."""

from pathlib import Path

import pytest
import yaml

from posttrain.config.batch import resolve_batch
from posttrain.config.loader import RecipeError, apply_overrides, load_recipe, validate_recipe
from posttrain.errors import RecipeVerdict
from tests.hub_cache import cache_recipe_hub_ids
from tests.stage_helpers import TINY

RECIPES = sorted(Path(__file__).resolve().parents[1].joinpath("recipes").glob("*.yaml"))
MINIMAL = {"ingest": {"source": "from_config"}, "sft": {"data": {"synthetic": {}}}}


def errors_of(data: dict) -> list[str]:
    with pytest.raises(RecipeError) as exc:
        validate_recipe(data)
    return exc.value.errors


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_shipped_recipe_validates(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    cache_recipe_hub_ids(path, tmp_path)
    recipe = load_recipe(path)
    assert recipe.infra.precision in ("fp32", "bf16")
    assert Path(recipe.run.workspace).is_absolute()
    assert path.read_text().startswith("#"), "recipe needs a header saying how to run it"


def test_shipped_recipes_exist() -> None:
    assert any(p.name == "quickstart.yaml" for p in RECIPES)


def test_error_names_the_field() -> None:
    errs = errors_of(apply_overrides(MINIMAL, ["sft.optim.lr=0"]))
    assert errs == ["sft.optim.lr: must be > 0, got 0"]


def test_unknown_key_is_named() -> None:
    errs = errors_of(apply_overrides(MINIMAL, ["sft.optim.learning_rate=1e-4"]))
    assert errs == ["sft.optim.learning_rate: unknown field; did you mean sft.optim.lr?"]


def test_every_error_is_reported_at_once() -> None:
    errs = errors_of(apply_overrides(MINIMAL, ["sft.optim.lr=-1", "sft.lora.r=0", "run.seed=x"]))
    fields = sorted(e.split(":")[0] for e in errs)
    assert fields == ["run.seed", "sft.lora.r", "sft.optim.lr"]


def test_missing_policy_stage() -> None:
    (err,) = errors_of({"ingest": {"source": "from_config"}})
    assert err.startswith("the recipe trains no policy: add an `sft:` section")


def test_wrong_type_in_list_field() -> None:
    errs = errors_of(apply_overrides(MINIMAL, ["evaluate.sampling=[{strategy: greedy}]"]))
    assert errs == ["evaluate.sampling.0.name: required field is missing"]


def test_fp16_without_loss_scaling_refused() -> None:
    errs = errors_of(apply_overrides(MINIMAL, ["infra.precision=fp16"]))
    assert "loss scaling" in errs[0] and errs[0].startswith("infra:")
    validate_recipe(apply_overrides(MINIMAL, ["infra.precision=fp16", "infra.loss_scaling=true"]))


def test_half_precision_on_cpu_refused(tmp_path: Path) -> None:

    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(MINIMAL))
    with pytest.raises(RecipeError, match="infra.precision: bf16 on CPU"):
        load_recipe(p, ["infra.device=cpu", "infra.precision=bf16"])
    assert load_recipe(p, ["infra.device=cpu"]).infra.precision == "fp32"


def test_base_dtype_auto_is_bf16_only_for_bf16_gpu_runs(tmp_path: Path, monkeypatch) -> None:

    from posttrain.config import loader

    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(MINIMAL))
    assert load_recipe(p, ["infra.device=cpu"]).infra.base_dtype == "fp32"
    assert load_recipe(p, ["infra.device=cpu", "infra.base_dtype=bf16"]).infra.base_dtype == "bf16"
    # What a GPU machine resolves to (this one has none): the device probes answer as a GPU's.
    monkeypatch.setattr(loader, "_cuda_devices", lambda: 8)
    monkeypatch.setattr(loader, "_bf16_supported", lambda: True)
    assert load_recipe(p).infra.base_dtype == "bf16"
    assert load_recipe(p, ["infra.precision=fp32"]).infra.base_dtype == "fp32"
    errs = errors_of(
        apply_overrides(
            MINIMAL, ["infra.precision=fp16", "infra.loss_scaling=true", "infra.base_dtype=bf16"]
        )
    )
    assert errs[0].startswith("infra: base_dtype bf16 with precision fp16 is refused"), errs


def test_ingest_path_required() -> None:
    errs = errors_of({"ingest": {"source": "path"}, "sft": {"data": {"synthetic": {}}}})
    assert "ingest.path" in errs[0]


def test_data_needs_exactly_one_source() -> None:
    errs = errors_of({"ingest": {"source": "from_config"}, "sft": {"data": {}}})
    assert errs == ["sft.data: give exactly one of data.path or data.synthetic"]


def test_overrides_parse_yaml_values() -> None:
    out = apply_overrides(
        MINIMAL,
        [
            "sft.optim.lr=1e-4",
            "sft.packing=true",
            "run.name=abc",
            "sft.lora.target_modules=[q_proj, v_proj]",
        ],
    )
    assert out["sft"]["optim"]["lr"] == 1e-4 and out["sft"]["packing"] is True
    assert out["sft"]["lora"]["target_modules"] == ["q_proj", "v_proj"]
    assert "optim" not in MINIMAL["sft"], "overrides must not mutate the input"


@pytest.mark.parametrize("bad", ["novalue", "=3", "a..b=1"])
def test_malformed_override(bad: str) -> None:
    with pytest.raises(RecipeError, match="expected key.path=value"):
        apply_overrides(MINIMAL, [bad])


def test_yaml_errors_name_the_file(tmp_path: Path) -> None:
    p = tmp_path / "broken.yaml"
    p.write_text("run: [unclosed\n")
    with pytest.raises(RecipeError) as exc:
        load_recipe(p)
    assert exc.value.errors == [
        f"{p} line 2, column 1: expected ',' or ']', but got '<stream end>' "
        "(while parsing a flow sequence that starts at line 1)"
    ]
    assert exc.value.fix == "fix the YAML at the line shown"
    with pytest.raises(RecipeError) as exc:
        load_recipe(tmp_path / "missing.yaml")
    assert exc.value.errors == [f"{tmp_path / 'missing.yaml'}: no such recipe file"]
    assert exc.value.fix.startswith("check the path (run from the folder that holds it")


# --- batch arithmetic -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("micro", "accum", "glob", "dp", "expect"),
    [
        (4, 2, None, 2, (4, 2, 16)),
        (4, None, 16, 2, (4, 2, 16)),
        (None, 2, 16, 2, (4, 2, 16)),
        (4, 2, 16, 2, (4, 2, 16)),
        (8, 1, None, 1, (8, 1, 8)),
    ],
)
def test_batch_two_of_three(micro, accum, glob, dp, expect) -> None:
    b = resolve_batch(micro, accum, glob, dp)
    assert (b.micro_batch_size, b.grad_accum_steps, b.global_batch_size) == expect


def test_batch_inconsistent_triple_names_numbers() -> None:
    with pytest.raises(ValueError) as exc:
        resolve_batch(4, 2, 20, 2, where="sft.batch")
    assert str(exc.value) == (
        "sft.batch: micro_batch_size 4 x grad_accum_steps 2 x "
        "data-parallel size 2 = 16, but global_batch_size is 20"
    )


def test_batch_not_divisible() -> None:
    with pytest.raises(ValueError, match="not divisible by grad_accum_steps 3"):
        resolve_batch(None, 3, 16, 2)
    with pytest.raises(ValueError, match="at least two"):
        resolve_batch(4, None, None, 1)


def test_recipe_checks_batch_against_devices() -> None:
    errs = errors_of(
        apply_overrides(
            MINIMAL,
            [
                "infra.devices_per_node=2",
                "sft.batch={micro_batch_size: 4, grad_accum_steps: 1, global_batch_size: 4}",
            ],
        )
    )
    assert errs == [
        "sft.batch: micro_batch_size 4 x grad_accum_steps 1 x data-parallel size 2 = 8, "
        "but global_batch_size is 4"
    ]


PAIRS = {"data": {"synthetic": {}}}
PROMPTS = {"data": {"synthetic": {}}}


def test_shorthand_policy_sections_chain() -> None:
    # Several policy sections are a chain in registry order: PPO goes on from DPO's policy,
    # measured against it, judged by the reward stage.
    graph = validate_recipe({**MINIMAL, "reward": PAIRS, "dpo": PAIRS, "ppo": PROMPTS}).graph()
    assert graph.names() == ["sft", "reward", "dpo", "ppo"]
    assert graph.get("ppo").links == {"policy": "dpo", "reference": "dpo", "reward_model": "reward"}
    assert graph.final_policy() == "ppo"


def test_rl_needs_a_reward_model() -> None:
    errs = errors_of({**MINIMAL, "grpo": PROMPTS})
    assert errs == [
        "grpo.reward_model: a grpo stage needs a reward: add a reward stage before it, name "
        "one, or list reward functions in `rewards`"
    ]


def test_grpo_needs_groups_and_kl_defaults_differ() -> None:
    errs = errors_of(
        {**MINIMAL, "reward": PAIRS, "grpo": {**PROMPTS, "rollout": {"samples_per_prompt": 1}}}
    )
    assert (
        len(errs) == 1
        and errs[0].startswith("grpo:")
        and "samples_per_prompt must be >= 2" in errs[0]
    )
    r = validate_recipe(
        {**MINIMAL, "reward": PAIRS, "grpo": PROMPTS, "infra": {"devices_per_node": 2}}
    )
    assert r.grpo.kl.estimator == "k3" and r.grpo.rollout.samples_per_prompt == 4
    r = validate_recipe({**MINIMAL, "reward": PAIRS, "ppo": PROMPTS})
    assert r.ppo.kl.estimator == "k1" and r.ppo.rollout.samples_per_prompt == 1


def test_rl_rollout_and_update_sizes_must_fit() -> None:
    from posttrain.config.loader import section_batch
    from posttrain.rl.setup import check_shapes

    data = {**MINIMAL, "reward": PAIRS, "ppo": {**PROMPTS, "rollout": {"prompts_per_step": 6}}}
    r = load_recipe_data(apply_overrides(data, ["infra.devices_per_node=4"]))
    with pytest.raises(
        RecipeVerdict, match="ppo.rollout.prompts_per_step: 6 must be a multiple of the 4 ranks"
    ):
        check_shapes("ppo", r.ppo, section_batch(r, "ppo"), 4)
    r = load_recipe_data(
        apply_overrides(data, ["ppo.batch={micro_batch_size: 4, grad_accum_steps: 1}"])
    )
    with pytest.raises(
        RecipeVerdict,
        match=r"ppo.batch: one update takes micro 4 x accum 1 = 4 sequences per "
        "rank, but a rollout gives 6",
    ):
        check_shapes("ppo", r.ppo, section_batch(r, "ppo"), 1)
    r = load_recipe_data(
        apply_overrides(
            data, ["ppo.batch={micro_batch_size: 3, grad_accum_steps: 1}", "ppo.update_epochs=2"]
        )
    )
    assert check_shapes("ppo", r.ppo, section_batch(r, "ppo"), 1) == (6, 4)


def load_recipe_data(data: dict):
    from posttrain.config.loader import resolve

    return resolve(validate_recipe(data))


def test_multinode_needs_a_rendezvous_and_counts_every_rank() -> None:
    errs = errors_of(apply_overrides(MINIMAL, ["infra.nnodes=2"]))
    assert len(errs) == 1 and errs[0].startswith("infra:") and "needs rdzv_endpoint" in errs[0]
    data = apply_overrides(
        MINIMAL,
        [
            "infra.nnodes=2",
            "infra.devices_per_node=4",
            "infra.rdzv_endpoint=node0.example:29400",
            "sft.batch={micro_batch_size: 2, grad_accum_steps: 1}",
        ],
    )
    r = load_recipe_data(data)
    assert r.infra.world_size() == 8 and r.sft.batch.global_batch_size == 16
    errs = errors_of(apply_overrides(data, ["infra.rdzv_endpoint=no-port"]))
    assert errs[0].startswith("infra.rdzv_endpoint:")


def test_tools_under_a_template_without_tool_calls_are_refused_before_anything_trains() -> None:
    """The from-config base's plain ChatML renders no tool calls: a stage given tools names the
    field at load time, and the tools template passes."""
    import copy

    from posttrain.config.schema import Recipe

    data = copy.deepcopy(TINY)
    data["grpo"] = {
        "data": {"synthetic": {"n_examples": 40}},
        "rollout": {"samples_per_prompt": 2, "tools": ["posttrain.rewards.match:exact_match"]},
        "rewards": [{"fn": "posttrain.rewards.match:exact_match"}],
    }
    with pytest.raises(
        ValueError, match=r"grpo\.rollout\.tools: the chat template .* renders no tool calls"
    ):
        Recipe.model_validate(data).graph()
    data["ingest"]["from_config"]["template"] = "chatml_tools"
    assert "grpo" in Recipe.model_validate(copy.deepcopy(data)).graph()


def test_only_resolve_makes_a_resolved_recipe_and_plan_takes_nothing_else() -> None:
    from pydantic import ValidationError

    from posttrain.config.loader import resolve
    from posttrain.config.schema import Recipe, ResolvedRecipe
    from posttrain.plan.planner import plan

    written = validate_recipe({**MINIMAL, "infra": {"device": "cpu", "devices_per_node": 1}})
    with pytest.raises(TypeError, match="plan takes a ResolvedRecipe"):
        plan(written)  # concrete devices, but its paths and batch triple were never resolved
    resolved = resolve(written)
    assert type(written) is Recipe and type(resolved) is ResolvedRecipe
    assert written.infra.parallel_stages == "auto" and resolved.infra.parallel_stages == 1
    assert resolve(resolved) == resolved  # a served run's recipe is resolved again on its worker
    # A stage's spec carries it as JSON: it validates again as resolved, not with an `auto`.
    data = resolved.model_dump(mode="json")
    assert ResolvedRecipe.model_validate(data) == resolved
    data["infra"] |= {"precision": "auto", "devices_per_node": "auto"}
    with pytest.raises(ValidationError, match=r"infra.devices_per_node, infra.precision: `auto`"):
        ResolvedRecipe.model_validate(data)
