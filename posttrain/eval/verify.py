"""Accuracy under verifiers: greedy pass@1 and sampled pass@k of a policy on held-out prompts
with references, each answer checked by the same reward functions RL trained against.

pass@k is the unbiased estimator of Chen et al. (2021): with n samples of a prompt of which c
pass, pass@k = 1 - C(n-c, k) / C(n, k), the chance that k samples drawn without replacement from
the n include a passing one; averaged over prompts. An answer passes when every verifier that
applies to it (did not return None) gives at least `threshold`; a prompt no verifier applies to
is left out.

Sampling `pass_samples` answers per prompt is most of the cost, so only the final policy is
sampled by default; the other policies compared get the greedy pass@1 alone
(`evaluate.pass_k_policies`, `samples_pass_k`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from peft import PeftModel

from posttrain.agents.episodes import EpisodeRun
from posttrain.data.chat import render
from posttrain.eval import failures
from posttrain.eval.generation import decode_new, generate_ids
from posttrain.eval.play import play_prompts
from posttrain.kinds.evaluate import EvaluateConfig
from posttrain.models.adapters import as_policy
from posttrain.rewards.combine import RewardFunction, score_functions
from posttrain.rewards.extract import completion_text
from posttrain.rl.rewarder import environments, episode_reward
from posttrain.rl.rollout.multiturn import (
    EpisodeSetup,
    episode_metrics,
    episode_record,
    played_sums,
)
from posttrain.sections.shared import SamplingConfig

log = logging.getLogger("posttrain.evaluate")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0  # C(n-c, k) / C(n, k) as a product, without big binomials
    for i in range(k):
        miss *= (n - c - i) / (n - i)
    return 1.0 - miss


@dataclass(frozen=True)
class VerifyPrompts:
    messages: list[list[dict[str, Any]]]  # each prompt's conversation, ending with a user turn
    columns: list[dict[str, Any]]  # each prompt's data columns (`answer`, ...)
    where: list[str]  # each prompt's origin, for error messages

    @staticmethod
    def from_rows(rows: Sequence[dict[str, Any]], origin: str) -> VerifyPrompts:
        """From saved prompt rows (`{"prompt": [...], **columns}`, an RL stage's data/eval.jsonl)
        or conversations (`{"messages": [..., assistant]}`: the last reply is the `answer`)."""
        msgs, cols = [], []
        for r in rows:
            if "prompt" in r:
                p = r["prompt"]
                msgs.append([{"role": "user", "content": p}] if isinstance(p, str) else p)
                cols.append({k: v for k, v in r.items() if k != "prompt"})
            else:
                m = r["messages"]
                last = max(i for i, x in enumerate(m) if x["role"] == "assistant")
                msgs.append(m[:last])
                extra = {k: v for k, v in r.items() if k != "messages"}
                cols.append({"answer": m[last]["content"], **extra})
        return VerifyPrompts(msgs, cols, [f"{origin}:{i + 1}" for i in range(len(rows))])


@dataclass(frozen=True)
class Answers:
    """What a policy answered to `repeat` samples per prompt (prompt-major)."""

    passed: list[bool | None]  # None where no verifier applies
    texts: list[str]  # the answers (an episode's: its final assistant message)
    episodes: list[EpisodeRun] | None = None  # played episodes, when the verifier has them
    # Why they failed (`posttrain.eval.failures.collect`); None: no verifier counted outcomes
    failures: dict[str, Any] | None = None


def _passes(
    model: Any,
    tok: Any,
    prompts: VerifyPrompts,
    funcs: Sequence[RewardFunction],
    sampling: SamplingConfig,
    repeat: int,
    seed: int,
    cfg: EvaluateConfig,
    episodes: EpisodeSetup | None = None,
) -> Answers:
    """`repeat` samples per prompt, each passed when every verifier that applies gives at least
    `cfg.pass_threshold`; with `episodes`, each sample is an episode judged whole (functions on
    its messages, the environment's reward a verifier too)."""
    idx = [i for i in range(len(prompts.messages)) for _ in range(repeat)]
    if episodes is not None:
        return _episode_passes(model, tok, prompts, funcs, sampling, idx, seed, cfg, episodes)
    texts = [render(tok, prompts.messages[i], add_generation_prompt=True) for i in idx]
    out = generate_ids(model, tok, texts, sampling, seed, cfg.batch_size)
    answers = [decode_new(tok, ids, stopped) for ids, stopped in out]
    failures.clear()
    _, per = score_functions(
        funcs,
        [prompts.messages[i] for i in idx],
        answers,
        [prompts.columns[i] for i in idx],
        [ids for ids, _ in out],
        [stopped for _, stopped in out],
        [prompts.where[i] for i in idx],
    )
    why = failures.collect(len(idx))
    return Answers(_verdicts(list(per.values()), len(idx), cfg.pass_threshold), answers, None, why)


def _episode_passes(
    model: Any,
    tok: Any,
    prompts: VerifyPrompts,
    funcs: Sequence[RewardFunction],
    sampling: SamplingConfig,
    idx: list[int],
    seed: int,
    cfg: EvaluateConfig,
    e: EpisodeSetup,
) -> Answers:
    """`_passes` by episode (`posttrain.eval.play.play_prompts`)."""
    asked = [(prompts.messages[i], prompts.columns[i], prompts.where[i]) for i in idx]
    runs = play_prompts(model, tok, e, asked, sampling, seed, cfg.batch_size)
    completions = [r.messages[r.n_prompt :] for r in runs]
    failures.clear()
    _, per = score_functions(
        funcs,
        [r.messages[: r.n_prompt] for r in runs],
        completions,
        [prompts.columns[i] for i in idx],
        [r.ids[r.prompt_len :] for r in runs],
        [not r.truncated for r in runs],
        [prompts.where[i] for i in idx],
        environments(runs),
    )
    values, why = list(per.values()), failures.collect(len(idx))
    if e.env_rewards:  # TRL's get_reward is optional (NaN: that episode's class has none)
        values.append(torch.tensor([episode_reward(r) for r in runs]))
    passed = _verdicts(values, len(idx), cfg.pass_threshold)
    return Answers(passed, [completion_text(c) for c in completions], runs, why)


def _verdicts(values: list[torch.Tensor], n: int, threshold: float) -> list[bool | None]:
    """Per sample: every verifier's value that applies (not NaN) at least `threshold`; None
    where none applies."""
    out: list[bool | None] = []
    for j in range(n):
        vals = [float(v[j]) for v in values if v[j] == v[j]]  # NaN: not applicable
        out.append(None if not vals else all(v >= threshold for v in vals))
    return out


def samples_pass_k(policy: str, final: str, setting: str | list[str]) -> bool:
    """Whether `policy` gets the sampled pass@k under `evaluate.pass_k_policies` (`setting`):
    the final policy always (its pass@k is the headline's); another only under `all` or when
    listed by name."""
    return policy == final or setting == "all" or (isinstance(setting, list) and policy in setting)


def pass_figures(
    greedy: list[bool | None], sampled: list[bool | None] | None, n: int, k: int
) -> dict[str, float]:
    """The report's figures from per-prompt verdicts (None: no verifier applied): greedy
    `pass@1`, the unbiased `pass@<k>` of the `n` samples per prompt (`sampled` holds prompt i's
    at [i*n, (i+1)*n)), their mean accuracy `sampled_pass@1`, and the prompts scored. With k = 1
    the sampled pass@1 is `sampled_pass@1`: the greedy `pass@1` is never overwritten. `sampled`
    None (the policy was not sampled): `pass@1` and the prompts only, no empty pass@k."""
    scored = [i for i, p in enumerate(greedy) if p is not None]
    out = {"pass@1": sum(bool(greedy[i]) for i in scored) / max(1, len(scored))}
    if sampled is not None:
        at_k, at_1 = [], []
        for i in scored:
            got = [p for p in sampled[i * n : (i + 1) * n] if p is not None]
            if len(got) >= k:
                c = sum(got)
                at_k.append(pass_at_k(len(got), c, k))
                at_1.append(c / len(got))
        if k > 1:
            out[f"pass@{k}"] = sum(at_k) / max(1, len(at_k))
        out["sampled_pass@1"] = sum(at_1) / max(1, len(at_1))
    out["prompts"] = len(scored)
    return out


def verify_policy(
    model: Any,
    tok: Any,
    prompts: VerifyPrompts,
    funcs: Sequence[RewardFunction],
    cfg: EvaluateConfig,
    seed: int,
    episodes: EpisodeSetup | None = None,
    sample: bool = True,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(`pass_figures`, greedy examples) of the active adapter of `model`; with `episodes`, by
    episode, with the greedy episodes' `episode_metrics` and whole episodes in the examples.
    `sample` False: greedy answers only (no pass@k). With a verifier that counts outcomes (the
    code verifier), `failures`: {"greedy": ..., "sampled": ...} (`posttrain.eval.failures`)."""
    n, k = cfg.pass_samples, cfg.pass_k
    greedy = cfg.pass_sampling.model_copy(update={"strategy": "greedy", "name": "greedy"})
    g = _passes(model, tok, prompts, funcs, greedy, 1, seed, cfg, episodes)
    sampled, why = None, {"greedy": g.failures}
    if sample:
        s = _passes(model, tok, prompts, funcs, cfg.pass_sampling, n, seed, cfg, episodes)
        sampled, why["sampled"] = s.passed, s.failures
    out: dict[str, Any] = pass_figures(g.passed, sampled, n, k)
    if g.failures is not None:  # a verifier that runs code: why its answers failed
        out["failures"] = why
    if g.episodes is not None:
        out |= episode_metrics(played_sums(g.episodes))
    examples = [
        {
            **prompts.columns[i],  # the reference `answer` among them
            "prompt": prompts.messages[i],
            "response": g.texts[i],
            "passed": g.passed[i],
            **(episode_record(g.episodes[i]) if g.episodes is not None else {}),
        }
        for i in range(len(g.passed))
    ]
    return out, examples


def verifier_report(
    model: PeftModel,
    tok: Any,
    prompts: VerifyPrompts,
    source: str,
    funcs: Sequence[RewardFunction],
    policies: dict[str, str | None],
    sampled: Collection[str],
    cfg: EvaluateConfig,
    seed: int,
    episodes: EpisodeSetup | None = None,
) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """`verify_policy` of each of `policies` (stage name -> its adapter, None = the base), in
    order, sampling pass@k for those in `sampled` only -> (the report, each policy's greedy
    examples)."""
    out: dict[str, Any] = {}
    examples: dict[str, list[dict[str, Any]]] = {}
    for name, adapter in policies.items():
        with as_policy(model, adapter):
            out[name], examples[name] = verify_policy(
                model, tok, prompts, funcs, cfg, seed, episodes, sample=name in sampled
            )
        greedy_only = "" if name in sampled else " (greedy only: see evaluate.pass_k_policies)"
        log.info(
            "verifiers on %d prompts: %s %s%s", out[name]["prompts"], name, out[name], greedy_only
        )
    report = {
        "verifiers": [{"label": f.label, "fn": f.fn_ref, "sha256": f.sha256} for f in funcs],
        "source": source,
        "k": cfg.pass_k,
        "samples": cfg.pass_samples,
        "sampled": [n for n in policies if n in sampled],  # the policies with pass@k
        "threshold": cfg.pass_threshold,
        **({"episodes": episodes.describe()} if episodes is not None else {}),
        "policies": out,
    }
    return report, examples
