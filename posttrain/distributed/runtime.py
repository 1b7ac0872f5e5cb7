"""Process-group setup shared by every stage: one code path for world size 1 and N.

Under torchrun the usual env vars (RANK, WORLD_SIZE, MASTER_ADDR, ...) are set; a plain
`python -m posttrain.stages.X` run gets a world of one on a free local port, so FSDP2 and
DCP run exactly as they do at scale.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class DistInfo:
    """This process's place in the stage's world. `mesh` is what FSDP2 shards over (all ranks;
    with sequence parallelism the flattened dp x sp mesh); `sp_mesh` the 2-D ("dp", "sp") mesh
    when `infra.sequence_parallel` > 1, else None. Ranks of one sequence-parallel group are
    consecutive (rank = dp_rank x sp_size + sp_rank) and take the same rows."""

    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh
    sp_mesh: DeviceMesh | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sp_size(self) -> int:
        """Ranks that split each sequence (1 without sequence parallelism)."""
        return self.sp_mesh.size(1) if self.sp_mesh is not None else 1

    @property
    def sp_rank(self) -> int:
        """This rank's slice of a sequence: 0 .. sp_size - 1."""
        return self.rank % self.sp_size

    @property
    def counted(self) -> float:
        """This rank's weight in figures summed over the world: 1, or 0 on a sequence-parallel
        rank after its group's first (the group holds the same rows: counted once)."""
        return float(self.sp_rank == 0)

    @property
    def dp_size(self) -> int:
        """Data-parallel groups: the ranks rows are dealt out to (`rank_batches`)."""
        return self.world_size // self.sp_size

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel group: every rank of it gets the same rows."""
        return self.rank // self.sp_size

    @property
    def sp_group(self) -> dist.ProcessGroup | None:
        """The process group of this rank's sequence-parallel peers (Ulysses' all-to-all);
        None without sequence parallelism."""
        return self.sp_mesh.get_group("sp") if self.sp_mesh is not None else None


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host` now (whoever needs it binds it moments later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def data_parallel_mesh(device_type: str, world: int, local_world: int, layout: str) -> DeviceMesh:
    """The DeviceMesh FSDP2 shards over, by layout:
    fsdp  1-D (world,)                       every model sharded across all ranks
    hsdp  2-D (world / local_world, local_world) = (replicate across nodes, shard within a node)
    ddp   2-D (world, 1)                     replicated on every rank, nothing sharded
    `fully_shard` on a 2-D mesh replicates over dim 0 and shards over dim 1 (HSDP)."""
    if layout == "fsdp":
        return init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
    if layout == "hsdp":
        if world % local_world:
            raise ValueError(
                f"hsdp: world size {world} is not a multiple of {local_world} per node"
            )
        shape = (world // local_world, local_world)
    elif layout == "ddp":
        shape = (world, 1)
    else:
        raise ValueError(f"unknown layout {layout!r}; known: fsdp, hsdp, ddp")
    return init_device_mesh(device_type, shape, mesh_dim_names=("dp_replicate", "dp_shard"))


def sequence_parallel_mesh(device_type: str, world: int, sp: int) -> tuple[DeviceMesh, DeviceMesh]:
    """(the 2-D ("dp", "sp") mesh, the 1-D "dp_sp" mesh flattened from it) for `sp` ranks per
    sequence. FSDP2 shards over the flattened one, so parameters are split over every rank as
    at sp = 1 (as torchtitan lays out context parallelism); the "sp" dimension's groups are the
    consecutive ranks that split one sequence (within a node where sp divides a node's
    devices)."""
    if world % sp:
        raise ValueError(f"sequence_parallel {sp} does not divide the world size {world}")
    mesh = init_device_mesh(device_type, (world // sp, sp), mesh_dim_names=("dp", "sp"))
    return mesh, mesh["dp", "sp"]._flatten("dp_sp")


def init_distributed(
    device_kind: str,
    timeout_s: float,
    threads: int | None = None,
    layout: str = "fsdp",
    sequence_parallel: int = 1,
) -> DistInfo:
    """Initialise the default process group and the data-parallel DeviceMesh of `layout`
    (with `sequence_parallel` > 1, layout fsdp only: the dp x sp mesh, `sequence_parallel_mesh`).

    Backend: NCCL on CUDA, gloo on CPU. `timeout_s` bounds every collective so a rank that
    diverges fails the stage instead of hanging it. Under a multi-node torchrun the node count
    is WORLD_SIZE / LOCAL_WORLD_SIZE.
    """
    standalone = "RANK" not in os.environ
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if device_kind == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        # Share the cores between the ranks on this node instead of oversubscribing them.
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // local_world))
    if not dist.is_initialized():
        # A standalone process (no torchrun env) is a world of one on a free local port. The
        # environment is left untouched: a process that runs a stage in-process and then starts
        # children must not hand them RANK/LOCAL_RANK of a world they are not part of.
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://127.0.0.1:{free_port()}" if standalone else "env://",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device_kind == "cuda" else None,
        )
    if sequence_parallel > 1:
        if layout != "fsdp":
            raise ValueError(
                f"sequence_parallel {sequence_parallel} needs layout fsdp, not {layout}"
            )
        sp_mesh, mesh = sequence_parallel_mesh(device.type, world, sequence_parallel)
        return DistInfo(rank, world, device, mesh, sp_mesh)
    mesh = data_parallel_mesh(device.type, world, local_world, layout)
    return DistInfo(rank, world, device, mesh)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(value: float | int, device: torch.device) -> float:
    """Sum a Python number over ranks (used for token counts and losses)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())


def all_reduce_on_device(t: torch.Tensor) -> torch.Tensor:
    """Sum a device tensor over ranks in place and return it, still on the device: nothing is
    read to the host (a loss summed here is read once, with the gradient norm, by the guard)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def all_reduce_sums(
    sums: dict[str, float | torch.Tensor], device: torch.device
) -> dict[str, float]:
    """Sum each value over ranks -> Python floats, with one all-reduce and one device-to-host
    copy for the whole dict. Loops accumulate their per-step metrics as device tensors and read
    them here once per step: a `.item()` per micro-batch and metric stalls a GPU stream each."""
    t = torch.stack([torch.as_tensor(v, device=device).detach().double() for v in sums.values()])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return dict(zip(sums, t.tolist(), strict=True))


def all_reduce_tensor(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Sum a small tensor over ranks (on `device`, as NCCL needs); returned on the CPU."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = t.to(device)
        dist.all_reduce(t)
    return t.cpu()


def min_max(value: float, device: torch.device) -> tuple[float, float]:
    """(min, max) of a number over ranks, with one all-reduce (max of value and of -value)."""
    t = torch.tensor([value, -value], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return -float(t[1]), float(t[0])


def rank_batches(n_items: int, rank: int, world: int, batch_size: int) -> list[list[int]]:
    """This rank's share of `n_items` (rank-strided) in batches, padded with empty batches so
    every rank runs the same number of forwards: FSDP all-gathers are collective, and a rank that
    stops early hangs the others. Callers run a filler forward with zero weight for an empty
    batch. `rank`/`world` are the data-parallel ones (`DistInfo.dp_rank`, `dp_size`): the ranks
    of one sequence-parallel group get the same batches."""
    mine = list(range(rank, n_items, world))
    n_batches = math.ceil(math.ceil(n_items / world) / batch_size) if n_items else 0
    return [mine[b * batch_size : (b + 1) * batch_size] for b in range(n_batches)]
