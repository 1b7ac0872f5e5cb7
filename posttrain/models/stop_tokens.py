"""The token ids a generation stops at: every sampler (eval samples, win-rate, RL rollouts) uses
`stop_token_ids`.

A chat model ends its turn with the template's end-of-turn marker, which is often not the
tokenizer's EOS: Qwen2.5's base tokenizer has EOS `<|endoftext|>` and turns end with
`<|im_end|>`, Gemma-2 ends turns with `<end_of_turn>` (EOS `<eos>`), Phi-3.5 with `<|end|>` (EOS
`<|endoftext|>`), Llama-3.1 with `<|eot_id|>`. Stopping at the EOS alone runs past the end of the
turn into whatever the model writes next (a new user turn, often) until max_new_tokens. Real
checkpoints list their stop ids in generation_config.json `eos_token_id` (an int or a list); a
model built from a config or ingested without that file lacks them, so the template's marker is
added too when it is one token.
"""

from __future__ import annotations

from typing import Any

from posttrain.data.chat import TemplateError, end_of_turn


def end_of_turn_token(tokenizer: Any) -> int | None:
    """The id of the template's end-of-turn marker (the text after an assistant turn's content,
    surrounding whitespace dropped: `<|im_end|>\\n` -> `<|im_end|>`) when it is a single token,
    else None (no template, nothing after a turn, or a marker of several tokens, which a token
    stop cannot express)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        marker = end_of_turn(tokenizer).strip()
    except TemplateError:
        return None
    if not marker:
        return None
    ids = tokenizer(marker, add_special_tokens=False)["input_ids"]
    return int(ids[0]) if len(ids) == 1 else None


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def stop_token_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """Ids generation stops at: the tokenizer's EOS (first, when it has one), the model's
    `generation_config.eos_token_id` (int or list), and the template's single-token end-of-turn
    marker; each once, in that order."""
    found = [
        *_as_ids(getattr(tokenizer, "eos_token_id", None)),
        *_as_ids(getattr(generation_config, "eos_token_id", None)),
    ]
    eot = end_of_turn_token(tokenizer)
    if eot is not None:
        found.append(eot)
    return list(dict.fromkeys(found))


def model_stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """`stop_token_ids` with the generation config of `model` (a transformers model, a peft
    wrapper of one, or a `RoleModel` through its causal LM)."""
    lm = getattr(model, "causal_lm", model)
    return stop_token_ids(tokenizer, getattr(lm, "generation_config", None))
