"""Off-policy (sequence-level) distillation, Kim & Rush 2016: an `sft` stage with a `teacher:` link
trains on the teacher's answers to its training prompts instead of the data's own answers.

Each training row's prompt (its conversation up to its last assistant turn) is answered by the
teacher (`posttrain.models.teacher`) `teacher_sampling.samples_per_prompt` times, greedily at
temperature 0, each answer a row. Held-out rows keep their own answers, so held-out loss and
evaluate's exact match still measure the task, not the resemblance to the teacher. The teacher
writes text, encoded again by the student's tokenizer: its vocabulary may differ.

The answers are cached in the workspace (`posttrain.store.cache`): the key hashes the teacher's
fingerprint, the prompts, the sampling fields, the seed and the numerics of the process that
samples (not the number of ranks: the batches and their seeds are the same at any number,
`world_batches`), so a re-run with other training fields does not sample again, a changed
teacher or prompt does, and reused answers are the ones sampling again would give.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from posttrain.data.prompts import encode_prompt
from posttrain.distributed.agree import barrier, gather_all
from posttrain.models.adapters import POLICY
from posttrain.models.stop_tokens import model_stop_token_ids
from posttrain.models.teacher import build_teacher
from posttrain.rl.rollout.engines import build_engine
from posttrain.rl.rollout.sample import response_mask
from posttrain.sections.shared import SamplingConfig
from posttrain.store.artifacts import stage_dir
from posttrain.store.cache import cached
from posttrain.telemetry import heartbeat

log = logging.getLogger("posttrain.distill")

Row = dict[str, Any]
ANSWERS = "answers.jsonl"


def prompt_of(row: Row) -> list[dict[str, Any]]:
    """The conversation up to (not including) its last assistant turn."""
    msgs = row["messages"]
    last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    return msgs[:last]


def cache_dir(ctx: Any, rows: list[Row]) -> Path:
    """The cache entry of the teacher's answers to `rows` under the stage's sampling."""
    cfg = ctx.section.teacher_sampling
    payload = {
        "teacher": ctx.role_ref("teacher").fingerprint,
        "prompts": [prompt_of(r) for r in rows],
        "sampling": cfg.model_dump(mode="json"),
        "seed": ctx.recipe.run.seed,
        "numerics": ctx.numerics(),
    }
    key = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]
    return stage_dir(ctx.recipe.run.workspace, "teacher_answers", key)


def teacher_rows(ctx: Any, rows: list[Row]) -> tuple[list[Row], dict[str, Any]]:
    """(`rows` answered by the teacher, `samples_per_prompt` rows per prompt in order; what it
    cost, for the summary)."""
    folder = cache_dir(ctx, rows)
    k = ctx.section.teacher_sampling.samples_per_prompt
    t = time.perf_counter()
    answers, reused = cached(
        folder,
        lambda: sample_answers(ctx, rows),
        save=save_answers,
        load=load_answers,
        parents=[ctx.role_ref("teacher").fingerprint],
        inputs={"answers": len(rows) * k, "numerics": ctx.numerics()},
        writer=ctx.is_main,
        barrier=barrier,
    )
    out = [
        {**row, "messages": [*prompt_of(row), {"role": "assistant", "content": a}]}
        for i, row in enumerate(rows)
        for a in answers[i * k : (i + 1) * k]
    ]
    info = {
        "teacher_answers": len(out),
        "teacher_answers_s": round(time.perf_counter() - t, 2),
        "teacher_answers_reused": reused,
        "teacher_answers_file": str(folder / ANSWERS),
    }
    log.info(
        "teacher %s: %d answers %s in %.1f s (%s)",
        ctx.stage.roles["teacher"],
        len(out),
        "reused" if reused else "sampled",
        info["teacher_answers_s"],
        folder,
    )
    return out, info


def save_answers(answers: list[str], folder: Path) -> None:
    text = "".join(json.dumps({"answer": a}, ensure_ascii=False) + "\n" for a in answers)
    (folder / ANSWERS).write_text(text)


def load_answers(folder: Path) -> list[str]:
    return [json.loads(line)["answer"] for line in (folder / ANSWERS).read_text().splitlines()]


def sampling_config(cfg: Any) -> SamplingConfig:
    greedy = cfg.temperature == 0
    return SamplingConfig(
        name="teacher",
        strategy="greedy" if greedy else "sample",
        temperature=1.0 if greedy else cfg.temperature,
        top_p=cfg.top_p,
        max_new_tokens=cfg.max_new_tokens,
    )


@torch.no_grad()
def world_batches(n: int, size: int, rank: int, world: int) -> list[list[int]]:
    """This rank's batches of `n` jobs: batches of `size` in order (the same at any number of
    ranks), dealt round-robin; every rank gets as many, an empty filler where it has none left."""
    batches = [list(range(b, min(b + size, n))) for b in range(0, n, size)]
    rounds = math.ceil(len(batches) / world)
    return [batches[k] if k < len(batches) else [] for k in range(rank, rounds * world, world)]


@torch.no_grad()
def sample_answers(ctx: Any, rows: list[Row]) -> list[str]:
    """The teacher's answers, `samples_per_prompt` per row in row order (batch b seeded by seed +
    b's first job), gathered on every rank; the teacher is freed before returning."""
    cfg, d = ctx.section.teacher_sampling, ctx.dist
    model, tok = build_teacher(ctx)
    engine = build_engine(_engine_config(ctx), model, POLICY, d.world_size)
    stops = model_stop_token_ids(model, tok)
    sampling = sampling_config(cfg)
    jobs = [(i, j) for i in range(len(rows)) for j in range(cfg.samples_per_prompt)]
    mine: dict[int, str] = {}
    for idx in world_batches(len(jobs), cfg.batch_size, d.rank, d.world_size):
        heartbeat.beat(phase="teacher")
        chunk = [jobs[n] for n in idx] or jobs[:1]
        prompts = [encode_prompt(tok, prompt_of(rows[i]), cfg.max_prompt_len) for i, _ in chunk]
        seed = ctx.recipe.run.seed + (idx[0] if idx else 0)
        response = engine.generate(prompts, sampling, stops, tok.pad_token_id, seed)
        texts = _texts(tok, response, stops)
        mine |= dict(zip(idx, texts, strict=False))  # a filler batch has no idx: kept none
    del engine, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    merged: dict[int, str] = {}
    for part in gather_all(mine):
        merged |= part
    return [merged[n] for n in range(len(jobs))]


def _texts(tok: Any, response: torch.Tensor, stops: list[int]) -> list[str]:
    """Each response [N, R]'s text up to, not including, the stop token that ended it."""
    mask, stopped = response_mask(response, stops)
    return [
        tok.decode(r[: int(m.sum()) - int(s)].tolist(), skip_special_tokens=True)
        for r, m, s in zip(response, mask, stopped, strict=True)
    ]


def _engine_config(ctx: Any) -> Any:
    """The in-process engine's settings: the RL sections' rollout defaults, batch as given."""
    from posttrain.sections.shared import RolloutConfig

    return RolloutConfig(generation_batch_size=ctx.section.teacher_sampling.batch_size)
