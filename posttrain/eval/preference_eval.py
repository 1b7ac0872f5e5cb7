"""Preference-side evaluation: reward-model accuracy, DPO implicit-reward accuracy, and the
win-rate of a tuned policy against its reference judged by the trained reward model."""

from __future__ import annotations

from typing import Any

import torch

from posttrain.data.chat import render
from posttrain.eval.generation import generate
from posttrain.models.adapters import active_adapter
from posttrain.models.reward import pair_batch, pair_scores, score_sequences
from posttrain.train.losses import sequence_logps


def _batches(pairs: list[dict], size: int):
    for i in range(0, len(pairs), size):
        yield pairs[i : i + size]


@torch.no_grad()
def reward_accuracy(
    rm: torch.nn.Module, pairs: list[dict], pad_id: int, batch_size: int
) -> dict[str, float]:
    """Share of held-out pairs the reward model ranks chosen above rejected, and mean margin."""
    device = next(rm.parameters()).device
    correct = margin = 0.0
    for chunk in _batches(pairs, batch_size):
        b = {k: v.to(device) for k, v in pair_batch(chunk, pad_id).items()}
        rc, rr = pair_scores(rm, b)
        correct += (rc > rr).sum().item()
        margin += (rc - rr).sum().item()
    return {"accuracy": correct / len(pairs), "margin": margin / len(pairs), "pairs": len(pairs)}


@torch.no_grad()
def implicit_reward_accuracy(
    model: torch.nn.Module,
    policy: str,
    reference: str,
    pairs: list[dict],
    pad_id: int,
    beta: float,
    batch_size: int,
) -> dict[str, float]:
    """DPO's implicit reward beta * (log pi - log ref) on held-out pairs: accuracy (chosen
    strictly above rejected) and mean margin. `policy`/`reference` are adapter names on one
    PeftModel."""
    device = next(model.parameters()).device
    correct = margin = 0.0
    for chunk in _batches(pairs, batch_size):
        b = {k: v.to(device) for k, v in pair_batch(chunk, pad_id).items()}
        out = {}
        for name in (policy, reference):
            with active_adapter(model, name):
                logits = model(
                    input_ids=b["input_ids"],
                    attention_mask=b["attention_mask"],
                    position_ids=b["position_ids"],
                ).logits
            out[name] = sequence_logps(logits, b["labels"])[0]
        r = beta * (out[policy] - out[reference])  # [2B]: chosen rows, then rejected
        half = r.size(0) // 2
        correct += (r[:half] > r[half:]).sum().item()
        margin += (r[:half] - r[half:]).sum().item()
    return {"accuracy": correct / len(pairs), "margin": margin / len(pairs), "pairs": len(pairs)}


def win_rate(
    model: torch.nn.Module,
    tok: Any,
    rm: torch.nn.Module,
    prompts: list[list[dict]],
    candidate: str,
    baseline: str,
    sampling: Any,
    seed: int,
    batch_size: int,
) -> dict[str, Any]:
    """Generate an answer to each prompt with adapter `candidate` and with `baseline`, score
    both with the reward model, count wins/losses/ties. win_rate = (wins + ties / 2) / n."""
    texts = [render(tok, p, add_generation_prompt=True) for p in prompts]
    answers = {}
    for name in (candidate, baseline):
        with active_adapter(model, name):
            answers[name] = generate(model, tok, texts, sampling, seed, batch_size)
    scores = {}
    for name, outs in answers.items():
        seqs = [
            tok(
                render(tok, p + [{"role": "assistant", "content": o}], False),
                add_special_tokens=False,
            )["input_ids"]
            for p, o in zip(prompts, outs, strict=True)
        ]
        scores[name] = score_sequences(rm, seqs, tok.pad_token_id, batch_size)
    wins = sum(c > b for c, b in zip(scores[candidate], scores[baseline], strict=True))
    losses = sum(c < b for c, b in zip(scores[candidate], scores[baseline], strict=True))
    ties = len(prompts) - wins - losses
    examples = [
        {
            "prompt": p[-1]["content"],
            candidate: a,
            baseline: b,
            f"{candidate}_score": sa,
            f"{baseline}_score": sb,
        }
        for p, a, b, sa, sb in zip(
            prompts,
            answers[candidate],
            answers[baseline],
            scores[candidate],
            scores[baseline],
            strict=True,
        )
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
