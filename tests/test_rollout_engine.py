"""The rollout engine (posttrain.rl.rollout.engine): the decode loop that drops finished rows
samples the same tokens as transformers' generate for the same seed (greedy and sampled, with
and without top-k/top-p, in one call or in chunks), `sample()` builds the same Rollout through
either path, and the new recipe fields stay out of the fingerprint at their defaults. The 2-rank
synced path is tested in test_rl_stages (tests/rl_two_rank_worker.py)."""

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
    prompts,
    tiny_assets,
)
from torch import nn

from posttrain.models.adapters import POLICY
from posttrain.models.lora import apply_lora
from posttrain.models.roles import RoleModel
from posttrain.rl.rollout.engine import HFEngine
from posttrain.rl.rollout.engines import build_engine
from posttrain.rl.rollout.sample import sample
from posttrain.sections.shared import RolloutConfig, SamplingConfig


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyAssets:
    return tiny_assets(tmp_path_factory)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def roles(tiny: TinyAssets) -> tuple[RoleModel, list[list[int]]]:
    lm = apply_lora(load_base(tiny), LORA_CFG)
    model = RoleModel(lm, nn.Linear(lm.get_base_model().config.hidden_size, 1), None)
    tok = tiny.tokenizer
    # Prompts of different lengths, so the left padding differs between rows.
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts(tok, 6)]
    ids = [s[: 4 + 3 * i] for i, s in enumerate(ids)]
    return model, ids


def _sampling(strategy: str, n: int, **kw: object) -> SamplingConfig:
    return SamplingConfig(name="t", strategy=strategy, max_new_tokens=n, **kw)


def _stops_that_end_rows_early(engine: HFEngine, ids: list[list[int]], s: SamplingConfig) -> list:
    """Stop ids taken from a run that never stops: row 0's 2nd and row 2's 5th token, so rows
    end at different steps (and the others later or never)."""
    full = engine.generate(ids, s, [-1], 0, seed=3)
    return [int(full[0, 1]), int(full[2, 4])]


@pytest.mark.parametrize(
    "strategy,kw",
    [
        ("greedy", {}),
        ("sample", {"temperature": 1.0}),
        ("sample", {"temperature": 0.7, "top_k": 20, "top_p": 0.9}),
    ],
    ids=["greedy", "sample", "sample-topk-topp"],
)
def test_decode_loop_samples_the_tokens_generate_samples(roles, strategy, kw) -> None:
    model, ids = roles
    s = _sampling(strategy, 16, **kw)
    hf = HFEngine(model, POLICY, world=1)
    stops = _stops_that_end_rows_early(hf, ids, s)
    want = hf.generate(ids, s, stops, 0, seed=3)
    got = HFEngine(model, POLICY, world=1, drop_finished=True).generate(ids, s, stops, 0, seed=3)
    assert torch.equal(got, want)
    # The case is one where rows end at different steps: some early, some run on.
    ends = [(r == stops[0]) | (r == stops[1]) for r in want]
    firsts = sorted(int(e.nonzero()[0]) if e.any() else 16 for e in ends)
    assert firsts[0] < firsts[-1] and firsts[0] <= 1


def test_decode_loop_matches_generate_in_chunks_and_restores_rng(roles) -> None:
    """Chunks of 4 and 2 rows share one RNG stream: the loop draws what generate draws per
    step, so the second chunk's tokens match too; the caller's RNG state is untouched."""
    model, ids = roles
    s = _sampling("sample", 12, temperature=1.0)
    stops = _stops_that_end_rows_early(HFEngine(model, POLICY, 1), ids, s)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    want = HFEngine(model, POLICY, 1, batch_size=4).generate(ids, s, stops, 0, seed=5)
    got = HFEngine(model, POLICY, 1, batch_size=4, drop_finished=True).generate(
        ids, s, stops, 0, seed=5
    )
    assert torch.equal(got, want)
    assert torch.equal(torch.get_rng_state(), before)
    other = HFEngine(model, POLICY, 1, drop_finished=True).generate(ids, s, stops, 0, seed=6)
    assert not torch.equal(other, got)  # the seed decides


def test_sample_builds_the_same_rollout_through_either_path(roles) -> None:
    model, ids = roles
    cfg = RolloutConfig(max_new_tokens=10, temperature=1.0)
    stops = _stops_that_end_rows_early(
        HFEngine(model, POLICY, 1),
        ids,
        SamplingConfig(name="r", strategy="sample", temperature=1.0, max_new_tokens=10),
    )
    dropping = cfg.model_copy(update={"drop_finished": True})
    a = sample(build_engine(cfg, model, POLICY, 1), ids, [[]] * len(ids), cfg, 0, stops, seed=9)
    b = sample(
        build_engine(dropping, model, POLICY, 1), ids, [[]] * len(ids), dropping, 0, stops, 9
    )
    for name in ("prompt_ids", "prompt_mask", "response", "mask", "stopped", "versions"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.stopped.any() and a.mask.sum() < a.mask.numel()
    assert a.versions.tolist() == [0] * len(ids)  # the in-process engine's starting version


def test_build_engine_names_the_field() -> None:
    cfg = RolloutConfig().model_copy(update={"engine": "vllm"})
    with pytest.raises(
        ValueError, match=r"rollout.engine: unknown engine 'vllm'; known: \['fast', 'hf'\]"
    ):
        build_engine(cfg, nn.Linear(1, 1), POLICY, 1)
    with pytest.raises(ValueError, match="engine"):
        RolloutConfig(engine="vllm")


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma2"])
def test_decode_loop_matches_generate_on_other_families(family: str) -> None:
    """Random-init tiny models of other cache layouts: grouped KV heads (Qwen2/3), and Gemma-2's
    sliding-window layers (window 8 < prompt lengths) with its logit soft-cap."""
    model = family_role_model(family)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 9, 14, 20, 7, 11)]
    s = _sampling("sample", 20, temperature=1.0)
    full = HFEngine(model, POLICY, 1).generate(ids, s, [-1], 0, seed=3)
    stops = [int(full[0, 1]), int(full[2, 4]), int(full[4, 7])]
    want = HFEngine(model, POLICY, 1).generate(ids, s, stops, 0, seed=3)
    got = HFEngine(model, POLICY, 1, drop_finished=True).generate(ids, s, stops, 0, seed=3)
    assert torch.equal(got, want)
