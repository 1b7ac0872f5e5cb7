"""The recipe: one pydantic schema for the YAML file, the CLI overrides and the Prefect UI form.

Every field is documented where it is declared; `docs/recipes.md` is generated from these
descriptions (`python -m posttrain.config.docs`). Validation happens at load time, before any
work starts, and every error names the field path (`sft.optim.lr: ...`).
"""

from __future__ import annotations

from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from posttrain.config.batch import resolve_batch
from posttrain.secrets import find_secrets

Precision = Literal["auto", "fp32", "bf16", "fp16"]


class _Section(BaseModel):
    # extra="forbid": a misspelt key is an error that names it, never silently ignored.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(_Section):
    name: str = Field(
        "posttrain-run",
        description="Pipeline name: groups runs, names the Prefect flow run and the champion slot.",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
    )
    workspace: str = Field(
        "./workspace",
        description="Folder that holds artifacts/, runs/ and Prefect results. Relative paths are "
        "resolved against the current directory when the recipe is loaded.",
    )
    seed: int = Field(0, ge=0, description="Seed for data order, initialisation and sampling.")
    allowed_paths: list[str] = Field(
        default_factory=list,
        description="Absolute folders the recipe's input paths (ingest.path, data.path, "
        "data.eval_path) may point into, besides the recipe file's folder, the current directory "
        "and the workspace. Anything else, reached by an absolute path, `..` or a symlink, is "
        "refused. Loading appends the recipe's folder or current directory when a path needed "
        "it, so a resolved recipe passes the same check on the machine that runs it.",
    )

    @field_validator("allowed_paths")
    @classmethod
    def _absolute(cls, value: list[str]) -> list[str]:
        for p in value:
            if not p.startswith(("/", "~")):
                raise ValueError(f"{p!r} is not an absolute folder (start it with / or ~)")
        return value


class StageTimeouts(_Section):
    ingest: float = Field(1800, gt=0, description="Seconds before the ingest stage is killed.")
    sft: float = Field(6 * 3600, gt=0, description="Seconds before the SFT stage is killed.")
    reward: float = Field(6 * 3600, gt=0, description="Seconds before the reward stage is killed.")
    dpo: float = Field(6 * 3600, gt=0, description="Seconds before the DPO stage is killed.")
    ppo: float = Field(6 * 3600, gt=0, description="Seconds before the PPO stage is killed.")
    grpo: float = Field(6 * 3600, gt=0, description="Seconds before the GRPO stage is killed.")
    evaluate: float = Field(3600, gt=0, description="Seconds before the evaluate stage is killed.")
    export: float = Field(3600, gt=0, description="Seconds before the export stage is killed.")
    head_to_head: float = Field(
        3600,
        gt=0,
        description="Seconds before the promotion gate's head-to-head against the champion "
        "is killed (the run still completes; the candidate is not promoted).",
    )


class InfraConfig(_Section):
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="`auto` picks CUDA when a GPU is visible, else CPU."
    )
    devices_per_node: int | Literal["auto"] = Field(
        1,
        description="Processes per node for distributed stages (one per GPU). `auto` = all visible "
        "GPUs, or 1 on CPU. Data-parallel size = nnodes x devices_per_node.",
    )
    nnodes: int = Field(
        1,
        ge=1,
        description="Machines a distributed stage spans. Above 1, every node runs the stage's "
        "torchrun agent with its own node rank (POSTTRAIN_NODE_RANK) and they meet at "
        "`rdzv_endpoint`.",
    )
    layout: Literal["fsdp", "hsdp", "ddp"] = Field(
        "fsdp",
        description="Data-parallel layout: `fsdp` shards every model across all ranks; `hsdp` "
        "replicates across nodes and shards within a node (a 2-D mesh: inter-node traffic is "
        "only the gradient all-reduce); `ddp` replicates everything (no sharding).",
    )
    rdzv_endpoint: str | None = Field(
        None,
        description="host:port of the c10d rendezvous (the node-rank-0 machine) when nnodes > 1.",
        pattern=r"^[A-Za-z0-9_.\[\]:-]+:[0-9]{1,5}$",
    )
    precision: Precision = Field(
        "auto",
        description="`auto` = bf16 on a GPU that supports it, fp32 on CPU (CPU bf16 matmul is ~100x "
        "slower than fp32). fp16 needs `loss_scaling: true`.",
    )
    loss_scaling: bool = Field(
        False, description="Dynamic loss scaling; required for fp16, whose losses otherwise go NaN."
    )
    threads_per_rank: int | None = Field(
        None, ge=1, description="torch threads per process; default = CPU cores / processes."
    )
    memory_preflight: Literal["refuse", "warn", "off"] = Field(
        "refuse",
        description="Before a training stage loads anything, estimate its per-device memory "
        "(weights by role and sharding, gradients and AdamW state of the trainable parts, "
        "activations, logits, generation KV cache) against the device's. `refuse`: a stage that "
        "cannot fit stops with the numbers and the fixes; `warn`: log them and run; `off`: no "
        "check.",
    )
    device_memory_gb: float | None = Field(
        None,
        gt=0,
        description="Memory of one device in GiB (2^30 bytes) for the pre-flight, instead of "
        "the detected free GPU memory or this process's share of the host's available RAM.",
    )
    pg_timeout_s: float = Field(
        600,
        gt=0,
        description="Process-group (collective) timeout: a mismatched collective fails "
        "after this many seconds instead of hanging.",
    )
    timeouts: StageTimeouts = Field(default_factory=StageTimeouts, description="Per-stage limits.")
    hang_timeout_s: float | None = Field(
        1800,
        gt=0,
        description="Hang watchdog of training stages: when no rank's heartbeat (one per "
        "optimizer step, evaluation batch, checkpoint) has advanced for this many seconds, the "
        "ranks' Python stacks are dumped to logs/stacks-rank<k>.txt and the stage is killed. "
        "null = off (only the stage timeout applies).",
    )
    hang_startup_s: float = Field(
        1800,
        ge=0,
        description="Extra silence the hang watchdog allows before the training loop's first "
        "beat: loading the base model, preparing data, sharding and resuming send no beats.",
    )
    orphan: Literal["stop", "finish"] = Field(
        "stop",
        description="What a stage process does when the process that launched it (`posttrain "
        "run`, a Prefect worker or runner) dies: `stop` ends it within seconds, leaving only "
        "complete checkpoints (the next run resumes from the newest); `finish` lets it train to "
        "the end and seal its artifact, which the next run then reuses.",
    )
    no_intact_checkpoint: Literal["restart", "fail"] = Field(
        "restart",
        description="What a training stage does when it has checkpoints but none passes its "
        "integrity check (sizes and checksums recorded at save): `restart` from step 0, saying "
        "so, or `fail` naming each damaged file. An intact older checkpoint is always preferred.",
    )

    @model_validator(mode="after")
    def _rendezvous(self) -> InfraConfig:
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(
                f"nnodes {self.nnodes} needs rdzv_endpoint (host:port of the node-rank-0 machine, "
                "reachable from every node)"
            )
        return self

    def world_size(self) -> int:
        """Data-parallel size of a distributed stage: nnodes x devices_per_node (resolved)."""
        assert isinstance(self.devices_per_node, int), "resolve() first"
        return self.nnodes * self.devices_per_node

    @model_validator(mode="after")
    def _fp16_needs_scaling(self) -> InfraConfig:
        if self.precision == "fp16" and not self.loss_scaling:
            raise ValueError(
                "precision fp16 without loss scaling is refused: fp16 gradients underflow and "
                "preference losses go NaN. Set infra.loss_scaling: true, or use bf16/fp32."
            )
        return self


class FromConfigModel(_Section):
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

    @model_validator(mode="after")
    def _heads_divide(self) -> FromConfigModel:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        kv = self.num_kv_heads or self.num_heads
        if self.num_heads % kv:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {kv}")
        return self


class IngestConfig(_Section):
    source: Literal["path", "from_config"] = Field(
        "path",
        description="`path`: a local Hugging Face folder. `from_config`: build a small "
        "random-init model and train a BPE tokenizer offline (quickstart, tests).",
    )
    path: str | None = Field(None, description="Local model folder (config, weights, tokenizer).")
    allow_pickle: bool = Field(
        False, description="Accept pickle weights (*.bin, *.pt). Pickle can run code when loaded."
    )
    trust_remote_code: bool = Field(
        False, description="Accept models whose config needs custom code from the folder."
    )
    chat_template: str | None = Field(
        None,
        description="Jinja chat template to install. Required when the tokenizer has none; "
        "replaces the tokenizer's own when given.",
    )
    from_config: FromConfigModel = Field(
        default_factory=FromConfigModel, description="Model to build when source = from_config."
    )

    @model_validator(mode="after")
    def _path_given(self) -> IngestConfig:
        if self.source == "path" and not self.path:
            raise ValueError("source 'path' needs ingest.path (a local Hugging Face model folder)")
        return self


class SyntheticData(_Section):
    n_examples: int = Field(3000, ge=10, description="Rows to generate.")
    seed: int = Field(1234, ge=0, description="Generator seed (independent of run.seed).")


class DataConfig(_Section):
    path: str | None = Field(
        None,
        description="JSONL, JSON, Parquet file, or a `datasets.save_to_disk` folder. Rows are "
        "`messages` (list of {role, content}) or `prompt`/`completion` strings.",
    )
    synthetic: SyntheticData | None = Field(
        None, description="Generate the quickstart task instead of reading `path`."
    )
    eval_path: str | None = Field(None, description="Held-out file; default: split from `path`.")
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


class _HeldOutSource(_Section):
    """Where a stage's rows come from and how a held-out share is split off."""

    synthetic: SyntheticData | None = Field(
        None, description="Generate quickstart rows instead of reading `path`."
    )
    eval_path: str | None = Field(None, description="Held-out file; default: split from `path`.")
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
        description="JSONL, JSON, Parquet file, or a saved `datasets` folder of pairs: "
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
        description="JSONL, JSON, Parquet file, or a saved `datasets` folder of prompts: "
        "`prompt` as text or a message list ending with a user turn (preference files work as "
        "they are), or `messages` (the prompt is everything before the last assistant turn).",
    )


class TemplateGuard(_Section):
    chat_template: str | None = Field(
        None,
        description="Format this stage's text with another chat template than the one "
        "recorded at SFT. Refused unless allow_template_change is true.",
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
    max_new_tokens: int = Field(32, ge=1, description="Longest response; generation stops at EOS.")
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
        description="Added to the score of a response that never stopped (no EOS within "
        "max_new_tokens); null = no penalty.",
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


_CRON_FIELD = r"[0-9A-Za-z*/,\-?LW#]+"


class ScheduleConfig(_Section):
    """When a served deployment of this recipe runs by itself (`posttrain serve`)."""

    cron: str | None = Field(
        None,
        description="Cron expression (5 fields, e.g. `0 3 * * 1` = Mondays 03:00) in `timezone`.",
        pattern=rf"^\s*{_CRON_FIELD}(\s+{_CRON_FIELD}){{4}}\s*$",
    )
    interval_s: float | None = Field(
        None, ge=60, description="Run every this many seconds (at least 60); instead of cron."
    )
    timezone: str = Field(
        "UTC",
        description="IANA time zone for cron (e.g. Europe/Paris): 03:00 stays 03:00 "
        "across daylight-saving changes.",
    )
    on_new_base: bool = Field(
        False,
        description="Also run when another pipeline's ingest emits `posttrain.base.published`; "
        "the run uses that base checkpoint (ingest.source = path).",
    )
    active: bool = Field(
        True,
        description="False: the schedule is created paused (the deployment still runs "
        "on request and on events).",
    )

    @model_validator(mode="after")
    def _one_kind(self) -> ScheduleConfig:
        if self.cron is not None and self.interval_s is not None:
            raise ValueError("give cron or interval_s, not both")
        return self

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError, OSError):  # OSError: a name too long
            raise ValueError(f"unknown time zone {value[:100]!r} (use an IANA name)") from None
        return value


class GuardConfig(_Section):
    """Numerical guards of the training stages (sft, reward, dpo, ppo, grpo)."""

    max_bad_steps: int = Field(
        3,
        ge=0,
        description="Bad optimizer steps (non-finite loss or gradient norm, or a loss spike) "
        "tolerated within `window`; one more stops the stage with an error. A bad step's update "
        "is skipped either way.",
    )
    window: int = Field(
        50, ge=1, description="How many of the most recent optimizer steps `max_bad_steps` counts."
    )
    loss_spike_k: float | None = Field(
        None,
        gt=0,
        description="Also treat as bad (skip) a step whose loss exceeds mean + k x std of the "
        "last `loss_spike_window` good steps' losses; null = off. When set, it is part of the "
        "training stages' fingerprints (it decides which updates are applied).",
    )
    loss_spike_window: int = Field(
        20, ge=2, description="Good steps' losses the spike test takes its mean and std over."
    )
    loss_spike_min_history: int = Field(
        10,
        ge=2,
        description="Good steps needed before the spike test applies (early losses move fast).",
    )

    @model_validator(mode="after")
    def _reachable(self) -> GuardConfig:
        if self.max_bad_steps >= self.window:
            raise ValueError(
                f"max_bad_steps {self.max_bad_steps} must be below window {self.window}: "
                "the guard could never stop the stage"
            )
        if self.loss_spike_min_history > self.loss_spike_window:
            raise ValueError(
                f"loss_spike_min_history {self.loss_spike_min_history} exceeds "
                f"loss_spike_window {self.loss_spike_window}: the spike test would never apply"
            )
        return self


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
