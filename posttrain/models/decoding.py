"""Decoding settings as `generate` keyword arguments: one named `SamplingConfig` -> every knob.

Every decoding knob is passed to `generate` explicitly. transformers fills any knob the caller
leaves out from the model's `generation_config.json` and then from its global defaults (top_k=50,
for one), so a checkpoint that ships e.g. `do_sample: true, temperature: 0.6` would otherwise
silently change what "greedy" or "t1.0-top_k20" means from one base model to the next.

Below both samplers: evaluation (`posttrain.eval.generation`) and RL rollouts
(`posttrain.rl.rollout.sample`) decode with the same arguments, and training does not import eval.
"""

from __future__ import annotations

from typing import Any

from posttrain.sections.shared import SamplingConfig


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
