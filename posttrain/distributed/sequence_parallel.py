"""Sequence parallelism, Ulysses style: P ranks share one packed micro-batch of N tokens.

Each rank of the sequence-parallel group holds a contiguous slice of N/P tokens of the flat
(padding-free) sequence (`posttrain.models.sequence_split`), so every linear layer and
the MLP see N/P tokens. Attention needs whole rows, so around it the ranks exchange by
all-to-all: q/k/v [1, H, N/P, D] (this rank's tokens, all heads) -> [1, H/P, N, D] (all tokens,
this rank's heads); the padding-free attention runs over the full `Segments` as on one rank;
the output [1, N, H/P, D] goes back to [1, N/P, H, D]. Each all-to-all moves 1/P of a
tensor's bytes per rank, whatever P.

Grouped-query attention: q head h reads kv head h // (H / Hkv). When Hkv is a multiple of P,
rank r's kv heads are exactly those its q heads read. Otherwise each kv head is replicated
lcm(Hkv, P) / Hkv times (`kv_replicas`) before the exchange: with L = lcm(Hkv, P) kv heads,
q head h reads replica h // (H / L), and rank r's L / P replicas are again exactly those of its
H / P q heads (H is a multiple of both Hkv and P, so of L). One kv head over two ranks: each
rank gets a copy. The replicas' gradients add up in backward (repeat_interleave's).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class SequenceParallel:
    """The ranks that share one micro-batch's tokens: `group` (None = the default group),
    this rank's place in it and its size."""

    group: Any
    rank: int
    size: int

    @classmethod
    def of(cls, group: Any = None) -> SequenceParallel:
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def to(self, device: Any, non_blocking: bool = False) -> SequenceParallel:
        """Itself: a shard's entry moves to a device with its tensors (`loop.to_device`)."""
        return self

    def attention(
        self,
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        query: torch.Tensor,  # [1, H, N/P, D]
        key: torch.Tensor,  # [1, Hkv, N/P, D]
        value: torch.Tensor,  # [1, Hkv, N/P, D]
    ) -> torch.Tensor:
        """`attend` (q/k/v [1, h, N, D] -> [1, N, h, D], whole rows) on this rank's heads of all
        tokens, exchanged from and back to this rank's tokens -> [1, N/P, H, D]."""
        check_heads(query.shape[1], self.size)
        replicas = kv_replicas(key.shape[1], self.size)
        if replicas > 1:
            key = key.repeat_interleave(replicas, dim=1)
            value = value.repeat_interleave(replicas, dim=1)
        # heads (dim 1) scattered, tokens (dim 2) gathered: [1, H/P, N, D]
        q, k, v = (all_to_all(t, self, scatter_dim=1, gather_dim=2) for t in (query, key, value))
        out = attend(q, k, v)  # [1, N, H/P, D]
        return all_to_all(out, self, scatter_dim=1, gather_dim=2)  # [1, N/P, H, D]


def check_heads(heads: int, size: int) -> None:
    """Refuse a head count the group cannot split: each rank attends with H / P heads."""
    if heads % size:
        raise ValueError(
            f"sequence parallelism over {size} ranks splits the attention heads between them: "
            f"{heads} attention heads is not a multiple of {size}; choose a sequence-parallel "
            f"size that divides {heads}"
        )


def kv_replicas(kv_heads: int, size: int) -> int:
    """How many copies of each kv head the exchange sends (1 when Hkv is a multiple of P):
    lcm(Hkv, P) / Hkv, so the copies split evenly and each rank gets those its q heads read."""
    return math.lcm(kv_heads, size) // kv_heads


def all_to_all(x: torch.Tensor, sp: SequenceParallel, scatter_dim: int, gather_dim: int) -> Tensor:
    """Differentiable all-to-all: `x` cut into P chunks along `scatter_dim`, chunk j sent to
    rank j; the chunks received, in rank order, laid end to end along `gather_dim`. Backward is
    the inverse exchange (gather_dim scattered, scatter_dim gathered)."""
    if sp.size == 1:
        return x
    return _AllToAll.apply(x, sp.group, scatter_dim, gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, scatter_dim: int, gather_dim: int) -> Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _exchange(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def _exchange(x: Tensor, group: Any, scatter_dim: int, gather_dim: int) -> Tensor:
    size = dist.get_world_size(group)
    if x.shape[scatter_dim] % size:
        raise ValueError(
            f"all-to-all over {size} ranks cannot cut dimension {scatter_dim} of "
            f"{tuple(x.shape)} evenly"
        )
    send = torch.stack(x.chunk(size, dim=scatter_dim))  # [P, ...chunk], chunk j for rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


def gather_tokens(x: Tensor, sp: SequenceParallel) -> Tensor:
    """This rank's slice [1, N/P, ...] -> the whole sequence [1, N, ...] on every rank (no
    gradient: for metrics and checks)."""
    if sp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(sp.size)]
    dist.all_gather(parts, x.contiguous(), group=sp.group)
    return torch.cat(parts, dim=1)
