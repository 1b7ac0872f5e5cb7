"""The four roles of online RL on ONE base model: policy, reference, value (critic), reward.

Every role here is a LoRA adapter on the same frozen base (plus a small head), not a model of its
own, so the base weights are held once and sharded once:
- policy    "default"   the SFT adapter, trained further                      -> logits
- reference "reference" a frozen copy of the SFT adapter (never the raw base)  -> logits
- reward    "reward"    the reward stage's adapter + its score head, frozen    -> one score
- value     "value"     initialised from the reward model (adapter + head, as in InstructGPT),
                        trained                                               -> one value per token
A stage scored by reward functions alone has no reward role; its critic (PPO) then starts from
the policy's adapter with a zero value head (every value 0 at first, so early advantages are the
returns themselves).
The reward stage trains on the same base (the ingest artifact), which is what makes sharing exact:
the shared-trunk reward score equals the stand-alone reward model's (tested).

`RoleModel.forward(role, ...)` runs the decoder body with the role's adapter active and applies
the role's head; one `fully_shard` of this module covers every role, and frozen roles simply have
no optimizer state. `generate` is registered as an FSDP forward method by the caller after
sharding, so decoding runs on the sharded policy.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from safetensors import safe_open
from torch import nn
from transformers import PreTrainedModel

from posttrain.data.segments import Segments
from posttrain.distributed.sequence_parallel import SequenceParallel
from posttrain.models.adapters import POLICY, REFERENCE, active_adapter, policy_with_reference
from posttrain.models.chunked import head_scores, model_transform, output_head
from posttrain.models.sharded_load import adapters_stay_real
from posttrain.models.varlen_attention import (
    SEGMENTS_KW,
    SEQUENCE_PARALLEL_KW,
    confined_attention,
)

VALUE, REWARD = "value", "reward"
LOGIT_ROLES = (POLICY, REFERENCE)


class RoleModel(nn.Module):
    def __init__(
        self,
        lm: PeftModel | PreTrainedModel,
        score_head: nn.Linear | None,
        value_head: nn.Linear | None,
    ) -> None:
        """`lm`: the base with its adapters; a plain causal LM serves as a policy of its own
        weights (a teacher that is a base: `posttrain.models.teacher`)."""
        super().__init__()
        self.lm = lm
        self.score_head = score_head
        self.value_head = value_head
        # Telemetry reads the architecture (layers, width) from `model.config`.
        self.config = self.causal_lm.config

    @property
    def causal_lm(self) -> PreTrainedModel:
        return self.lm.get_base_model() if isinstance(self.lm, PeftModel) else self.lm

    def forward(
        self,
        role: str,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        start: int = 0,
        stop: int | None = None,
        targets: torch.Tensor | None = None,
        chunk_tokens: int = 0,
        entropy: bool = False,
        temperature: float = 1.0,
        segments: Segments | None = None,
        index: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        sequence_parallel: SequenceParallel | None = None,
    ) -> torch.Tensor:
        """input_ids/attention_mask/position_ids [B, T] ->
        policy/reference: logits [B, stop-start, V] of positions start..stop-1; with `targets`
        [B, stop-start] (IGNORE = not scored) instead their log-probs [B, stop-start] ([.., 2]:
        log-prob, entropy, with `entropy`) through the head `chunk_tokens` at a time
        (`posttrain.models.chunked`), inside this root forward so FSDP2's hooks see the head;
        value: values [B, stop-start] (fp32);  reward: scores [B] at each row's last real token.
        `temperature`: policy/reference logits divided by it (the sampling temperature, so
        log-probs are those of the distribution the rollout was drawn from).
        Padding-free (`segments`, `Rollout.packed_inputs`): input_ids/position_ids [1, N], no
        attention mask, and `index` [B, R] the flat positions to read instead of start..stop:
        the same outputs for the B rows, with no compute on padding (`reward`: index [B, 1],
        each row's last token).
        `positions` [M]: with `targets`, the flat indices into [B * (stop-start)] of the scored
        positions, taken on the host (`posttrain.rl.rollout.sample.scored_positions`), so the
        head does not wait for the device to find them.
        `sequence_parallel`: input_ids/position_ids are this rank's slice of the packed tokens
        (`posttrain.rl.rollout.sp_shard`), `segments` the whole sequence's and `index` points
        into the slice: the group exchanges its tokens in every attention call.
        Only the requested positions go through the LM head (a [B, T, V] tensor is the largest
        activation of a small-vocabulary-to-hidden ratio model)."""
        with active_adapter(self.lm, role):
            hidden = self._hidden(
                input_ids, attention_mask, position_ids, segments, sequence_parallel
            )
        if segments is not None:
            assert index is not None, "padding-free: the flat positions to read"
            hidden = hidden[0, index]  # [1, N, H] -> [B, R, H]
            start, stop = 0, None
        if role == REWARD:
            if self.score_head is None:
                raise ValueError("this RoleModel was built without a reward model")
            if segments is not None:  # [B, 1, H] at each row's last token -> [B]
                return self.score_head(hidden[:, -1]).sum(-1).float()
            # The reward model reads the last non-pad token, wherever the padding is.
            positions = torch.arange(attention_mask.size(1), device=attention_mask.device)
            last = (positions * attention_mask).argmax(1)  # [B]
            rows = torch.arange(hidden.size(0), device=hidden.device)
            # [B, 1] -> [B] by a sum, not a squeeze: FSDP2 warns when a forward returns a view.
            return self.score_head(hidden[rows, last]).sum(-1).float()
        hidden = hidden[:, start:stop]
        if role == VALUE:
            if self.value_head is None:
                raise ValueError("this RoleModel was built without a critic")
            return self.value_head(hidden).sum(-1).float()  # [B, R, 1] -> [B, R]
        if role not in LOGIT_ROLES:
            raise ValueError(f"unknown role {role!r}; known: {LOGIT_ROLES + (VALUE, REWARD)}")
        # The architecture's logit transform (Gemma soft-cap, Cohere/Granite scale), which the
        # causal LM's own forward applies after its head.
        transform = model_transform(self.causal_lm)
        if temperature != 1.0:
            transform = replace(transform, temperature=temperature)
        if targets is None:
            return transform.logits(self.causal_lm.get_output_embeddings()(hidden))
        head = output_head(self.causal_lm)
        logp, ent = head_scores(head, hidden, targets, chunk_tokens, entropy, transform, positions)
        return logp if ent is None else torch.stack([logp, ent], dim=-1)

    def _hidden(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        segments: Segments | None,
        sp: SequenceParallel | None = None,
    ) -> torch.Tensor:
        """The decoder's last hidden states [B, T, H] (after the final norm); padding-free
        [1, N, H], attention confined to each row (`posttrain.models.varlen_attention`); with
        `sp`, [1, N/P, H] of this rank's slice, attending over the whole rows."""
        decoder = self.causal_lm.get_decoder()
        if segments is None:
            return decoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
            ).last_hidden_state
        with confined_attention(self.causal_lm) as native:
            # Flash-attention reads the rows from the position ids; the others get them as a
            # keyword handed down to every attention call, and an all-ones attention mask:
            # without one transformers looks for packed rows in the position ids, a read to the
            # host every forward (`posttrain.models.chunked.model_call`, the SFT step's twin).
            if native and sp is not None:
                raise ValueError(
                    "sequence parallelism runs through posttrain's varlen attention: set "
                    "infra.attention: sdpa, not flash_attention_2"
                )
            extra = {}
            if not native:
                extra = {SEGMENTS_KW: segments, "attention_mask": torch.ones_like(input_ids)}
            if sp is not None:
                extra[SEQUENCE_PARALLEL_KW] = sp
            return decoder(
                input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra
            ).last_hidden_state

    def generate(self, role: str = POLICY, **kwargs: Any) -> torch.Tensor:
        with active_adapter(self.lm, role):
            return self.lm.generate(**kwargs)

    def decode(
        self,
        role: str,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any,
    ) -> torch.Tensor:
        """One step of a hand-written decode loop (`posttrain.rl.rollout.engine`): input_ids /
        position_ids [B, T] (the prompt at prefill, the last sampled token after), attention_mask
        [B, cached + T], the KV `cache` (a transformers Cache, filled in place) -> fp32 logits
        [B, V] of the last position, through the causal LM's own head and logit transform. The
        caller registers it as an FSDP forward method."""
        with active_adapter(self.lm, role):
            out = self.causal_lm(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        return out.logits[:, -1].float()  # [B, 1, V] -> [B, V]

    def save_pretrained(
        self, path: str, state_dict: dict[str, Any], selected_adapters: list[str]
    ) -> None:
        """Save from a full state dict of this module (keys "lm.*", "value_head.*"): the policy
        in peft format (loads with PeftModel.from_pretrained on the base); the critic as one
        safetensors file of its adapter and head (loads into `build_roles(..., critic=True)`
        with load_state_dict(strict=False))."""
        if selected_adapters == [VALUE]:
            from safetensors.torch import save_file

            critic = {
                k: v.contiguous()
                for k, v in state_dict.items()
                if k.startswith("value_head.") or adapter_of(k) == VALUE
            }
            Path(path).mkdir(parents=True, exist_ok=True)
            save_file(critic, str(Path(path) / "critic.safetensors"))
            return
        inner = {k.removeprefix("lm."): v for k, v in state_dict.items() if k.startswith("lm.")}
        self.lm.save_pretrained(path, state_dict=inner, selected_adapters=selected_adapters)


def adapter_of(param_name: str) -> str | None:
    """The adapter a peft parameter belongs to ('...lora_A.<adapter>.weight'), else None."""
    parts = param_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.startswith("lora_"):
            return parts[i + 1]
    return None


def load_score_head(reward_adapter: Path, hidden_size: int) -> nn.Linear:
    """The reward model's score head (trained in full by the reward stage, saved with its
    adapter as `...score.weight` [1, H] and, for some architectures, a bias)."""
    with safe_open(str(reward_adapter / "adapter_model.safetensors"), "pt") as f:
        keys = {k.rsplit(".", 1)[-1]: k for k in f.keys() if ".score." in f".{k}"}  # noqa: SIM118
        if "weight" not in keys:
            raise ValueError(f"{reward_adapter}: no score head weight in the reward adapter")
        weight = f.get_tensor(keys["weight"]).float()
        bias = f.get_tensor(keys["bias"]).float() if "bias" in keys else None
    if tuple(weight.shape) != (1, hidden_size):
        raise ValueError(
            f"{reward_adapter}: score head {tuple(weight.shape)} does not fit hidden size "
            f"{hidden_size}: the reward model was trained on another base"
        )
    head = nn.Linear(hidden_size, 1, bias=bias is not None)
    with torch.no_grad():
        head.weight.copy_(weight)
        if bias is not None:
            head.bias.copy_(bias)
    return head


def build_roles(
    base: PreTrainedModel,
    policy_adapter: Path,
    reward_adapter: Path | None,
    critic: bool,
    reference_adapter: Path | None = None,
) -> RoleModel:
    """Base + adapters for every role (see module docstring): the policy starts from
    `policy_adapter`, the reference is `reference_adapter` (default the same); no reward role
    when `reward_adapter` is None (reward functions only). Only the policy adapter (and the
    critic's adapter and head) require gradients."""
    lm = policy_with_reference(base, policy_adapter, reference_adapter)
    with adapters_stay_real():  # a base on the meta device keeps the adapters' values
        if reward_adapter is not None:
            lm.load_adapter(str(reward_adapter), adapter_name=REWARD, is_trainable=False)
        if critic:
            start = reward_adapter if reward_adapter is not None else policy_adapter
            lm.load_adapter(str(start), adapter_name=VALUE, is_trainable=True)
    trainable = {POLICY, VALUE} if critic else {POLICY}
    for name, p in lm.named_parameters():
        p.requires_grad_(adapter_of(name) in trainable)
    hidden = base.config.hidden_size
    score = None
    if reward_adapter is not None:
        score = load_score_head(reward_adapter, hidden).requires_grad_(False)
    value = None
    if critic:
        if score is not None:
            value = copy.deepcopy(score)
        else:
            value = nn.Linear(hidden, 1)
            nn.init.zeros_(value.weight)
            nn.init.zeros_(value.bias)
        value.requires_grad_(True)
    return RoleModel(lm, score, value)
