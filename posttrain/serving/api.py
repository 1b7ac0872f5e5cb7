"""How a rollout is asked of each kind of server, and how its answer becomes token ids.

One prompt per request (the server batches concurrent requests itself: continuous batching), so
a row's answer never depends on which other rows were sent with it. Pure functions of the
request's inputs and the server's JSON; `posttrain.rl.rollout.server_engine` sends them.

- `transformers` (`transformers serve`, `/v1/completions`): the prompt goes as text (the server
  refuses token ids) and comes back as text, decoded without special tokens, so the response ids
  are the text re-tokenised, plus the turn's stop token when the server says it stopped. What it
  sampled can differ (a byte-level BPE model may sample a tokenisation of the text other than
  the canonical one, or a special token the text drops); the server's own token counts catch
  some of it: a response whose re-tokenised length differs from `usage.completion_tokens` is a
  known mismatch. Every sampling knob goes in a `generation_config` (the model's own
  generation_config.json would fill any left out: `posttrain.models.decoding`).
- `vllm` (`vllm serve`, `/v1/completions`): token-id prompts, `return_token_ids` gives the ids
  it sampled (exact) and `logprobs` their log-probs; LoRA adapters go by name in `model`.
- `sglang` (native `/generate`): `input_ids` in, `output_ids` (or the ids of
  `output_token_logprobs`) out, with log-probs; LoRA adapters by name in `lora_path`.

Weights: each API's requests that make a folder servable under a name (`load`) and that drop a
name (`unload`); `posttrain.serving.weights` writes the folders.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from posttrain.models.decoding import generate_kwargs
from posttrain.sections.shared import SamplingConfig

# (path, JSON body) of one POST
Call = tuple[str, dict[str, Any]]


@dataclass(frozen=True)
class Completion:
    """One row's answer, as token ids."""

    ids: list[int]  # the response, its stop token included when it stopped
    exact: bool  # the ids the server sampled (False: its text re-tokenised)
    stopped: bool  # it ended at a stop token (not at max_new_tokens)
    model: str | None  # the model (or adapter) the server says answered; None: it does not say
    prompt_tokens: int | None  # the server's count of the prompt it read
    completion_tokens: int | None  # the server's count of what it sampled
    logps: list[float] | None = None  # the server's log-prob of each id (exact APIs)
    # exact APIs: whether the answer's text re-tokenises to other ids than it sampled (None:
    # no text to compare)
    text_differs: bool | None = None

    @property
    def known_mismatch(self) -> bool:
        """The answer's text and the ids sampled disagree, where that can be known: an exact
        answer's text re-tokenises to other ids; re-tokenised ids whose count contradicts the
        server's (then they cannot be what it sampled)."""
        if self.exact:
            return bool(self.text_differs)
        return self.completion_tokens is not None and self.completion_tokens != len(self.ids)


class ServerError(ValueError):
    """The server answered, but not with something a completion can be read from."""


class ServerAPI(Protocol):
    name: str
    path: str  # where a completion is POSTed
    exact: bool  # whether answers carry the sampled ids
    # weight sync: adapters loaded by name (every request names one), or weights replaced in
    # place (requests name nothing: the server's answer cannot say which version answered)
    named_versions: bool

    def request(
        self, ids: list[int], model: str, sampling: SamplingConfig, stops: list[int], seed: int
    ) -> dict[str, Any]: ...

    def parse(self, body: dict[str, Any], stops: list[int]) -> Completion: ...

    def load(self, name: str, folder: str) -> list[Call]: ...

    def unload(self, name: str) -> list[Call]: ...


def _choice(body: dict[str, Any]) -> dict[str, Any]:
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ServerError(f"no choices in the answer: {json.dumps(body)[:300]}")
    return choices[0]


def _usage(body: dict[str, Any]) -> tuple[int | None, int | None]:  # (prompt, completion)
    usage = body.get("usage") or {}
    return usage.get("prompt_tokens"), usage.get("completion_tokens")


def _text_differs(tok: Any, text: Any, ids: list[int], stopped: bool) -> bool | None:
    """Whether `text` (an exact answer's, special tokens kept or not) re-tokenises to other ids
    than `ids` (its stop token left out of both), or None without text."""
    if not isinstance(text, str):
        return None
    body = ids[:-1] if stopped else ids
    stop_text = tok.decode(ids[-1:]) if stopped else ""
    if stop_text and text.endswith(stop_text):
        text = text[: -len(stop_text)]
    return tok(text, add_special_tokens=False)["input_ids"] != body


def _cut(ids: list[int], stops: list[int]) -> tuple[list[int], bool]:
    """`ids` up to and including the first stop id, and whether there was one."""
    for i, t in enumerate(ids):
        if t in stops:
            return ids[: i + 1], True
    return ids, False


class TransformersAPI:
    """`transformers serve`: text in, text out (see the module docstring)."""

    name, path, exact, named_versions = "transformers", "/v1/completions", False, True

    def __init__(self, tokenizer: Any, turn_stop: int) -> None:
        self.tok, self.turn_stop = tokenizer, turn_stop
        # What the tokenizer puts before any text by itself (a BOS): the server's tokenizer adds
        # it again to the text it gets, so it is left out of the text sent.
        self.auto_prefix = tokenizer("", add_special_tokens=True)["input_ids"]

    def prompt_text(self, ids: list[int]) -> str:
        n = len(self.auto_prefix)
        if n and ids[:n] == self.auto_prefix:
            ids = ids[n:]
        return self.tok.decode(ids, skip_special_tokens=False)

    def request(
        self, ids: list[int], model: str, sampling: SamplingConfig, stops: list[int], seed: int
    ) -> dict[str, Any]:
        config = generate_kwargs(sampling) | {"eos_token_id": stops}
        config.pop("use_cache")  # the server decides how it caches (its paged cache, say)
        return {
            "model": model,
            "prompt": self.prompt_text(ids),
            "generation_config": json.dumps(config),
            "seed": seed,
        }

    def parse(self, body: dict[str, Any], stops: list[int]) -> Completion:
        c = _choice(body)
        text = c.get("text")
        if not isinstance(text, str):
            raise ServerError(f"no text in the answer: {json.dumps(body)[:300]}")
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        stopped = c.get("finish_reason") == "stop"
        if stopped:
            ids = [*ids, self.turn_stop]
        return Completion(ids, False, stopped, body.get("model"), *_usage(body))

    def load(self, name: str, folder: str) -> list[Call]:
        # /reset first: the server keeps every model it loaded (until an idle timeout), and a
        # policy version is a model of its own; nothing is in flight when weights are synced.
        return [("/reset", {}), ("/load_model", {"model": folder})]

    def unload(self, name: str) -> list[Call]:
        return []


def _exact_sampling(sampling: SamplingConfig) -> dict[str, Any]:
    """The sampling fields vLLM and SGLang share (top_k -1 = off; temperature 0 = greedy)."""
    greedy = sampling.strategy == "greedy"
    return {
        "temperature": 0.0 if greedy else sampling.temperature,
        "top_p": 1.0 if greedy or sampling.top_p is None else sampling.top_p,
        "top_k": -1 if greedy or sampling.top_k is None else sampling.top_k,
    }


class VLLMAPI:
    """`vllm serve`: token ids both ways, LoRA adapters by name."""

    name, path, exact, named_versions = "vllm", "/v1/completions", True, True

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer

    def request(
        self, ids: list[int], model: str, sampling: SamplingConfig, stops: list[int], seed: int
    ) -> dict[str, Any]:
        return {
            "model": model,
            "prompt": ids,
            "max_tokens": sampling.max_new_tokens,
            **_exact_sampling(sampling),
            "seed": seed,
            "stop_token_ids": stops,
            "skip_special_tokens": False,
            "return_token_ids": True,
            "logprobs": 1,
        }

    def parse(self, body: dict[str, Any], stops: list[int]) -> Completion:
        c = _choice(body)
        ids = c.get("token_ids")
        if not isinstance(ids, list):
            raise ServerError(
                "no token_ids in the answer (a vLLM without `return_token_ids`, an older "
                "release, does not return them): "
                f"{json.dumps(body)[:300]}"
            )
        ids, stopped = _cut([int(t) for t in ids], stops)
        logps = (c.get("logprobs") or {}).get("token_logprobs")
        logps = [float(x) for x in logps[: len(ids)]] if isinstance(logps, list) else None
        differs = _text_differs(self.tok, c.get("text"), ids, stopped)
        return Completion(ids, True, stopped, body.get("model"), *_usage(body), logps, differs)

    def load(self, name: str, folder: str) -> list[Call]:
        return [("/v1/load_lora_adapter", {"lora_name": name, "lora_path": folder})]

    def unload(self, name: str) -> list[Call]:
        return [("/v1/unload_lora_adapter", {"lora_name": name})]


class SGLangAPI:
    """SGLang's native `/generate`: token ids both ways; LoRA adapters by name, or merged weights
    replaced in place (`merged`)."""

    name, path, exact = "sglang", "/generate", True

    def __init__(self, tokenizer: Any, merged: bool) -> None:
        self.tok, self.merged = tokenizer, merged
        self.named_versions = not merged

    def request(
        self, ids: list[int], model: str, sampling: SamplingConfig, stops: list[int], seed: int
    ) -> dict[str, Any]:
        params = {
            "max_new_tokens": sampling.max_new_tokens,
            **_exact_sampling(sampling),
            "stop_token_ids": stops,
            "skip_special_tokens": False,
            "no_stop_trim": True,
            "sampling_seed": seed,
        }
        body = {"input_ids": ids, "sampling_params": params, "return_logprob": True}
        return body if self.merged else body | {"lora_path": model}

    def parse(self, body: dict[str, Any], stops: list[int]) -> Completion:
        meta = body.get("meta_info") or {}
        pairs = meta.get("output_token_logprobs")
        ids = body.get("output_ids")
        if ids is None and isinstance(pairs, list):
            ids = [p[1] for p in pairs]  # [log-prob, token id, text]
        if not isinstance(ids, list):
            raise ServerError(f"no output ids in the answer: {json.dumps(body)[:300]}")
        ids, stopped = _cut([int(t) for t in ids], stops)
        logps = [float(p[0]) for p in pairs][: len(ids)] if isinstance(pairs, list) else None
        differs = _text_differs(self.tok, body.get("text"), ids, stopped)
        usage = meta.get("prompt_tokens"), meta.get("completion_tokens")
        # model None: /generate does not name the adapter that answered
        return Completion(ids, True, stopped, None, *usage, logps, differs)

    def load(self, name: str, folder: str) -> list[Call]:
        if self.merged:
            return [("/update_weights_from_disk", {"model_path": folder})]
        return [("/load_lora_adapter", {"lora_name": name, "lora_path": folder})]

    def unload(self, name: str) -> list[Call]:
        return [] if self.merged else [("/unload_lora_adapter", {"lora_name": name})]


def server_api(name: str, tokenizer: Any, turn_stop: int, merged: bool) -> ServerAPI:
    """The API of `rollout.server.api`; `turn_stop`: the stop id a re-tokenised answer that
    stopped ends with (the template's end of turn)."""
    if name == "transformers":
        return TransformersAPI(tokenizer, turn_stop)
    if name == "vllm":
        return VLLMAPI(tokenizer)
    if name == "sglang":
        return SGLangAPI(tokenizer, merged)
    raise ValueError(f"rollout.server.api: unknown {name!r}; known: transformers, vllm, sglang")
