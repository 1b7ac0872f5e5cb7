"""lm-evaluation-harness tasks on an in-memory model (decision 48).

The harness runs in-process on a model object the evaluate stage already holds (the base, or a
policy with its LoRA merged: the weights export ships), through its HF backend (`HFLM`), with
every seed fixed so that a re-run gives the same scores. The global state the harness touches
(logging levels, torch threads, the python/numpy/torch random generators) is restored
afterwards: evaluate's own sampling after it must not depend on whether the harness ran.

Score keys: the harness reports `<metric>,<filter>` per task (`acc,none`,
`exact_match,strict-match`). `metric_key` flattens that to `<metric>` when the filter is
`none` (the harness's "no filter") and to `<metric>/<filter>` otherwise; the headline key is
`lm_eval/<task>/<that>`, e.g. `lm_eval/arc_easy/acc`, `lm_eval/gsm8k/exact_match/strict-match`.

`harness_report` is evaluate's block: the tasks on each of `evaluate.lm_eval.policies`.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from peft import PeftModel

from posttrain.errors import RecipeVerdict
from posttrain.kinds.evaluate import LmEvalConfig
from posttrain.models.adapters import merged_copy

log = logging.getLogger("posttrain.evaluate")

HEADLINE_PREFIX = "lm_eval"
# The harness's name for "no filter" in its `<metric>,<filter>` result keys.
NO_FILTER = "none"


def metric_key(harness_key: str) -> str | None:
    """`acc,none` -> `acc`; `exact_match,strict-match` -> `exact_match/strict-match`; None for
    what is not a score (`alias`, `name`, `sample_len`, `*_stderr,...`)."""
    if "," not in harness_key:
        return None
    metric, _, filt = harness_key.partition(",")
    if metric.endswith("_stderr"):
        return None
    return metric if filt == NO_FILTER else f"{metric}/{filt}"


def flat_scores(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{task: {metric key: value}} from the harness's `results` block, numbers only (a stderr
    the harness did not compute is the string "N/A")."""
    out: dict[str, dict[str, float]] = {}
    for task, row in results.items():
        scores = {
            k: float(v)
            for hk, v in row.items()
            if (k := metric_key(hk)) is not None and isinstance(v, int | float)
        }
        if scores:
            out[task] = scores
    return out


def headline(scores: dict[str, dict[str, float]], tasks: list[str]) -> dict[str, float]:
    """`lm_eval/<task>/<metric>` for each task the recipe named (a group's aggregate, not its
    dozens of subtasks: those stay in eval.json)."""
    return {
        f"{HEADLINE_PREFIX}/{task}/{k}": v
        for task in tasks
        for k, v in scores.get(task, {}).items()
    }


@contextmanager
def preserved_global_state() -> Iterator[None]:
    """Restores, on exit, what the harness changes globally: the level of every logger (it
    sets its own and quietens others), torch's intra-op threads and the python, numpy and torch
    random generators (it seeds them all)."""
    manager = logging.Logger.manager
    levels = {
        name: lg.level for name, lg in manager.loggerDict.items() if isinstance(lg, logging.Logger)
    }
    root_level = logging.getLogger().level
    threads = torch.get_num_threads()
    py_state, np_state = random.getstate(), np.random.get_state()
    torch_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        for name, lg in list(manager.loggerDict.items()):
            if isinstance(lg, logging.Logger):
                # Loggers the harness created stay quiet at NOTSET: they follow their parents.
                lg.setLevel(levels.get(name, logging.NOTSET))
        logging.getLogger().setLevel(root_level)
        torch.set_num_threads(threads)
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


def task_manager(tasks: list[str], include_path: str | None) -> Any:
    """The harness's task index. Indexing its thousands of built-in task YAMLs costs ~15 s, so
    when every named task is defined in `include_path` only that folder is indexed."""
    from lm_eval.tasks import TaskManager

    if include_path:
        own = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in own.all_tasks for t in tasks):
            return own
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" or in {include_path}" if include_path else ""
        raise RecipeVerdict(
            "lm_eval.tasks",
            f"unknown task(s) {', '.join(unknown)}: not a task of lm-evaluation-harness{where}",
            "evaluate",
        )
    return manager


def run_tasks(
    model: Any,
    tok: Any,
    tasks: list[str],
    manager: Any,
    *,
    limit: int | None,
    num_fewshot: int | None,
    batch_size: int,
    seed: int,
    bootstrap_iters: int = 0,
) -> dict[str, Any]:
    """Score one `transformers` model (in eval mode on its device) on `tasks`."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    with preserved_global_state():
        lm = HFLM(pretrained=model, tokenizer=tok, batch_size=batch_size)
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(tasks),
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            log_samples=False,
            bootstrap_iters=bootstrap_iters,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    results = out["results"]
    stderr = {
        task: {
            k.replace("_stderr", "", 1).replace(f",{NO_FILTER}", "").replace(",", "/"): float(v)
            for k, v in row.items()
            if "_stderr," in k and isinstance(v, int | float)
        }
        for task, row in results.items()
    }
    return {
        "scores": flat_scores(results),
        "stderr": {t: v for t, v in stderr.items() if v},
        "n_samples": {
            t: int(v.get("effective", v.get("original", 0))) if isinstance(v, dict) else int(v)
            for t, v in out.get("n-samples", {}).items()
        },
        "n_shot": dict(out.get("n-shot", {})),
        "versions": {t: str(v) for t, v in out.get("versions", {}).items()},
    }


def harness_report(
    model: PeftModel,
    tok: Any,
    stages: dict[str, str | None],
    kinds: dict[str, str],
    merged_final: Any,
    cfg: LmEvalConfig,
    seed: int,
) -> dict[str, Any]:
    """`cfg.tasks` on each of `cfg.policies`, in order, each timed; a stage two labels name is
    scored once. `stages`: label -> its stage (`sft`: None without one; `final` is scored as
    `merged_final`, the copy the inference figures used). `kinds`: stage -> kind ("base")."""
    import lm_eval

    manager = task_manager(cfg.tasks, cfg.include_path)
    settings = {
        "limit": cfg.limit,
        "num_fewshot": cfg.num_fewshot,
        "batch_size": cfg.batch_size,
        "seed": seed,
        "bootstrap_iters": cfg.bootstrap_iters,
    }
    by_stage: dict[str, dict[str, Any]] = {}
    out: dict[str, Any] = {}
    for label in cfg.policies:
        stage = stages[label]
        if stage is None:
            log.warning("lm_eval: the final policy's lineage has no SFT stage: no sft scores")
            continue
        if stage not in by_stage:
            started = time.perf_counter()
            if kinds[stage] == "base":
                with model.disable_adapter():
                    scores = run_tasks(model.get_base_model(), tok, cfg.tasks, manager, **settings)
            elif stage == stages["final"]:
                scores = run_tasks(merged_final, tok, cfg.tasks, manager, **settings)
            else:
                scores = run_tasks(merged_copy(model, stage), tok, cfg.tasks, manager, **settings)
            by_stage[stage] = {**scores, "seconds": round(time.perf_counter() - started, 2)}
        out[label] = {"stage": stage, "kind": kinds[stage], **by_stage[stage]}
        log.info("lm_eval %s (%s): %s", label, stage, out[label]["scores"])
    return {
        "harness_version": lm_eval.__version__,
        "tasks": list(cfg.tasks),
        "limit": cfg.limit,
        "num_fewshot": cfg.num_fewshot,
        "policies": out,
    }
