"""The `fast` rollout engine (posttrain.rl.rollout.fast_engine): its merged plain copy samples the
tokens the `hf` engine samples from the trainer's peft model (greedy and seeded, stop ids
ending rows at different steps), follows an optimizer update at `sync_weights`, and the
stale-sampler probe fails the stage by name when the copy is left behind. The whole GRPO stage
on it: tests/test_rl_stages.py. CUDA-only behaviour (bf16 copy, compiled decode step): the
skipped test at the end."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from fixtures_tiny import TinyAssets, family_role_model, one_torch_thread, prompts, tiny_assets
from rl_tiny import role_model

import posttrain.rl.rollout.fast_engine as fast_engine
from posttrain.errors import StaleSampler
from posttrain.models.adapters import POLICY, REFERENCE
from posttrain.models.roles import RoleModel
from posttrain.rl.rollout.engine import HFEngine
from posttrain.rl.rollout.engines import build_engine
from posttrain.rl.rollout.fast_engine import FastEngine
from posttrain.sections.shared import RolloutConfig, SamplingConfig


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyAssets:
    return tiny_assets(tmp_path_factory)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


@pytest.fixture
def trained(tiny: TinyAssets) -> tuple[RoleModel, list[list[int]]]:
    """A role model whose policy and reference are the trained (non-zero) tiny adapter, and six
    prompts of different lengths."""
    model = role_model(tiny, critic=False)
    tok = tiny.tokenizer
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts(tok, 6)]
    return model, [s[: 4 + 3 * i] for i, s in enumerate(ids)]


def _sampling(strategy: str, n: int, **kw: object) -> SamplingConfig:
    return SamplingConfig(name="t", strategy=strategy, max_new_tokens=n, **kw)


def _update(model: RoleModel, ids: list[list[int]]) -> None:
    """One AdamW step on the policy's adapter (a large learning rate: the tokens change)."""
    params = [p for n, p in model.named_parameters() if ".lora_" in n and ".default." in n]
    opt = torch.optim.AdamW(params, lr=5e-2)
    x = torch.tensor([ids[-1]])
    logits = model(POLICY, x, torch.ones_like(x), torch.arange(x.size(1))[None])
    (-torch.log_softmax(logits[0, :-1], -1).gather(-1, x[0, 1:, None]).mean()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize(
    "strategy,kw",
    [("greedy", {}), ("sample", {"temperature": 0.7, "top_k": 20, "top_p": 0.9})],
    ids=["greedy", "sample-topk-topp"],
)
@pytest.mark.parametrize("static", [None, True], ids=["cpu-dynamic-cache", "static-cache"])
def test_fast_engine_samples_the_tokens_hf_samples(trained, strategy, kw, static) -> None:
    """Same tokens as `generate` on the peft model, with stops ending rows early; the copy is
    fp32 on CPU, so merged and unmerged LoRA agree to ~1e-6 and the same seed draws the same.
    On CPU the engine decodes with the dynamic cache; the static one (CUDA's) too."""
    model, ids = trained
    s = _sampling(strategy, 16, **kw)
    hf = HFEngine(model, POLICY, 1)
    full = hf.generate(ids, s, [-1], 0, seed=3)
    stops = [int(full[0, 1]), int(full[2, 4])]
    want = hf.generate(ids, s, stops, 0, seed=3)
    fast = FastEngine(model, POLICY, static_cache=static)
    got = fast.generate(ids, s, stops, 0, seed=3)
    assert torch.equal(got, want)
    assert got.size(1) < 16 or bool((got == stops[0]).any() or (got == stops[1]).any())
    assert fast.figures["sampler_probe_mean"] < 1e-4  # the start's probe


def test_fast_engine_follows_an_update_at_sync_weights(trained) -> None:
    model, ids = trained
    s = _sampling("greedy", 12)
    fast = FastEngine(model, POLICY)
    before = fast.generate(ids, s, [-1], 0, seed=0)
    _update(model, ids)
    figures = fast.sync_weights(model)
    after = fast.generate(ids, s, [-1], 0, seed=0)
    assert fast.version == 1
    assert figures["sampler_probe_mean"] < 1e-4 and figures["sampler_probe_max"] < 1e-3
    assert not torch.equal(after, before)  # the update moved the greedy tokens...
    assert torch.equal(after, HFEngine(model, POLICY, 1).generate(ids, s, [-1], 0, seed=0))


def test_probe_fails_the_stage_when_the_copy_is_left_stale(trained, monkeypatch) -> None:
    """The refresh skipped on a real engine: the copy keeps the old weights, the probe names
    the engine, the version and the figures."""
    model, ids = trained
    fast = FastEngine(model, POLICY)
    _update(model, ids)
    monkeypatch.setattr(fast_engine, "refresh", lambda plain, lm, role: None)
    with pytest.raises(StaleSampler) as e:
        fast.sync_weights(model)
    msg = str(e.value)
    assert msg.startswith("rollout.engine 'fast': after the weight refresh to policy version 1 ")
    assert "nats per token apart from the trainer on average (max " in msg
    assert "tolerance 0.001)" in msg


def test_reference_copy_folds_the_reference_adapter(trained) -> None:
    """A copy of another role folds that role's adapter: after a policy update the reference's
    copy still samples what the reference does."""
    model, ids = trained
    _update(model, ids)
    s = _sampling("greedy", 10)
    want = HFEngine(model, REFERENCE, 1).generate(ids, s, [-1], 0, seed=0)
    assert torch.equal(FastEngine(model, REFERENCE).generate(ids, s, [-1], 0, seed=0), want)


def test_episode_turns_keep_their_cache_on_the_copy(trained) -> None:
    """`turns=True`: the decode loop on the merged copy keeps each row's cache, so the next
    turn prefills only what was appended, and samples what the `hf` engine samples."""
    model, ids = trained
    s = _sampling("sample", 8, temperature=1.0)
    hf, fast = HFEngine(model, POLICY, 1), FastEngine(model, POLICY)
    out = fast.generate(ids, s, [-1], 0, seed=4, turns=True)
    assert torch.equal(out, hf.generate(ids, s, [-1], 0, seed=4, turns=True))
    nxt = [p + r + [5, 6, 7] for p, r in zip(ids, out.tolist(), strict=True)]
    again = fast.generate(nxt, s, [-1], 0, seed=5, turns=True)
    assert torch.equal(again, hf.generate(nxt, s, [-1], 0, seed=5, turns=True))
    assert fast.reused == hf.reused > 0


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_fast_engine_matches_hf_on_other_families(family: str) -> None:
    """Grouped KV heads (Qwen2), sliding-window layers and the logit soft-cap (Gemma-2) in the
    static cache."""
    model = family_role_model(family)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 9, 14, 20)]
    s = _sampling("sample", 12, temperature=1.0)
    want = HFEngine(model, POLICY, 1).generate(ids, s, [-1], 0, seed=3)
    fast = FastEngine(model, POLICY, static_cache=True)
    assert torch.equal(fast.generate(ids, s, [-1], 0, seed=3), want)


def test_build_engine_and_fields() -> None:
    with pytest.raises(ValueError, match="rollout.drop_finished: the `fast` engine decodes"):
        RolloutConfig(engine="fast", drop_finished=True)
    cfg = RolloutConfig(engine="fast", sampler_probe_tolerance=0.5, compile_decode=False)
    assert (cfg.sampler_probe_tolerance, cfg.compile_decode) == (0.5, False)


def test_build_engine_makes_the_fast_engine(trained) -> None:
    model, _ = trained
    cfg = RolloutConfig(engine="fast", sampler_probe_tolerance=0.5, compile_decode=False)
    engine = build_engine(cfg, model, POLICY, 2)
    assert isinstance(engine, FastEngine)
    assert (engine.collective, engine.tolerance, engine.compile) == (False, 0.5, False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the bf16 copy and its compiled step")
def test_bf16_copy_on_cuda_passes_its_probe_and_keeps_one_graph(tiny: TinyAssets) -> None:
    """On CUDA: the copy is bf16, the start's probe is within its bf16 tolerance, and a second
    rollout of other prompt widths under the same cache bucket compiles nothing new."""
    model = role_model(tiny, critic=False).cuda()
    tok = tiny.tokenizer
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts(tok, 8)]
    fast = FastEngine(model, POLICY)
    assert next(fast.plain.parameters()).dtype == torch.bfloat16
    assert fast.figures["sampler_probe_mean"] < fast.tolerance == 0.05
    s = _sampling("sample", 32, temperature=1.0)
    first = fast.generate(ids, s, [-1], 0, seed=0)
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    second = fast.generate([x[:-2] for x in ids], s, [-1], 0, seed=1)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled
    assert first.shape == second.shape == (8, 32)
