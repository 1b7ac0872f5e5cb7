"""Multi-node launch: two torchrun node agents on 127.0.0.1 meet at a c10d rendezvous and train
an HSDP SFT stage (2 nodes x 1 process: a 2-D mesh, replicated across the nodes)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from flows.stage.launch import stage_command
from posttrain.distributed.runtime import free_port
from posttrain.store.artifacts import verify
from posttrain.telemetry.records import read_metrics
from tests.stage_helpers import ROOT, TINY, planned_dir, run_inprocess, run_shared


def test_multinode_command_line() -> None:
    cmd = stage_command(
        "posttrain.stages.sft",
        "/s.json",
        2,
        python="py",
        nnodes=3,
        node_rank=1,
        rdzv_endpoint="10.0.0.1:29400",
        rdzv_id="abc",
    )
    assert cmd == [
        "py", "-m", "torch.distributed.run", "--nnodes", "3", "--node-rank", "1",
        "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:29400",
        "--rdzv-id", "abc", "-m", "posttrain.stages.sft", "--spec", "/s.json",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="rendezvous endpoint"):
        stage_command("m", "/s.json", 1, nnodes=2)
    with pytest.raises(ValueError, match="node rank 2 is outside 0..1"):
        stage_command("m", "/s.json", 1, nnodes=2, node_rank=2, rdzv_endpoint="h:1")


@pytest.mark.slow
def test_two_node_agents_run_hsdp_sft(tmp_path, shared_parents) -> None:
    data = copy.deepcopy(TINY)
    data["run"]["workspace"] = str(tmp_path / "ws")
    data["infra"] |= {
        "nnodes": 2,
        "devices_per_node": 1,
        "layout": "hsdp",
        "rdzv_endpoint": f"127.0.0.1:{free_port()}",
        "threads_per_rank": 1,
    }
    data["sft"] |= {"max_steps": 4, "checkpoint_every": 2}
    data["sft"]["batch"] = {"micro_batch_size": 4, "grad_accum_steps": 1}  # x 2 nodes = 8
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    run_shared("ingest", recipe, shared_parents)  # TINY's: built once per session
    # A one-process reference run of the same global batch, in a copy of the workspace.
    shutil.copytree(tmp_path / "ws", tmp_path / "ws1")
    single = copy.deepcopy(data)
    single["run"]["workspace"] = str(tmp_path / "ws1")
    single["infra"] = {"device": "cpu", "devices_per_node": 1, "threads_per_rank": 1}
    single["sft"]["batch"] = {"micro_batch_size": 8, "grad_accum_steps": 1}
    recipe1 = tmp_path / "recipe1.yaml"
    recipe1.write_text(yaml.safe_dump(single))

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "launch", "sft", str(recipe)],
            cwd=ROOT,
            env={**env, "POSTTRAIN_NODE_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [a.communicate(timeout=300)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, 9)
    for a, text in zip(agents, outputs, strict=True):
        assert a.returncode == 0, text[-4000:]
        # Each node's supervisor checked what node 0's rank 0 sealed.
        assert "stage sft: ran: " in text, text[-4000:]
    assert "--nnodes 2 --node-rank 1" in outputs[1]
    logs = "\n".join(outputs)
    assert "world 2, layout hsdp, mesh (2, 1) ('dp_replicate', 'dp_shard')" in logs

    out = planned_dir("sft", recipe)
    assert verify(out)[0]
    start = read_metrics(out / "metrics.jsonl", "start")[0]
    assert start["world_size"] == 2 and start["global_batch_size"] == 8
    assert (out / "checkpoints" / "step_0000002" / "meta.json").exists()
    two = read_metrics(out / "metrics.jsonl", "train")
    one = read_metrics(run_inprocess("sft", recipe1) / "metrics.jsonl", "train")
    assert [r["step"] for r in two] == [1, 2, 3, 4]
    for a, b in zip(one, two, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-4)
    assert json.loads((out / "manifest.json").read_text())["stage"] == "sft"
