"""Recipe-section building blocks that several stage kinds share: data sources, LoRA, optimizer,
batch, the training fields every training stage has, the template guard, rollouts and KL, and
the numerical guards of the training stages (`guard`).

Each stage kind's own section lives beside its registration in `posttrain/kinds/<kind>.py`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from posttrain.sections.fields import Execution, Result, _Section
from posttrain.sections.rewards import RewardSpec
from posttrain.sections.served import SERVER_URL_PATTERN, check_served


class SyntheticData(_Section):
    n_examples: int = Result(3000, ge=10, description="Rows to generate.")
    seed: int = Result(1234, ge=0, description="Generator seed (independent of run.seed).")


# The generated tasks (posttrain.data.synthetic, .calculator, .guess, .code_tasks).
SyntheticTask = Literal["quickstart", "calculator", "guess", "code"]
# `batch.by_tokens`: tokens per forward, "auto" (resolved at stage start:
# posttrain.runtime.token_budget), or None (micro_batch_size rows per forward).
TokenBudgetField = Annotated[int, Field(ge=1)] | Literal["auto"] | None


class SFTSyntheticData(SyntheticData):
    task: SyntheticTask = Result(
        "quickstart",
        description="`quickstart`: the five one-line skills. `calculator`: tool-use traces (a "
        "two-digit sum, difference or product; a call to `add`/`subtract`/`multiply` of "
        "recipes/calculator.py, its result, the number as the answer) with `tools` and "
        "`answer` columns; needs a template with tools (`ingest.from_config.template: "
        "chatml_tools`). `guess`: played number games (recipes/guess_number.py's rules), each "
        "guess a random one the 'higher'/'lower' answers so far leave. `code`: requests for a "
        "tiny Python function (`Write a function solve(x) that returns x plus 5.`) answered "
        "by the program in a ```python block; only combinations RL prompts never use.",
    )


class PromptSyntheticData(SyntheticData):
    task: SyntheticTask = Result(
        "quickstart",
        description="`quickstart`: the five one-line skills with their `answer`. `calculator`: "
        "the calculator traces' system turn and question (`What is 37 + 45?`) with their "
        "`answer`; the tools are the stage's `rollout.tools`. `guess`: a number game's "
        "instructions with a `target` column, for an environment such as "
        "recipes/guess_number.py. `code`: a tiny-function request with three asserts in "
        "`test_list` for `posttrain.rewards.code:code_tests`; distinct combinations SFT's "
        "`code` rows never hold (the held-out ones are new to both stages).",
    )


class DataSourceFields(_Section):
    """How `path` / `eval_path` are read when they are hub dataset ids, and column renames."""

    split: str = Result("train", min_length=1, description="Hub datasets: the split of `path`.")
    eval_split: str = Result(
        "test", min_length=1, description="Hub datasets: the split of `eval_path`."
    )
    revision: str = Result(
        "main",
        min_length=1,
        description="Hub datasets: branch, tag or commit sha; the commit it resolves to is part "
        "of the fingerprint and the manifest.",
    )
    subset: str | None = Result(
        None, description="Hub datasets: the configuration (subset) name, when it has several."
    )
    columns: dict[str, str] = Result(
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

    @model_validator(mode="after")
    def _one_source(self) -> DataSourceFields:
        # Every data section reads `path` or generates `synthetic` rows.
        if (getattr(self, "path", None) is None) == (getattr(self, "synthetic", None) is None):
            raise ValueError("give exactly one of data.path or data.synthetic")
        return self


class DataConfig(DataSourceFields):
    path: str | None = Result(
        None,
        source="data",
        description="JSONL, JSON, Parquet file, a `datasets.save_to_disk` folder, or a hub "
        "dataset id `org/name`. Rows are `messages` (list of {role, content}), `prompt`/"
        "`completion` (strings or message lists), ShareGPT `conversations` (from/value) or "
        "Alpaca `instruction`/`input`/`output`.",
    )
    synthetic: SFTSyntheticData | None = Field(
        None, description="Generate a task's rows (`task`) instead of reading `path`."
    )
    eval_path: str | None = Result(
        None,
        source="data",
        description="Held-out file or hub dataset id (its `eval_split`); default: split from `path`.",
    )
    eval_fraction: float = Result(
        0.05, ge=0.0, lt=1.0, description="Held-out share when there is no eval_path."
    )
    max_seq_len: int = Result(256, ge=8, description="Tokens per sequence after the chat template.")
    on_too_long: Literal["truncate", "drop"] = Result(
        "truncate", description="Rows longer than max_seq_len: cut at the right, or drop (counted)."
    )


class LoraConfig(_Section):
    r: int = Result(8, ge=1, description="LoRA rank.")
    alpha: float = Result(16, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Result(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: list[str] | Literal["all-linear"] = Result(
        "all-linear",
        description="Module names to adapt, or `all-linear` (every linear but the head).",
    )


class OptimConfig(_Section):
    lr: float = Result(1e-3, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Result(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Result((0.9, 0.999), description="AdamW betas.")
    eps: float = Result(1e-8, gt=0, description="AdamW epsilon.")
    schedule: Literal["cosine", "linear", "constant"] = Result("cosine", description="LR decay.")
    warmup_steps: int = Result(0, ge=0, description="Linear warm-up optimizer steps.")
    min_lr_ratio: float = Result(0.1, ge=0, le=1, description="Final LR as a fraction of lr.")
    max_grad_norm: float | None = Result(1.0, gt=0, description="Clip gradient norm; null = off.")


class BatchConfig(_Section):
    """Give any two of the three; the third is derived. All three must agree:
    global_batch_size = micro_batch_size x grad_accum_steps x data-parallel size."""

    micro_batch_size: int | None = Execution(
        None, ge=1, description="Sequences per device per step."
    )
    grad_accum_steps: int | None = Execution(
        None, ge=1, description="Micro-batches per optimizer step."
    )
    global_batch_size: int | None = Result(None, ge=1, description="Sequences per optimizer step.")
    padding_free: bool = Execution(
        True,
        description="SFT, reward, DPO, ORPO, KTO: lay each micro-batch's rows end to end in one "
        "sequence (position ids restart per row, attention confined to each row) instead of "
        "padding them to the longest: no compute on padding, same results. Models whose "
        "attention cannot (soft-capped logits, eager attention) fall back to padding, said in "
        "the log.",
    )
    by_tokens: TokenBudgetField = Execution(
        None,
        description="SFT, reward, DPO, ORPO, KTO: regroup each rank's rows of a step into "
        "micro-batches of at most this many tokens (longest first) instead of "
        "micro_batch_size rows each: the same rows and loss per step, as few forwards as fit "
        "(short rows share one, a long row goes alone), bounded activation memory. A pair "
        "counts both replies. `auto`: the largest multiple of 256 the memory pre-flight "
        "estimates to fit the device (CUDA; on CPU the rows' own micro-batches), in the log, "
        "the start record and the summary beside the measured peak.",
    )


class RolloutBatchConfig(_Section):
    """Give any two of the three; the third is derived. All three must agree:
    global_batch_size = micro_batch_size x grad_accum_steps x data-parallel size. In online RL
    one update takes micro x accum sequences of a rank's own rollout, and the held-out and
    generation batches follow micro_batch_size: every field shapes the result."""

    micro_batch_size: int | None = Result(None, ge=1, description="Sequences per device per step.")
    grad_accum_steps: int | None = Result(
        None, ge=1, description="Micro-batches per optimizer step."
    )
    global_batch_size: int | None = Result(None, ge=1, description="Sequences per optimizer step.")
    padding_free: bool = Execution(
        True,
        description="Lay the rows of each scoring and update forward end to end in one sequence "
        "(position ids restart per row, attention confined to each row) instead of padding "
        "prompts on the left and responses on the right to the widest: no compute on padding, "
        "the same results up to rounding. Models whose attention cannot (soft-capped logits, "
        "eager attention) fall back to padding, said in the log.",
    )
    by_tokens: TokenBudgetField = Execution(
        None,
        description="The scoring forwards of a rollout and the update's forwards (every RL "
        "kind) take at most this many tokens (prompt + response) each, rows regrouped longest "
        "first, instead of micro_batch_size rows each (online DPO: a pair's two rows share a "
        "forward and count together): the same rows per update and the same loss weights, so "
        "the same scores and update. `auto`: as the SFT batch's.",
    )


class TrainingSection(_Section):
    """Fields every training stage shares."""

    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer and schedule.")
    batch: BatchConfig = Field(
        default_factory=lambda: BatchConfig(micro_batch_size=8, grad_accum_steps=1),
        description=BatchConfig.__doc__,
    )
    epochs: float = Result(
        1.0, gt=0, description="Passes over the training set (fractions allowed)."
    )
    max_steps: int | None = Result(None, ge=1, description="Stop after this many optimizer steps.")
    activation_checkpointing: bool = Execution(
        False,
        description="Recompute each block's activations in backward: less memory, ~30% slower.",
    )
    checkpoint_every: int = Execution(
        50, ge=0, description="Save a resumable checkpoint every N steps."
    )
    keep_checkpoints: int = Execution(2, ge=1, description="Complete checkpoints kept on disk.")
    log_every: int = Execution(1, ge=1, description="Write metrics.jsonl every N optimizer steps.")
    # A result: the held-out records it adds are part of the artifact's metrics.jsonl.
    eval_every: int = Result(
        0,
        ge=0,
        description="Held-out figures every N optimizer steps as well as at the start and the "
        "end (0 = start and end only): one point per evaluation in the curves.",
    )


class _HeldOutSource(DataSourceFields):
    """Where a stage's rows come from and how a held-out share is split off."""

    synthetic: SyntheticData | None = Field(
        None, description="Generate quickstart rows instead of reading `path`."
    )
    eval_path: str | None = Result(
        None,
        source="data",
        description="Held-out file or hub dataset id (its `eval_split`); default: split from `path`.",
    )
    eval_fraction: float = Result(0.1, ge=0.0, lt=1.0, description="Held-out share of rows.")
    max_prompt_len: int = Result(
        128, ge=1, description="Longer prompts keep their last max_prompt_len tokens."
    )
    on_invalid: Literal["error", "skip"] = Result(
        "error",
        description="A bad row (missing/empty field, wrong type, no room for a response): stop "
        "naming file and row, or skip it and count it by reason.",
    )


class PreferenceDataConfig(_HeldOutSource):
    path: str | None = Result(
        None,
        source="data",
        description="JSONL, JSON, Parquet file, a saved `datasets` folder or a hub dataset id "
        "`org/name` of pairs: "
        "`prompt`/`chosen`/`rejected` as text or message lists, or `chosen`/`rejected` full "
        "conversations with the prompt implicit in their shared prefix.",
    )
    max_seq_len: int = Result(256, ge=8, description="Tokens per prompt + response.")

    @model_validator(mode="after")
    def _room_for_response(self) -> PreferenceDataConfig:
        if self.max_prompt_len >= self.max_seq_len:
            raise ValueError(
                f"max_prompt_len {self.max_prompt_len} leaves no room for a response "
                f"within max_seq_len {self.max_seq_len}"
            )
        return self


class PromptDataConfig(_HeldOutSource):
    path: str | None = Result(
        None,
        source="data",
        description="JSONL, JSON, Parquet file, a saved `datasets` folder or a hub dataset id "
        "`org/name` of prompts: "
        "`prompt` as text or a message list ending with a user turn (preference files work as "
        "they are), or `messages` (the prompt is everything before the last assistant turn).",
    )
    synthetic: PromptSyntheticData | None = Field(
        None, description="Generate a task's prompts (`task`) instead of reading `path`."
    )


class TemplateGuard(_Section):
    chat_template: str | None = Result(
        None,
        source="template",
        description="Format this stage's text with another chat template than the one "
        "recorded at SFT (Jinja text or a template file's path). Refused unless "
        "allow_template_change is true.",
    )
    allow_template_change: bool = Result(
        False,
        description="Accept a template that differs from the one the policy was "
        "fine-tuned with (template mismatches silently cost reward accuracy).",
    )


class RolloutServerConfig(_Section):
    """An OpenAI-compatible server that samples the rollouts (`posttrain.serving`): one that
    already runs (`url`), or one the stage starts and stops (`command`)."""

    api: Literal["transformers", "vllm", "sglang"] = Result(
        "transformers",
        description="What the server is, which decides how requests are written and how it "
        "gets weights. `transformers` (`transformers serve`): text prompts, text answers "
        "(re-tokenised), a new model folder per policy version loaded by `/load_model`. "
        "`vllm` (`vllm serve --enable-lora`): token-id prompts, the sampled ids returned, "
        "LoRA adapters loaded by name (`/v1/load_lora_adapter`). `sglang` (native "
        "`/generate`): token ids both ways, LoRA adapters (`/load_lora_adapter`) or merged "
        "weights (`/update_weights_from_disk`).",
    )
    weights: Literal["adapter", "merged"] = Result(
        "adapter",
        description="What is synced after each update: the policy's LoRA `adapter` (small; the "
        "server applies it to the base it holds), or the base with the adapter `merged` into "
        "it (full weights each update; `transformers` and `sglang` only).",
    )
    url: str | None = Execution(
        None,
        pattern=SERVER_URL_PATTERN,
        description="A server that already runs (`http://host:port`): the stage syncs weights "
        "to it and never stops it. It must read the stage's folders (the same filesystem).",
    )
    command: str | list[str] | None = Execution(
        None,
        description="The command that starts a server for the stage (one string, split like a "
        "shell would, or a list): e.g. `transformers serve --host {host} --port {port} "
        "--continuous-batching`. `{host}`, `{port}` (a free port unless `port` is set) and "
        "`{model}` (a folder holding the stage's base model and tokenizer) are filled in. The "
        "stage's rank 0 starts it in a session of its own, waits for `health_path`, and stops "
        "it when the stage ends, however it ends.",
    )
    host: str = Execution(
        "127.0.0.1", min_length=1, description="`command`: the address the server listens on."
    )
    port: int = Execution(
        0, ge=0, le=65535, description="`command`: the server's port; 0 = a free one."
    )
    health_path: str = Execution(
        "/health", pattern=r"^/", description="GET path that answers 200 once the server is up."
    )
    startup_timeout_s: float = Execution(
        900.0, gt=0, description="`command`: seconds the server may take to become healthy."
    )
    request_timeout_s: float = Execution(
        300.0,
        gt=0,
        description="Seconds a request (or a weight sync) may go unanswered before the stage "
        "fails, naming the server and the last thing it said.",
    )
    max_concurrency: int = Execution(
        64, ge=1, description="Requests in flight at once per rank (one prompt per request)."
    )
    env: dict[str, str] = Execution(
        default_factory=dict, description="`command`: extra environment variables."
    )

    @model_validator(mode="after")
    def _consistent(self) -> RolloutServerConfig:
        check_served("rollout.server", self.url, self.command)
        if self.weights == "merged" and self.api == "vllm":
            raise ValueError(
                "rollout.server.weights: vllm takes LoRA adapters by name; `merged` is for "
                "`transformers` and `sglang`"
            )
        return self


class RolloutConfig(_Section):
    prompts_per_step: int = Result(
        16, ge=1, description="Prompts per rollout, over all ranks (a multiple of the ranks)."
    )
    samples_per_prompt: int = Result(
        1, ge=1, description="Responses sampled per prompt (GRPO's group size; needs >= 2 there)."
    )
    max_new_tokens: int = Result(
        32,
        ge=1,
        description="Longest response; generation stops earlier at a stop token: the "
        "tokenizer's EOS, the model's generation_config eos ids, or the chat template's "
        "end-of-turn token when it is one token.",
    )
    temperature: float = Result(1.0, gt=0, description="Sampling temperature.")
    top_k: int | None = Result(None, ge=1, description="Top-k filter; null = off.")
    top_p: float | None = Result(None, gt=0, le=1, description="Nucleus filter; null = off.")
    generation_batch_size: int | None = Result(
        None, ge=1, description="Sequences per `generate` call on a rank; null = all at once."
    )
    keep_gathered: bool = Execution(
        True,
        description="Keep the sharded weights gathered for the whole decode loop (one all-gather "
        "per rollout, full-model memory while generating) instead of gathering every block at "
        "every new token.",
    )
    engine: Literal["hf", "fast", "server"] = Result(
        "hf",
        description="Rollout engine (`posttrain.rl.rollout.engine`): `hf` decodes in process "
        "on the sharded role model; `fast` decodes in process from a plain copy of the policy "
        "with its LoRA merged (bf16 on CUDA, fp32 on CPU; every rank holds the whole copy), "
        "refreshed after every update and probed against the trainer "
        "(`rollout.sampler_probe_tolerance`), on CUDA with a static KV cache and a compiled "
        "decode step (`rollout.compile_decode`), on CPU with the dynamic cache; `server` samples from an OpenAI-compatible "
        "server (`rollout.server`: vLLM, SGLang or `transformers serve`) that gets the "
        "policy's weights after every update (`posttrain.serving`).",
    )
    # Execution, as infra.compile: the compiled step computes eager's logits to float rounding.
    compile_decode: bool = Execution(
        True,
        description="`fast` engine on CUDA: transformers' `generate` compiles the one-token "
        "decode step (torch.compile mode reduce-overhead: CUDA graphs); false decodes "
        "eagerly with the dynamic cache. No effect on CPU.",
    )
    sampler_probe_tolerance: float | None = Execution(
        None,
        gt=0,
        description="`fast` engine: after every weight refresh (and at the start) the copy "
        "and the trainer score a fixed token probe; `server` engine (vLLM, SGLang; temperature "
        "1 without top-k/top-p): the server's log-probs of the tokens it sampled are held "
        "against the trainer's. The stage fails (`StaleSampler`) when they differ by more than "
        "this many nats per token on average. null = by the sampler's dtype: 0.001 fp32, 0.05 "
        "bf16 (a server: 0.05). The figures are logged as `sampler_probe_mean` / "
        "`sampler_probe_max`.",
    )
    # A result as a whole only in that it exists with `engine: server`; its own fields decide.
    server: RolloutServerConfig | None = Result(
        None, description="`engine: server`: the server, and how it gets the weights."
    )
    max_staleness: Literal[0, 1] = Result(
        0,
        description="`engine: server`: 0 = each rollout is sampled by the weights it trains "
        "(synchronous); 1 = the next rollout is sampled while the current update trains (one "
        "update behind), the update then weighting each token by min(p_now / p_sampled, "
        "importance_weight_cap) (truncated importance sampling against the weights that "
        "sampled it).",
    )
    importance_weight_cap: float = Result(
        2.0,
        ge=1.0,
        description="max_staleness 1: the truncation of the importance weight p_now / p_sampled "
        "of a token sampled one update behind (its share above the cap is logged as "
        "`is_clip_frac`).",
    )
    # A result, although the tokens are the same up to ties: the logits of a smaller batch may
    # flip a near-tie, and a reused artifact must be exactly what the recipe asks for.
    drop_finished: bool = Result(
        False,
        description="`hf` engine: decode with a loop that drops a response from the batch (and "
        "its KV cache) once it emits a stop token, instead of transformers' `generate`, which "
        "steps every row until the longest ends. Same tokens for the same seed (up to "
        "floating-point ties); faster when response lengths vary.",
    )
    tools: list[str] = Result(
        default_factory=list,
        source="code",
        description="Tools the policy may call in multi-turn episodes: `module:function` "
        "(`<module>.py` in the recipe's folder or `run.allowed_paths`; served runs: the "
        "worker's reward folders) or `file.py:function`. Plain functions with type hints and "
        "a Google-style docstring, described to the chat template through `tools=`; a call "
        "that raises or times out is told to the model as an error and counted.",
    )
    environment: str | dict[str, str] | None = Result(
        None,
        source="code",
        description="An environment class `module:Class`, one instance per episode (TRL's "
        "`environment_factory` shape): `reset(**row_columns) -> str | None` (appended to the "
        "last user message), its public methods are the episode's tools, optional "
        "`get_reward() -> float` scores the finished episode (the stage's `rewards` then may "
        "be empty; functions taking `environments` get the episodes' instances); or a gym-like "
        "`step(assistant_message) -> (observation messages, reward, done)`. Several classes: "
        "a mapping `{name: module:Class}`, each prompt row naming its own in an `environment` "
        "column (TRL's multi-environment shape; the column is not passed to `reset`); a row's "
        "episode sees only its class's tools and gets only its class's reward.",
    )
    max_turns: int = Result(
        4,
        ge=1,
        description="Episodes (tools or environment): most assistant turns; an episode also "
        "ends with a reply that calls no tool, or at max_episode_tokens.",
    )
    max_episode_tokens: int = Result(
        512,
        ge=2,
        description="Episodes: most tokens after the prompt, generated and rendered (tool "
        "results, the template's turns); an episode that reaches it ends truncated.",
    )
    tool_timeout_s: float = Result(
        10.0,
        gt=0,
        description="Episodes: seconds a turn's tool calls may take; a call still running then "
        "is told to the model as timed out (`tool_timeouts`).",
    )
    episode_cache: bool = Result(
        True,
        description="Episodes, `hf` engine: keep each row's KV cache from one turn to the "
        "next, so a turn prefills only what was appended (the tool turn, the next generation "
        "prompt) instead of the whole conversation again. Costs the memory of every live "
        "episode's cache between turns (2 x layers x kv_heads x head_dim x bytes per token). "
        "Same tokens as without (up to floating-point ties); only for models whose layers all "
        "attend to the whole sequence (others re-prefill).",
    )
    mask_truncated: bool = Result(
        False,
        description="Episodes cut by max_episode_tokens or max_new_tokens (truncated) train "
        "nothing: their tokens leave the loss (their rewards still count in their group).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> RolloutConfig:
        if self.engine == "server" and self.server is None:
            raise ValueError(
                "rollout.server: engine `server` needs a server: `url` of one that runs, or "
                "`command` to start one"
            )
        if self.engine != "server" and self.server is not None:
            raise ValueError(
                f"rollout.server is read only by `engine: server` (engine is {self.engine!r})"
            )
        if self.drop_finished and self.engine == "fast":
            raise ValueError(
                "rollout.drop_finished: the `fast` engine decodes on a GPU with a static KV "
                "cache and a compiled step of fixed shape, where finished rows cost nothing "
                "extra to keep; set drop_finished: false (or engine: hf)"
            )
        if self.max_staleness and self.engine != "server":
            raise ValueError(
                "rollout.max_staleness: 1 needs `engine: server`: the in-process engine "
                "samples with the weights it trains, so it cannot sample while they train"
            )
        if self.tools and self.environment:
            raise ValueError(
                "give rollout.tools or rollout.environment, not both: an environment's public "
                "methods are its episodes' tools"
            )
        if isinstance(self.environment, dict):
            if not self.environment:
                raise ValueError("rollout.environment: an empty mapping names no environment")
            if bad := [k for k in self.environment if not k.strip()]:
                raise ValueError(f"rollout.environment: environment names must not be blank {bad}")
        return self

    @property
    def environments(self) -> dict[str, str]:
        """Each environment class by name ({} without): a mapping's own names; a single class
        goes by ``""`` (every row plays it)."""
        env = self.environment
        return {} if env is None else dict(env) if isinstance(env, dict) else {"": env}

    @property
    def episodes(self) -> bool:
        """Whether rollouts are multi-turn episodes (`posttrain.rl.rollout.multiturn`)."""
        return bool(self.tools) or self.environment is not None


class KLConfig(_Section):
    estimator: Literal["k1", "k2", "k3"] = Result(
        "k1",
        description="Per-token KL(policy || reference) estimate: k1 = log-ratio (can be "
        "negative on a sample), k2 = half its square, k3 = exp(-log-ratio) - 1 + log-ratio "
        "(unbiased, never negative). The penalty, each step's `kl`, the held-out `eval_kl`, "
        "`max_kl` and the adaptive `target` all use it.",
    )
    placement: Literal["auto", "reward", "loss"] = Result(
        "auto",
        description="`reward`: subtract coef x KL from each token's reward (PPO); `loss`: add "
        "coef x KL to the loss (GRPO). `auto` = the algorithm's usual place.",
    )
    coef: float = Result(0.05, ge=0, description="KL coefficient (initial value when adaptive).")
    adaptive: bool = Result(
        False, description="Adapt the coefficient towards `target` (proportional controller)."
    )
    target: float = Result(
        6.0,
        gt=0,
        description="Adaptive target: KL per sequence (sum over its tokens), by `estimator`.",
    )
    horizon: int = Result(10000, ge=1, description="Adaptive controller horizon, in sequences.")


class OnlineRLConfig(TrainingSection, TemplateGuard):
    """What PPO and GRPO share: prompts, rollouts, scoring, KL, clipped updates, gates."""

    batch: RolloutBatchConfig = Field(
        default_factory=lambda: RolloutBatchConfig(micro_batch_size=8, grad_accum_steps=1),
        description=RolloutBatchConfig.__doc__,
    )
    data: PromptDataConfig = Field(description="Prompts to roll out from.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation.")
    kl: KLConfig = Field(default_factory=KLConfig, description="KL penalty against the reference.")
    update_epochs: int = Result(
        1, ge=1, description="Passes over each rollout batch; `batch` sizes one update."
    )
    clip_range: float = Result(
        0.2,
        gt=0,
        description="Policy ratio clip (1 +- clip_range; the low side with clip_range_high).",
    )
    clip_range_high: float | None = Result(
        None,
        gt=0,
        description="Upper side of the ratio clip (1 + clip_range_high; DAPO's clip-higher lets "
        "unlikely tokens with positive advantage grow); null = clip_range.",
    )
    loss_aggregation: Literal["token_mean", "sequence_mean", "token_sum_norm"] | None = Result(
        None,
        description="How per-token losses of a minibatch become one number: `token_mean` = "
        "over all its tokens (every token counts the same); `sequence_mean` = each response's "
        "token mean, averaged over responses; `token_sum_norm` = each response's token sum over "
        "rollout.max_new_tokens, averaged over responses (Dr. GRPO, no length bias). null = the "
        "algorithm's default (token_mean for ppo).",
    )
    dynamic_sampling: bool = Result(
        False,
        description="DAPO's dynamic sampling: drop prompt groups whose samples all score the "
        "same (zero advantage) and sample more, up to max_sampling_rounds rollouts, to fill "
        "the batch. Needs rollout.samples_per_prompt >= 2.",
    )
    max_sampling_rounds: int = Result(
        3, ge=1, description="Dynamic sampling: most generation rounds per rollout step."
    )
    entropy_coef: float = Result(0.0, ge=0, description="Entropy bonus weight.")
    missing_eos_penalty: float | None = Result(
        None,
        le=0,
        description="Added to the score of a response that never stopped (no stop token - EOS, "
        "generation_config eos id or end-of-turn token - within max_new_tokens); null = no "
        "penalty.",
    )
    rewards: list[RewardSpec] = Field(
        default_factory=list,
        description="Reward functions (verifiers) scoring each response, summed with their "
        "weights: e.g. `[{fn: posttrain.rewards.match:exact_match}]` against the prompt rows' "
        "`answer` column. With rewards, a reward model is used only when `reward_model` names "
        "one (its score then joins the sum with `reward_model_weight`); without, the stage "
        "needs one.",
    )
    reward_model_weight: float = Result(
        1.0, description="Weight of the reward model's score in the summed reward."
    )

    eval_prompts: int = Result(
        32, ge=1, description="Held-out prompts scored for the final reward and KL."
    )
    eval_every: int = Result(0, ge=0, description="Also evaluate every N rollouts; 0 = end only.")
    max_kl: float | None = Result(
        None,
        gt=0,
        description="Quality gate: held-out KL(policy || reference) per response, by "
        "kl.estimator, above this stops the pipeline.",
    )
    min_reward_gain: float | None = Result(
        None,
        description="Quality gate: held-out mean reward minus the starting policy's (the "
        "reference's) below this stops the pipeline.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> OnlineRLConfig:
        labels = [r.label for r in self.rewards]
        if len(set(labels)) != len(labels):
            raise ValueError(f"rewards: two functions share a label ({labels}); set `name`")
        r = self.rollout
        if r.tools and not self.rewards:
            raise ValueError(
                "rollout.tools: episodes are scored by reward functions or an environment's "
                "get_reward; list functions in `rewards` (they receive the whole episode's "
                "messages) or use rollout.environment"
            )
        if r.episodes and getattr(self, "reward_model", None) is not None:
            raise ValueError(
                "reward_model: multi-turn episodes are scored by `rewards` and the environment, "
                "not by a reward model"
            )
        if self.dynamic_sampling and self.rollout.samples_per_prompt < 2:
            raise ValueError(
                "dynamic_sampling needs rollout.samples_per_prompt >= 2: it keeps the prompts "
                "whose samples score differently"
            )
        return self


class SamplingConfig(_Section):
    name: str = Result(description="Label used in reports.")
    strategy: Literal["greedy", "sample", "beam"] = Result("greedy", description="Decoding.")
    temperature: float = Result(1.0, gt=0, description="Sampling temperature (sample only).")
    top_k: int | None = Result(None, ge=1, description="Top-k filter (sample only).")
    top_p: float | None = Result(None, gt=0, le=1, description="Nucleus filter (sample only).")
    num_beams: int = Result(4, ge=2, description="Beams (beam only).")
    max_new_tokens: int = Result(48, ge=1, description="Longest generation.")


class GuardConfig(_Section):
    """Numerical guards of the training stages (sft, reward, dpo, ppo, grpo)."""

    max_bad_steps: int = Execution(
        3,
        ge=0,
        description="Bad optimizer steps (non-finite loss or gradient norm, or a loss spike) "
        "tolerated within `window`; one more stops the stage with an error. A bad step's update "
        "is skipped either way.",
    )
    window: int = Execution(
        50, ge=1, description="How many of the most recent optimizer steps `max_bad_steps` counts."
    )
    loss_spike_k: float | None = Result(
        None,
        gt=0,
        description="Also treat as bad (skip) a step whose loss exceeds mean + k x std of the "
        "last `loss_spike_window` good steps' losses; null = off. When set, it is part of the "
        "training stages' fingerprints (it decides which updates are applied).",
    )
    loss_spike_window: int = Result(
        20, ge=2, description="Good steps' losses the spike test takes its mean and std over."
    )
    loss_spike_min_history: int = Result(
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
