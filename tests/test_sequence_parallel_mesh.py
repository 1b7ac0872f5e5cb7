"""The dp x sp mesh of `infra.sequence_parallel` on gloo CPU processes (tests/sp_mesh_worker.py):
its shape and groups, the rows each rank is dealt (the same within a sequence-parallel group)
and a tiny model sharded by FSDP2 over every rank. A world of one has no sp mesh."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from posttrain.distributed.runtime import DistInfo, init_distributed, rank_batches, shutdown
from tests.stage_helpers import ROOT


def _ranks(world: int, sp: int) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    with tempfile.TemporaryDirectory() as out_dir:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world)]
        cmd += ["-m", "tests.sp_mesh_worker", str(sp), out_dir]
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_two_ranks_split_one_sequence() -> None:
    r0, r1 = _ranks(2, 2)
    for r in (r0, r1):
        assert r["sp_mesh"] == [[1, 2], ["dp", "sp"]]
        assert r["fsdp_mesh"] == [[2], ["dp_sp"]] and r["weight_mesh"] == ["dp_sp"]
        # An [8, 8] weight (and its gradient) split over both ranks: 4 rows each.
        assert r["weight_local_rows"] == r["grad_local_rows"] == 4
        assert (r["dp_size"], r["dp_rank"], r["sp_size"], r["sp_group"]) == (1, 0, 2, [0, 1])
        assert r["all_to_all"] == [0.0, 1.0]
    assert (r0["sp_rank"], r1["sp_rank"]) == (0, 1)
    # One data-parallel group: both ranks get every row.
    assert r0["rows"] == r1["rows"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]


@pytest.mark.slow
def test_four_ranks_two_groups_of_two() -> None:
    ranks = _ranks(4, 2)
    assert [(r["dp_rank"], r["sp_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["sp_group"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["all_to_all"] for r in ranks] == [[0.0, 1.0]] * 2 + [[2.0, 3.0]] * 2
    for r in ranks:
        assert r["sp_mesh"] == [[2, 2], ["dp", "sp"]] and r["fsdp_mesh"] == [[4], ["dp_sp"]]
        assert r["weight_local_rows"] == r["grad_local_rows"] == 2  # 8 rows over all 4 ranks
    # Rows dealt to the 2 data-parallel groups; a group's ranks share them.
    assert ranks[0]["rows"] == ranks[1]["rows"] == [[0, 2], [4, 6], [8]]
    assert ranks[2]["rows"] == ranks[3]["rows"] == [[1, 3], [5, 7], [9]]


def test_rows_dealt_by_data_parallel_group() -> None:
    # World 4 at sequence_parallel 2 deals rows as a world of 2 would.
    by_rank = [rank_batches(7, rank // 2, 4 // 2, 2) for rank in range(4)]
    assert by_rank == [[[0, 2], [4, 6]]] * 2 + [[[1, 3], [5]]] * 2


def test_a_world_of_one_has_no_sequence_parallel_group() -> None:
    threads = torch.get_num_threads()
    d = init_distributed("cpu", 60, threads=1)
    try:
        assert (d.sp_mesh, d.sp_group, d.sp_size, d.sp_rank) == (None, None, 1, 0)
        assert (d.dp_size, d.dp_rank) == (1, 0)
        assert isinstance(d, DistInfo) and d.device == torch.device("cpu")
    finally:
        shutdown()
        torch.set_num_threads(threads)
