"""Merge, save, verify and describe an export, on a tiny real model and real LoRA adapters."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from fixtures_tiny import TinyAssets, load_base, one_torch_thread, sft_batch, tiny_assets
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.export.merge import merge_adapter, save_export
from posttrain.export.model_card import model_card
from posttrain.export.verify import ExportVerificationError, verify_export
from posttrain.store.artifacts import sha256_file

ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyAssets:
    return tiny_assets(tmp_path_factory)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def probe_ids(tiny: TinyAssets) -> torch.Tensor:
    """Held-out-like token ids [4, T] the export is checked on (not the adapter's training rows)."""
    return sft_batch(tiny.tokenizer, n=4, seed=3)["input_ids"]


@pytest.fixture(scope="module")
def fp32_export(tiny: TinyAssets, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export_fp32")
    save_export(
        merge_adapter(tiny.base_dir, tiny.adapter_trained, torch.float32), tiny.tokenizer, out
    )
    return out


def _export(tiny: TinyAssets, adapter: Path, dtype: torch.dtype, out: Path) -> list[Path]:
    return save_export(merge_adapter(tiny.base_dir, adapter, dtype), tiny.tokenizer, out)


def test_save_export_writes_safetensors_config_and_tokenizer(tiny, tmp_path):
    files = _export(tiny, tiny.adapter_trained, torch.float32, tmp_path / "out")
    names = {f.name for f in files}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= names
    assert not [n for n in names if n.endswith((".bin", ".pt"))]
    assert all(f.is_file() for f in files)


def test_trained_adapter_export_verifies(tiny, fp32_export, probe_ids):
    report = verify_export(fp32_export, tiny.base_dir, tiny.adapter_trained, probe_ids, ATOL)
    assert report["passed"]
    assert report["export_dtype"] == "float32" and report["atol_effective"] == ATOL
    assert report["max_abs_logit_diff"] <= ATOL
    assert report["max_abs_weight_diff_vs_base"] > 0
    # The adapter visibly changes the model, and the export carries that change.
    assert report["adapter_logit_effect"] > 100 * ATOL
    assert report["logits_differ_from_base"] == pytest.approx(
        report["adapter_logit_effect"], abs=ATOL
    )
    assert report["tensors_missing_from_export"] == []


def test_export_reloads_with_plain_transformers(tiny, fp32_export, probe_ids):
    model = AutoModelForCausalLM.from_pretrained(str(fp32_export)).eval()
    assert not isinstance(model, PeftModel)
    assert not [k for k in model.state_dict() if "lora" in k]
    tok = AutoTokenizer.from_pretrained(str(fp32_export))
    assert tok.chat_template == tiny.tokenizer.chat_template
    assert tok.eos_token_id == tiny.tokenizer.eos_token_id
    with torch.no_grad():
        reloaded = model(input_ids=probe_ids).logits
        ref_model = PeftModel.from_pretrained(load_base(tiny), str(tiny.adapter_trained)).eval()
        reference = ref_model(input_ids=probe_ids).logits
    assert (reloaded - reference).abs().max().item() <= ATOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_export_verifies_with_scaled_tolerance(tiny, tmp_path, probe_ids, dtype):
    out = tmp_path / "half"
    _export(tiny, tiny.adapter_trained, dtype, out)
    with safe_open(str(out / "model.safetensors"), framework="pt") as st:
        assert {st.get_tensor(k).dtype for k in st.keys()} == {dtype}  # noqa: SIM118
    report = verify_export(out, tiny.base_dir, tiny.adapter_trained, probe_ids, ATOL)
    # Rounding alone exceeds the fp32 atol, so without the scaling this export would fail ...
    assert report["max_abs_logit_diff"] > ATOL
    assert report["rounding_floor"] > 0
    assert report["max_abs_logit_diff"] <= report["atol_effective"]
    # ... while the tolerance stays far below what the adapter changes.
    assert report["atol_effective"] < report["adapter_logit_effect"] / 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_untrained_adapter_export_is_refused(tiny, tmp_path, probe_ids, dtype):
    # LoRA B is initialised to zero, so merging an untrained adapter changes nothing; in bf16 the
    # export differs from the fp32 base file only by rounding, which must not count as a change.
    out = tmp_path / "zero"
    _export(tiny, tiny.adapter_zero, dtype, out)
    with pytest.raises(ExportVerificationError, match="identical to the base.*all-zero LoRA B"):
        verify_export(out, tiny.base_dir, tiny.adapter_zero, probe_ids, ATOL)


def test_export_that_lost_the_adapter_is_refused(tiny, tmp_path, probe_ids):
    # The base saved as the "export" of a trained adapter: the silent no-op merge.
    out = tmp_path / "not_merged"
    save_export(load_base(tiny), tiny.tokenizer, out)
    with pytest.raises(ExportVerificationError, match="identical to the base.*did not apply"):
        verify_export(out, tiny.base_dir, tiny.adapter_trained, probe_ids, ATOL)


def test_export_whose_logits_drift_is_refused(tiny, fp32_export, tmp_path, probe_ids):
    out = tmp_path / "tampered"
    out.mkdir()
    for f in fp32_export.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(out / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name] = weights[name] + 1e-2 * torch.randn_like(weights[name])
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ExportVerificationError, match="logits differ from base \\+ adapter"):
        verify_export(out, tiny.base_dir, tiny.adapter_trained, probe_ids, ATOL)


# --- model card ------------------------------------------------------------------------------

LINEAGE = [
    {"stage": "ingest", "fingerprint": "a1b2c3d4e5f60718", "parents": []},
    {"stage": "sft", "fingerprint": "0f1e2d3c4b5a6978", "parents": ["a1b2c3d4e5f60718"]},
    {"stage": "evaluate", "fingerprint": "99887766554433aa", "parents": ["0f1e2d3c4b5a6978"]},
    {
        "stage": "export",
        "fingerprint": "bbccddeeff001122",
        "parents": ["0f1e2d3c4b5a6978", "99887766554433aa"],
    },
]


def _card(files: dict[str, str], hub_id: str | None = None) -> str:
    base = {"name": "tiny-llama", "architecture": "LlamaForCausalLM", "params": 107840}
    if hub_id:
        base["hub_id"] = hub_id
    return model_card(
        name="tiny-llama-sft",
        base=base,
        lineage=LINEAGE,
        files=files,
        metrics={"heldout": {"loss": 1.23456, "perplexity": 3.437}, "exact_match": 0.5},
        recipe_sections={
            "sft": {"lora": {"r": 4, "alpha": 8}, "optim": {"lr": 0.01}},
            "export": {"dtype": "bf16"},
        },
        path=[("ingest", "ingest"), ("sft", "sft")],
        evaluated=True,
    )


def test_model_card_lists_lineage_file_hashes_and_metrics(fp32_export):
    files = {f.name: sha256_file(f) for f in sorted(fp32_export.iterdir()) if f.is_file()}
    card = _card(files)
    for stage in LINEAGE:
        assert f"| {stage['stage']} | {stage['fingerprint']} |" in card
    for name, digest in files.items():
        assert f"| {name} | {digest} |" in card
    assert "| heldout.loss | 1.235 |" in card and "| exact_match | 0.5 |" in card
    assert "r: 4" in card and "dtype: bf16" in card
    assert card == _card(files), "the card must be a pure function of its inputs"


def test_model_card_front_matter_is_valid_yaml():
    card = _card({"model.safetensors": "0" * 64})
    assert card.startswith("---\n")
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["library_name"] == "transformers"
    assert "posttrain" in meta["tags"]
    assert "base_model" not in meta, "a local base has no hub id to link"
    meta = yaml.safe_load(_card({}, hub_id="org/tiny-base").split("---\n")[1])
    assert meta["base_model"] == "org/tiny-base"
    assert meta["base_model_relation"] == "finetune"


def test_model_card_pipeline_and_tags_follow_the_shipped_policys_path():
    """The sentence and tags name every kind the policy went through, not a fixed SFT chain;
    a stage named other than its kind keeps its name, and evaluate is there only if it ran."""
    path = [("ingest", "ingest"), ("sft", "sft"), ("dpo", "dpo"), ("grpo_long", "grpo")]
    card = model_card("chain", {"name": "tiny"}, [], {}, {}, {}, path, evaluated=False)
    assert "posttrain pipeline: ingest -> sft -> dpo -> grpo (grpo_long) -> export." in card
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["tags"] == [
        "posttrain", "lora", "merged-lora", "text-generation", "sft", "dpo", "grpo"
    ]  # fmt: skip
    card = model_card("kto", {"name": "tiny"}, [], {}, {}, {}, path[:1] + [("kto", "kto")], True)
    assert "pipeline: ingest -> kto -> evaluate -> export." in card
    assert "sft" not in yaml.safe_load(card.split("---\n")[1])["tags"]
