"""torchrun worker for tests/test_sequence_parallel_mesh.py: one gloo CPU world with
`infra.sequence_parallel` = argv[1]; each rank writes argv[2]/rank<r>.json, what its mesh says (dp/sp
coordinates, the sp group's ranks, the rows it is dealt) and of a tiny two-block model sharded
over the whole dp x sp mesh (each parameter's mesh and local shard), after one forward and
backward and an all-to-all over the sp group (Ulysses' collective).

Usage: torchrun --nproc-per-node <world> -m tests.sp_mesh_worker <sequence_parallel>
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from posttrain.distributed.fsdp import shard_model
from posttrain.distributed.runtime import init_distributed, rank_batches, shutdown


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class Tiny(nn.Module):
    # As transformers marks its decoder blocks: `shard_model` shards each block, then the root.
    _no_split_modules = ["Block"]

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def main() -> None:
    sp = int(sys.argv[1])
    d = init_distributed("cpu", 60, threads=1, layout="fsdp", sequence_parallel=sp)
    torch.manual_seed(0)
    model = shard_model(Tiny(), d.mesh, "fp32")
    model(torch.ones(4, 8)).sum().backward()
    weight = model.blocks[0].linear.weight  # [8, 8] DTensor, sharded on dim 0
    # Ulysses' collective over this rank's sequence-parallel peers: each sends its rank.
    sent = torch.full((d.sp_size,), float(d.rank))
    got = torch.empty(d.sp_size)
    dist.all_to_all_single(got, sent, group=d.sp_group)
    record = {
        "rank": d.rank,
        "dp_rank": d.dp_rank,
        "dp_size": d.dp_size,
        "sp_rank": d.sp_rank,
        "sp_size": d.sp_size,
        "sp_group": dist.get_process_group_ranks(d.sp_group),
        "sp_mesh": [list(d.sp_mesh.shape), list(d.sp_mesh.mesh_dim_names)],
        "fsdp_mesh": [list(d.mesh.shape), list(d.mesh.mesh_dim_names)],
        "weight_mesh": list(weight.device_mesh.mesh_dim_names),
        "weight_local_rows": weight.to_local().shape[0],
        "grad_local_rows": weight.grad.to_local().shape[0],
        "all_to_all": got.tolist(),
        "rows": rank_batches(10, d.dp_rank, d.dp_size, 2),
    }
    # A file per rank: two ranks printing at once can interleave their lines on torchrun's stdout.
    Path(sys.argv[2], f"rank{d.rank}.json").write_text(json.dumps(record))
    shutdown()


if __name__ == "__main__":
    main()
