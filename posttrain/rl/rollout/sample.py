"""Rollouts for online RL: sample responses from the sharded policy, then score them with every
role (policy and reference log-probs, critic values, reward-model scores) without gradients.

Layout of one rank's rollout of N sequences: prompts LEFT-padded to P columns, responses after
them in R columns, right-padded after the stop token that ended each (or full width when a
response never stopped). Stop tokens: `posttrain.models.stop_tokens.stop_token_ids` (the
tokenizer's EOS, the model's generation_config eos ids, the template's end-of-turn token). The
logits/values for response token t come from sequence position P-1+t, so every role is read at
positions [P-1, P+R-1).

A multi-turn episode (`posttrain.rl.rollout.multiturn`) is one sequence: its first prompt, then
everything after it as the "response" - the policy's turns and, between them, tool results and
the template's turns. `mask` is then 1 on the policy's tokens only (what the losses, the KL and
the critic cover), and `attn` 1 on every real token after the prompt (what the model attends).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from posttrain.data.batching import pad_batch, regroup_by_tokens
from posttrain.data.chat import IGNORE
from posttrain.data.preference import Messages, encode_reply
from posttrain.data.segments import Segments
from posttrain.distributed.runtime import min_max
from posttrain.distributed.sequence_parallel import SequenceParallel
from posttrain.models.adapters import POLICY, REFERENCE
from posttrain.models.roles import REWARD, VALUE
from posttrain.rl.losses import entropy_from_logits, token_logps
from posttrain.rl.rollout.engine import RolloutEngine, left_pad
from posttrain.rl.rollout.sp_shard import from_first, group_sum, shard_packed
from posttrain.sections.shared import RolloutConfig, SamplingConfig
from posttrain.train.micro_batches import regroup_step

if TYPE_CHECKING:
    from posttrain.agents.episodes import EpisodeRun


@dataclass
class Rollout:
    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P] 1 on real prompt tokens
    response: torch.Tensor  # [N, R]
    mask: torch.Tensor  # [N, R] float: 1 on response tokens up to and including the stop token
    stopped: torch.Tensor  # [N] bool: the response ended with a stop token
    messages: list[Messages]  # prompt messages of each sequence
    scored: dict[str, torch.Tensor] = field(default_factory=dict)  # logps, values, scores...
    # Episodes: [N, R] 1 on every real token after the prompt (None: the mask, single-turn),
    # and each sequence's episode (conversation, turns, tool results, environment).
    attn: torch.Tensor | None = None
    episodes: list[EpisodeRun] | None = None
    # How the batch was generated, summed over the parts of `cat` (episodes: seconds in tools,
    # tool-call counts; a server's exact and re-tokenised answers).
    stats: dict[str, float] = field(default_factory=dict)
    # [N] long: the policy version that sampled each sequence (`RolloutEngine.version`); None
    # for the reference's samples, which no update trains on.
    versions: torch.Tensor | None = None

    @property
    def response_attn(self) -> torch.Tensor:  # [N, R] long: 1 on real tokens after the prompt
        return (self.mask if self.attn is None else self.attn).long()

    @property
    def n(self) -> int:
        return self.response.size(0)

    @property
    def width(self) -> tuple[int, int]:
        return self.prompt_ids.size(1), self.response.size(1)

    def inputs(self, idx: list[int] | torch.Tensor) -> dict[str, torch.Tensor]:
        """Model inputs of rows `idx`, position ids skipping the left padding, and the slice
        bounds of the response positions."""
        ids = torch.cat([self.prompt_ids[idx], self.response[idx]], dim=1)  # [n, P+R]
        attn = torch.cat([self.prompt_mask[idx], self.response_attn[idx]], dim=1)
        pos = (attn.cumsum(1) - 1).clamp(min=0)
        p, r = self.width
        return {
            "input_ids": ids,
            "attention_mask": attn,
            "position_ids": pos,
            "start": p - 1,
            "stop": p + r - 1,
        }

    def packed_inputs(self, idx: list[int] | torch.Tensor) -> dict[str, Any]:
        """Model inputs of rows `idx` laid end to end (`posttrain.data.segments`), no padding:
        each row's real tokens in input_ids/position_ids [1, N] (positions restart per row),
        the `segments` that confine attention to each row, and `index` [n, R]: for response
        column r of row i, the flat position whose output predicts that token (0 past the row's
        end, where the mask is 0)."""
        rows = torch.as_tensor(idx, dtype=torch.long).reshape(-1)
        attn = self.response_attn[rows]  # [n, R], a prefix of each row
        index = torch.zeros(attn.shape, dtype=torch.long)
        seqs, offset = [], 0
        for k, i in enumerate(rows.tolist()):
            prompt = self.prompt_ids[i][self.prompt_mask[i].bool()]
            n_resp = int(attn[k].sum())
            seqs.append(torch.cat([prompt, self.response[i, :n_resp]]))
            index[k, :n_resp] = offset + prompt.numel() - 1 + torch.arange(n_resp)
            offset += seqs[-1].numel()
        segments = Segments.from_lengths([s.numel() for s in seqs])
        return {
            "input_ids": torch.cat(seqs)[None],
            "position_ids": segments.pos_of[None],
            "segments": segments,
            "index": index,
        }

    def tokens(self) -> int:  # real (non-pad) tokens: prompts and what follows them
        return int(self.prompt_mask.sum() + self.response_attn.sum())

    def select(self, rows: list[int] | torch.Tensor) -> Rollout:
        """The rollout of `rows` only; widths stay as they are (padding columns are harmless)."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        return Rollout(
            self.prompt_ids[idx],
            self.prompt_mask[idx],
            self.response[idx],
            self.mask[idx],
            self.stopped[idx],
            [self.messages[int(i)] for i in idx],
            {k: v[idx] for k, v in self.scored.items()},
            None if self.attn is None else self.attn[idx],
            None if self.episodes is None else [self.episodes[int(i)] for i in idx],
            dict(self.stats),
            None if self.versions is None else self.versions[idx],
        )

    @staticmethod
    def cat(parts: Sequence[Rollout], pad_id: int = 0) -> Rollout:
        """One rollout of several (rounds of dynamic sampling), in order: prompts re-padded on
        the LEFT and responses on the RIGHT to the widest, so a row's model inputs and each
        token's response column keep their meaning; per-token scored tensors [N, R] get zeros on
        the new columns (the mask is 0 there). Every part must hold the same scored keys."""
        if not parts:
            raise ValueError("Rollout.cat needs at least one rollout")
        keys = set(parts[0].scored)
        if any(set(p.scored) != keys for p in parts):
            raise ValueError(
                f"rollouts with different scored keys: {[sorted(p.scored) for p in parts]}"
            )
        p_w = max(p.width[0] for p in parts)
        r_w = max(p.width[1] for p in parts)

        def left(x: torch.Tensor, fill: float) -> torch.Tensor:
            return torch.nn.functional.pad(x, (p_w - x.size(1), 0), value=fill)

        def right(x: torch.Tensor, fill: float) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, r_w - x.size(1)), value=fill)

        scored = {
            k: torch.cat(
                [right(p.scored[k], 0.0) if p.scored[k].dim() == 2 else p.scored[k] for p in parts]
            )
            for k in sorted(keys)
        }
        return Rollout(
            torch.cat([left(p.prompt_ids, pad_id) for p in parts]),
            torch.cat([left(p.prompt_mask, 0) for p in parts]),
            torch.cat([right(p.response, pad_id) for p in parts]),
            torch.cat([right(p.mask, 0.0) for p in parts]),
            torch.cat([p.stopped for p in parts]),
            [m for p in parts for m in p.messages],
            scored,
            None
            if parts[0].attn is None
            else torch.cat([right(p.response_attn, 0) for p in parts]),
            None if parts[0].episodes is None else [e for p in parts for e in p.episodes or []],
            {k: sum(p.stats.get(k, 0.0) for p in parts) for k in parts[0].stats},
            None
            if parts[0].versions is None
            else torch.cat([p.versions for p in parts if p.versions is not None]),
        )


def model_inputs(
    ro: Rollout, idx: list[int] | torch.Tensor, packed: bool, device: torch.device
) -> dict[str, Any]:
    return _to_device(ro.packed_inputs(idx) if packed else ro.inputs(idx), device)


def _to_device(inp: dict[str, Any], device: torch.device) -> dict[str, Any]:
    # Host-to-device without waiting for the device's queue (pageable memory is staged at once).
    return {
        k: v.to(device, non_blocking=True) if torch.is_tensor(v) or isinstance(v, Segments) else v
        for k, v in inp.items()
    }


def forward_inputs(
    ro: Rollout,
    idx: list[int] | torch.Tensor,
    packed: bool,
    device: torch.device,
    sp: SequenceParallel | None = None,
) -> tuple[dict[str, Any], torch.Tensor]:
    """(model inputs of rows `idx` on the device, the host mask [n, R] of the response tokens
    this forward scores): every response token, or with `sp` (packed rows only) this rank's
    shard of the packed rows and the tokens it scores (`sp_shard.shard_packed`)."""
    if sp is None:
        return model_inputs(ro, idx, packed, device), ro.mask[idx]
    shard, own = shard_packed(ro.packed_inputs(idx), sp)
    return _to_device(shard, device), ro.mask[idx] * own


def response_mask(
    response: torch.Tensor, stop_ids: int | Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask [N, R] float, stopped [N] bool): tokens up to and including the first stop id."""
    stops = torch.tensor(_ids(stop_ids), dtype=response.dtype, device=response.device)
    is_stop = torch.isin(response, stops)  # [N, R]
    stops_before = is_stop.long().cumsum(1) - is_stop.long()  # stop tokens strictly before t
    return (stops_before == 0).float(), is_stop.any(1)


def _ids(stop_ids: int | Sequence[int]) -> list[int]:
    return [stop_ids] if isinstance(stop_ids, int) else [int(i) for i in stop_ids]


def sampling_of(cfg: RolloutConfig) -> SamplingConfig:
    return SamplingConfig(
        name="rollout",
        strategy="sample",
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        max_new_tokens=cfg.max_new_tokens,
    )


@torch.no_grad()
def sample(
    engine: RolloutEngine,
    prompts: list[list[int]],
    messages: list[Messages],
    cfg: RolloutConfig,
    pad_id: int,
    stop_ids: int | Sequence[int],
    seed: int,
    versions: bool = True,
    sp: SequenceParallel | None = None,
) -> Rollout:
    """One response per prompt (repeat a prompt for several samples) from `engine`, seeded by
    `seed`, as a Rollout stamped with the engine's policy version (`versions`; False for the
    reference's samples). A response ends at the first of `stop_ids` (-1 never stops).
    `sp`: the ranks of a sequence-parallel group (same prompts, same seed) keep their first
    rank's responses, so they train on one set of rows even where sampling kernels are not
    deterministic. With a collective engine (`hf`: forwards of the sharded model, kept in step
    over the world) every rank generates and the others' draws are dropped; otherwise only the
    first rank generates."""
    stops = _ids(stop_ids)
    drawn = None
    # An engine whose forwards are no collective (the `fast` engine's merged copy) samples on
    # the group's first rank only: the others would draw what they then drop.
    if sp is None or sp.rank == 0 or engine.collective:
        response = engine.generate(prompts, sampling_of(cfg), stops, pad_id, seed)  # [N, R]
        # logps: [N, R] a server's, for its stale-sampler check (None from in-process engines)
        drawn = (response, engine.take_counts(), engine.take_logps())
    response, counts, logps = from_first(drawn, sp)
    ids, attn = left_pad(prompts, pad_id)
    mask, stopped = response_mask(response, stops)
    ro = Rollout(ids, attn, response, mask, stopped, messages, stats=counts)
    if logps is not None:
        ro.scored["sampler_logps"] = logps
    if versions:
        ro.versions = torch.full((len(prompts),), engine.version, dtype=torch.long)
    return ro


def decode_responses(tokenizer: Any, ro: Rollout) -> list[str]:
    """Each response's text without the stop token that ended it (the reward model's input is
    re-rendered through the chat template, which writes the end of turn itself; an end-of-turn
    marker that is not a special token would otherwise appear twice)."""
    return [
        tokenizer.decode(r[: int(m.sum()) - int(s)].tolist(), skip_special_tokens=True)
        for r, m, s in zip(ro.response, ro.mask, ro.stopped, strict=True)
    ]


def scored_positions(mask: torch.Tensor) -> torch.Tensor:
    """[M] the flat indices into [n * R] where the host-side `mask` [n, R] is set: the positions
    the chunked head scores, found on the host so the forward waits for no device read."""
    assert mask.device.type == "cpu", "positions are taken from the rollout's host mask"
    return mask.reshape(-1).nonzero().squeeze(1)


def response_logps(
    model: torch.nn.Module,
    role: str,
    inp: dict[str, Any],
    response: torch.Tensor,
    mask: torch.Tensor,
    chunk_tokens: int,
    entropy: bool = False,
    temperature: float = 1.0,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(response) [n, R], entropy [n, R] | None) under `role`: through the chunked head
    on the response tokens only (0.0 on padding) when `chunk_tokens`, else from full logits.
    `positions`: `scored_positions` of the mask, on the device (None: the head finds them from
    the mask, one device read)."""
    if not chunk_tokens:
        logits = model(role, **inp, temperature=temperature)  # [n, R, V]
        return token_logps(logits, response), entropy_from_logits(logits) if entropy else None
    targets = response.masked_fill(mask == 0, IGNORE)
    y = model(
        role,
        **inp,
        targets=targets,
        chunk_tokens=chunk_tokens,
        entropy=entropy,
        temperature=temperature,
        positions=positions,
    )
    return (y[..., 0], y[..., 1]) if entropy else (y, None)


def forward_groups(
    ro: Rollout, rows: torch.Tensor, micro: int, by_tokens: int | None, device: torch.device
) -> list[list[int]]:
    """The forwards over rollout `rows` [n], as positions in `rows`: `micro` rows each in
    order, or with `by_tokens` regrouped by their real tokens (prompt + response,
    `regroup_step`: longest first, every rank runs as many). Each row's results and loss
    weights are its own, so scores and updates are the same either way."""
    n = len(rows)
    if not by_tokens:
        return [list(range(k, min(k + micro, n))) for k in range(0, n, micro)]
    tokens = (ro.prompt_mask[rows].sum(1) + ro.response_attn[rows].sum(1)).tolist()  # [n]
    return regroup_step([list(range(n))], lambda p: int(tokens[p]), by_tokens, device)


def row_tokens(ro: Rollout) -> list[int]:
    """[N] each row's real tokens (prompt + response): what it costs a forward by tokens."""
    return (ro.prompt_mask.sum(1) + ro.response_attn.sum(1)).tolist()


def balanced_groups(
    n_items: int,
    per: int,
    tokens: Callable[[int], int],
    by_tokens: int | None,
    device: torch.device,
) -> list[list[int]]:
    """This rank's forwards over `n_items` items (rows, or pairs of rows) as lists of item
    positions: `per` items each in order, or with `by_tokens` regrouped so a forward carries at
    most that many tokens (`tokens(i)`: item i's; `regroup_by_tokens`: longest first, an item
    over the budget alone); then empty forwards until this rank runs as many as the busiest
    (FSDP's gathers are collective; an empty one is a filler that counts for nothing). Each
    item's loss and weight are its own, so the step is the same however they are grouped."""
    items = list(range(n_items))
    if by_tokens and items:
        groups = regroup_by_tokens(items, tokens, by_tokens)
    else:
        groups = [items[k : k + per] for k in range(0, n_items, per)]
    busiest = int(min_max(float(len(groups)), device)[1])
    return groups + [[] for _ in range(busiest - len(groups))]


@torch.no_grad()
def score(
    model: torch.nn.Module,
    ro: Rollout,
    tokenizer: Any,
    batch_size: int,
    max_prompt_len: int,
    roles: tuple[str, ...] = (POLICY, REFERENCE, VALUE, REWARD),
    chunk_tokens: int = 0,
    temperature: float = 1.0,
    packed: bool = False,
    by_tokens: int | None = None,
    sp: SequenceParallel | None = None,
) -> dict[str, torch.Tensor]:
    """Fill `ro.scored` for the requested roles: "logps" (policy) / "ref_logps" [N, R], "values"
    [N, R] (critic), "scores" [N] (reward model: `reward_model_scores`).
    `packed`: each forward's rows laid end to end instead of padded; `by_tokens`: forwards of
    at most that many tokens (`forward_groups`) instead of `batch_size` rows. `sp`: the
    sequence-parallel group (packed rows): each rank scores its shard of every forward and the
    group sums the parts, so every rank holds the whole scores."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: dict[str, list[torch.Tensor]] = {}
    names = {POLICY: "logps", REFERENCE: "ref_logps", VALUE: "values"}
    groups = forward_groups(ro, torch.arange(ro.n), batch_size, by_tokens, device)
    for idx in groups:
        inp, host_mask = forward_inputs(ro, idx, packed, device, sp)
        mask = host_mask.to(device)
        positions = scored_positions(host_mask).to(device)
        for role in (r for r in roles if r in names):
            if role == VALUE:
                y = model(role, **inp)
            else:
                y, _ = response_logps(
                    model,
                    role,
                    inp,
                    ro.response[idx].to(device),
                    mask,
                    chunk_tokens,
                    temperature=temperature,
                    positions=positions,
                )
            # With `sp`: this rank's tokens, summed with the group's into the whole rows.
            out.setdefault(names[role], []).append(group_sum(y.float() * mask, sp))
    if REWARD in roles:
        out["scores"] = [reward_model_scores(model, ro, tokenizer, batch_size, max_prompt_len, sp)]
    model.train(was_training)
    # Back in row order: the forwards took the rows in `groups`' order.
    order = torch.tensor([i for g in groups for i in g], dtype=torch.long)
    for k in names.values():
        if k in out:
            y = torch.cat(out[k]).cpu()
            out[k] = [torch.empty_like(y).index_copy_(0, order, y)]
    ro.scored |= {k: torch.cat(v).cpu() for k, v in out.items()}
    return ro.scored


def reward_model_scores(
    model: torch.nn.Module,
    ro: Rollout,
    tokenizer: Any,
    batch_size: int,
    max_prompt_len: int,
    sp: SequenceParallel | None = None,
) -> torch.Tensor:
    """[N] the reward model's score of each response, re-rendered through the chat template
    exactly as its training pairs were (so it sees the end-of-turn text it learnt on),
    `batch_size` rows per forward, padded; with `sp`, packed and split (`split_scores`)."""
    device = next(model.parameters()).device
    texts = decode_responses(tokenizer, ro)
    seqs = [
        encode_reply(tokenizer, m, t, max_prompt_len)
        for m, t in zip(ro.messages, texts, strict=True)
    ]
    out = []
    for start in range(0, ro.n, batch_size):
        part = seqs[start : start + batch_size]
        if sp is not None:
            out.append(split_scores(model, part, sp, device))
            continue
        b = pad_batch([{"input_ids": s, "labels": s} for s in part], tokenizer.pad_token_id)
        inp = (b[k].to(device) for k in ("input_ids", "attention_mask", "position_ids"))
        out.append(model(REWARD, *inp))
    return torch.cat(out).cpu()


def split_scores(
    model: torch.nn.Module, seqs: list[list[int]], sp: SequenceParallel, device: torch.device
) -> torch.Tensor:
    """[n] the reward model's scores of `seqs`, laid end to end and split over the ranks of
    `sp` (`shard_packed`): each row's last token lies in one rank's shard, which reads the
    row's score there (0 elsewhere); the group sums the parts, the same on every rank."""
    segments = Segments.from_lengths([len(s) for s in seqs])
    whole = {
        "input_ids": torch.tensor([t for s in seqs for t in s]).unsqueeze(0),  # [1, N]
        "position_ids": segments.pos_of.unsqueeze(0),
        "segments": segments,
        "index": segments.last_positions().unsqueeze(1),  # [n, 1]
    }
    shard, own = shard_packed(whole, sp)  # own [n, 1]
    y = model(REWARD, **_to_device(shard, device))  # [n]
    return group_sum(y * own[:, 0].to(device), sp)
