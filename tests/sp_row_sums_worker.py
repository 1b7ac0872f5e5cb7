"""Spawned gloo rank for tests/test_sp_row_sums.py: per-row summed log-probs of one packed
micro-batch (what the preference losses read), unsplit (every rank alone, the reference) and
split between the 2 ranks of a sequence-parallel group, and the LoRA gradients of a DPO-like
loss of them; writes what the test compares to <out>/rank<r>.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sequence_parallel_worker import lora_grads, packed_batch, tiny_lora

from posttrain.distributed.sequence_parallel import SequenceParallel
from posttrain.models.sequence_split import split_batch
from posttrain.train.forward_logps import forward_sequence_logps
from posttrain.train.loop import to_device

# Four rows (two "pairs"); 35 tokens: the slice boundary falls inside row 1, and 34 tokens
# need a padding row.
LAYOUTS = {"even": (7, 13, 6, 10), "padded": (7, 12, 6, 10)}


def pair_loss(sums: torch.Tensor) -> torch.Tensor:
    """A DPO-like loss of the rows' sums [4]: chosen rows first, then rejected."""
    return -F.logsigmoid(0.1 * (sums[:2] - sums[2:])).sum()


def compare(
    model: torch.nn.Module, batch: dict[str, Any], sp: SequenceParallel, chunk: int
) -> dict:
    model.zero_grad()
    ref, ref_len = forward_sequence_logps(model, batch, chunk)  # [rows] each
    pair_loss(ref).backward()
    ref_grads = lora_grads(model)
    model.zero_grad()
    shard = to_device(split_batch(batch, sp), torch.device("cpu"))
    sums, lengths = forward_sequence_logps(model, shard, chunk)  # the whole batch's rows
    pair_loss(sums).backward()
    grad_err = 0.0
    for name, g in lora_grads(model).items():
        dist.all_reduce(g)  # what the replicated weights' gradient reduction adds up
        grad_err = max(grad_err, float((g - ref_grads[name]).norm() / ref_grads[name].norm()))
    return {
        "ref": ref.tolist(),
        "sp": sums.tolist(),
        "ref_lengths": ref_len.tolist(),
        "sp_lengths": lengths.tolist(),
        "grad_rel_err": grad_err,
        "grads": len(ref_grads),
    }


def worker(rank: int, world: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    sp = SequenceParallel.of()
    model = tiny_lora(heads=4, kv_heads=2)
    record = {
        f"{layout}_chunk{chunk}": compare(model, packed_batch(lengths), sp, chunk)
        for layout, lengths in LAYOUTS.items()
        for chunk in (0, 8)
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
