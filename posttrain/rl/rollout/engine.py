"""The rollout engine: what turns prompt token ids into sampled responses for online RL.

`sample()` (posttrain.rl.rollout.sample) asks an engine for response tokens and builds the Rollout
(masks, stop flags) around them; scoring and updates never see the engine. Two engines: the
in-process `HFEngine` below, and a serving engine's (vLLM, SGLang, `transformers serve`;
`posttrain.rl.rollout.server_engine.ServerEngine`). The stage holds one engine per sampling role
and calls `sync_weights` after each update, which makes the next `version` (in process: only the
kept cache is dropped; a server loads the policy's adapter). Each rollout records the version
that sampled it, and the update measures its lag. `collective`: `generate` is a collective over
ranks (every forward of the sharded model is one), so callers keep the ranks in step.
`turns=True`: an episode loop's call, whose next prompts extend these prompts and responses, so
the engine may keep its KV cache until `release()` (`posttrain.rl.rollout.prefix_cache`).

`HFEngine` decodes with transformers' `generate` (`drop_finished=False`, the default) or with a
decode loop of its own that drops rows from the batch (and their KV cache) as soon as they emit
a stop token: `generate` keeps stepping every row until the last one ends, so a batch of
long-tailed responses pays for its longest one in every row.

The decode loop samples exactly as `generate` does, token for token for the same seed (on CPU
and CUDA; tested against `generate`): same logit warpers in the same order (temperature, top-k,
top-p), and the same random draws: torch.multinomial(probs, 1) is argmax(probs / q) with
q ~ Exp(1) drawn for the whole [B, V] batch, so the loop draws q for the full batch every step
and reads the rows still running. Logits of a smaller batch may differ from the full batch's in
the last bits (other matmul blocking), which can flip a near-tie.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from transformers import DynamicCache
from transformers.generation import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from posttrain.distributed.fsdp import forward_method, gathered
from posttrain.models.decoding import generate_kwargs
from posttrain.rl.rollout.prefix_cache import Continued, Kept, PrefixCache, full_attention
from posttrain.sections.shared import SamplingConfig

_DECODE_REGISTERED = "_posttrain_decode_registered"


class RolloutEngine(Protocol):
    """Samples responses for online RL; see the module docstring."""

    version: int  # updates applied since the stage's start, counting those before a resume
    collective: bool

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        stop_ids: list[int],
        pad_id: int,
        seed: int,
        turns: bool = False,
    ) -> torch.Tensor:
        """Response ids [N, R] (R = longest response of this call; rows right-padded with
        `pad_id` after the stop token that ended them), seeded by `seed`; the caller's RNG
        state is left as it was."""
        ...

    def release(self) -> None: ...  # drop what `generate(..., turns=True)` kept

    # The updated policy's weights; returns figures for the step's metrics (the `fast`
    # engine's stale-sampler probe), empty where there are none.
    def sync_weights(self, model: torch.nn.Module) -> dict[str, float]: ...

    def take_counts(self) -> dict[str, float]: ...  # what calls since the last take saw; reset

    # [N, R] the sampler's own log-prob of each token of the last `generate` (NaN where it
    # gave none), or None: an engine that returns none (a server's; `sample` keeps them).
    def take_logps(self) -> torch.Tensor | None: ...

    # The stale-sampler check of a scored rollout of this engine's (`lag` [N]: updates each
    # row's sampler was behind): its figures, {} where there is none to make (a server's
    # engine: `posttrain.rl.rollout.server_probe`). A collective: every rank calls it.
    def check_rollout(self, ro: Any, lag: torch.Tensor) -> dict[str, float]: ...


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [N, P], mask [N, P]): each sequence right-aligned, pad_id / 0 on its left."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s)
        mask[i, width - len(s) :] = 1
    return ids, mask


def right_pad(seqs: list[list[int]], pad_id: int) -> torch.Tensor:
    """[N, R] (R: the longest, at least 1): each sequence left-aligned, pad_id on its right."""
    out = torch.full((len(seqs), max([1, *map(len, seqs)])), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


# leave(batch row, original row, that row's mask [S], cache, tokens generated and fed)
Leave = Callable[[int, int, torch.Tensor, DynamicCache, list[int]], None]


class HFEngine:
    """In-process engine on the role model (`RoleModel.generate` / `RoleModel.decode`).
    `world` > 1: every rank runs the same number of forwards (each is a collective), so a rank
    whose rows all ended keeps stepping with a one-row dummy. `keep_gathered`: hold the sharded
    blocks gathered for the whole call. `cache_implementation`: transformers' cache for
    `generate` ("static" is measured in bench/rollout_cost.py). `keep_turns`: `turns=True`
    calls run the decode loop and keep their KV cache, on models whose layers all attend to the
    whole sequence and for greedy or sampled decoding."""

    def __init__(
        self,
        model: torch.nn.Module,
        role: str,
        world: int,
        batch_size: int | None = None,
        keep_gathered: bool = True,
        drop_finished: bool = False,
        cache_implementation: str | None = None,
        keep_turns: bool = True,
    ) -> None:
        self.model, self.role, self.world = model, role, world
        self.batch_size = batch_size
        self.keep_gathered = keep_gathered
        self.drop_finished = drop_finished
        self.cache_implementation = cache_implementation
        self.keep_turns = keep_turns
        self.prefix = PrefixCache()
        self._full_attention: bool | None = None
        self.reused = 0  # prompt tokens continued from kept rows instead of prefilled, so far
        self.version = 0  # the caller sets the starting one (a resumed stage's)

    collective = True  # every forward of the sharded model is one

    def sync_weights(self, model: torch.nn.Module) -> dict[str, float]:
        self.model = model  # decodes with the training model's own (sharded) weights
        self.prefix.clear()  # keys and values of the old weights
        self.version += 1
        return {}  # nothing to probe: the trainer's own weights sample

    def take_counts(self) -> dict[str, float]:
        return {}

    def take_logps(self) -> torch.Tensor | None:
        return None  # the trainer's scoring pass is the only scorer in process

    def check_rollout(self, ro: Any, lag: torch.Tensor) -> dict[str, float]:
        return {}  # the trainer's own weights sample (`fast`: its copy is probed at the refresh)

    def release(self) -> None:
        self.prefix.clear()

    def _keeps(self, sampling: SamplingConfig) -> bool:
        if self._full_attention is None:  # the model's layout: looked up once
            self._full_attention = full_attention(self.model.causal_lm.config)
        return (
            self.keep_turns and sampling.strategy in ("greedy", "sample") and self._full_attention
        )

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        stop_ids: list[int],
        pad_id: int,
        seed: int,
        turns: bool = False,
    ) -> torch.Tensor:
        model = self.model
        device = next(model.parameters()).device
        keep = turns and self._keeps(sampling)
        found = self.prefix.find(prompts) if keep else []
        self.prefix.clear()  # what this call keeps replaces the last call's
        ids, attn = left_pad(prompts, pad_id)
        bs = self.batch_size or len(prompts)
        if self.drop_finished or keep:
            _register_decode(model)
        chunks: list[torch.Tensor] = []
        was_training = model.training
        model.eval()
        fork = [device] if device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=fork), gathered(model, self.keep_gathered):
                torch.manual_seed(seed)
                for start in range(0, len(prompts), bs):
                    rows = slice(start, start + bs)
                    if keep:
                        out = self._turn(prompts[rows], found[rows], sampling, stop_ids, pad_id)
                        found[rows] = [None] * len(found[rows])  # the last turn's rows, done
                    else:
                        chunk = ids[rows].to(device), attn[rows].to(device)
                        if self.drop_finished:
                            out = self._decode(self._fresh(*chunk), sampling, stop_ids, pad_id)
                        else:
                            out = self._generate(*chunk, sampling, stop_ids, pad_id)
                    chunks.append(out.cpu())
        finally:
            model.train(was_training)
        return right_pad([row for c in chunks for row in c.tolist()], pad_id)

    def _generate(
        self,
        ids: torch.Tensor,
        attn: torch.Tensor,
        sampling: SamplingConfig,
        stop_ids: list[int],
        pad_id: int,
    ) -> torch.Tensor:
        """transformers' generate: ids/attn [b, P] -> new tokens [b, R]."""
        extra = {"cache_implementation": self.cache_implementation}
        out = self.model.generate(
            role=self.role,
            input_ids=ids,
            attention_mask=attn,
            eos_token_id=stop_ids,
            pad_token_id=pad_id,
            synced_gpus=self.world > 1,
            **generate_kwargs(sampling),
            **{k: v for k, v in extra.items() if v is not None},
        )  # [b, P + R]
        return out[:, ids.size(1) :]

    def _fresh(self, ids: torch.Tensor, attn: torch.Tensor) -> Continued:
        """The decode loop's start on a left-padded batch ids/attn [b, P], nothing cached."""
        pos = (attn.cumsum(-1) - 1).masked_fill(attn == 0, 0)  # [b, P] as generate makes them
        return Continued(DynamicCache(config=self.model.causal_lm.config), ids, attn, pos, 0)

    def _turn(
        self,
        prompts: list[list[int]],
        kept: list[Kept | None],
        sampling: SamplingConfig,
        stop_ids: list[int],
        pad_id: int,
    ) -> torch.Tensor:
        """A turn of episodes: the decode loop from the rows kept for these prompts (the whole
        prompt for the others), keeping every row's cache as it leaves the batch."""
        config = self.model.causal_lm.config
        if any(k is not None for k in kept):
            state = self.prefix.continued(kept, prompts, pad_id, config)
        else:
            device = next(self.model.parameters()).device
            ids, attn = left_pad(prompts, pad_id)
            state = self._fresh(ids.to(device), attn.to(device))
        self.reused += state.reused

        def leave(j: int, r: int, mask: torch.Tensor, cache: DynamicCache, fed: list[int]) -> None:
            self.prefix.keep(prompts[r] + fed, cache, j, mask)

        return self._decode(state, sampling, stop_ids, pad_id, leave)

    def _decode(
        self,
        state: Continued,
        sampling: SamplingConfig,
        stop_ids: list[int],
        pad_id: int,
        leave: Leave | None = None,
    ) -> torch.Tensor:
        """The decode loop that drops finished rows: from `state` (b rows) -> new tokens
        [b, R]. `leave` sees each row as it leaves the batch, its cache holding every token it
        fed (the last token sampled is not fed)."""
        if sampling.strategy not in ("greedy", "sample"):
            raise ValueError(
                f"the decode loop samples or decodes greedily, not {sampling.strategy!r}"
            )
        cache, inp, mask, pos = state.cache, state.inp, state.mask, state.pos
        b, device = inp.size(0), inp.device
        warp = _warpers(sampling)
        stops = torch.tensor(stop_ids, device=device)
        out = torch.full((b, sampling.max_new_tokens), pad_id, dtype=torch.long, device=device)
        rows = torch.arange(b, device=device)  # original row of each row still in the batch
        steps, done = 0, False
        while _any_running(not done, self.world > 1, device):
            logits = self.model.decode(self.role, inp, mask, pos, cache)  # [n, V] fp32
            if done:  # every row here ended; a dummy step keeps the ranks' forwards in step
                nxt = torch.full((inp.size(0),), pad_id, dtype=torch.long, device=device)
            else:
                nxt = _pick(warp(inp, logits), b, rows, sampling.strategy == "sample")
                out[rows, steps] = nxt
                steps += 1
                ended = torch.isin(nxt, stops)
                done = bool(ended.all()) or steps == sampling.max_new_tokens
                if leave is not None and (done or ended.any()):
                    for j in range(len(rows)) if done else ended.nonzero().squeeze(1).tolist():
                        r = int(rows[j])
                        leave(j, r, mask[j], cache, out[r, : steps - 1].tolist())
                if ended.any() and not done:
                    keep = (~ended).nonzero().squeeze(1)  # [n'] rows still running
                    cache.batch_select_indices(keep)
                    rows, nxt, mask, pos = rows[keep], nxt[keep], mask[keep], pos[keep]
                elif done and inp.size(0) > 1:  # the dummy steps need one row, not n
                    one = torch.zeros(1, dtype=torch.long, device=device)
                    cache.batch_select_indices(one)
                    nxt, mask, pos = nxt[one], mask[one], pos[one]
            inp = nxt[:, None]  # [n, 1]
            mask = torch.cat([mask, mask.new_ones(mask.size(0), 1)], dim=1)
            pos = pos[:, -1:] + 1
        return out[:, :steps]


def _any_running(running: bool, synced: bool, device: torch.device) -> bool:
    """Whether any rank still has rows to decode (one all-reduce per step, as `generate`)."""
    if not synced:
        return running
    flag = torch.tensor(1.0 if running else 0.0, device=device)
    dist.all_reduce(flag)
    return bool(flag.item() > 0)


def _warpers(sampling: SamplingConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The logit warpers `generate` applies for these settings, in its order (temperature,
    top-k, top-p); none for greedy. (ids, fp32 logits [n, V]) -> scores [n, V]."""
    warpers: list[Any] = []
    if sampling.strategy == "sample":
        if sampling.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k:
            warpers.append(TopKLogitsWarper(top_k=sampling.top_k, min_tokens_to_keep=1))
        if sampling.top_p is not None and sampling.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=sampling.top_p, min_tokens_to_keep=1))

    def apply(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for w in warpers:
            scores = w(ids, scores)
        return scores

    return apply


def _pick(scores: torch.Tensor, b: int, rows: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """Next token [n] of the running rows `rows` (of a batch of b) from scores [n, V].

    Sampling draws what torch.multinomial(probs [b, V], 1) draws on the full batch - it is
    argmax(probs / q) with q ~ Exp(1) of probs' shape - so a row's token does not depend on
    which other rows are still running, and matches `generate`'s for the same seed."""
    if not do_sample:
        return scores.argmax(-1)
    probs = torch.softmax(scores, dim=-1)  # [n, V]
    q = torch.empty((b, probs.size(1)), dtype=probs.dtype, device=probs.device).exponential_(1)
    return (probs / q[rows]).argmax(-1)


def _register_decode(model: torch.nn.Module) -> None:
    """Make `model.decode` run as the forward does (`posttrain.distributed.fsdp.forward_method`),
    once: a second registration would wrap it twice."""
    if not getattr(model, _DECODE_REGISTERED, False):
        forward_method(model, "decode")
        setattr(model, _DECODE_REGISTERED, True)
