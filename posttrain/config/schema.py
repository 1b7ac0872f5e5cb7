"""The recipe: one pydantic schema for the YAML file, the CLI overrides and the Prefect UI form.

Every field is documented where it is declared; `docs/recipes.md` is generated from these
descriptions (`python -m posttrain.config.docs`). Validation happens at load time, before any
work starts, and every error names the field path (`sft.optim.lr: ...`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from posttrain.config.batch import resolve_batch
from posttrain.config.run_sections import (
    GuardConfig,
    InfraConfig,
    RunConfig,
    ScheduleConfig,
    _Section,
)
from posttrain.secrets import find_secrets

# Real models' shapes for `ingest.from_config.shape`: random-init stand-ins with the exact width,
# depth, heads and vocabulary of a public checkpoint (its config.json), for memory and throughput
# checks where the hub is out of reach. `vocab_size` is the tokenizer's size, `embedding_rows`
# the model's (Qwen pads its embedding past the tokenizer).
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {
        "architecture": "qwen2",
        "hidden_size": 896,
        "num_layers": 24,
        "num_heads": 14,
        "num_kv_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151_665,
        "embedding_rows": 151_936,
        "max_position_embeddings": 32_768,
        "tie_word_embeddings": True,
    },
    "qwen2.5-1.5b": {
        "architecture": "qwen2",
        "hidden_size": 1536,
        "num_layers": 28,
        "num_heads": 12,
        "num_kv_heads": 2,
        "intermediate_size": 8960,
        "vocab_size": 151_665,
        "embedding_rows": 151_936,
        "max_position_embeddings": 32_768,
        "tie_word_embeddings": True,
    },
    "qwen2.5-7b": {
        "architecture": "qwen2",
        "hidden_size": 3584,
        "num_layers": 28,
        "num_heads": 28,
        "num_kv_heads": 4,
        "intermediate_size": 18_944,
        "vocab_size": 151_665,
        "embedding_rows": 152_064,
        "max_position_embeddings": 32_768,
        "tie_word_embeddings": False,
    },
    "llama3.1-8b": {
        "architecture": "llama",
        "hidden_size": 4096,
        "num_layers": 32,
        "num_heads": 32,
        "num_kv_heads": 8,
        "intermediate_size": 14_336,
        "vocab_size": 128_256,
        "embedding_rows": 128_256,
        "max_position_embeddings": 131_072,
        "tie_word_embeddings": False,
    },
}


class FromConfigModel(_Section):
    shape: Literal["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "llama3.1-8b"] | None = Field(
        None,
        description="A public model's exact shape (width, depth, heads, vocabulary) as the "
        "default for every model field not set here; the BPE is filled to the real vocabulary "
        "size. Set `num_layers`/`hidden_size`... to shrink it (e.g. the real 151,936-row "
        "vocabulary on a 2-block model).",
    )
    architecture: Literal["llama", "qwen2"] = Field(
        "llama", description="transformers model family."
    )
    hidden_size: int = Field(128, ge=8, description="Model width.")
    num_layers: int = Field(4, ge=1, description="Decoder blocks.")
    num_heads: int = Field(4, ge=1, description="Attention heads.")
    num_kv_heads: int | None = Field(None, ge=1, description="KV heads (GQA); default = num_heads.")
    intermediate_size: int = Field(256, ge=8, description="MLP width.")
    vocab_size: int = Field(2048, ge=300, description="BPE vocabulary size to train.")
    max_position_embeddings: int = Field(
        512, ge=16, description="Longest sequence the model takes."
    )
    embedding_rows: int | None = Field(
        None,
        ge=300,
        description="Rows of the model's embedding and LM head (config.vocab_size); default the "
        "tokenizer's size. Real checkpoints pad it (Qwen2.5: 151,936 rows, 151,665 tokens).",
    )
    fill_vocab: bool = Field(
        False,
        description="Extend the trained BPE with merges of its own tokens to exactly `vocab_size` "
        "tokens, for a real-size vocabulary from a small corpus (on by default with `shape`).",
    )
    tie_word_embeddings: bool = Field(True, description="Share input embedding and LM head.")
    pretrain_steps: int = Field(
        0,
        ge=0,
        description="Causal-LM warm-up steps on the synthetic corpus, so LoRA has a "
        "non-random base to adapt (0 = random init).",
    )
    pretrain_lr: float = Field(3e-3, gt=0, description="Warm-up learning rate.")
    pretrain_batch_size: int = Field(16, ge=1, description="Warm-up sequences per step.")
    pretrain_seq_len: int = Field(128, ge=8, description="Warm-up sequence length.")
    corpus_examples: int = Field(
        4000, ge=100, description="Synthetic examples used to train the tokenizer and warm-up."
    )

    @model_validator(mode="before")
    @classmethod
    def _shape_defaults(cls, data: Any) -> Any:
        # The shape fills only what the recipe leaves out, so `num_layers: 2` shrinks it.
        if isinstance(data, dict) and data.get("shape") in MODEL_SHAPES:
            data = {**MODEL_SHAPES[data["shape"]], "fill_vocab": True, **data}
        return data

    @model_validator(mode="after")
    def _heads_divide(self) -> FromConfigModel:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        kv = self.num_kv_heads or self.num_heads
        if self.num_heads % kv:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {kv}")
        if self.embedding_rows is not None and self.embedding_rows < self.vocab_size:
            raise ValueError(
                f"embedding_rows {self.embedding_rows} is smaller than vocab_size "
                f"{self.vocab_size}: every token needs an embedding row"
            )
        return self


class IngestConfig(_Section):
    source: Literal["path", "from_config"] = Field(
        "path",
        description="`path`: a local Hugging Face folder or a hub id. `from_config`: build a "
        "small random-init model and train a BPE tokenizer offline (quickstart, tests).",
    )
    path: str | None = Field(
        None,
        description="Local model folder (config, weights, tokenizer), or a hub id `org/name` "
        "(anything that is not an existing local path), read from the huggingface_hub cache "
        "(downloaded first unless HF_HUB_OFFLINE=1).",
    )
    revision: str = Field(
        "main",
        min_length=1,
        description="Hub ids only: branch, tag or commit sha. The commit it resolves to is "
        "part of the fingerprint and the manifest.",
    )
    allow_pickle: bool = Field(
        False, description="Accept pickle weights (*.bin, *.pt). Pickle can run code when loaded."
    )
    trust_remote_code: bool = Field(
        False, description="Accept models whose config needs custom code from the folder."
    )
    chat_template: str | None = Field(
        None,
        description="Jinja chat template to install, as text or the path of a file holding "
        "it (e.g. `templates/qwen3.jinja`). Required when the tokenizer has none; replaces the "
        "tokenizer's own when given.",
    )
    from_config: FromConfigModel = Field(
        default_factory=FromConfigModel, description="Model to build when source = from_config."
    )

    @model_validator(mode="after")
    def _path_given(self) -> IngestConfig:
        if self.source == "path" and not self.path:
            raise ValueError(
                "source 'path' needs ingest.path (a local Hugging Face model folder or a hub id)"
            )
        return self


class SyntheticData(_Section):
    n_examples: int = Field(3000, ge=10, description="Rows to generate.")
    seed: int = Field(1234, ge=0, description="Generator seed (independent of run.seed).")


class DataSourceFields(_Section):
    """How `path` / `eval_path` are read when they are hub dataset ids, and column renames."""

    split: str = Field("train", min_length=1, description="Hub datasets: the split of `path`.")
    eval_split: str = Field(
        "test", min_length=1, description="Hub datasets: the split of `eval_path`."
    )
    revision: str = Field(
        "main",
        min_length=1,
        description="Hub datasets: branch, tag or commit sha; the commit it resolves to is part "
        "of the fingerprint and the manifest.",
    )
    subset: str | None = Field(
        None, description="Hub datasets: the configuration (subset) name, when it has several."
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="Rename source columns to ours before reading rows, e.g. "
        "`{question: prompt, answer: completion}`; for local files and hub datasets alike.",
    )

    @model_validator(mode="after")
    def _columns_distinct(self) -> DataSourceFields:
        targets = list(self.columns.values())
        if len(set(targets)) != len(targets):
            raise ValueError(f"columns: two source columns renamed to one name ({self.columns})")
        return self


class DataConfig(DataSourceFields):
    path: str | None = Field(
        None,
        description="JSONL, JSON, Parquet file, a `datasets.save_to_disk` folder, or a hub "
        "dataset id `org/name`. Rows are `messages` (list of {role, content}), `prompt`/"
        "`completion` (strings or message lists), ShareGPT `conversations` (from/value) or "
        "Alpaca `instruction`/`input`/`output`.",
    )
    synthetic: SyntheticData | None = Field(
        None, description="Generate the quickstart task instead of reading `path`."
    )
    eval_path: str | None = Field(
        None,
        description="Held-out file or hub dataset id (its `eval_split`); default: split from `path`.",
    )
    eval_fraction: float = Field(
        0.05, ge=0.0, lt=1.0, description="Held-out share when there is no eval_path."
    )
    max_seq_len: int = Field(256, ge=8, description="Tokens per sequence after the chat template.")
    on_too_long: Literal["truncate", "drop"] = Field(
        "truncate", description="Rows longer than max_seq_len: cut at the right, or drop (counted)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if (self.path is None) == (self.synthetic is None):
            raise ValueError("give exactly one of data.path or data.synthetic")
        return self


class LoraConfig(_Section):
    r: int = Field(8, ge=1, description="LoRA rank.")
    alpha: float = Field(16, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="Module names to adapt, or `all-linear` (every linear but the head).",
    )


class OptimConfig(_Section):
    lr: float = Field(1e-3, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="LR decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up optimizer steps.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final LR as a fraction of lr.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip gradient norm; null = off.")


class BatchConfig(_Section):
    """Give any two of the three; the third is derived. All three must agree:
    global_batch_size = micro_batch_size x grad_accum_steps x data-parallel size."""

    micro_batch_size: int | None = Field(None, ge=1, description="Sequences per device per step.")
    grad_accum_steps: int | None = Field(
        None, ge=1, description="Micro-batches per optimizer step."
    )
    global_batch_size: int | None = Field(None, ge=1, description="Sequences per optimizer step.")


class TrainingSection(_Section):
    """Fields every training stage shares."""

    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer and schedule.")
    batch: BatchConfig = Field(
        default_factory=lambda: BatchConfig(micro_batch_size=8, grad_accum_steps=1),
        description=BatchConfig.__doc__,
    )
    epochs: float = Field(
        1.0, gt=0, description="Passes over the training set (fractions allowed)."
    )
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps.")
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each block's activations in backward: less memory, ~30% slower.",
    )
    checkpoint_every: int = Field(
        50, ge=0, description="Save a resumable checkpoint every N steps."
    )
    keep_checkpoints: int = Field(2, ge=1, description="Complete checkpoints kept on disk.")
    log_every: int = Field(1, ge=1, description="Write metrics.jsonl every N optimizer steps.")


class SFTConfig(TrainingSection):
    data: DataConfig = Field(description="Training data.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="Adapter shape.")
    packing: bool = Field(
        False,
        description="Concatenate short rows into full max_seq_len sequences (position ids "
        "restart per row; attention across rows is not masked, as in most packers).",
    )
    eval_every: int = Field(
        0, ge=0, description="Held-out loss every N steps (0 = only at the end)."
    )


class _HeldOutSource(DataSourceFields):
    """Where a stage's rows come from and how a held-out share is split off."""

    synthetic: SyntheticData | None = Field(
        None, description="Generate quickstart rows instead of reading `path`."
    )
    eval_path: str | None = Field(
        None,
        description="Held-out file or hub dataset id (its `eval_split`); default: split from `path`.",
    )
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0, description="Held-out share of rows.")
    max_prompt_len: int = Field(
        128, ge=1, description="Longer prompts keep their last max_prompt_len tokens."
    )
    on_invalid: Literal["error", "skip"] = Field(
        "error",
        description="A bad row (missing/empty field, wrong type, no room for a response): stop "
        "naming file and row, or skip it and count it by reason.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> _HeldOutSource:
        if (getattr(self, "path", None) is None) == (self.synthetic is None):
            raise ValueError("give exactly one of data.path or data.synthetic")
        return self


class PreferenceDataConfig(_HeldOutSource):
    path: str | None = Field(
        None,
        description="JSONL, JSON, Parquet file, a saved `datasets` folder or a hub dataset id "
        "`org/name` of pairs: "
        "`prompt`/`chosen`/`rejected` as text or message lists, or `chosen`/`rejected` full "
        "conversations with the prompt implicit in their shared prefix.",
    )
    max_seq_len: int = Field(256, ge=8, description="Tokens per prompt + response.")

    @model_validator(mode="after")
    def _room_for_response(self) -> PreferenceDataConfig:
        if self.max_prompt_len >= self.max_seq_len:
            raise ValueError(
                f"max_prompt_len {self.max_prompt_len} leaves no room for a response "
                f"within max_seq_len {self.max_seq_len}"
            )
        return self


class PromptDataConfig(_HeldOutSource):
    path: str | None = Field(
        None,
        description="JSONL, JSON, Parquet file, a saved `datasets` folder or a hub dataset id "
        "`org/name` of prompts: "
        "`prompt` as text or a message list ending with a user turn (preference files work as "
        "they are), or `messages` (the prompt is everything before the last assistant turn).",
    )


class TemplateGuard(_Section):
    chat_template: str | None = Field(
        None,
        description="Format this stage's text with another chat template than the one "
        "recorded at SFT (Jinja text or a template file's path). Refused unless "
        "allow_template_change is true.",
    )
    allow_template_change: bool = Field(
        False,
        description="Accept a template that differs from the one the policy was "
        "fine-tuned with (template mismatches silently cost reward accuracy).",
    )


class RewardConfig(TrainingSection, TemplateGuard):
    data: PreferenceDataConfig = Field(description="Preference pairs.")
    lora: LoraConfig = Field(
        default_factory=LoraConfig, description="Adapter shape (the score head is trained in full)."
    )
    margin: float = Field(
        0.0,
        description="Bradley-Terry margin: loss = -log sigmoid(r_chosen - r_rejected - margin).",
    )
    min_accuracy: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Quality gate: held-out pair accuracy below this stops the "
        "pipeline before any RL stage.",
    )


class DPOConfig(TrainingSection, TemplateGuard):
    data: PreferenceDataConfig = Field(description="Preference pairs.")
    loss: Literal["sigmoid", "ipo", "robust", "hinge", "simpo"] = Field(
        "sigmoid",
        description="Preference loss: sigmoid (DPO), ipo, robust (label-smoothing "
        "unbiased), hinge (SLiC), simpo (reference-free, length-normalised).",
    )
    beta: float = Field(0.1, gt=0, description="Strength of the implicit KL constraint.")
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="Assumed preference-label noise (sigmoid, robust, simpo)."
    )
    simpo_gamma: float = Field(0.5, ge=0, description="SimPO target reward margin.")
    sft_weight: float = Field(
        0.0, ge=0, description="Weight of an added NLL term on the chosen response."
    )
    precompute_reference: bool = Field(
        False,
        description="Compute reference log-probs once, store them as an artifact keyed by "
        "reference, data, template and max length, and reuse them across runs.",
    )


class RolloutConfig(_Section):
    prompts_per_step: int = Field(
        16, ge=1, description="Prompts per rollout, over all ranks (a multiple of the ranks)."
    )
    samples_per_prompt: int = Field(
        1, ge=1, description="Responses sampled per prompt (GRPO's group size; needs >= 2 there)."
    )
    max_new_tokens: int = Field(
        32,
        ge=1,
        description="Longest response; generation stops earlier at a stop token: the "
        "tokenizer's EOS, the model's generation_config eos ids, or the chat template's "
        "end-of-turn token when it is one token.",
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_k: int | None = Field(None, ge=1, description="Top-k filter; null = off.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus filter; null = off.")
    generation_batch_size: int | None = Field(
        None, ge=1, description="Sequences per `generate` call on a rank; null = all at once."
    )
    keep_gathered: bool = Field(
        True,
        description="Keep the sharded weights gathered for the whole decode loop (one all-gather "
        "per rollout, full-model memory while generating) instead of gathering every block at "
        "every new token.",
    )


class KLConfig(_Section):
    estimator: Literal["k1", "k2", "k3"] = Field(
        "k1",
        description="Per-token KL(policy || reference) estimate: k1 = log-ratio, k2 = half its "
        "square, k3 = exp(-log-ratio) - 1 + log-ratio (unbiased, never negative).",
    )
    placement: Literal["auto", "reward", "loss"] = Field(
        "auto",
        description="`reward`: subtract coef x KL from each token's reward (PPO); `loss`: add "
        "coef x KL to the loss (GRPO). `auto` = the algorithm's usual place.",
    )
    coef: float = Field(0.05, ge=0, description="KL coefficient (initial value when adaptive).")
    adaptive: bool = Field(
        False, description="Adapt the coefficient towards `target` (proportional controller)."
    )
    target: float = Field(
        6.0, gt=0, description="Adaptive target: KL per sequence (sum over its tokens)."
    )
    horizon: int = Field(10000, ge=1, description="Adaptive controller horizon, in sequences.")


class _OnlineRLConfig(TrainingSection, TemplateGuard):
    """What PPO and GRPO share: prompts, rollouts, scoring, KL, clipped updates, gates."""

    data: PromptDataConfig = Field(description="Prompts to roll out from.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation.")
    kl: KLConfig = Field(default_factory=KLConfig, description="KL penalty against the reference.")
    update_epochs: int = Field(
        1, ge=1, description="Passes over each rollout batch; `batch` sizes one update."
    )
    clip_range: float = Field(0.2, gt=0, description="Policy ratio clip (1 +- clip_range).")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight.")
    missing_eos_penalty: float | None = Field(
        None,
        le=0,
        description="Added to the score of a response that never stopped (no stop token - EOS, "
        "generation_config eos id or end-of-turn token - within max_new_tokens); null = no "
        "penalty.",
    )
    eval_prompts: int = Field(
        32, ge=1, description="Held-out prompts scored for the final reward and KL."
    )
    eval_every: int = Field(0, ge=0, description="Also evaluate every N rollouts; 0 = end only.")
    max_kl: float | None = Field(
        None,
        gt=0,
        description="Quality gate: held-out KL(policy || SFT) per response above this stops "
        "the pipeline.",
    )
    min_reward_gain: float | None = Field(
        None,
        description="Quality gate: held-out mean reward minus the SFT policy's below this "
        "stops the pipeline.",
    )


class PPOConfig(_OnlineRLConfig):
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    value_clip: float = Field(0.2, gt=0, description="Value clip around the rollout's values.")
    vf_coef: float = Field(0.1, ge=0, description="Value-loss weight.")
    whiten_advantages: bool = Field(True, description="Normalise advantages over the rollout.")


class GRPOConfig(_OnlineRLConfig):
    rollout: RolloutConfig = Field(
        default_factory=lambda: RolloutConfig(prompts_per_step=8, samples_per_prompt=4),
        description="Generation; samples_per_prompt is the group size (>= 2).",
    )
    kl: KLConfig = Field(
        default_factory=lambda: KLConfig(estimator="k3", coef=0.04),
        description="KL penalty against the reference (in the loss, k3, by default).",
    )
    scale_rewards: bool = Field(
        True, description="Divide group-centred rewards by the group's standard deviation."
    )

    @model_validator(mode="after")
    def _groups(self) -> GRPOConfig:
        if self.rollout.samples_per_prompt < 2:
            raise ValueError(
                "rollout.samples_per_prompt must be >= 2: GRPO's advantage compares the samples "
                "of one prompt with each other"
            )
        return self


class SamplingConfig(_Section):
    name: str = Field(description="Label used in reports.")
    strategy: Literal["greedy", "sample", "beam"] = Field("greedy", description="Decoding.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (sample only).")
    top_k: int | None = Field(None, ge=1, description="Top-k filter (sample only).")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus filter (sample only).")
    num_beams: int = Field(4, ge=2, description="Beams (beam only).")
    max_new_tokens: int = Field(48, ge=1, description="Longest generation.")


def _default_sampling() -> list[SamplingConfig]:
    return [
        SamplingConfig(name="greedy", strategy="greedy"),
        SamplingConfig(name="beam4", strategy="beam", num_beams=4),
        SamplingConfig(name="t0.7-top_p0.9", strategy="sample", temperature=0.7, top_p=0.9),
        SamplingConfig(name="t1.0-top_k20", strategy="sample", temperature=1.0, top_k=20),
    ]


class EvaluateConfig(_Section):
    max_eval_rows: int = Field(256, ge=1, description="Held-out rows scored for loss/perplexity.")
    batch_size: int = Field(16, ge=1, description="Rows per forward pass when scoring.")
    num_prompts: int = Field(8, ge=1, description="Held-out prompts to generate from.")
    sampling: list[SamplingConfig] = Field(
        default_factory=_default_sampling, description="Decoding settings to sample under."
    )
    inference_prompt_tokens: int = Field(64, ge=1, description="Prompt length for latency figures.")
    inference_new_tokens: int = Field(32, ge=1, description="Generated tokens for latency figures.")
    inference_repeats: int = Field(3, ge=1, description="Timed repeats (median is reported).")
    win_rate_prompts: int = Field(
        64,
        ge=1,
        description="Held-out DPO prompts on which the tuned policy's answers are judged "
        "against the SFT policy's by the reward model (needs reward and dpo sections); also "
        "how many held-out reward prompts the promotion gate's head-to-head against the "
        "champion uses.",
    )
    win_rate_sampling: SamplingConfig = Field(
        default_factory=lambda: SamplingConfig(name="win-rate", strategy="greedy"),
        description="Decoding used for the win-rate and head-to-head generations.",
    )

    @model_validator(mode="after")
    def _unique_names(self) -> EvaluateConfig:
        names = [s.name for s in self.sampling]
        if len(names) != len(set(names)):
            raise ValueError(f"sampling names must be unique, got {names}")
        return self


class ExportConfig(_Section):
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="Saved weight dtype; `auto` keeps the base checkpoint's dtype."
    )
    logits_atol: float = Field(
        1e-4,
        gt=0,
        description="Max |logit difference| allowed between the reloaded export and "
        "base+adapter (fp32); scaled up for half-precision exports.",
    )


class PromotionRule(_Section):
    metric: str = Field(description="A key of the evaluate stage's headline, e.g. tuned_loss.")
    direction: Literal["min", "max"] = Field(description="`min`: lower is better; `max`: higher.")
    tolerance: float = Field(
        0.0, ge=0, description="How much worse than the champion still counts as no regression."
    )


class PromotionConfig(_Section):
    enabled: bool = Field(
        True,
        description="Compare each completed run with the pipeline's champion and promote it "
        "only if no rule regresses.",
    )
    rules: list[PromotionRule] = Field(
        default_factory=lambda: [
            PromotionRule(metric="tuned_loss", direction="min", tolerance=0.02),
            PromotionRule(metric="exact_match_tuned", direction="max", tolerance=0.02),
            PromotionRule(metric="rm_accuracy", direction="max", tolerance=0.02),
            PromotionRule(metric="win_rate_vs_sft", direction="max", tolerance=0.05),
            PromotionRule(metric="win_rate_vs_champion", direction="max", tolerance=0.05),
        ],
        description="Metric, direction, tolerance; a metric absent from either run is skipped. "
        "`win_rate_vs_champion` (candidate vs champion answers judged by the candidate's reward "
        "model; needs a reward section) is compared with 0.5, the champion against itself; "
        "if its head-to-head fails, the candidate is not promoted.",
    )


class Recipe(_Section):
    """A whole post-training run."""

    # A refused recipe's error must not echo its input: it may hold the token it is refused for.
    model_config = ConfigDict(hide_input_in_errors=True)

    @model_validator(mode="before")
    @classmethod
    def _no_secrets(cls, data: Any) -> Any:
        # The loader reports these field by field before validating; this catches recipes that
        # arrive by another way (a Prefect UI form, a deployment parameter, code).
        found = find_secrets(data) if isinstance(data, dict) else []
        if found:
            raise ValueError(
                "; ".join(f"{where}: looks like a secret ({kind})" for where, kind in found)
                + ". A recipe holds no credentials: pass them through the environment"
            )
        return data

    run: RunConfig = Field(default_factory=RunConfig, description="Name, workspace, seed.")
    infra: InfraConfig = Field(default_factory=InfraConfig, description="Devices and limits.")
    ingest: IngestConfig = Field(description="Base checkpoint.")
    sft: SFTConfig = Field(description="LoRA supervised fine-tuning.")
    reward: RewardConfig | None = Field(None, description="Reward-model training; omit to skip.")
    dpo: DPOConfig | None = Field(None, description="DPO-family preference tuning; omit to skip.")
    ppo: PPOConfig | None = Field(
        None, description="PPO against the reward model (needs `reward`); omit to skip."
    )
    grpo: GRPOConfig | None = Field(
        None, description="GRPO against the reward model (needs `reward`); omit to skip."
    )
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig, description="Evaluation.")
    export: ExportConfig = Field(default_factory=ExportConfig, description="Merged export.")
    guard: GuardConfig = Field(
        default_factory=GuardConfig,
        description="Numerical guards of the training stages: skip non-finite or spiking "
        "steps, stop after too many.",
    )
    promotion: PromotionConfig = Field(
        default_factory=PromotionConfig,
        description="The gate that decides whether a run replaces the pipeline's champion.",
    )
    schedule: ScheduleConfig | None = Field(
        None,
        description="Cron/interval schedule and event trigger for the served deployment "
        "(`posttrain serve`); omit for on-request runs only.",
    )

    @model_validator(mode="after")
    def _policy_stages(self) -> Recipe:
        tuners = [n for n in ("dpo", "ppo", "grpo") if getattr(self, n) is not None]
        if len(tuners) > 1:
            raise ValueError(
                f"sections {', '.join(tuners)}: one policy-tuning stage per recipe (each starts "
                "from the SFT policy, and evaluate/export ship one policy). To compare them, run "
                "one recipe each with the same workspace: ingest, sft and reward are reused."
            )
        for n in ("ppo", "grpo"):
            if getattr(self, n) is not None and self.reward is None:
                raise ValueError(
                    f"{n}: needs a `reward` section (its reward model scores rollouts)"
                )
        return self

    @model_validator(mode="after")
    def _batch_arithmetic(self) -> Recipe:
        # With devices_per_node = "auto" the data-parallel size is only known once devices are
        # probed; `posttrain.config.loader.resolve` checks it then.
        if isinstance(self.infra.devices_per_node, int):
            for name, section in self.training_sections().items():
                b = section.batch
                resolve_batch(
                    b.micro_batch_size,
                    b.grad_accum_steps,
                    b.global_batch_size,
                    self.infra.world_size(),
                    where=f"{name}.batch",
                )
        return self

    def training_sections(self) -> dict[str, TrainingSection]:
        """The training stages this recipe runs, by name."""
        return {
            n: s
            for n in ("sft", "reward", "dpo", "ppo", "grpo")
            if (s := getattr(self, n)) is not None
        }
