"""Generation stops at the end of a turn: the stop-id set (tokenizer EOS, generation_config eos
ids, the template's single-token end-of-turn marker) for templates modelled on real families,
and the eval sampler and the RL rollout stopping at a marker that is not the tokenizer's EOS, on
the tiny real model with its head's output scripted by a forward hook."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from chat_template_fixtures import FIXTURES, Fixture, base_tokenizer, fixture_tokenizer
from fixtures_tiny import LORA_CFG, TinyAssets, load_base, one_torch_thread, prompts, tiny_assets
from torch import nn
from transformers import GenerationConfig

from posttrain.eval.generation import generate, generate_ids
from posttrain.models.adapters import POLICY
from posttrain.models.lora import apply_lora
from posttrain.models.roles import RoleModel
from posttrain.models.stop_tokens import end_of_turn_token, model_stop_token_ids, stop_token_ids
from posttrain.models.tiny import EOT, IM_END
from posttrain.rl.rollout.engines import build_engine
from posttrain.rl.rollout.sample import decode_responses, sample
from posttrain.sections.shared import RolloutConfig, SamplingConfig
from tests.chat_template_fixtures import with_chat_tokens

GREEDY = SamplingConfig(name="greedy", strategy="greedy", max_new_tokens=12)

# The end-of-turn marker each fixture's template writes (chat_template_fixtures: Gemma-2's
# <end_of_turn> vs EOS <eos>, Phi-3.5's <|end|> vs <|endoftext|>, Llama-3's <|eot_id|>, ...).
MARKERS = {
    "chatml": IM_END,
    "no_system": "<end_of_turn>",
    "eos_every_render": "<|end|>",
    "think_prompt": "<｜end▁of▁sentence｜>",
    "think_last": IM_END,
    "system_last_user": "</s>",
    "bos_in_template": "<|eot_id|>",
    "generation": IM_END,
}


@pytest.mark.parametrize("f", FIXTURES, ids=lambda f: f.name)
def test_stop_ids_of_real_family_templates(f: Fixture) -> None:
    """The marker is found as one token; the set is the EOS then the marker, each once."""
    tok = fixture_tokenizer(f)
    marker = tok.convert_tokens_to_ids(MARKERS[f.name])
    assert end_of_turn_token(tok) == marker
    want = [tok.eos_token_id] + ([marker] if marker != tok.eos_token_id else [])
    assert stop_token_ids(tok) == want
    # Differs from the EOS for Gemma-2-like, Phi-3.5-like and Qwen-base-like setups.
    if f.name in ("no_system", "eos_every_render"):
        assert len(want) == 2


def test_stop_ids_add_generation_config_ids_and_skip_multi_token_markers() -> None:
    tok = copy.deepcopy(base_tokenizer())
    tok.eos_token = EOT  # a base tokenizer (<|endoftext|>) with a ChatML template (<|im_end|>)
    eot, im_end = tok.convert_tokens_to_ids(EOT), tok.convert_tokens_to_ids(IM_END)
    assert stop_token_ids(tok) == [eot, im_end]
    assert stop_token_ids(tok, GenerationConfig(eos_token_id=7)) == [eot, 7, im_end]
    assert stop_token_ids(tok, GenerationConfig(eos_token_id=[im_end, 9, eot])) == [eot, im_end, 9]
    # A plain-text end of turn of several tokens cannot be a token stop; no template, no marker.
    plain = with_chat_tokens(
        tok,
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\nEND OF TURN\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}",
        (),
        None,
        EOT,
    )
    assert end_of_turn_token(plain) is None and stop_token_ids(plain) == [eot]
    plain.chat_template = None
    assert end_of_turn_token(plain) is None


# --- samplers on the tiny real model --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyAssets:
    return tiny_assets(tmp_path_factory)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


@contextmanager
def scripted(model: nn.Module, token: int, step: int, banned: list[int]) -> Iterator[None]:
    """The head's output, through a forward hook: `banned` ids never win, and at the `step`-th
    head call (1 = the prefill, which gives the first new token) `token` does."""
    calls = [0]

    def hook(_m: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:  # [b, t, V]
        calls[0] += 1
        out = out.clone()
        out[..., banned] = -1e4
        if calls[0] == step:
            out[..., token] = 1e4
        return out

    handle = model.get_output_embeddings().register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _base_tok(tiny: TinyAssets):
    """The tiny tokenizer with a Qwen-base-like EOS (<|endoftext|>); turns end with <|im_end|>."""
    tok = copy.deepcopy(tiny.tokenizer)
    tok.eos_token = EOT
    return tok


def test_generation_stops_at_the_templates_end_of_turn(tiny: TinyAssets) -> None:
    """EOS <|endoftext|>, generation_config naming only that: the 4th new token is <|im_end|>,
    where generation stops (at the EOS alone it would run on to max_new_tokens); the text is
    the 3 tokens before it."""
    model, tok = load_base(tiny), _base_tok(tiny)
    eot, im_end = tok.eos_token_id, tok.convert_tokens_to_ids(IM_END)
    model.generation_config.eos_token_id = eot
    assert model_stop_token_ids(model, tok) == [eot, im_end]
    ps = prompts(tok, 2)
    with scripted(model, im_end, 4, [eot, im_end]):
        rows = generate_ids(model, tok, ps, GREEDY, seed=0)
    assert [(len(ids), ids[-1], stopped) for ids, stopped in rows] == [(4, im_end, True)] * 2
    with scripted(model, im_end, 4, [eot, im_end]):
        texts = generate(model, tok, ps, GREEDY, seed=0)
    assert texts == [tok.decode(ids[:3], skip_special_tokens=True) for ids, _ in rows]
    # Without the marker in play the same run is max_new_tokens long.
    with scripted(model, im_end, 99, [eot, im_end]):
        long = generate_ids(model, tok, ps, GREEDY, seed=0)
    assert [(len(ids), stopped) for ids, stopped in long] == [(12, False)] * 2


def test_generation_stops_at_generation_config_eos_ids(tiny: TinyAssets) -> None:
    """An ordinary token listed in the model's generation_config eos_token_id (a list, as real
    checkpoints ship it) ends generation."""
    model, tok = load_base(tiny), tiny.tokenizer
    other = 100
    model.generation_config.eos_token_id = [tok.eos_token_id, other]
    with scripted(model, other, 3, [tok.eos_token_id, other]):
        rows = generate_ids(model, tok, prompts(tok, 1), GREEDY, seed=0)
    assert [(len(ids), ids[-1], stopped) for ids, stopped in rows] == [(3, other, True)]


def test_rl_rollout_ends_responses_at_the_end_of_turn(tiny: TinyAssets) -> None:
    """The rollout sampler on the role model: responses stop at <|im_end|> (not the EOS), the
    response mask covers the tokens up to and including it, `stopped` is set, and the text
    the reward model re-renders leaves the marker out."""
    tok = _base_tok(tiny)
    lm = apply_lora(load_base(tiny), LORA_CFG)
    lm.get_base_model().generation_config.eos_token_id = tok.eos_token_id
    model = RoleModel(lm, nn.Linear(lm.get_base_model().config.hidden_size, 1), None)
    im_end = tok.convert_tokens_to_ids(IM_END)
    stops = model_stop_token_ids(model, tok)
    assert stops == [tok.eos_token_id, im_end]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts(tok, 3)]
    cfg = RolloutConfig(max_new_tokens=8, temperature=1.0)
    with scripted(lm.get_base_model(), im_end, 3, stops):
        ro = sample(
            build_engine(cfg, model, POLICY, 1), ids, [[]] * 3, cfg, tok.pad_token_id, stops, 0
        )
    assert ro.mask.sum(1).tolist() == [3.0] * 3
    assert ro.stopped.tolist() == [True] * 3
    assert (ro.response[:, 2] == im_end).all()
    assert decode_responses(tok, ro) == [
        tok.decode(r[:2].tolist(), skip_special_tokens=True) for r in ro.response
    ]
    # At the EOS alone (the old behaviour) none of them would have ended.
    with scripted(lm.get_base_model(), im_end, 3, stops):
        ro = sample(
            build_engine(cfg, model, POLICY, 1),
            ids,
            [[]] * 3,
            cfg,
            tok.pad_token_id,
            tok.eos_token_id,
            0,
        )
    assert ro.stopped.tolist() == [False] * 3 and ro.mask.sum(1).tolist() == [8.0] * 3
