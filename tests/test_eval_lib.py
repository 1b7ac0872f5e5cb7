"""Held-out loss, generation and decode timing on a tiny real model (no mocks)."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator

import pytest
import torch
from fixtures_tiny import (
    LORA_CFG,
    TinyAssets,
    load_base,
    one_torch_thread,
    prompts,
    sft_batch,
    sft_examples,
    tiny_assets,
    train_steps,
)
from peft import PeftModel
from transformers import GenerationConfig

from posttrain.data.batching import pad_batch
from posttrain.data.chat import IGNORE
from posttrain.eval.generation import generate
from posttrain.eval.heldout import heldout_loss
from posttrain.eval.inference import compare_cache_modes, greedy_decode, measure_inference
from posttrain.models.decoding import generate_kwargs
from posttrain.models.lora import apply_lora
from posttrain.sections.shared import SamplingConfig

GREEDY = SamplingConfig(name="greedy", strategy="greedy", max_new_tokens=12)
SAMPLE = SamplingConfig(name="t1.0", strategy="sample", temperature=1.0, max_new_tokens=12)
BEAM = SamplingConfig(name="beam3", strategy="beam", num_beams=3, max_new_tokens=8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyAssets:
    return tiny_assets(tmp_path_factory)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


# --- held-out loss ---------------------------------------------------------------------------


def _hand_nll(model, examples) -> tuple[float, int]:
    """Sum of -log p(label) over label tokens, one unpadded example at a time, by explicit loop."""
    total, count = 0.0, 0
    with torch.no_grad():
        for e in examples:
            logits = model(input_ids=torch.tensor([e["input_ids"]])).logits[0]  # [T, V]
            logp = torch.log_softmax(logits.double(), dim=-1)
            for t in range(len(e["input_ids"]) - 1):
                target = e["labels"][t + 1]
                if target != IGNORE:
                    total -= logp[t, target].item()
                    count += 1
    return total, count


def test_heldout_loss_equals_hand_computation(tiny):
    model = load_base(tiny)
    examples = sft_examples(tiny.tokenizer, 5, seed=3)
    pad = tiny.tokenizer.pad_token_id
    # Uneven batches (3 + 2 rows of different lengths), right-padded.
    batches = [pad_batch(examples[:3], pad), pad_batch(examples[3:], pad)]
    got = heldout_loss(model, batches, "cpu")

    total, count = _hand_nll(model, examples)
    assert got["tokens"] == count
    assert got["loss"] == pytest.approx(total / count, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
    # Token weighting matters here: the mean of per-batch means is a different number.
    per_batch = [heldout_loss(model, [b], "cpu")["loss"] for b in batches]
    assert abs(sum(per_batch) / 2 - got["loss"]) > 1e-4


def test_heldout_loss_drops_after_adapter_steps_and_restores_mode(tiny):
    batch = sft_batch(tiny.tokenizer, n=8, seed=11)
    torch.manual_seed(0)
    model = apply_lora(load_base(tiny), LORA_CFG)
    before = heldout_loss(model, [batch], "cpu")
    train_steps(model, batch, steps=5, lr=1e-2)
    model.train()
    after = heldout_loss(model, [batch], "cpu")
    assert model.training, "heldout_loss must hand the model back in the mode it found it"
    assert after["tokens"] == before["tokens"]
    assert after["loss"] < before["loss"] - 0.2, (before, after)


def test_heldout_loss_refuses_batches_without_labels(tiny):
    batch = sft_batch(tiny.tokenizer, n=2)
    batch["labels"].fill_(IGNORE)
    with pytest.raises(ValueError, match="no label tokens"):
        heldout_loss(load_base(tiny), [batch], "cpu")


# --- generation kwargs -----------------------------------------------------------------------


def test_generate_kwargs_map_each_strategy():
    greedy = generate_kwargs(GREEDY)
    assert greedy["do_sample"] is False and greedy["num_beams"] == 1
    assert greedy["max_new_tokens"] == 12

    beam = generate_kwargs(BEAM)
    assert beam["do_sample"] is False and beam["num_beams"] == 3

    cfg = SamplingConfig(name="s", strategy="sample", temperature=0.7, top_p=0.9, top_k=20)
    sample = generate_kwargs(cfg)
    assert sample["do_sample"] is True and sample["num_beams"] == 1
    assert (sample["temperature"], sample["top_p"], sample["top_k"]) == (0.7, 0.9, 20)
    # Unset filters are explicitly off, so transformers' default top_k=50 cannot apply.
    plain = generate_kwargs(SAMPLE)
    assert plain["top_k"] == 0 and plain["top_p"] == 1.0


@pytest.mark.parametrize("cfg", [GREEDY, SAMPLE, BEAM], ids=lambda c: c.strategy)
def test_generate_kwargs_are_valid_generation_config_fields(cfg):
    kwargs = generate_kwargs(cfg)
    fields = GenerationConfig()
    unknown = [k for k in kwargs if not hasattr(fields, k)]
    assert not unknown, f"would be forwarded to the model's forward(): {unknown}"
    # strict=True raises on the flag conflicts transformers otherwise only warns about.
    GenerationConfig(**kwargs).validate(strict=True)


# --- generation ------------------------------------------------------------------------------


def test_greedy_is_deterministic_and_independent_of_batching(tiny):
    model, tok = load_base(tiny), tiny.tokenizer
    ps = prompts(tok, 5)
    together = generate(model, tok, ps, GREEDY, seed=0, batch_size=8)
    assert len(together) == 5 and all(isinstance(t, str) for t in together)
    assert len(set(together)) > 1, together  # varied prompts give varied text
    # Left padding: a prompt decodes the same alone as in a padded batch.
    assert generate(model, tok, ps, GREEDY, seed=1, batch_size=2) == together
    assert [generate(model, tok, [p], GREEDY, seed=0)[0] for p in ps] == together


def test_sampling_repeats_with_a_seed_and_restores_global_rng(tiny):
    model, tok = load_base(tiny), tiny.tokenizer
    ps = prompts(tok, 4)
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = generate(model, tok, ps, SAMPLE, seed=5, batch_size=2)
    assert torch.equal(torch.rand(3), expected_next), "caller's RNG stream was disturbed"
    assert generate(model, tok, ps, SAMPLE, seed=5, batch_size=2) == first
    assert generate(model, tok, ps, SAMPLE, seed=6, batch_size=2) != first


def test_model_generation_config_does_not_leak_into_settings(tiny):
    model, tok = load_base(tiny), tiny.tokenizer
    ps = prompts(tok, 3)
    clean = {c.name: generate(model, tok, ps, c, seed=3) for c in (GREEDY, SAMPLE)}
    # A checkpoint shipping its own decoding defaults (top_k=1 would make sampling greedy).
    gc = model.generation_config
    gc.do_sample, gc.temperature, gc.top_k, gc.num_beams, gc.max_new_tokens = True, 3.0, 1, 2, 2
    for c in (GREEDY, SAMPLE):
        assert generate(model, tok, ps, c, seed=3) == clean[c.name], c.name


def test_beam_search_runs_and_is_deterministic(tiny):
    model, tok = load_base(tiny), tiny.tokenizer
    ps = prompts(tok, 3)
    out = generate(model, tok, ps, BEAM, seed=0)
    assert len(out) == 3
    assert generate(model, tok, ps, BEAM, seed=9) == out


def test_generation_stops_at_the_tokenizer_eos(tiny):
    model, tok = load_base(tiny), tiny.tokenizer
    p = prompts(tok, 1)
    ids = tok(p, add_special_tokens=False, return_tensors="pt")["input_ids"]
    first_new, _ = greedy_decode(model, ids, new_tokens=1, use_cache=True)
    long = generate(model, tok, p, GREEDY, seed=0)[0]
    # Same model and prompt, but the first greedy token is now the EOS: generation must stop
    # right after it, leaving at most that one token.
    tok_eos = copy.deepcopy(tok)
    tok_eos.eos_token = tok.convert_ids_to_tokens(first_new[0])
    short = generate(model, tok_eos, p, GREEDY, seed=0)[0]
    assert short in ("", tok.decode(first_new)), short
    assert len(long) > len(short)


def test_generate_on_peft_model_matches_merged_model(tiny):
    tok = tiny.tokenizer
    peft_model = PeftModel.from_pretrained(load_base(tiny), str(tiny.adapter_trained))
    ps = prompts(tok, 4)
    with_adapter = generate(peft_model, tok, ps, GREEDY, seed=0)
    merged = PeftModel.from_pretrained(
        load_base(tiny), str(tiny.adapter_trained)
    ).merge_and_unload()
    assert generate(merged, tok, ps, GREEDY, seed=0) == with_adapter
    assert with_adapter != generate(load_base(tiny), tok, ps, GREEDY, seed=0)


# --- decode timing ---------------------------------------------------------------------------


def _prompt_ids(tok) -> torch.Tensor:
    return tok(prompts(tok, 1), add_special_tokens=False, return_tensors="pt")["input_ids"]


@pytest.mark.parametrize("with_adapter", [False, True], ids=["plain", "peft"])
def test_cache_and_no_cache_decode_the_same_tokens(tiny, with_adapter):
    model = load_base(tiny)
    if with_adapter:
        model = PeftModel.from_pretrained(model, str(tiny.adapter_trained))
    result = compare_cache_modes(model, _prompt_ids(tiny.tokenizer), new_tokens=12, repeats=2)
    assert result["tokens_match"], (result["cache"]["token_ids"], result["no_cache"]["token_ids"])
    for mode in ("cache", "no_cache"):
        r = result[mode]
        assert len(r["token_ids"]) == 12
        assert r["ttft_s"] > 0 and r["tpot_s"] > 0 and r["tokens_per_s"] > 0
    assert result["speedup"] > 0


def test_hand_loop_matches_hf_greedy_generate(tiny):
    model, tok = load_base(tiny), tiny.tokenizer
    ids = _prompt_ids(tok)
    timed = measure_inference(model, ids, new_tokens=10, use_cache=True, repeats=1)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=10,
        min_new_tokens=10,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **{
            k: v
            for k, v in generate_kwargs(GREEDY).items()
            if k not in ("max_new_tokens", "min_new_tokens")
        },
    )
    hf = out[0, ids.shape[1] :].tolist()
    # min_new_tokens masks EOS in generate; the bare loop may pick it, so compare up to it.
    ours = timed["token_ids"]
    cut = ours.index(tok.eos_token_id) if tok.eos_token_id in ours else len(ours)
    assert hf[:cut] == ours[:cut] and cut > 0


def test_measure_inference_rejects_a_batch_of_prompts(tiny):
    ids = _prompt_ids(tiny.tokenizer).repeat(2, 1)
    with pytest.raises(ValueError, match=r"\[1, P\]"):
        measure_inference(load_base(tiny), ids, new_tokens=2, use_cache=True, repeats=1)


def test_decode_speed_times_the_cached_decode_only_unless_asked(tiny):
    from posttrain.kinds.evaluate import EvaluateConfig, SpeedConfig
    from posttrain.stages.evaluate import decode_speed

    default = EvaluateConfig().speed
    assert default == SpeedConfig(prompt_tokens=32, new_tokens=32, repeats=1, no_cache=False)
    assert EvaluateConfig(speed=None).speed is None  # `evaluate.speed: null` = not measured
    model, ids = load_base(tiny), _prompt_ids(tiny.tokenizer)
    cheap = decode_speed(model, ids, SpeedConfig(new_tokens=6))
    assert set(cheap) == {"cache", "seconds"}
    assert cheap["cache"]["new_tokens"] == 6 and cheap["cache"]["repeats"] == 1
    assert cheap["cache"]["tokens_per_s"] > 0 and "token_ids" not in cheap["cache"]
    both = decode_speed(model, ids, SpeedConfig(new_tokens=6, no_cache=True))
    assert both["no_cache"]["tokens_per_s"] > 0 and both["tokens_match"]
