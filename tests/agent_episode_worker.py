"""torchrun worker for test_agent_rl: episodes played by the sharded policy on two ranks whose
episodes take different numbers of turns (rank 0: 1, rank 1: 3), so rank 0 keeps generating
filler turns until rank 1 is done. Sampling at temperature 1e-4 is greedy, so every token the
policy generated must be the argmax of one forward over the ids the episode kept, and the
log-probs `score` reads off the Rollout must be those of that forward.
Usage: torchrun --nproc-per-node 2 -m tests.agent_episode_worker <ingest_dir> <sft_dir> <env.py>;
prints one JSON line per rank."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from posttrain.agents.environment import Episode
from posttrain.agents.episodes import run_episodes, start_episodes
from posttrain.distributed.fsdp import forward_method, shard_model
from posttrain.distributed.runtime import init_distributed, shutdown
from posttrain.kinds.grpo import GRPOConfig
from posttrain.models.adapters import POLICY
from posttrain.models.loading import load_base
from posttrain.models.roles import build_roles
from posttrain.models.stop_tokens import model_stop_token_ids
from posttrain.rl.rollout.engine import build_engine
from posttrain.rl.rollout.multiturn import (
    engine_turns,
    episode_rollout,
    episode_setup,
    synced_turns,
)
from posttrain.rl.rollout.sample import Rollout, sampling_of, score

REPLY_TOKENS = 4  # each turn: the policy's first tokens, then the stop token (forced)


def main() -> None:
    ingest, sft, env_file = (Path(p) for p in sys.argv[1:4])
    d = init_distributed("cpu", timeout_s=60)
    base, tok = load_base(ingest, json.loads((ingest / "manifest.json").read_text()))
    model = shard_model(build_roles(base, sft / "adapter", None, False), d.mesh, "fp32")
    forward_method(model, "generate")
    rollout = {"environment": f"{env_file}:Turns", "max_turns": 5, "max_new_tokens": 6}
    rollout |= {"samples_per_prompt": 2, "temperature": 1e-4}
    cfg = GRPOConfig.model_validate({"data": {"synthetic": {"n_examples": 16}}, "rollout": rollout})
    stops = model_stop_token_ids(model, tok)
    e = episode_setup(cfg.rollout, tok, stops, "tiny")
    engine = build_engine(cfg.rollout, model, POLICY, d.world_size)
    policy = engine_turns(engine, sampling_of(cfg.rollout), stops, tok.pad_token_id, seed=d.rank)

    def generate(prompts: list[list[int]], max_new: int) -> list[list[int]]:
        # The untrained policy may not stop on its own: its first tokens, then the stop token.
        return [
            [*[t for t in row[:REPLY_TOKENS] if t not in stops], stops[0]]
            for row in policy(prompts, max_new)
        ]

    turns = 1 if d.rank == 0 else 3
    rows = [{"prompt": [{"role": "user", "content": q}], "turns": turns} for q in ("Go.", "Play.")]
    envs = [Episode(e.env, f"rank {d.rank} row {i}") for i in range(len(rows))]
    runs = start_episodes(rows, e.renderer, e.tools, e.schemas, envs)
    gen, sync = synced_turns(generate, d.device, runs[0].ids[:1])
    run_episodes(runs, gen, e.renderer, e.fmt, e.limits, stops, sync)
    ro = episode_rollout(runs, [r["prompt"] for r in rows], tok.pad_token_id, e)
    score(model, ro, tok, 2, 64, roles=(POLICY,), temperature=1e-4)
    record = {"rank": d.rank, "turns": [r.turns for r in runs], "ended": [r.ended for r in runs]}
    record |= check(model, runs, ro, set(stops))
    print(json.dumps(record), flush=True)
    shutdown()


def check(model: torch.nn.Module, runs: list, ro: Rollout, stops: set[int]) -> dict:
    """Over the policy's own tokens (the forced stop tokens aside): is each the argmax of one
    forward over the kept ids, and how far are the scored log-probs from that forward's."""
    greedy, logp_err, checked = True, 0.0, 0
    for i, run in enumerate(runs):
        ids = torch.tensor([run.ids])  # [1, T]
        n = ids.size(1)
        with torch.no_grad():
            logits = model(POLICY, ids, torch.ones_like(ids), torch.arange(n)[None], 0, n)[0]
        logp = torch.log_softmax(logits.float() / 1e-4, -1)  # [T, V]
        for t in range(run.prompt_len, n):
            if not run.mask[t] or run.ids[t] in stops:
                continue
            greedy = greedy and run.ids[t] == int(logits[t - 1].argmax())
            got = float(ro.scored["logps"][i, t - run.prompt_len])
            logp_err = max(logp_err, abs(got - float(logp[t - 1, run.ids[t]])))
            checked += 1
    return {"greedy": greedy, "logp_err": logp_err, "checked": checked}


if __name__ == "__main__":
    main()
