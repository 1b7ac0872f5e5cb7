"""The names TRL, axolotl and LLaMA-Factory give to settings a recipe also has, mapped to the
recipe field that holds them: what an unknown field's error suggests (`sft.optim.learning_rate:
unknown field; did you mean sft.optim.lr?`).

The same mapping is written out for people in docs/migrating.md; tests/test_error_hints.py checks
that every name here is on that page beside its field and that every target is a real field.

A target starting with `<stage>.` is inside a training stage's section (`sft.`, `stages.dpo2.`);
the others are absolute. A name with several targets means different things in different kinds
(TRL's `loss_type` is DPO's `loss` but GRPO's `algorithm`): the first target the stage at hand
has is the one suggested.
"""

from __future__ import annotations

STAGE = "<stage>"

ALIASES: dict[str, tuple[str, ...]] = {
    # Where the base model comes from, where outputs go, precision.
    "model_name_or_path": ("ingest.path",),
    "base_model": ("ingest.path",),
    "model": ("ingest.path",),
    "template": ("ingest.chat_template",),
    "output_dir": ("run.workspace",),
    "seed": ("run.seed",),
    "bf16": ("infra.precision",),
    "fp16": ("infra.precision",),
    "flash_attention": ("infra.attention",),
    # Optimizer and schedule.
    "learning_rate": ("<stage>.optim.lr",),
    "lr_scheduler_type": ("<stage>.optim.schedule",),
    "lr_scheduler": ("<stage>.optim.schedule",),
    "cosine_min_lr_ratio": ("<stage>.optim.min_lr_ratio",),
    "warmup_steps": ("<stage>.optim.warmup_steps",),
    "weight_decay": ("<stage>.optim.weight_decay",),
    "adam_beta1": ("<stage>.optim.betas",),
    "adam_beta2": ("<stage>.optim.betas",),
    "max_grad_norm": ("<stage>.optim.max_grad_norm",),
    # Batch, length of training, checkpoints and logs.
    "per_device_train_batch_size": ("<stage>.batch.micro_batch_size",),
    "micro_batch_size": ("<stage>.batch.micro_batch_size",),
    "gradient_accumulation_steps": ("<stage>.batch.grad_accum_steps",),
    "num_train_epochs": ("<stage>.epochs",),
    "num_epochs": ("<stage>.epochs",),
    "max_steps": ("<stage>.max_steps",),
    "gradient_checkpointing": ("<stage>.activation_checkpointing",),
    "eval_steps": ("<stage>.eval_every",),
    "save_steps": ("<stage>.checkpoint_every",),
    "save_total_limit": ("<stage>.keep_checkpoints",),
    "logging_steps": ("<stage>.log_every",),
    # Data.
    "dataset_name": ("<stage>.data.path",),
    "dataset": ("<stage>.data.path",),
    "datasets": ("<stage>.data.path",),
    "dataset_train_split": ("<stage>.data.split",),
    "dataset_test_split": ("<stage>.data.eval_split",),
    "val_set_size": ("<stage>.data.eval_fraction",),
    "val_size": ("<stage>.data.eval_fraction",),
    "max_length": ("<stage>.data.max_seq_len",),
    "sequence_len": ("<stage>.data.max_seq_len",),
    "cutoff_len": ("<stage>.data.max_seq_len",),
    "max_prompt_length": ("<stage>.data.max_prompt_len",),
    "packing": ("<stage>.packing",),
    "sample_packing": ("<stage>.packing",),
    "neat_packing": ("<stage>.packing",),
    "padding_free": ("<stage>.batch.padding_free",),
    # LoRA.
    "lora_r": ("<stage>.lora.r",),
    "lora_rank": ("<stage>.lora.r",),
    "lora_alpha": ("<stage>.lora.alpha",),
    "lora_dropout": ("<stage>.lora.dropout",),
    "lora_target_modules": ("<stage>.lora.target_modules",),
    "lora_target": ("<stage>.lora.target_modules",),
    # Preference tuning.
    "loss_type": ("<stage>.loss", "<stage>.algorithm"),
    "pref_loss": ("<stage>.loss",),
    "rl_beta": ("<stage>.beta",),
    "dpo_beta": ("<stage>.beta",),
    "orpo_alpha": ("<stage>.beta",),
    "pref_beta": ("<stage>.beta",),
    "rpo_alpha": ("<stage>.sft_weight",),
    "pref_ftx": ("<stage>.sft_weight",),
    "precompute_ref_log_probs": ("<stage>.precompute_reference",),
    "kto_chosen_weight": ("<stage>.desirable_weight",),
    "kto_rejected_weight": ("<stage>.undesirable_weight",),
    # Online RL.
    "beta": ("<stage>.kl.coef",),
    "num_generations": ("<stage>.rollout.samples_per_prompt",),
    "max_completion_length": ("<stage>.rollout.max_new_tokens",),
    "temperature": ("<stage>.rollout.temperature",),
    "top_p": ("<stage>.rollout.top_p",),
    "top_k": ("<stage>.rollout.top_k",),
    "generation_batch_size": ("<stage>.rollout.generation_batch_size",),
    "epsilon": ("<stage>.clip_range",),
    "epsilon_high": ("<stage>.clip_range_high",),
    "num_iterations": ("<stage>.update_epochs",),
    "reward_funcs": ("<stage>.rewards",),
    "reward_weights": ("<stage>.rewards",),
    "max_tool_calling_iterations": ("<stage>.rollout.max_turns",),
    "mask_truncated_completions": ("<stage>.rollout.mask_truncated",),
}
