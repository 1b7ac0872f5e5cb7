"""Small collectives that make every rank take the same decision.

A decision one rank takes alone (skip this checkpoint, stop for lack of disk) leaves the others
waiting in the next collective until the process-group timeout. These helpers exchange the
inputs of such a decision, so every rank computes the same result from the same values. With no
process group they are the identity.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def gather_all(value: Any) -> list[Any]:
    """Every rank's `value` (picklable), in rank order, on every rank."""
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def from_rank0(value: T) -> T:
    """Rank 0's `value` on every rank (what rank 0 saw of a shared folder, say)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
