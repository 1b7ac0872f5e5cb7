"""Where an RL step's time goes with each rollout engine: the real GRPO stage, in this process,
on one recipe and one pair of parents, three ways:

  hf       the in-process engine (`rollout.engine: hf`), the trainer's own threads;
  server   `transformers serve` (continuous batching) as the sampler, synchronous
           (`max_staleness: 0`): generation, then scoring and the update, then the weight sync;
  overlap  the same server one update behind (`max_staleness: 1`): the next rollout is sampled
           while this one is scored and trained.

The server gets its own threads (`--server-threads`, on a core of its own where there are
enough) and the trainer the rest, so `overlap` runs both at once; `hf` has every thread.
Printed per engine: medians over the steps after the first of the step, the generation the
step waited for (in `overlap`, what the background did not hide), scoring, the update, the
weight sync, and the generation that ran beside the update; the ratio to `hf`; the final
held-out reward.

Then the equality at staleness 0: a synchronous step trains on what its engine sampled with
the same code whichever engine it is, so the rollouts are what can differ. The SFT policy's
argmax continuations (`top_k: 1`) of `--equality-prompts` prompts, in process and from the
server: the rows that are identical, and for those that are not, the policy's logit margin
where they first part (a near-tie that the server's other float rounding resolves the other
way, or a real difference), and those whose text is the same but re-tokenised to other ids
(`transformers serve` returns text).

    python bench/rollout_engines.py [--steps 8] [--hidden 256] [--layers 4] [--threads 2]
        [--server-threads 1] [--prompts 8] [--samples 4] [--new-tokens 24]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml

from posttrain.telemetry.records import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_models import rl_parents, run_stage  # noqa: E402 (bench/, on the path above)

SERVE = (
    "transformers serve --host {host} --port {port} --continuous-batching "
    "--cb-num-blocks 256 --cb-block-size 16 --format quiet"
)


def recipe(ws: Path, args: argparse.Namespace) -> dict[str, Any]:
    rows = args.prompts * args.samples  # one update per rollout: micro = the rollout
    section = {
        "data": {"synthetic": {"n_examples": 400, "seed": 9}, "eval_fraction": 0.05},
        "rollout": {
            "prompts_per_step": args.prompts,
            "samples_per_prompt": args.samples,
            "max_new_tokens": args.new_tokens,
        },
        # continuous rewards, so that every group has advantages to train on
        "rewards": [{"fn": "posttrain.rewards.match:token_similarity"}],
        "kl": {"coef": 0.0},
        "batch": {"micro_batch_size": rows, "grad_accum_steps": 1},
        "max_steps": args.steps,
        "checkpoint_every": 0,
        "eval_prompts": 16,
        "max_kl": None,
    }
    parents = rl_parents(
        ws, args.hidden, args.layers, args.threads, args.warmup_steps, args.sft_steps
    )
    return parents | {"grpo": section}


def engine(section: dict[str, Any], kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """`section` sampling from `kind`: hf, server or overlap."""
    rollout = dict(section["rollout"])
    if kind != "hf":
        threads = str(args.server_threads)
        rollout["engine"] = "server"
        rollout["server"] = {"command": SERVE, "env": {"OMP_NUM_THREADS": threads}}
        rollout["max_staleness"] = int(kind == "overlap")
    return {**section, "rollout": rollout}


def set_threads(path: Path, threads: int) -> Path:
    """The recipe at `path` with `infra.threads_per_rank` set (an execution field)."""
    data = yaml.safe_load(path.read_text())
    data["infra"]["threads_per_rank"] = threads
    path.write_text(yaml.safe_dump(data))
    return path


def figures(out: Path) -> dict[str, Any]:
    rows = read_metrics(out / "metrics.jsonl", "train")
    later = rows[1:] or rows  # the first step warms up (and is never overlapped)
    keys = ("generation_s", "scoring_s", "training_s", "sync_s", "generation_overlapped_s")
    med = {k: statistics.median(r.get(k, 0.0) for r in later) for k in keys}
    med["step_s"] = statistics.median(
        r["generation_s"] + r["scoring_s"] + r["training_s"] + r["sync_s"] for r in later
    )
    end = read_metrics(out / "metrics.jsonl", "eval")
    med["reward"] = next(r["eval_reward"] for r in reversed(end) if "eval_reward" in r)
    med["rows"] = rows
    return med


def run_engines(tmp: Path, args: argparse.Namespace, kinds: list[str]) -> dict[str, dict]:
    """The GRPO stage once per engine kind, on shared parents: their figures."""
    data = recipe(tmp / "ws", args)
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    run_stage("ingest", path)
    run_stage("sft", path)
    out = {}
    for kind in kinds:
        data["grpo"] = engine(recipe(tmp / "ws", args)["grpo"], kind, args)
        path.write_text(yaml.safe_dump(data))
        threads = args.threads if kind == "hf" else max(1, args.threads - args.server_threads)
        folder = run_stage("grpo", set_threads(path, threads))
        out[kind] = figures(folder)
        shutil.rmtree(folder)
    return out


def equality(tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The SFT policy's argmax continuations (top_k 1) of `--equality-prompts` prompts, from
    the in-process engine and from the server: identical rows, and for each row that differs
    the policy's logit margin (top 1 minus top 2) where it first does: a near-tie that other
    float rounding (the server's batch) resolves the other way, or not."""
    from posttrain.data.prompts import encode_prompt, quickstart_prompts
    from posttrain.models.adapters import POLICY
    from posttrain.models.loading import load_base
    from posttrain.models.roles import build_roles
    from posttrain.models.stop_tokens import model_stop_token_ids
    from posttrain.rl.rollout.engine import HFEngine
    from posttrain.rl.rollout.server_engine import ServerEngine
    from posttrain.sections.shared import RolloutServerConfig, SamplingConfig
    from posttrain.serving.server import rollout_server

    torch.set_num_threads(max(1, args.threads - args.server_threads))
    arts = tmp / "ws" / "artifacts"
    ingest, sft = (next(p for p in (arts / k).iterdir() if p.is_dir()) for k in ("ingest", "sft"))
    manifest = json.loads((ingest / "manifest.json").read_text())
    base, tok = load_base(ingest, manifest)
    model = build_roles(base, sft / "adapter", None, critic=False).eval()
    stops = model_stop_token_ids(model, tok)
    rows = quickstart_prompts(args.equality_prompts, seed=11)
    ids = [encode_prompt(tok, r["messages"], 64) for r in rows]
    argmax = SamplingConfig(
        name="argmax", strategy="sample", top_k=1, max_new_tokens=args.new_tokens
    )
    hf = HFEngine(model, POLICY, 1).generate(ids, argmax, stops, tok.pad_token_id, 0).tolist()
    cfg = RolloutServerConfig(command=SERVE, env={"OMP_NUM_THREADS": str(args.server_threads)})
    model_dir = Path(manifest["summary"]["model_dir"])
    with rollout_server(cfg, tmp / "eq", model_dir, ingest / "tokenizer", tok, stops[-1],
                        lambda: None) as server:  # fmt: skip
        server.sync(model, 0)
        engine = ServerEngine(server, "policy")
        sv = engine.generate(ids, argmax, stops, tok.pad_token_id, 0).tolist()
        counts = engine.take_counts()
    pad = tok.pad_token_id
    same, retokenised, margins = 0, 0, []
    for p, a, b in zip(ids, hf, sv, strict=True):
        a, b = [t for t in a if t != pad], [t for t in b if t != pad]
        if a == b:
            same += 1
        elif tok.decode(a, skip_special_tokens=True) == tok.decode(b, skip_special_tokens=True):
            retokenised += 1  # the same text: the server's text re-tokenised to other ids
        else:
            margins.append(first_difference_margin(model, p, a, b))
    return {
        "rows": len(ids),
        "same": same,
        "retokenised": retokenised,
        "margins": margins,
        "mismatch": counts.get("retokenized_mismatch", 0.0),
    }


def first_difference_margin(
    model: torch.nn.Module, prompt: list[int], a: list[int], b: list[int]
) -> float:
    """The policy's top-1 minus top-2 logit where responses `a` and `b` first differ, given
    the prompt and their common part."""
    from posttrain.models.adapters import POLICY

    k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    ids = torch.tensor([prompt + a[:k]])
    with torch.no_grad():
        logits = model(POLICY, ids, torch.ones_like(ids), torch.arange(ids.size(1))[None])
    top = logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


def report(got: dict[str, dict], eq: dict[str, Any] | None, args: argparse.Namespace) -> None:
    print(
        f"GRPO, {args.prompts} prompts x {args.samples} samples, {args.new_tokens} new tokens, "
        f"hidden {args.hidden}, {args.layers} layers, kl.coef 0, one update per rollout; "
        f"threads: hf {args.threads}, server runs {args.server_threads} for the server + "
        f"{max(1, args.threads - args.server_threads)} for the trainer; medians of "
        f"{args.steps - 1} steps after the first"
    )
    print("engine  | step s | generation s (waited) | scoring s | update s | sync s | "
          "generation beside the update s | vs hf | held-out reward")  # fmt: skip
    base = got.get("hf", {}).get("step_s")
    for kind, m in got.items():
        ratio = f"{m['step_s'] / base:.2f}x" if base else "-"
        print(
            f"{kind:7s} | {m['step_s']:6.3f} | {m['generation_s']:21.3f} | {m['scoring_s']:9.3f}"
            f" | {m['training_s']:8.3f} | {m['sync_s']:6.3f} | "
            f"{m['generation_overlapped_s']:30.3f} | {ratio:>5s} | {m['reward']:.4f}"
        )
    if eq is not None:
        near = sum(m < 1e-3 for m in eq["margins"])
        print(
            f"argmax continuations (top_k 1) of the SFT policy, hf vs server: {eq['same']} of "
            f"{eq['rows']} rows identical; {eq['retokenised']} the same text re-tokenised to "
            f"other ids (the server returns text; {eq['mismatch']:.0f} of its answers' lengths "
            f"contradict its own count); {len(eq['margins'])} other texts, {near} parting at a "
            f"near-tie (top-2 logit margin < 1e-3; margins "
            f"{', '.join(f'{m:.1e}' for m in sorted(eq['margins'])) or '-'})"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--server-threads", type=int, default=1)
    ap.add_argument("--engines", default="hf,server,overlap")
    ap.add_argument("--warmup-steps", type=int, default=100, help="the base's warm-up steps")
    ap.add_argument("--sft-steps", type=int, default=30)
    ap.add_argument("--equality-prompts", type=int, default=32)
    ap.add_argument("--no-equality", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="rollout-engines-") as tmp:
        got = run_engines(Path(tmp), args, args.engines.split(","))
        eq = None if args.no_equality else equality(Path(tmp), args)
    report(got, eq, args)
    return {"engines": got, "equality": eq}


if __name__ == "__main__":
    sys.exit(main() and 0)
