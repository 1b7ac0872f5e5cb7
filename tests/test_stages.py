"""ingest and sft on a tiny model: real training on one rank. Two ranks giving one rank's
trajectory and adapter: tests/test_equivalence.py (the SFT loop's one 2-rank run)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from posttrain.store.artifacts import verify
from posttrain.telemetry.records import read_metrics
from tests.stage_helpers import planned_dir, run_inprocess, run_shared, write_recipe

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, shared_parents: Path) -> dict:
    folder = tmp_path_factory.mktemp("stages")
    recipe = write_recipe(folder)
    # Built once per session: test_preference_stages, test_rl_stages and test_verifiable_rl
    # start from the same ingest and sft.
    ingest = run_shared("ingest", recipe, shared_parents)
    sft = run_shared("sft", recipe, shared_parents)
    return {"recipe": recipe, "ingest": ingest, "sft": sft}


def test_ingest_from_config(tiny) -> None:
    m = json.loads((tiny["ingest"] / "manifest.json").read_text())
    assert verify(tiny["ingest"])[0]
    s = m["summary"]
    assert s["architecture"] == "LlamaForCausalLM" and s["num_params"] > 50_000
    assert s["warmup_final_loss"] < s["warmup_first_loss"] - 1.0
    assert "<|im_start|>" in m["chat_template"]
    assert (s["chat_template_strategy"], s["chat_template_end_of_turn"]) == (
        "prefix",
        "<|im_end|>\n",
    )
    assert {"model/model.safetensors", "tokenizer/tokenizer.json"} <= set(m["files"])


def test_sft_learns_and_reports(tiny) -> None:
    m = json.loads((tiny["sft"] / "manifest.json").read_text())["summary"]
    assert m["eval_loss_final"] < m["eval_loss_start"] - 0.5
    train = read_metrics(tiny["sft"] / "metrics.jsonl", "train")
    assert [r["step"] for r in train] == list(range(1, 17))
    first, last = (sum(r["loss"] for r in rs) / 3 for rs in (train[:3], train[-3:]))
    assert last < first - 0.15, (first, last)
    required = {
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "tokens_per_s_per_device",
        "tflops",
        "mfu",
        "step_time_s",
        "data_wait_s",
        "compute_s",
        "mem_peak_rss_gib",
    }
    assert required <= set(train[-1])
    assert 0 < train[-1]["mfu"] < 1
    start = read_metrics(tiny["sft"] / "metrics.jsonl", "start")[0]
    assert start["params_trainable"] < start["params_total"]
    assert start["global_batch_size"] == 8 and start["grad_accum_steps"] == 1
    assert (tiny["sft"] / "data" / "eval.jsonl").exists()


def test_adapter_changed_and_reloads_to_the_same_loss(tiny) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file

    from posttrain.config.loader import load_recipe
    from posttrain.data.batching import pad_batch
    from posttrain.data.sft_data import tokenize_rows
    from posttrain.models.loading import load_causal_lm, load_tokenizer
    from posttrain.train.losses import token_nll_sum

    weights = load_file(tiny["sft"] / "adapter" / "adapter_model.safetensors")
    lora_b = [v for k, v in weights.items() if "lora_B" in k]
    assert lora_b and all(v.abs().max() > 0 for v in lora_b), "LoRA B starts at 0: must move"

    recipe = load_recipe(tiny["recipe"])
    tok = load_tokenizer(tiny["ingest"] / "tokenizer")
    base = load_causal_lm(tiny["ingest"] / "model")
    model = PeftModel.from_pretrained(base, str(tiny["sft"] / "adapter")).eval()
    rows = [json.loads(x) for x in (tiny["sft"] / "data" / "eval.jsonl").read_text().splitlines()]
    examples, _ = tokenize_rows(rows, tok, recipe.sft.data)
    total = count = 0.0
    with torch.no_grad():
        for i in range(0, len(examples), 8):
            b = pad_batch(examples[i : i + 8], tok.pad_token_id)
            logits = model(
                input_ids=b["input_ids"],
                attention_mask=b["attention_mask"],
                position_ids=b["position_ids"],
            ).logits
            nll, n = token_nll_sum(logits, b["labels"])
            total, count = total + nll.item(), count + n.item()
    recorded = json.loads((tiny["sft"] / "manifest.json").read_text())["summary"]["eval_loss_final"]
    assert total / count == pytest.approx(recorded, abs=1e-4)


def test_rerun_of_complete_stage_does_nothing(tiny) -> None:
    before = (tiny["sft"] / "metrics.jsonl").read_text()
    run_inprocess("sft", tiny["recipe"])
    assert (tiny["sft"] / "metrics.jsonl").read_text() == before


def test_crash_leaves_checkpoint_and_rerun_resumes(tiny) -> None:
    over = ("sft.checkpoint_every=5", "sft.max_steps=10")
    out = run_inprocess("sft", tiny["recipe"], *over)
    full = read_metrics(out / "metrics.jsonl", "train")
    assert (out / "checkpoints" / "step_0000005" / "meta.json").exists()
    # Simulate a crash at step 7 (after the step-5 checkpoint): no adapter, no manifest, and
    # metrics up to step 7 that the resumed run must replace from step 6 on.
    (out / "manifest.json").unlink()
    shutil.rmtree(out / "adapter")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join(lines[: 2 + 7]) + "\n")
    run_inprocess("sft", tiny["recipe"], *over)
    resumed = read_metrics(out / "metrics.jsonl", "train")
    assert [r["step"] for r in resumed] == list(range(1, 11))
    for a, b in zip(full[5:], resumed[5:], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
    assert verify(out)[0]


def _path_recipe(tmp_path: Path, model_dir: Path, *extra: str) -> tuple[Path, list[str]]:
    recipe = write_recipe(tmp_path)
    return recipe, ["ingest.source=path", f"ingest.path={model_dir}", *extra]


def _hf_folder(tiny, tmp_path: Path) -> Path:
    folder = tmp_path / "base"
    shutil.copytree(tiny["ingest"] / "model", folder)
    for f in (tiny["ingest"] / "tokenizer").iterdir():
        shutil.copy(f, folder / f.name)
    return folder


def test_ingest_path_admits_a_hf_folder(tiny, tmp_path: Path) -> None:
    folder = _hf_folder(tiny, tmp_path)
    recipe, over = _path_recipe(tmp_path, folder)
    out = run_inprocess("ingest", recipe, *over)
    s = json.loads((out / "manifest.json").read_text())["summary"]
    assert s["model_dir"] == str(folder) and s["num_params"] > 50_000
    assert set(s["source_files"]) >= {"model.safetensors", "config.json", "tokenizer.json"}


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("pickle", "pickle weight files ['pytorch_model.bin'] refused"),
        ("remote_code", "needs custom code (auto_map)"),
        ("truncated", "model.safetensors: unreadable safetensors file"),
        ("header_length", "model.safetensors: unreadable safetensors file (header length"),
        ("no_template", "has no chat template; set ingest.chat_template"),
    ],
)
def test_ingest_refuses_unsafe_or_broken_folders(tiny, tmp_path: Path, damage, message) -> None:
    folder = _hf_folder(tiny, tmp_path)
    if damage == "pickle":
        torch.save({"w": torch.zeros(1)}, folder / "pytorch_model.bin")
    elif damage == "remote_code":
        cfg = json.loads((folder / "config.json").read_text())
        cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.Model"}
        (folder / "config.json").write_text(json.dumps(cfg))
    elif damage == "truncated":
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[: len(data) // 3])
    elif damage == "header_length":
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + data[8:])
    else:
        (folder / "chat_template.jinja").unlink()
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        cfg.pop("chat_template", None)
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    recipe, over = _path_recipe(tmp_path, folder)
    with pytest.raises(SystemExit):
        run_inprocess("ingest", recipe, *over)
    err = (planned_dir("ingest", recipe, *over) / "logs" / "error.txt").read_text()
    assert message in err
    assert not (planned_dir("ingest", recipe, *over) / "manifest.json").exists()


def _fresh_run(recipe: Path, *overrides: str) -> list[dict]:
    """Train records of one run, its folder removed after: how a step's rows are split and
    laid out is not part of the fingerprint, so without that the next run would be a cache
    hit of this one."""
    out = run_inprocess("sft", recipe, *overrides)
    rows = read_metrics(out / "metrics.jsonl", "train")
    shutil.rmtree(out)
    return rows


def test_accumulation_equals_a_bigger_micro_batch(tiny) -> None:
    """micro 4 x accum 2 takes the same rows and the same token-weighted loss as micro 8 x 1."""
    a = _fresh_run(tiny["recipe"], "sft.max_steps=2")
    b = _fresh_run(
        tiny["recipe"],
        "sft.max_steps=2",
        "sft.batch.micro_batch_size=4",
        "sft.batch.grad_accum_steps=2",
    )
    assert [r["forwards"] for r in a] == [1, 1] and [r["forwards"] for r in b] == [2, 2]
    assert [r["target_tokens"] for r in a] == [r["target_tokens"] for r in b]
    for x, y in zip(a, b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], abs=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)


def test_padding_free_and_token_budgets_change_nothing_but_the_layout(tiny) -> None:
    """Padded rows, padding-free rows (the default) and micro-batches by token budget take the
    same rows and give the same losses and gradient norms; only padding and forwards differ."""
    flat = _fresh_run(tiny["recipe"], "sft.max_steps=3")
    padded = _fresh_run(tiny["recipe"], "sft.max_steps=3", "sft.batch.padding_free=false")
    budget = _fresh_run(tiny["recipe"], "sft.max_steps=3", "sft.batch.by_tokens=200")
    assert all(r["padding_frac"] == 0 for r in flat + budget)
    assert all(r["padding_frac"] > 0.05 for r in padded)  # rows of unequal length
    assert all(r["forwards"] == 1 for r in flat) and all(r["forwards"] > 1 for r in budget)
    for other in (padded, budget):
        assert [r["target_tokens"] for r in other] == [r["target_tokens"] for r in flat]
        assert [r["tokens"] for r in other] == [r["tokens"] for r in flat]  # real tokens
        for x, y in zip(flat, other, strict=True):
            assert y["loss"] == pytest.approx(x["loss"], abs=1e-5)
            assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)


def test_by_tokens_auto_on_cpu_keeps_the_rows(tiny) -> None:
    """`batch.by_tokens: auto` on CPU: the rows' own micro-batches (one forward of 8 rows a
    step), recorded in the start record, the pre-flight's record and the summary's memory."""
    out = run_inprocess("sft", tiny["recipe"], "sft.max_steps=1", "sft.batch.by_tokens=auto")
    start = read_metrics(out / "metrics.jsonl", "start")[0]
    assert start["by_tokens"] is None and start["by_tokens_asked"] == "auto"
    assert start["logits_head"] == "chunked"  # infra.logits_head auto: compile is off on CPU
    assert [r["forwards"] for r in read_metrics(out / "metrics.jsonl", "train")] == [1]
    pre = json.loads((out / "logs" / "preflight.json").read_text())
    assert pre["by_tokens"] is None and pre["by_tokens_asked"] == "auto"
    memory = json.loads((out / "manifest.json").read_text())["summary"]["memory"]
    assert memory["measured"] == "peak RSS" and memory.get("by_tokens") is None
    shutil.rmtree(out)


@pytest.mark.slow
def test_compiled_blocks_train_as_eager_and_report_compile_time(tiny) -> None:
    """infra.compile true on CPU: the same losses as eager (float rounding), the compile's
    seconds in the first step's record (the held-out loss before step 1 compiles too, outside
    step_time_s), and no graph compiled after."""
    eager = _fresh_run(tiny["recipe"], "sft.max_steps=3")
    out = run_inprocess("sft", tiny["recipe"], "sft.max_steps=3", "infra.compile=true")
    compiled = read_metrics(out / "metrics.jsonl", "train")
    assert read_metrics(out / "metrics.jsonl", "start")[0]["compiled_blocks"] == 2
    assert compiled[0]["graphs_compiled"] >= 1
    assert compiled[0]["compile_s"] > 0
    assert [r["graphs_compiled"] for r in compiled[1:]] == [0, 0]
    for x, y in zip(eager, compiled, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
    shutil.rmtree(out)


@pytest.mark.slow
def test_compiled_logits_head_trains_as_chunked(tiny) -> None:
    """infra.logits_head compiled on CPU (blocks eager): the losses and gradient norms of the
    eager chunked head step by step (float rounding), the head's two graphs compiled at the
    first step (its held-out loss before it compiles the forward) and none after."""
    eager = _fresh_run(tiny["recipe"], "sft.max_steps=3")
    torch._dynamo.reset()  # in-process stages: an earlier test's head graphs would serve here
    out = run_inprocess("sft", tiny["recipe"], "sft.max_steps=3", "infra.logits_head=compiled")
    start = read_metrics(out / "metrics.jsonl", "start")[0]
    assert start["logits_head"] == "compiled" and start["compiled_blocks"] == 0
    compiled = read_metrics(out / "metrics.jsonl", "train")
    assert compiled[0]["graphs_compiled"] >= 1
    assert [r["graphs_compiled"] for r in compiled[1:]] == [0, 0]
    for x, y in zip(eager, compiled, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
    shutil.rmtree(out)


def test_bf16_base_sft_trains_fp32_adapter(tiny) -> None:
    """infra.base_dtype bf16 on CPU (slow matmul, so 4 steps): the stage holds the base in
    bf16, computes in bf16, and its step-1 loss is the fp32 run's to bf16 rounding; losses stay
    finite and fall; the saved adapter is fp32."""
    out = run_inprocess("sft", tiny["recipe"], "sft.max_steps=4", "infra.base_dtype=bf16")
    assert read_metrics(out / "metrics.jsonl", "start")[0]["base_dtype"] == "bfloat16"
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl", "train")]
    fp32 = read_metrics(tiny["sft"] / "metrics.jsonl", "train")
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[0] == pytest.approx(fp32[0]["loss"], abs=0.05)  # same rows, LoRA B = 0
    m = json.loads((out / "manifest.json").read_text())["summary"]
    assert m["eval_loss_final"] < m["eval_loss_start"] - 0.05, m  # held-out loss falls
    from safetensors import safe_open

    with safe_open(str(out / "adapter" / "adapter_model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}  # noqa: SIM118


def test_packing_and_activation_checkpointing(tiny) -> None:
    out = run_inprocess(
        "sft",
        tiny["recipe"],
        "sft.max_steps=3",
        "sft.packing=true",
        "sft.activation_checkpointing=true",
        "sft.data.max_seq_len=128",
    )
    start = read_metrics(out / "metrics.jsonl", "start")[0]
    assert start["train_examples"] < start["train_rows"], "rows were packed together"
    train = read_metrics(out / "metrics.jsonl", "train")
    assert len(train) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in train)
    # Packed rows hold several examples: more target tokens per step than unpacked rows give.
    plain = read_metrics(tiny["sft"] / "metrics.jsonl", "train")
    assert train[0]["target_tokens"] > plain[0]["target_tokens"]


def test_bad_data_row_fails_the_stage_naming_file_and_line(tiny, tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    good = json.dumps({"prompt": "What is 1 + 1?", "completion": "2"})
    data.write_text("\n".join([good] * 5 + ['{"prompt": "x", "completion": 7}']) + "\n")
    # The data lives outside the recipe's folder: the recipe must allow it explicitly.
    over = ("sft.data.synthetic=null", f"sft.data.path={data}", f"run.allowed_paths=[{tmp_path}]")
    with pytest.raises(SystemExit):
        run_inprocess("sft", tiny["recipe"], *over)
    err = (planned_dir("sft", tiny["recipe"], *over) / "logs" / "error.txt").read_text()
    assert f"{data}:6: 'completion' must be a string, got int" in err
    assert verify(tiny["ingest"])[0], "the failure leaves earlier artifacts intact"
