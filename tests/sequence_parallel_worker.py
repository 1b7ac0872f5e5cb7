"""Spawned gloo rank for tests/test_sequence_parallel.py: one packed micro-batch through a tiny
LoRA Llama, unsplit (every rank alone, the reference) and split between the 2 ranks of the
sequence-parallel group; writes what the test compares to <out>/rank<r>.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.data.chat import IGNORE
from posttrain.data.segments import flat_batch
from posttrain.distributed.sequence_parallel import SequenceParallel, gather_tokens
from posttrain.models.chunked import label_logps
from posttrain.models.lora import apply_lora
from posttrain.models.sequence_split import shard_logps, split_batch
from posttrain.sections.shared import LoraConfig
from posttrain.train.loop import to_device

VOCAB = 96
# 26 tokens: the slice boundary (13) falls inside row 1 (tokens 7..19); 25 tokens: padded to 26.
LAYOUTS = {"even": (7, 13, 6), "padded": (7, 12, 6)}


def tiny_lora(heads: int, kv_heads: int, hidden: int = 64) -> torch.nn.Module:
    """A 2-layer Llama with a LoRA adapter on every attention and MLP projection, fp32; the
    adapter's B matrices random (peft starts them at zero, where A would get no gradient)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    lora = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = apply_lora(LlamaForCausalLM(config), lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    return model.float()


def packed_batch(lengths: tuple[int, ...]) -> dict[str, Any]:
    """Rows of random tokens; each row's first 3 tokens are its prompt (IGNORE labels)."""
    gen = torch.Generator().manual_seed(1)
    rows = []
    for n in lengths:
        ids = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
        rows.append({"input_ids": ids, "labels": [IGNORE] * 3 + ids[3:]})
    return flat_batch(rows)


def lora_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def compare(model: torch.nn.Module, batch: dict[str, Any], sp: SequenceParallel) -> dict:
    """Reference (unsplit) vs split: summed NLL, per-token log-probs, LoRA gradients."""
    model.zero_grad()
    ref_logp, _ = label_logps(model, batch, 0)  # [1, N-1]
    ref_nll = -ref_logp.sum()
    ref_nll.backward()
    ref_grads = lora_grads(model)
    model.zero_grad()
    shard = to_device(split_batch(batch, sp), torch.device("cpu"))  # as the loop moves it
    logp, _ = shard_logps(model, shard, 0)  # [1, N'/2]
    nll = -logp.sum()
    nll.backward()
    total = nll.detach().clone()
    dist.all_reduce(total)
    full = gather_tokens(logp.detach(), sp)[:, : ref_logp.shape[1]]
    grad_err = 0.0
    for name, g in lora_grads(model).items():
        dist.all_reduce(g)
        grad_err = max(grad_err, float((g - ref_grads[name]).norm() / ref_grads[name].norm()))
    return {
        "nll_ref": float(ref_nll.detach()),
        "nll_sp": float(total),
        "logp_err": float((full - ref_logp.detach()).abs().max()),
        "grad_rel_err": grad_err,
        "grads": len(ref_grads),
        "tail": float(gather_tokens(logp.detach(), sp)[:, ref_logp.shape[1] :].abs().sum()),
    }


def refusal(sp: SequenceParallel) -> str:
    """3 heads over 2 ranks: the text the user sees."""
    model = tiny_lora(heads=3, kv_heads=3, hidden=48)
    try:
        shard_logps(model, split_batch(packed_batch(LAYOUTS["even"]), sp), 0)
    except ValueError as e:
        return str(e)
    return "not refused"


def worker(rank: int, world: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    sp = SequenceParallel.of()
    record: dict[str, Any] = {}
    for kv_heads in (2, 1):
        model = tiny_lora(heads=4, kv_heads=kv_heads)
        for layout, lengths in LAYOUTS.items():
            record[f"kv{kv_heads}_{layout}"] = compare(model, packed_batch(lengths), sp)
    # Activation checkpointing recomputes each block during backward, outside the forward's
    # contexts: the group reaches the attention as a keyword, so the recompute exchanges too.
    model = tiny_lora(heads=4, kv_heads=2)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    record["kv2_checkpointed"] = compare(model, packed_batch(LAYOUTS["even"]), sp)
    record["refusal"] = refusal(sp)
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
