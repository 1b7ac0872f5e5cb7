"""bench/vs_trl.py's TRL side: TRL's SFT, DPO and GRPO trainers on the project's rows, base and
settings, run in a process of their own (`vs_trl.py --trl-run <stage> <recipe>`), each
returning its per-step figures. The settings each trainer gets, and why, are in vs_trl.py's
docstring."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def stage_dirs(recipe_path: Path) -> dict[str, Path]:
    from posttrain.config.loader import load_recipe
    from posttrain.plan.planner import plan

    return {p.name: p.out_dir for p in plan(load_recipe(recipe_path)).stages}


def stage_order(n_rows: int, steps: int, micro: int, accum: int, seed: int) -> list[int]:
    """Row indices in the order the stage trains them: step by step, micro-batch by micro-batch
    (`step_indices` at world size 1). Read sequentially, TRL then sees the same batches."""
    from posttrain.data.batching import step_indices

    return [
        i
        for step in range(steps)
        for ix in step_indices(n_rows, step, micro=micro, accum=accum, dp_size=1, rank=0, seed=seed)
        for i in ix
    ]


def trl_args(
    cls: type, section: Any, batch: Any, steps: int, seed: int, out: Path, gc: str, **stage_kw
):
    """TRL config with everything the comparison must hold equal set from the stage's section;
    the rest stays at TRL's defaults. `stage_kw`: the trainer's own fields (max_length, ...)."""
    o = section.optim
    schedules = {
        "cosine": ("cosine_with_min_lr", {"min_lr_rate": o.min_lr_ratio}),
        "linear": ("linear", {}),  # floor 0 only; checked below
        "constant": ("constant", {}),
    }
    assert o.schedule != "linear" or o.min_lr_ratio == 0, "linear with a floor has no TRL twin"
    sched, sched_kw = schedules[o.schedule]
    # transformers 5 renamed it activation_checkpointing; TRL's default (True) is set on the old name.
    extra = {} if gc == "default" else {"activation_checkpointing": gc == "on"}
    extra |= stage_kw
    return cls(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=batch.micro_batch_size,
        gradient_accumulation_steps=batch.grad_accum_steps,
        learning_rate=o.lr,
        lr_scheduler_type=sched,
        lr_scheduler_kwargs=sched_kw,
        warmup_steps=o.warmup_steps,
        weight_decay=o.weight_decay,
        adam_beta1=o.betas[0],
        adam_beta2=o.betas[1],
        adam_epsilon=o.eps,
        optim="adamw_torch",
        max_grad_norm=o.max_grad_norm or 0.0,
        seed=seed,
        data_seed=seed,
        bf16=False,  # TRL's default is True; fp32 here, as the stage on CPU
        fp16=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        logging_steps=1,  # a loss per step; logged after on_step_end, so outside the timing
        disable_tqdm=True,
        train_sampling_strategy="sequential",  # the rows are already in the stage's order
        **extra,
    )


class CountingCollator:
    """Wraps TRL's own collator: real tokens (attention-mask sum) and collation seconds of each
    micro-batch, in the order the trainer asked for them."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.tokens: list[int] = []
        self.seconds: list[float] = []

    def __call__(self, examples: list[dict]) -> dict:
        t = time.perf_counter()
        out = self.inner(examples)
        self.seconds.append(time.perf_counter() - t)
        self.tokens.append(int(out["attention_mask"].sum()))
        return out


def step_timer() -> Any:
    """A TrainerCallback recording each optimizer step's wall time (on_step_begin ->
    on_step_end) and what the trainer logged after it (logging_steps 1: every step)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.logs: dict[int, dict[str, float]] = {}  # global step -> its logged figures
            self._t = 0.0

        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
            self.times.append(time.perf_counter() - self._t)

        def on_log(self, args, state, control, logs=None, **kw):  # noqa: ANN001
            if logs and "loss" in logs:  # not the run's closing summary (train_loss)
                self.logs[state.global_step] = dict(logs)

    return StepTimer()


def _load(recipe_path: Path, stage: str) -> tuple[Any, Any, Any, dict[str, Path]]:
    from posttrain.config.loader import load_recipe, section_batch
    from posttrain.models.loading import load_tokenizer

    recipe = load_recipe(recipe_path)
    dirs = stage_dirs(recipe_path)
    tok = load_tokenizer(dirs["ingest"] / "tokenizer")
    return recipe, section_batch(recipe, stage), tok, dirs


def _base(dirs: dict[str, Path]) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(dirs["ingest"] / "model"), dtype=torch.float32)


def trl_sft(recipe_path: Path, steps: int, out: Path, gc: str) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    from posttrain.data.sft_data import prepare, saved_split

    recipe, batch, tok, dirs = _load(recipe_path, "sft")
    cfg, seed = recipe.sft, recipe.run.seed
    data = prepare(cfg.data, tok, seed)
    # The rows the stage wrote as trained are the rows tokenized here.
    assert data.train_rows == saved_split(dirs["sft"], "train"), "SFT rows differ from the stage's"
    order = stage_order(
        len(data.train), steps, batch.micro_batch_size, batch.grad_accum_steps, seed
    )
    # Pre-tokenized with labels: TRL uses them as they are (-100 = no loss), so both sides
    # score exactly the template's assistant tokens.
    ds = Dataset.from_list(
        [
            {"input_ids": data.train[i]["input_ids"], "labels": data.train[i]["labels"]}
            for i in order
        ]
    )
    lora = LoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=cfg.lora.target_modules,
        task_type="CAUSAL_LM",
        bias="none",
    )
    args = trl_args(SFTConfig, cfg, batch, steps, seed, out, gc, max_length=cfg.data.max_seq_len)
    torch.manual_seed(seed)  # the adapter's A init, as the stage seeds before apply_lora
    trainer = SFTTrainer(
        model=_base(dirs), args=args, train_dataset=ds, processing_class=tok, peft_config=lora
    )
    return _train(trainer, batch.grad_accum_steps, args)


def trl_pairs(pairs: list[dict]) -> list[dict[str, list[int]]]:
    """The project's encoded pairs (full chosen/rejected ids + labels, -100 before the response)
    as TRL's pre-tokenized prompt_ids / chosen_ids / rejected_ids. Checks the split is exact:
    one shared prompt, and every token after it scored (TRL scores all completion tokens)."""
    from posttrain.data.chat import IGNORE

    out = []
    for p in pairs:
        ends = {}
        for side in ("chosen", "rejected"):
            labels = p[f"{side}_labels"]
            start = next(i for i, x in enumerate(labels) if x != IGNORE)
            assert all(x != IGNORE for x in labels[start:]), "unscored token after the response"
            ends[side] = start
        assert ends["chosen"] == ends["rejected"], "chosen and rejected prompts differ"
        assert p["chosen_ids"][: ends["chosen"]] == p["rejected_ids"][: ends["chosen"]]
        s = ends["chosen"]
        out.append(
            {
                "prompt_ids": p["chosen_ids"][:s],
                "chosen_ids": p["chosen_ids"][s:],
                "rejected_ids": p["rejected_ids"][s:],
            }
        )
    return out


def trl_dpo(recipe_path: Path, steps: int, out: Path, gc: str) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from peft import PeftModel
    from trl import DPOConfig, DPOTrainer

    from posttrain.data.pref_prepare import prepare
    from posttrain.data.sft_data import saved_split

    recipe, batch, tok, dirs = _load(recipe_path, "dpo")
    cfg, seed = recipe.dpo, recipe.run.seed
    data = prepare(cfg.data, tok, seed)
    assert [r for r in data.train_rows] == saved_split(dirs["dpo"], "train"), (
        "DPO pairs differ from the stage's"
    )
    order = stage_order(
        len(data.train), steps, batch.micro_batch_size, batch.grad_accum_steps, seed
    )
    pairs = trl_pairs(data.train)
    ds = Dataset.from_list([pairs[i] for i in order])

    class PreTokenizedDPOTrainer(DPOTrainer):
        # TRL 1.16's DPO preparation always tokenizes text (no pre-tokenized path, unlike
        # SFTTrainer); these rows already are prompt_ids/chosen_ids/rejected_ids.
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):  # noqa: ANN001
            return dataset

    # Policy = base + the SFT stage's adapter, trainable. With ref_model=None TRL adds a frozen
    # "ref" copy of that adapter as the reference: the dpo stage's policy_with_reference.
    torch.manual_seed(seed)
    model = PeftModel.from_pretrained(_base(dirs), str(dirs["sft"] / "adapter"), is_trainable=True)
    args = trl_args(DPOConfig, cfg, batch, steps, seed, out, gc, max_length=cfg.data.max_seq_len)
    args.beta, args.loss_type, args.label_smoothing = cfg.beta, [cfg.loss], cfg.label_smoothing
    assert cfg.loss == "sigmoid" and not cfg.sft_weight, "bench compares plain sigmoid DPO"
    trainer = PreTokenizedDPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    return _train(trainer, batch.grad_accum_steps, args)


def grpo_section(recipe: Any) -> Any:
    """The grpo stage's section (a `stages:` entry, not a shorthand attribute)."""
    return recipe.graph().get("grpo").section


def grpo_kw(cfg: Any) -> dict[str, Any]:
    """GRPOConfig fields from the grpo section: the rollout's shape and sampling (top-k 0 and
    top-p 1.0 are TRL's "off", the section's null), the clipped loss. Checks the section
    stays within what both sides compute alike."""
    r = cfg.rollout
    assert cfg.algorithm == "grpo" and cfg.loss_aggregation == "token_mean", cfg.algorithm
    assert cfg.kl.coef == 0 and not cfg.kl.adaptive, "the GRPO row compares runs without KL"
    assert cfg.missing_eos_penalty is None and not cfg.dynamic_sampling
    return {
        "num_generations": r.samples_per_prompt,
        "max_completion_length": r.max_new_tokens,
        "temperature": r.temperature,
        "top_k": r.top_k or 0,
        "top_p": r.top_p or 1.0,
        "beta": 0.0,  # no reference model, no reference pass
        "num_iterations": cfg.update_epochs,
        "epsilon": cfg.clip_range,
        "epsilon_high": cfg.clip_range_high or cfg.clip_range,
        "scale_rewards": "group" if cfg.scale_rewards else "none",
        "loss_type": "dapo",  # TRL's default: the token mean over the whole batch (token_mean)
        "entropy_coef": cfg.entropy_coef,
        "mask_truncated_completions": r.mask_truncated,
        # The rows are laid out in the stage's prompt order; TRL's sampler repeats each one
        # num_generations times in that order.
        "shuffle_dataset": False,
    }


def trl_grpo(recipe_path: Path, steps: int, out: Path, gc: str) -> dict[str, Any]:
    from datasets import Dataset
    from peft import PeftModel
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.data.prompts import prepare_prompts
    from posttrain.data.sft_data import saved_split
    from posttrain.rewards.match import exact_match

    recipe, batch, tok, dirs = _load(recipe_path, "grpo")
    cfg = grpo_section(recipe)
    seed, r = recipe.run.seed, cfg.rollout
    data = prepare_prompts(cfg.data, tok, seed)
    as_saved = [{"prompt": x["messages"], **x["columns"]} for x in data.train]
    assert as_saved == saved_split(dirs["grpo"], "train"), "GRPO prompts differ from the stage's"
    # The stage's prompts of step s: step_indices with micro = prompts_per_step (its
    # `round_prompts` at world size 1).
    order = stage_order(len(data.train), steps, r.prompts_per_step, 1, seed)
    rows = [data.train[i] for i in order]
    ds = Dataset.from_list([{"prompt": x["messages"], **x["columns"]} for x in rows])
    # Policy = base + the SFT stage's adapter, trainable; beta 0: no reference copy.
    model = PeftModel.from_pretrained(_base(dirs), str(dirs["sft"] / "adapter"), is_trainable=True)
    # Off unless asked: the shape (the stage's activation_checkpointing is off too).
    gc = "off" if gc == "default" else gc
    args = trl_args(GRPOConfig, cfg, batch, steps, seed, out, gc, **grpo_kw(cfg))
    # One step = one generation of prompts_per_step x samples_per_prompt and one optimizer step
    # over the stage's micro x accum (TRL: steps_per_generation = accumulation, so its
    # per-device batch x accumulation = the rollout, one generation per optimizer step).
    assert args.generation_batch_size == r.prompts_per_step * r.samples_per_prompt
    assert args.steps_per_generation == args.gradient_accumulation_steps == batch.grad_accum_steps
    # The very function the stage scores with: TRL passes the `answer` column as a keyword.
    trainer = GRPOTrainer(
        model=model, reward_funcs=[exact_match], args=args, train_dataset=ds, processing_class=tok
    )
    check_grpo_inputs(trainer, rows, model, tok)
    return _train_grpo(trainer, args)


def check_grpo_inputs(trainer: Any, rows: list[dict], model: Any, tok: Any) -> None:
    """TRL renders the prompts to the stage's ids (chat template, generation prompt) and stops
    at the stage's stop ids: both sides generate from the same inputs to the same ends."""
    from posttrain.models.stop_tokens import model_stop_token_ids

    ids, _, _ = trainer._tokenize_prompts([x["messages"] for x in rows])
    assert [list(i) for i in ids] == [x["ids"] for x in rows], "TRL renders other prompt ids"
    stops = model_stop_token_ids(model, tok)
    assert set(trainer.eos_token_ids) == set(stops), (trainer.eos_token_ids, stops)


def _train_grpo(trainer: Any, args: Any) -> dict[str, Any]:
    """Trains with a step timer and a timer around TRL's generation call (one per step here)."""
    generation: list[float] = []
    generate = trainer._generate_single_turn

    def timed_generate(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            generation.append(time.perf_counter() - t)

    trainer._generate_single_turn = timed_generate
    timer = step_timer()
    trainer.add_callback(timer)
    trainer.train()
    assert len(generation) == len(timer.times), "expected one generation per optimizer step"
    steps = [
        {
            "step_time_s": t,
            "completion_len": float(timer.logs[k + 1]["completions/mean_length"]),
            "loss": float(timer.logs[k + 1]["loss"]),
            "generation_s": generation[k],
        }
        for k, t in enumerate(timer.times)
    ]
    return {"steps": steps, "gradient_checkpointing": bool(args.activation_checkpointing)}


def _train(trainer: Any, accum: int, args: Any) -> dict[str, Any]:
    collator = CountingCollator(trainer.data_collator)
    trainer.data_collator = collator
    timer = step_timer()
    trainer.add_callback(timer)
    trainer.train()
    # A step's time includes its micro-batches' collation, as the stage's does.
    steps = [
        {
            "tokens": sum(collator.tokens[k * accum : (k + 1) * accum]),
            "step_time_s": t + sum(collator.seconds[k * accum : (k + 1) * accum]),
            "loss": float(timer.logs[k + 1]["loss"]),
        }
        for k, t in enumerate(timer.times)
    ]
    return {
        "steps": steps,
        "gradient_checkpointing": bool(args.activation_checkpointing),
        "padding_free": bool(getattr(args, "padding_free", False)),
    }
