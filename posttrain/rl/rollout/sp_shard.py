"""A rollout's rows under sequence parallelism: each forward's packed rows
(`Rollout.packed_inputs`) split between the ranks of a sequence-parallel group, as
`posttrain.models.sequence_split.split_batch` splits an SFT micro-batch.

Rank r of P takes the contiguous slice r of the N' = N rounded up to a multiple of P tokens (the
padding: a row of its own that nothing reads). Each response token is scored at one flat
position (`index`), so on exactly one rank of the group: `own` [n, R] says where. A per-token
quantity of the rollout (log-probs, values) is then this rank's on its own tokens and 0
elsewhere, and its sum over the group (`group_sum`) is the unsplit forward's, on every rank.

What is not a forward's is taken from the group's first rank (`from_first`): the sampled
responses (so the group trains on one set of rows even where sampling kernels are not
deterministic) and the reward functions' values (a judge asked, code run once per row).
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist

from posttrain.data.segments import Segments
from posttrain.distributed.sequence_parallel import SequenceParallel


def shard_packed(
    inp: dict[str, Any], sp: SequenceParallel, pad_id: int = 0
) -> tuple[dict[str, Any], torch.Tensor]:
    """Packed inputs (input_ids/position_ids [1, N], segments, index [n, R]; on the host) ->
    (this rank's shard: input_ids/position_ids [1, N'/P], the whole sequence's segments,
    `index` [n, R] into the shard's positions and the group; own [n, R] bool: the response
    columns this rank scores)."""
    ids, pos, index = inp["input_ids"], inp["position_ids"], inp["index"]
    lengths = list(inp["segments"].lengths)
    pad = -ids.shape[1] % sp.size
    if pad:  # attends to itself only; no response column reads it
        ids = torch.cat([ids, ids.new_full((1, pad), pad_id)], dim=1)
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype).unsqueeze(0)], dim=1)
        lengths.append(pad)
    width = ids.shape[1] // sp.size
    start = sp.rank * width
    own = (index >= start) & (index < start + width)  # [n, R]
    local = torch.where(own, index - start, torch.zeros_like(index))
    shard = {
        "input_ids": ids[:, start : start + width],
        "position_ids": pos[:, start : start + width],
        "segments": Segments.from_lengths(lengths),
        "index": local,
        "sequence_parallel": sp,
    }
    return shard, own


def group_sum(x: torch.Tensor, sp: SequenceParallel | None) -> torch.Tensor:
    """The sum of `x` (no grad) over the ranks of `sp`'s group: a per-token tensor each rank
    filled on its own tokens (0 elsewhere) becomes the whole one, the same on every rank."""
    if sp is None or sp.size == 1:
        return x
    out = x.detach().clone()
    dist.all_reduce(out, group=sp.group)
    return out


T = TypeVar("T")


def from_first(obj: T, sp: SequenceParallel | None) -> T:
    """`obj` as the first rank of `sp`'s group holds it, on every rank of the group (pickled:
    host tensors, dicts, lists; the other ranks' `obj` is ignored and may be None)."""
    if sp is None or sp.size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=sp.group, group_src=0)
    return box[0]
