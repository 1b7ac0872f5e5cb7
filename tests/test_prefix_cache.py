"""The KV cache kept between episode turns (posttrain.rl.rollout.prefix_cache, `HFEngine` with
`turns=True`): a turn that continues the rows kept from the last one samples the tokens a fresh
prefill of the whole conversation samples (greedy and sampled, GQA families, in chunks, with
rows that continue nothing), prefills only what was appended, and keeps nothing across a
weight change, a `release()`, a call that is not a turn, or on a sliding-window model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from fixtures_tiny import (
    LORA_CFG,
    TinyAssets,
    family_role_model,
    load_base,
    one_torch_thread,
    tiny_assets,
)

from posttrain.models.adapters import POLICY
from posttrain.models.lora import apply_lora
from posttrain.models.roles import RoleModel
from posttrain.rl.rollout.engine import HFEngine
from posttrain.rl.rollout.prefix_cache import PrefixCache, full_attention
from posttrain.sections.shared import SamplingConfig


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyAssets:
    return tiny_assets(tmp_path_factory)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


def _family(name: str, tiny: TinyAssets) -> RoleModel:
    if name == "llama":
        return RoleModel(apply_lora(load_base(tiny), LORA_CFG), None, None)
    return family_role_model(name)


def _prompts(n: int, seed: int, vocab: int = 300) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (4 + 3 * i,), generator=g).tolist() for i in range(n)]


def _next(prompts: list[list[int]], out: torch.Tensor, stops: list[int], seed: int) -> list:
    """Each prompt, its reply as generated (through its stop token) and a tool turn of 2-7
    tokens: the next turn's prompts, as an episode builds them."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for p, r in zip(prompts, out.tolist(), strict=True):
        end = next((i + 1 for i, t in enumerate(r) if t in stops), len(r))
        tool = torch.randint(3, 300, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g)
        rows.append(p + r[:end] + tool.tolist())
    return rows


def _stops(engine: HFEngine, ids: list[list[int]], s: SamplingConfig) -> list[int]:
    """Two tokens a non-stopping run samples early, so rows end at different steps."""
    full = engine.generate(ids, s, [-1], 0, seed=3)
    engine.release()
    return [int(full[0, 1]), int(full[2, 3])]


@pytest.mark.parametrize(
    "family,strategy",
    [("llama", "greedy"), ("llama", "sample"), ("qwen2", "sample"), ("qwen3", "greedy")],
)
def test_turns_from_the_kept_cache_sample_what_a_fresh_prefill_samples(
    tiny: TinyAssets, family: str, strategy: str
) -> None:
    model = _family(family, tiny)
    vocab = model.causal_lm.config.vocab_size
    s = SamplingConfig(name="t", strategy=strategy, max_new_tokens=10)
    kept = HFEngine(model, POLICY, 1)
    fresh = HFEngine(model, POLICY, 1, drop_finished=True)
    prompts = _prompts(6, seed=1, vocab=min(vocab, 300))
    stops = _stops(kept, prompts, s)
    out = kept.generate(prompts, s, stops, 0, seed=4, turns=True)
    assert torch.equal(out, fresh.generate(prompts, s, stops, 0, seed=4))
    assert kept.reused == 0 and len(kept.prefix.rows) == 6
    for turn in range(2):
        prompts = _next(prompts, out, stops, seed=10 + turn)
        held = sum(len(k.ids) for k in kept.prefix.rows.values())
        before = kept.reused
        out = kept.generate(prompts, s, stops, 0, seed=5 + turn, turns=True)
        assert torch.equal(out, fresh.generate(prompts, s, stops, 0, seed=5 + turn)), turn
        # every row continued: only the reply's stop token and the tool turn were prefilled
        assert kept.reused - before == held
        assert held > sum(len(p) for p in prompts) * 0.6


def test_chunks_new_rows_and_ended_rows(tiny: TinyAssets) -> None:
    """Two rows of the last turn ended (left out), a new row continues nothing (a filler),
    in chunks of 2: the same tokens as fresh chunks of 2."""
    model = _family("llama", tiny)
    s = SamplingConfig(name="t", strategy="sample", max_new_tokens=8)
    kept = HFEngine(model, POLICY, 1, batch_size=2)
    fresh = HFEngine(model, POLICY, 1, batch_size=2, drop_finished=True)
    prompts = _prompts(5, seed=2)
    stops = _stops(kept, prompts, s)
    out = kept.generate(prompts, s, stops, 0, seed=4, turns=True)
    nxt = _next(prompts, out, stops, seed=3)
    nxt = [nxt[0], [7, 8], nxt[2], nxt[4]]
    before = kept.reused
    got = kept.generate(nxt, s, stops, 0, seed=6, turns=True)
    assert torch.equal(got, fresh.generate(nxt, s, stops, 0, seed=6))
    assert kept.reused > before
    assert len(kept.prefix.rows) == 4  # what this call kept replaced the last call's


def test_nothing_is_kept_across_weights_release_or_a_plain_call(tiny: TinyAssets) -> None:
    model = _family("llama", tiny)
    s = SamplingConfig(name="t", strategy="greedy", max_new_tokens=4)
    engine = HFEngine(model, POLICY, 1)
    prompts = _prompts(3, seed=3)
    for drop in (
        lambda: engine.sync_weights(model),
        engine.release,
        lambda: engine.generate(prompts, s, [-1], 0, seed=1),
    ):
        engine.generate(prompts, s, [-1], 0, seed=1, turns=True)
        assert engine.prefix.rows
        drop()
        assert not engine.prefix.rows
    off = HFEngine(model, POLICY, 1, keep_turns=False)
    off.generate(prompts, s, [-1], 0, seed=1, turns=True)
    assert not off.prefix.rows


def test_a_sliding_window_model_re_prefills(tiny: TinyAssets) -> None:
    model = _family("gemma2", tiny)
    assert not full_attention(model.causal_lm.config)
    assert full_attention(_family("qwen2", tiny).causal_lm.config)
    s = SamplingConfig(name="t", strategy="sample", max_new_tokens=6)
    engine = HFEngine(model, POLICY, 1)
    prompts = _prompts(3, seed=4)
    out = engine.generate(prompts, s, [-1], 0, seed=1, turns=True)
    assert not engine.prefix.rows
    want = HFEngine(model, POLICY, 1).generate(prompts, s, [-1], 0, seed=1)
    assert torch.equal(out, want)


def test_find_takes_the_longest_strict_prefix_and_checks_the_ids() -> None:
    cache = PrefixCache()
    from transformers import DynamicCache

    kv = DynamicCache()
    kv.update(torch.zeros(2, 1, 5, 2), torch.zeros(2, 1, 5, 2), 0)
    real = torch.ones(5, dtype=torch.bool)
    cache.keep([1, 2, 3, 4, 5], kv, 0, real)
    cache.keep([1, 2], kv, 1, torch.tensor([0, 0, 0, 1, 1], dtype=torch.bool))
    hits = cache.find([[1, 2, 3, 4, 5, 6], [1, 2, 3], [1, 2, 3, 4, 5], [9, 2, 3], [1, 2]])
    assert [None if h is None else len(h.ids) for h in hits] == [5, 2, 2, None, None]
    with pytest.raises(AssertionError, match="kept 5 cached positions for 2 tokens"):
        cache.keep([1, 2], kv, 0, real)
