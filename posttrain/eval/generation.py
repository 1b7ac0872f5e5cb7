"""Text generation under a named decoding setting (`SamplingConfig`), reproducible from a seed.

Every decoding knob is passed to `generate` explicitly. transformers fills any knob the caller
leaves out from the model's `generation_config.json` and then from its global defaults (top_k=50,
for one), so a checkpoint that ships e.g. `do_sample: true, temperature: 0.6` would otherwise
silently change what "greedy" or "t1.0-top_k20" means from one base model to the next.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.config.schema import SamplingConfig


def generate_kwargs(cfg: SamplingConfig) -> dict[str, Any]:
    """`generate` keyword arguments for one decoding setting; all are GenerationConfig fields.

    Filters that do not apply to the strategy are set to their neutral value (temperature 1,
    top_p 1, top_k 0 = off) rather than left out, for the reason in the module docstring.
    """
    kwargs: dict[str, Any] = {
        "max_new_tokens": cfg.max_new_tokens,
        "min_new_tokens": 0,
        "num_return_sequences": 1,
        "repetition_penalty": 1.0,
        "no_repeat_ngram_size": 0,
        "use_cache": True,
    }
    if cfg.strategy == "greedy":
        # Sampling-only knobs stay neutral; transformers warns when they are set with
        # do_sample=False, so top_k is None (unset) instead of 0 here.
        kwargs |= {
            "do_sample": False,
            "num_beams": 1,
            "temperature": 1.0,
            "top_k": None,
            "top_p": 1.0,
        }
    elif cfg.strategy == "beam":
        # early_stopping=True: stop once num_beams hypotheses have ended; length_penalty 1 ranks
        # finished beams by mean log-prob per token.
        kwargs |= {
            "do_sample": False,
            "num_beams": cfg.num_beams,
            "early_stopping": True,
            "length_penalty": 1.0,
            "temperature": 1.0,
            "top_k": None,
            "top_p": 1.0,
        }
    elif cfg.strategy == "sample":
        kwargs |= {
            "do_sample": True,
            "num_beams": 1,
            "temperature": cfg.temperature,
            # 0 = top-k off, stated outright; leaving the key out would let the checkpoint or
            # the global default (top_k=50) decide.
            "top_k": cfg.top_k if cfg.top_k is not None else 0,
            "top_p": cfg.top_p if cfg.top_p is not None else 1.0,
            "min_p": None,
            "typical_p": 1.0,
        }
    else:  # the schema's Literal makes this unreachable from a recipe
        raise ValueError(f"unknown strategy {cfg.strategy!r}; known: greedy, sample, beam")
    return kwargs


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def generate(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    cfg: SamplingConfig,
    seed: int,
    batch_size: int = 8,
) -> list[str]:
    """Completions for `prompts` (already chat-templated text), one string per prompt, in order.

    Prompts are tokenized without special tokens (the template already holds them) and padded on
    the LEFT, so every row's last prompt token sits at the same position and new tokens are the
    columns after the input width. Generation stops at the tokenizer's EOS; the decoded text is
    the new tokens only, with special tokens removed.

    Batch k is seeded with seed + k, so a batch's samples do not depend on how many random
    numbers earlier batches used. The caller's global RNG state is restored afterwards. Works on
    a plain transformers model and on a peft PeftModel (both take keyword-only `generate`).
    """
    if not prompts:
        return []
    kwargs = generate_kwargs(cfg)
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    device = _model_device(model)
    was_training = model.training
    model.eval()
    texts: list[str] = []
    fork_devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=fork_devices), torch.no_grad():
            for k, start in enumerate(range(0, len(prompts), batch_size)):
                chunk = prompts[start : start + batch_size]
                enc = tokenizer(
                    chunk,
                    add_special_tokens=False,
                    padding=True,
                    padding_side="left",
                    return_tensors="pt",
                )
                input_ids = enc["input_ids"].to(device)  # [b, P], left-padded
                torch.manual_seed(seed + k)
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=enc["attention_mask"].to(device),
                    eos_token_id=eos_id,
                    pad_token_id=pad_id,
                    **kwargs,
                )  # [b, P + new]; rows that stopped early are padded with pad_id
                new_tokens = out[:, input_ids.shape[1] :]
                texts += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    finally:
        model.train(was_training)
    return texts
