"""A real-size vocabulary end to end: recipes/smoke-152k.yaml (Qwen2.5-0.5B's architecture and
151,936-row vocabulary, shrunk to 2 blocks) through ingest -> SFT -> DPO -> evaluate -> export,
and the strict-JSON guarantee of every manifest it writes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from posttrain import jsonsafe
from posttrain.data.synthetic import pretrain_corpus
from posttrain.kinds.ingest import MODEL_SHAPES, FromConfigModel
from posttrain.models.tiny import fill_vocabulary, train_tokenizer
from posttrain.store.artifacts import write_manifest
from tests.stage_helpers import ROOT, run_inprocess, write_recipe


def _strict(text: str) -> object:
    """json.loads that refuses NaN/Infinity, as jq, JavaScript and Go do."""

    def refuse(name: str) -> None:
        raise ValueError(f"non-JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def test_jsonsafe_writes_null_for_non_finite_figures() -> None:
    text = jsonsafe.dumps({"a": math.nan, "b": [1.5, -math.inf], "c": {"d": math.inf}, "e": 2})
    assert _strict(text) == {"a": None, "b": [1.5, None], "c": {"d": None}, "e": 2}


def test_manifest_with_a_nan_summary_is_strict_json(tmp_path: Path) -> None:
    (tmp_path / "x.txt").write_text("x")
    write_manifest(
        tmp_path,
        stage="sft",
        fp="f",
        parents=[],
        section={},
        seed=0,
        summary={"eval_loss_final": math.nan, "loss": 1.25},
    )
    summary = _strict((tmp_path / "manifest.json").read_text())["summary"]
    assert summary == {"eval_loss_final": None, "loss": 1.25}


def test_shape_fills_what_the_recipe_leaves_out() -> None:
    m = FromConfigModel(shape="qwen2.5-0.5b", num_layers=2, hidden_size=64, num_heads=4)
    assert (m.num_layers, m.hidden_size, m.num_heads) == (2, 64, 4)
    assert (m.vocab_size, m.embedding_rows, m.num_kv_heads) == (151_665, 151_936, 2)
    assert m.architecture == "qwen2" and m.fill_vocab and m.tie_word_embeddings
    assert FromConfigModel(shape="llama3.1-8b").intermediate_size == 14_336
    with pytest.raises(ValueError, match="embedding_rows 1000 is smaller than vocab_size 2048"):
        FromConfigModel(vocab_size=2048, embedding_rows=1000)
    assert set(MODEL_SHAPES) >= {"qwen2.5-0.5b", "qwen2.5-1.5b"}


def test_fill_vocabulary_reaches_the_exact_size_and_still_round_trips(tmp_path: Path) -> None:
    small = train_tokenizer(pretrain_corpus(200, 0), 1000)
    big = fill_vocabulary(small, 151_665)
    assert len(big) == 151_665
    assert big.convert_ids_to_tokens([0, 3]) == ["<|pad|>", "<|im_end|>"]
    text = "Reverse the list: 3, 1, 2. <|im_end|>"
    assert big.decode(big(text, add_special_tokens=False)["input_ids"]) == text
    big.save_pretrained(str(tmp_path))
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(str(tmp_path))) == 151_665


@pytest.mark.slow
def test_smoke_152k_recipe_runs_every_stage(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, yaml.safe_load((ROOT / "recipes/smoke-152k.yaml").read_text()))
    outs = {s: run_inprocess(s, recipe) for s in ("ingest", "sft", "dpo", "evaluate", "export")}
    manifests = {s: _strict((d / "manifest.json").read_text()) for s, d in outs.items()}

    ingest = manifests["ingest"]["summary"]
    assert ingest["vocab_size"] == 151_665
    config = json.loads((Path(ingest["model_dir"]) / "config.json").read_text())
    assert (config["vocab_size"], config["model_type"]) == (151_936, "qwen2")
    # No held-out split: the figure is null (strict JSON), and evaluate says what it skipped.
    assert manifests["sft"]["summary"]["eval_loss_final"] is None
    assert manifests["evaluate"]["summary"]["heldout"] is None
    assert manifests["dpo"]["summary"]["total_steps"] == 3
    assert manifests["export"]["summary"]["verification"]["passed"] is True
    exported = json.loads((outs["export"] / "model" / "config.json").read_text())
    assert exported["vocab_size"] == 151_936
    for d in outs.values():
        metrics = d / "metrics.jsonl"
        for line in metrics.read_text().splitlines() if metrics.exists() else []:
            _strict(line)


@pytest.mark.slow
def test_gpu_check_runs_its_path_shrunk_on_cpu(tmp_path: Path) -> None:
    """bench/gpu_check.py is run by hand on GPU machines; its --cpu-smoke mode runs the very
    same code (shape, data, stages, figures) shrunk, so the script cannot rot between them."""
    import subprocess
    import sys

    out = tmp_path / "figures.json"
    cmd = [sys.executable, "bench/gpu_check.py", "--cpu-smoke", "--shapes", "qwen2.5-0.5b"]
    cmd += ["--work", str(tmp_path / "w"), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert set(figures) == {"qwen2.5-0.5b sft", "qwen2.5-0.5b dpo", "rl grpo", "rl distill"}
    for name, r in figures.items():
        if name.startswith("rl "):  # the RL steps' phases: sampling, then the update
            assert r["sampled_tokens_per_s"] > 0 and r["generation_s"] > 0 < r["training_s"]
        else:
            assert r["tokens_per_s_per_device"] > 0 and 0 < r["mfu"] < 1
        assert r["peak_allocated_gib"] > 0 and r["estimate_gib"] > 0
