"""torchrun worker: the online-RL loop's 2-rank checks below the stage, in one launch that
test_rl_stages and test_agent_rl both read (`two_rank_records` runs it once per session):

- rollouts: sampling from the sharded four-role model when the ranks stop at different lengths
  (rank 0 after 2 new tokens, rank 1 after 10), every gathering mode and both decode paths;
- episodes: the sharded policy plays episodes whose number of turns differs by rank (rank 0: 1,
  rank 1: 3), so rank 0 keeps generating filler turns until rank 1 is done. Sampling at
  temperature 1e-4 is greedy, so every token the policy generated must be the argmax of one
  forward over the ids the episode kept, and the log-probs `score` reads off the Rollout must
  be those of that forward.

Usage: torchrun --nproc-per-node 2 -m tests.rl_two_rank_worker <ingest_dir> <sft_dir>
<reward_dir> <env.py>; prints JSON records: {"rank"...} per rollout variant, {"stop_rank"...}
for rows stopping inside a rank, {"episode_rank"...} for the episodes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import register_fsdp_forward_method

from posttrain.agents.environment import Episode
from posttrain.agents.episodes import run_episodes, start_episodes
from posttrain.data.prompts import encode_prompt, quickstart_prompts
from posttrain.distributed.fsdp import forward_method, shard_model
from posttrain.distributed.runtime import init_distributed, shutdown
from posttrain.kinds.grpo import GRPOConfig
from posttrain.models.adapters import POLICY
from posttrain.models.loading import load_base
from posttrain.models.roles import build_roles
from posttrain.models.stop_tokens import model_stop_token_ids
from posttrain.rl.rollout.engines import build_engine
from posttrain.rl.rollout.multiturn import (
    engine_turns,
    episode_rollout,
    episode_setup,
    synced_turns,
)
from posttrain.rl.rollout.sample import Rollout, sample, sampling_of, score
from posttrain.sections.shared import RolloutConfig

ROOT = Path(__file__).resolve().parents[1]
REPLY_TOKENS = 4  # each turn: the policy's first tokens, then the stop token (forced)

TURNS = '''
class Turns:
    """Answers every reply until the row's number of turns is played."""

    def reset(self, turns, **columns):
        self.left = int(turns)

    def step(self, message):
        self.left -= 1
        return "Go on.", 0.0, self.left == 0
'''

_RUNS: dict[tuple[str, ...], dict[str, Any]] = {}


def two_rank_records(ingest: Path, sft: Path, reward: Path, folder: Path) -> dict[str, Any]:
    """The worker's records on these parents, from one torchrun per session: artifacts with the
    same fingerprints (the shared parents' copies in each module's workspace) reuse it.
    `folder`: where the episodes' environment file is written."""
    key = (ingest.name, sft.name, reward.name)
    if key not in _RUNS:
        env_file = folder / "turns.py"
        env_file.write_text(TURNS)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node=2", "-m", "tests.rl_two_rank_worker"]
        cmd += [str(ingest), str(sft), str(reward), str(env_file)]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        # Both ranks print to one pipe, so lines may run together: find the records themselves.
        found = {
            name: [json.loads(x) for x in re.findall(rf'\{{"{name}".*?\}}', proc.stdout)]
            for name in ("rank", "stop_rank", "episode_rank")
        }
        _RUNS[key] = {
            "rollouts": found["rank"],
            "stops": found["stop_rank"],
            "episodes": {r["episode_rank"]: r for r in found["episode_rank"]},
        }
    return _RUNS[key]


def rollouts(d: Any, ingest: Path, sft: Path, reward: Path) -> None:
    """Rank 0 stops after 2 new tokens, rank 1 runs to 10 (EOS id -1 never ends a row early),
    so rank 0 must keep stepping with rank 1."""
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
            # With every block re-gathered at each token (keep False) and with the weights kept
            # gathered for the whole loop (keep True); through generate and through the decode
            # loop that drops finished rows (drop True; its rank 0 steps a one-row dummy).
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


def episodes(d: Any, ingest: Path, sft: Path, env_file: Path) -> None:
    """Episodes of `env_file`'s Turns: rank 0's end after 1 turn, rank 1's after 3."""
    base, tok = load_base(ingest, json.loads((ingest / "manifest.json").read_text()))
    model = shard_model(build_roles(base, sft / "adapter", None, False), d.mesh, "fp32")
    forward_method(model, "generate")
    rollout = {"environment": f"{env_file}:Turns", "max_turns": 5, "max_new_tokens": 6}
    rollout |= {"samples_per_prompt": 2, "temperature": 1e-4}
    cfg = GRPOConfig.model_validate({"data": {"synthetic": {"n_examples": 16}}, "rollout": rollout})
    stops = model_stop_token_ids(model, tok)
    e = episode_setup(cfg.rollout, tok, stops, "tiny", rewarded=bool(cfg.rewards))
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
    envs = [Episode(e.envs[""], f"rank {d.rank} row {i}") for i in range(len(rows))]
    runs = start_episodes(rows, e.renderer, e.tools, e.schemas, envs)
    gen, sync = synced_turns(generate, d.device, runs[0].ids[:1])
    run_episodes(runs, gen, e.renderer, e.fmt, e.limits, stops, sync)
    ro = episode_rollout(runs, [r["prompt"] for r in rows], tok.pad_token_id, e)
    score(model, ro, tok, 2, 64, roles=(POLICY,), temperature=1e-4)
    record = {"episode_rank": d.rank, "turns": [r.turns for r in runs]}
    record |= {"ended": [r.ended for r in runs], **check(model, runs, ro, set(stops))}
    print(json.dumps(record), flush=True)


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


def main() -> None:
    ingest, sft, reward, env_file = (Path(p) for p in sys.argv[1:5])
    d = init_distributed("cpu", timeout_s=60)
    rollouts(d, ingest, sft, reward)
    episodes(d, ingest, sft, env_file)
    shutdown()


if __name__ == "__main__":
    main()
