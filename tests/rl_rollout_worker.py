"""torchrun worker for test_rl_stages: sampling from the sharded four-role model when ranks
stop at different lengths. Usage: torchrun --nproc-per-node 2 -m tests.rl_rollout_worker
<ingest_dir> <sft_dir> <reward_dir>; prints one JSON line per rank, gathering mode and decode path."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.fsdp import register_fsdp_forward_method

from posttrain.config.schema import RolloutConfig
from posttrain.data.prompts import encode_prompt, quickstart_prompts
from posttrain.distributed.fsdp import shard_model
from posttrain.distributed.runtime import init_distributed, shutdown
from posttrain.models.adapters import POLICY
from posttrain.models.loading import load_base
from posttrain.models.roles import build_roles
from posttrain.rl.rollout.engine import build_engine
from posttrain.rl.rollout.sample import sample, score


def main() -> None:
    ingest, sft, reward = (Path(p) for p in sys.argv[1:4])
    d = init_distributed("cpu", timeout_s=60)
    base, tok = load_base(ingest, json.loads((ingest / "manifest.json").read_text()))
    model = shard_model(
        build_roles(base, sft / "adapter", reward / "adapter", True), d.mesh, "fp32"
    )
    register_fsdp_forward_method(model, "generate")
    msgs = [r["messages"] for r in quickstart_prompts(4, seed=d.rank)]
    ids = [encode_prompt(tok, m, 64) for m in msgs]
    responses = {}
    for drop in (False, True):
        for keep in (False, True):
            # Rank 0 stops after 2 new tokens, rank 1 runs to 10 (EOS id -1 never ends a row
            # early), so rank 0 must keep stepping with rank 1: with every block re-gathered at
            # each token (keep False) and with the weights kept gathered for the whole loop
            # (keep True); through generate and through the decode loop that drops finished
            # rows (drop True; its rank 0 steps a one-row dummy).
            cfg = RolloutConfig(
                max_new_tokens=2 if d.rank == 0 else 10, keep_gathered=keep, drop_finished=drop
            )
            engine = build_engine(cfg, model, POLICY, d.world_size)
            ro = sample(engine, ids, msgs, cfg, tok.pad_token_id, -1, d.rank)
            responses[drop, keep] = ro.response
            score(model, ro, tok, 2, 64)
            record = {
                "rank": d.rank,
                "keep_gathered": keep,
                "drop_finished": drop,
                "width": ro.width[1],
                "scored": sorted(ro.scored),
                "finite": all(bool(torch.isfinite(v).all()) for v in ro.scored.values()),
                "same_tokens": bool(torch.equal(ro.response, responses[False, keep])),
            }
            print(json.dumps(record), flush=True)
    # Rows that end at different steps inside each rank: the token row 0 sampled second stops
    # it; the decode loop drops it and must sample what generate samples.
    stop = [int(responses[False, True][0, 1])]
    got = {}
    for drop in (False, True):
        cfg = RolloutConfig(max_new_tokens=2 if d.rank == 0 else 10, drop_finished=drop)
        engine = build_engine(cfg, model, POLICY, d.world_size)
        got[drop] = sample(engine, ids, msgs, cfg, tok.pad_token_id, stop, d.rank)
    record = {
        "stop_rank": d.rank,
        "stopped": got[True].stopped.tolist(),
        "same_tokens": bool(torch.equal(got[True].response, got[False].response)),
    }
    print(json.dumps(record), flush=True)
    shutdown()


if __name__ == "__main__":
    main()
