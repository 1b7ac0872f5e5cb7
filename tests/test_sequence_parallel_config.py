"""`infra.sequence_parallel` in the recipe: its refusals by field (devices, heads, layout,
padding-free batches, a stage kind not wired) and its batch arithmetic (global batch = micro x
accumulation x devices / N)."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from posttrain.config.loader import RecipeError, apply_overrides, resolve, validate_recipe
from posttrain.kinds import KINDS
from posttrain.sections.infra import InfraConfig

MINIMAL = {"ingest": {"source": "from_config"}, "sft": {"data": {"synthetic": {}}}}
BATCH = "sft.batch={micro_batch_size: 2, grad_accum_steps: 3}"
NOT_WIRED = (
    "infra.sequence_parallel: 2: sequence parallelism is not yet wired into stage online_dpo; "
    "set infra.sequence_parallel: 1"
)


def errors_of(overrides: list[str], data: dict = MINIMAL) -> list[str]:
    with pytest.raises(RecipeError) as exc:
        resolve(validate_recipe(apply_overrides(data, overrides)))
    return exc.value.errors


def test_default_is_one_and_the_data_parallel_size_is_the_world() -> None:
    infra = InfraConfig(devices_per_node=4, nnodes=2, rdzv_endpoint="h:1")
    assert infra.sequence_parallel == 1 and infra.dp_size() == infra.world_size() == 8
    assert InfraConfig(devices_per_node=4, sequence_parallel=2).dp_size() == 2


def test_every_training_stage_is_wired() -> None:
    """Every kind that trains splits its sequences: a new one must be wired (and proven equal to
    the unsplit run) before `sequence_parallel=True` lets a recipe use it above 1."""
    trains = {name for name, kind in KINDS.items() if kind.trains}
    assert trains >= {"sft", "reward", "dpo", "orpo", "kto", "ppo", "grpo", "online_dpo"}
    assert {name for name in trains if not KINDS[name].sequence_parallel} == set()


def test_a_stage_not_wired_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kind without the mark (as a newly added one would be) is refused by name; SFT alone
    is accepted."""
    unwired = dataclasses.replace(KINDS["online_dpo"], sequence_parallel=False)
    monkeypatch.setitem(KINDS, "online_dpo", unwired)
    data = {
        **MINIMAL,
        "reward": {"data": {"synthetic": {}}},
        "ppo": {"data": {"synthetic": {}}},
        "online_dpo": {"data": {"synthetic": {}}},
    }
    over = ["infra.devices_per_node=2", "infra.sequence_parallel=2"]
    assert errors_of(over, data) == [NOT_WIRED]
    resolve(validate_recipe(apply_overrides(MINIMAL, over)))


def test_sequence_parallel_must_divide_the_devices() -> None:
    errs = errors_of(["infra.devices_per_node=3", "infra.sequence_parallel=2"])
    assert errs == [
        "infra.sequence_parallel: 2 does not divide the 3 devices (nnodes 1 x devices_per_node "
        "3); pick a divisor of 3"
    ]


def test_sequence_parallel_needs_layout_fsdp() -> None:
    errs = errors_of(["infra.devices_per_node=2", "infra.sequence_parallel=2", "infra.layout=ddp"])
    assert errs[0] == (
        "infra.sequence_parallel: 2 with infra.layout ddp is refused: sequence parallelism "
        "shards parameters over the data-parallel and sequence dimensions of one mesh "
        "(layout fsdp); use infra.layout: fsdp"
    )


def test_heads_must_divide_by_sequence_parallel() -> None:
    # from_config's default shape: 4 attention heads.
    errs = errors_of(["infra.devices_per_node=3", "infra.sequence_parallel=3"])
    assert errs[0] == (
        "infra.sequence_parallel: 3 cannot split the attention of base 'ingest': its 4 attention "
        "heads are not divisible by 3"
    )
    # 6 query heads split over 2 ranks, but 3 key/value heads neither split nor replicate.
    gqa = [f"ingest.from_config.{k}" for k in ("num_heads=6", "num_kv_heads=3", "hidden_size=96")]
    errs = errors_of(["infra.devices_per_node=2", "infra.sequence_parallel=2", *gqa])
    assert errs[0] == (
        "infra.sequence_parallel: 2 cannot split the attention of base 'ingest': its 3 key/value "
        "heads are not divisible by 2, nor 2 by 3 (fewer key/value heads than ranks are "
        "replicated)"
    )


def test_padding_free_batches_are_needed() -> None:
    off = "sft.batch={micro_batch_size: 2, grad_accum_steps: 1, padding_free: false}"
    errs = errors_of(["infra.devices_per_node=2", "infra.sequence_parallel=2", off])
    assert errs[0] == (
        "sft.batch.padding_free: false is refused with infra.sequence_parallel 2: each rank "
        "takes a slice of the micro-batch's packed token stream; set it true"
    )


def test_global_batch_counts_data_parallel_groups() -> None:
    data = apply_overrides(MINIMAL, ["infra.devices_per_node=4", "infra.sequence_parallel=2"])
    r = resolve(validate_recipe(apply_overrides(data, [BATCH])))
    # 2 rows x 3 micro-batches x (4 devices / 2 per sequence) data-parallel groups.
    assert r.sft.batch.global_batch_size == 12
    errs = errors_of([BATCH.replace("}", ", global_batch_size: 24}")], data)
    assert errs == [
        "sft.batch: micro_batch_size 2 x grad_accum_steps 3 x data-parallel size 2 = 12, "
        "but global_batch_size is 24"
    ]


def test_a_local_base_is_checked_at_resolve(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    config = {
        **{"num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 48},
        **{"num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 100},
    }
    (base / "config.json").write_text(json.dumps(config))
    data = {
        "run": {"allowed_paths": [str(tmp_path)]},
        "ingest": {"source": "path", "path": str(base)},
        "sft": {"data": {"synthetic": {}}},
    }
    errs = errors_of(["infra.devices_per_node=4", "infra.sequence_parallel=4"], data)
    assert (
        "infra.sequence_parallel: 4 cannot split the attention of base 'ingest': its 6 "
        "attention heads are not divisible by 4"
    ) in errs


def test_dpo_is_wired() -> None:
    """SFT and its DPO child both split their sequences: neither is refused."""
    data = {**MINIMAL, "dpo": {"data": {"synthetic": {}}}}
    over = ["infra.devices_per_node=2", "infra.sequence_parallel=2"]
    resolve(validate_recipe(apply_overrides(data, over)))


GRPO = {
    "data": {"synthetic": {}},
    "rewards": [{"fn": "posttrain.rewards.match:exact_match"}],
    "batch": {"micro_batch_size": 2, "grad_accum_steps": 1, "padding_free": True},
    "rollout": {"samples_per_prompt": 2},
}


def test_grpo_is_wired_on_the_in_process_engines_only() -> None:
    """GRPO splits its forwards (accepted on `hf` and `fast`); a server engine is refused by
    its field."""
    data = {**MINIMAL, "grpo": GRPO}
    over = ["infra.devices_per_node=2", "infra.sequence_parallel=2"]
    resolve(validate_recipe(apply_overrides(data, over)))
    resolve(validate_recipe(apply_overrides(data, [*over, "grpo.rollout.engine=fast"])))
    served = copy.deepcopy(data)
    served["grpo"]["rollout"] |= {"engine": "server", "server": {"url": "http://127.0.0.1:9"}}
    assert errors_of(over, served) == [
        "grpo.rollout.engine: server is refused with infra.sequence_parallel 2: the ranks of a "
        "sequence-parallel group must train on the same responses, which the in-process "
        "engines are wired to share; set rollout.engine: hf or fast"
    ]


def test_episodes_are_refused_under_sequence_parallelism() -> None:
    """Every rank of a group plays the group's episodes itself: a tool would act twice."""
    data = {
        **MINIMAL,
        "ingest": {"source": "from_config", "from_config": {"template": "chatml_tools"}},
        "grpo": {**GRPO, "rollout": {**GRPO.get("rollout", {}), "tools": ["calculator:add"]}},
    }
    over = ["infra.devices_per_node=2", "infra.sequence_parallel=2"]
    assert (
        "grpo.rollout.tools is refused with infra.sequence_parallel 2: every rank of a "
        "sequence-parallel group plays the same episodes, so a tool or environment would act 2 "
        "times; set infra.sequence_parallel: 1 for episodes"
    ) in errors_of(over, data)
