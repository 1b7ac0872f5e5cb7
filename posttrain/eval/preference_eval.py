"""Preference-side evaluation: reward-model accuracy, DPO implicit-reward accuracy, and
win-rates judged by a trained reward model: a tuned policy against its reference (two adapters
of one model), and a candidate export against the champion's (two merged model folders)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from posttrain.data.chat import render
from posttrain.eval.generation import generate
from posttrain.kinds.evaluate import EvaluateConfig
from posttrain.models.adapters import active_adapter
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.models.reward import pair_batch, pair_scores, score_sequences
from posttrain.sections.shared import SamplingConfig
from posttrain.train.forward_logps import forward_sequence_logps
from posttrain.train.losses import pair_outcome, pair_tie
from posttrain.train.preference_losses import REFERENCE_FREE, implicit_rewards

log = logging.getLogger("posttrain.evaluate")


def _pair_accuracy(
    pairs: list[dict],
    pad_id: int,
    batch_size: int,
    device: torch.device,
    rewards: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, float]:
    """Share of `pairs` whose chosen reward is above the rejected one (a tie counting half), the
    share of ties and the mean margin; `rewards(batch)` -> (chosen [B], rejected [B]) of a
    `pair_batch` of them."""
    correct = ties = margin = 0.0
    for i in range(0, len(pairs), batch_size):
        b = {k: v.to(device) for k, v in pair_batch(pairs[i : i + batch_size], pad_id).items()}
        rc, rr = rewards(b)
        correct += pair_outcome(rc, rr).sum().item()
        ties += pair_tie(rc, rr).sum().item()
        margin += (rc - rr).sum().item()
    n = len(pairs)
    return {"accuracy": correct / n, "ties": ties / n, "margin": margin / n, "pairs": n}


@torch.no_grad()
def reward_accuracy(
    rm: torch.nn.Module, pairs: list[dict], pad_id: int, batch_size: int
) -> dict[str, float]:
    """Share of held-out pairs the reward model ranks chosen above rejected, and mean margin."""
    device = next(rm.parameters()).device
    return _pair_accuracy(pairs, pad_id, batch_size, device, lambda b: pair_scores(rm, b))


@torch.no_grad()
def implicit_reward_accuracy(
    model: torch.nn.Module,
    policy: str,
    reference: str,
    pairs: list[dict],
    pad_id: int,
    beta: float,
    batch_size: int,
    chunk_tokens: int = 0,
    *,
    loss: str,
) -> dict[str, float]:
    """The implicit reward of preference loss `loss` (`implicit_rewards`) on held-out pairs:
    accuracy and mean margin, as the DPO stage's held-out metrics compute them.
    `policy`/`reference` are adapter names on one PeftModel (the reference is not run for a
    reference-free loss)."""
    adapters = (policy,) if loss in REFERENCE_FREE else (policy, reference)

    def rewards(b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logps: dict[str, torch.Tensor] = {}
        for name in adapters:
            with active_adapter(model, name):
                logps[name], lengths = forward_sequence_logps(model, b, chunk_tokens)
        # [2B]: chosen rows, then rejected
        r = implicit_rewards(logps[policy], logps.get(reference), lengths, beta=beta, loss=loss)
        return r[: r.size(0) // 2], r[r.size(0) // 2 :]

    return _pair_accuracy(pairs, pad_id, batch_size, next(model.parameters()).device, rewards)


def answers(
    model: Any,
    tok: Any,
    prompts: list[list[dict]],
    sampling: SamplingConfig,
    seed: int,
    batch_size: int,
) -> list[str]:
    """`model`'s answer to each chat prompt (messages), rendered with `tok`'s chat template."""
    texts = [render(tok, p, add_generation_prompt=True) for p in prompts]
    return generate(model, tok, texts, sampling, seed, batch_size)


def judge(
    rm: torch.nn.Module,
    tok: Any,
    prompts: list[list[dict]],
    replies: dict[str, list[str]],
    candidate: str,
    baseline: str,
    batch_size: int,
) -> dict[str, Any]:
    """Score both replies to each prompt with the reward model (rendered with its tokenizer
    `tok`) and count the candidate's wins/losses/ties; win_rate = (wins + ties / 2) / n."""
    scores = {}
    for name in (candidate, baseline):
        seqs = [
            tok(
                render(tok, p + [{"role": "assistant", "content": o}], False),
                add_special_tokens=False,
            )["input_ids"]
            for p, o in zip(prompts, replies[name], strict=True)
        ]
        scores[name] = score_sequences(rm, seqs, tok.pad_token_id, batch_size)
    wins = sum(c > b for c, b in zip(scores[candidate], scores[baseline], strict=True))
    losses = sum(c < b for c, b in zip(scores[candidate], scores[baseline], strict=True))
    ties = len(prompts) - wins - losses
    keys = ("prompt", candidate, baseline, f"{candidate}_score", f"{baseline}_score")
    columns = (replies[candidate], replies[baseline], scores[candidate], scores[baseline])
    examples = [
        dict(zip(keys, (p[-1]["content"], *row), strict=True))
        for p, *row in zip(prompts, *columns, strict=True)
    ]
    return {
        "wins": wins,
        "losses": losses,
        "ties": ties,
        "n": len(prompts),
        "win_rate": (wins + ties / 2) / len(prompts),
        "mean_reward": {
            candidate: sum(scores[candidate]) / len(prompts),
            baseline: sum(scores[baseline]) / len(prompts),
        },
        "examples": examples,
    }


def policy_win_rate(
    model: torch.nn.Module,
    tok: Any,
    rm: torch.nn.Module,
    prompts: list[list[dict]],
    policy: tuple[str, str],
    parent: str,
    cfg: EvaluateConfig,
    seed: int,
) -> dict[str, Any] | None:
    """`judge` of a policy against its parent (adapters of one PeftModel; `policy` = (its stage
    name, its adapter)) on `prompts`; None without prompts."""
    if not prompts:
        return None
    name, adapter = policy
    replies = {}
    for which in (adapter, parent):
        with active_adapter(model, which):
            replies[which] = answers(
                model, tok, prompts, cfg.win_rate_sampling, seed, cfg.batch_size
            )
    wr = judge(rm, tok, prompts, replies, adapter, parent, cfg.batch_size)
    log.info(
        "%s vs %s, judged by the reward model: %d wins, %d losses, %d ties (win-rate %.3f)",
        name,
        parent,
        wr["wins"],
        wr["losses"],
        wr["ties"],
        wr["win_rate"],
    )
    return wr


def head_to_head(
    candidate_dir: str | Path,
    champion_dir: str | Path,
    rm: torch.nn.Module,
    rm_tok: Any,
    prompts: list[list[dict]],
    sampling: SamplingConfig,
    seed: int,
    batch_size: int,
    device: torch.device | str = "cpu",
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Candidate vs champion: two merged model folders answer the same prompts with the same
    sampling and seed, each rendering with its own chat template, and the reward model judges
    each pair (`judge`). Loaded in fp32 one at a time, so the peak is one policy plus the
    reward model. A folder against itself ties on every prompt.
    """
    replies: dict[str, list[str]] = {}
    seconds: dict[str, float] = {}
    for name, folder in (("candidate", candidate_dir), ("champion", champion_dir)):
        t0 = time.perf_counter()
        tok = load_tokenizer(folder)
        model = load_causal_lm(folder, torch.float32, trust_remote_code).to(device).eval()
        replies[name] = answers(model, tok, prompts, sampling, seed, batch_size)
        del model
        seconds[name] = time.perf_counter() - t0
    out = judge(rm, rm_tok, prompts, replies, "candidate", "champion", batch_size)
    return {**out, "generate_s": seconds}
