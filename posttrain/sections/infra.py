"""The recipe's `infra` section: devices, processes, precision, timeouts, fault handling and the
engine that runs the stages (its Slurm and Kubernetes sub-sections live beside it)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from posttrain.sections.fields import Execution, Result, _Section
from posttrain.sections.kubernetes import KubernetesConfig
from posttrain.sections.slurm import SlurmConfig

Precision = Literal["auto", "fp32", "bf16", "fp16"]


class StageTimeouts(_Section):
    """Seconds before a stage is killed. `ingest`, `evaluate`, `export` and `head_to_head` have
    fields of their own; every graph stage gets `train` unless a key names it (`dpo: 7200`,
    `dpo_round2: 3600`)."""

    # Keys naming graph stages are checked against the recipe's stages by the Recipe.
    model_config = ConfigDict(extra="allow", validate_assignment=True)

    ingest: float = Field(1800, gt=0, description="Seconds before the ingest stage is killed.")
    train: float = Field(
        6 * 3600,
        gt=0,
        description="Seconds before a graph stage (sft, reward, dpo ...) is killed, unless a key "
        "named after the stage sets its own.",
    )
    evaluate: float = Field(3600, gt=0, description="Seconds before the evaluate stage is killed.")
    export: float = Field(3600, gt=0, description="Seconds before the export stage is killed.")
    head_to_head: float = Field(
        3600,
        gt=0,
        description="Seconds before the promotion gate's head-to-head against the champion "
        "is killed (the run still completes; the candidate is not promoted).",
    )

    @model_validator(mode="after")
    def _positive(self) -> StageTimeouts:
        for key, value in (self.model_extra or {}).items():
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{key}: a stage timeout is a positive number of seconds")
        return self

    def for_stage(self, name: str, kind: str | None = None) -> float:
        """The limit of stage `name` (of `kind`): its own key, a fixed stage's field (an
        extra base: ingest's), or `train`."""
        extra = self.model_extra or {}
        if name in extra:
            return float(extra[name])
        fields = type(self).model_fields
        key = name if name in fields else kind if kind in fields else None
        return float(getattr(self, key) if key is not None else self.train)


class InfraConfig(_Section):
    device: Literal["auto", "cpu", "cuda"] = Result(
        "auto", description="`auto` picks CUDA when a GPU is visible, else CPU."
    )
    devices_per_node: int | Literal["auto"] = Execution(
        1,
        description="Processes per node for distributed stages (one per GPU). `auto` = all visible "
        "GPUs, or 1 on CPU. Data-parallel size = nnodes x devices_per_node.",
    )
    parallel_stages: Annotated[int, Field(ge=1)] | Literal["auto"] = Execution(
        "auto",
        description="Graph stages that may run at once when neither needs the other's output "
        "(a reward model beside an SFT, two DPO branches). Each gets its own devices_per_node "
        "GPUs (CUDA_VISIBLE_DEVICES), so N x devices_per_node must fit the visible GPUs. "
        "`auto` = as many as the visible GPUs hold on one node, 1 on CPU or across nodes "
        "(ranks of concurrent stages on CPU share the cores).",
    )
    nnodes: int = Execution(
        1,
        ge=1,
        description="Machines a distributed stage spans. Above 1, every node runs the stage's "
        "torchrun agent with its own node rank (POSTTRAIN_NODE_RANK) and they meet at "
        "`rdzv_endpoint`.",
    )
    layout: Literal["fsdp", "hsdp", "ddp"] = Execution(
        "fsdp",
        description="Data-parallel layout: `fsdp` shards every model across all ranks; `hsdp` "
        "replicates across nodes and shards within a node (a 2-D mesh: inter-node traffic is "
        "only the gradient all-reduce); `ddp` replicates everything (no sharding).",
    )
    sequence_parallel: int = Execution(
        1,
        ge=1,
        description="Devices that split each sequence (Ulysses sequence parallelism): the "
        "nnodes x devices_per_node ranks form a 2-D mesh of data-parallel groups x "
        "`sequence_parallel` ranks; the ranks of one group take the same rows, each holds "
        "1/N of every micro-batch's packed tokens and attention exchanges them for heads "
        "(all-to-all). Parameters stay sharded over all ranks (layout fsdp). Data-parallel "
        "size = nnodes x devices_per_node / sequence_parallel, so global_batch_size = "
        "micro_batch_size x grad_accum_steps x that. N must divide the devices and the base "
        "model's attention heads and needs padding-free batches; the pre-flight counts "
        "activations at 1/N of the sequence. Every training stage splits its sequences; an RL "
        "stage needs rollout.engine hf or fast and no episodes (tools or an environment).",
    )
    rdzv_endpoint: str | None = Execution(
        None,
        description="host:port of the c10d rendezvous (the node-rank-0 machine) when nnodes > 1 "
        "and the launcher is local; slurm and kubernetes put it on the job's first node.",
        pattern=r"^[A-Za-z0-9_.\[\]:-]+:[0-9]{1,5}$",
    )
    precision: Precision = Result(
        "auto",
        description="`auto` = bf16 on a GPU that supports it, fp32 on CPU (CPU bf16 matmul is ~100x "
        "slower than fp32). fp16 needs `loss_scaling: true`.",
    )
    loss_scaling: bool = Result(
        False,
        training_only=True,
        description="Dynamic loss scaling; required for fp16, whose losses otherwise go NaN.",
    )
    attention: Literal["auto", "sdpa", "flash_attention_2", "eager"] = Execution(
        "auto",
        description="Attention kernel every model of the run loads with (transformers' "
        "`attn_implementation`): `auto` = torch SDPA (flash or memory-efficient kernels on GPU); "
        "`flash_attention_2` needs the flash-attn package and a bf16/fp16 GPU.",
    )
    compile: Literal["auto"] | bool = Execution(
        "auto",
        description="Compile each decoder block of a training stage's model with torch.compile "
        "(regional compilation, after LoRA, sharding and activation checkpointing): one graph "
        "serves every block and every packed length, so only a new kind of batch (one row or "
        "several, packed or padded) compiles again. `auto` = on for CUDA, off on CPU. The first "
        "step of each kind pays the compile (`compile_s` in metrics.jsonl, apart from the step's "
        "run time). Losses and gradients equal eager's to float rounding, so the setting is left "
        "out of the fingerprint.",
    )
    logits_head: Literal["auto", "chunked", "compiled"] = Execution(
        "auto",
        description="How the chunked LM head (`logits_chunk_tokens` > 0) computes each chunk of "
        "a training stage's log-probs, entropies and their gradients: `chunked` = eager kernels "
        "over [chunk, vocab] fp32 buffers (the reference); `compiled` = each chunk's forward and "
        "backward through torch.compile, which fuses the upcast, transform, log-softmax, "
        "entropy and gradient into a few passes that write no [chunk, vocab] fp32 buffer (a bf16 "
        "model's logits and gradient stay bf16 in memory, the arithmetic fp32). One graph for "
        "every length. `auto` = compiled where the stage compiles its decoder blocks "
        "(`compile`: CUDA by default), chunked otherwise. Results equal to float rounding, so "
        "the setting is left out of the fingerprint.",
    )
    base_dtype: Literal["auto", "fp32", "bf16"] = Result(
        "auto",
        training_only=True,
        description="dtype the frozen base weights are held in (trainable parts - LoRA, heads, "
        "critic - always keep fp32 masters). `auto` = bf16 when the run computes in bf16 on a "
        "GPU (precision bf16), else fp32 (CPU bf16 matmul is ~100x slower). A bf16 base "
        "computes in bf16 whatever `precision` says; it is refused with fp16.",
    )
    shard_single_device: bool = Execution(
        False,
        description="Wrap models with FSDP2 also when a stage runs on one device. Off: one device "
        "trains the plain module (FSDP2 there shards nothing but costs per-block hooks and "
        "DTensor dispatch: 5-7% of a CPU LoRA step, more on a GPU); bf16/fp16 compute then runs "
        "under autocast. On: to exercise the sharded code path (DTensor parameters, FSDP mixed "
        "precision) on a single device, e.g. to debug it without a second one.",
    )
    threads_per_rank: int | None = Execution(
        None, ge=1, description="torch threads per process; default = CPU cores / processes."
    )
    logits_chunk_tokens: int = Execution(
        2048,
        ge=0,
        description="Tokens per pass through the LM head when computing log-probs and losses "
        "(SFT and held-out NLL, DPO policy and reference, PPO/GRPO scoring and update): only "
        "labelled positions are scored, this many at a time, so full-vocabulary fp32 logits "
        "([batch, tokens, vocab]: 10 GB for 8 x 2048 tokens of a 152k vocabulary) never exist; "
        "peak is a few [chunk, vocab] fp32 buffers (2048 x 152k x 4 B = 1.2 GB each). Same "
        "results as unchunked (to ~1e-6), also for models whose head output is transformed into "
        "logits (Gemma-2/3 soft-capping, Cohere's logit_scale, Granite's logits_scaling are "
        "applied per chunk; another architecture setting one of these is refused). 0 = "
        "unchunked: full logits, needed for an adapter on the LM head.",
    )
    memory_preflight: Literal["refuse", "warn", "off"] = Execution(
        "refuse",
        description="Before a training stage loads anything, estimate its per-device memory "
        "(weights by role and sharding, gradients and AdamW state of the trainable parts, "
        "activations, logits, generation KV cache) against the device's. `refuse`: a stage that "
        "cannot fit stops with the numbers and the fixes; `warn`: log them and run; `off`: no "
        "check.",
    )
    device_memory_gb: float | None = Execution(
        None,
        gt=0,
        description="Memory of one device in GiB (2^30 bytes) for the pre-flight, instead of "
        "the detected free GPU memory or this process's share of the host's available RAM.",
    )
    pg_timeout_s: float = Execution(
        600,
        gt=0,
        description="Process-group (collective) timeout: a mismatched collective fails "
        "after this many seconds instead of hanging.",
    )
    timeouts: StageTimeouts = Execution(
        default_factory=StageTimeouts, description="Per-stage limits."
    )
    hang_timeout_s: float | None = Execution(
        1800,
        gt=0,
        description="Hang watchdog of training stages: when no rank's heartbeat (one per "
        "optimizer step, evaluation batch, checkpoint) has advanced for this many seconds, the "
        "ranks' Python stacks are dumped to logs/stacks-rank<k>.txt and the stage is killed. "
        "null = off (only the stage timeout applies).",
    )
    hang_startup_s: float = Execution(
        1800,
        ge=0,
        description="Extra silence the hang watchdog allows before the training loop's first "
        "beat: loading the base model, preparing data, sharding and resuming send no beats.",
    )
    orphan: Literal["stop", "finish"] = Execution(
        "stop",
        description="What a stage process does when the process that launched it (`posttrain "
        "run`, a Prefect worker or runner) dies: `stop` ends it within seconds, leaving only "
        "complete checkpoints (the next run resumes from the newest); `finish` lets it train to "
        "the end and seal its artifact, which the next run then reuses.",
    )
    launcher: Literal["local", "slurm", "kubernetes"] = Execution(
        "local",
        description="What runs the stages: `local` = processes on this machine (torchrun for "
        "several ranks; for nnodes > 1 the other nodes' agents are started by hand, `posttrain "
        "launch`); `slurm` = one sbatch job per stage (`infra.slurm`); `kubernetes` = one "
        "Indexed Job and headless Service per stage (`infra.kubernetes`). With slurm or "
        "kubernetes every stage but ingest runs on the engine's nodes, the workspace must be on "
        "storage they share, and infra.device and devices_per_node must be set (the nodes' "
        "GPUs are not visible from where the flow runs).",
    )
    slurm: SlurmConfig = Execution(
        default_factory=lambda: SlurmConfig(), description="Slurm job settings (launcher slurm)."
    )
    queue_timeout_s: float | None = Execution(
        None,
        gt=0,
        description="Seconds a stage may wait in the engine's queue (a pending Slurm job or pod) "
        "before it is cancelled and fails; null = as long as the engine keeps it. The stage's "
        "own timeout (infra.timeouts) counts from when it starts running.",
    )
    wait_devices_s: float | None = Execution(
        None,
        ge=0,
        description="Seconds a run waits for its devices while another run holds them, then "
        "fails naming the holder (`posttrain run --wait-devices`); null = as long as it takes, "
        "telling the holder's stage, step and ETA every minute.",
    )
    supervisor_silence_s: float = Execution(
        120,
        ge=10,
        description="Stages run by slurm or kubernetes watch a beat file the flow rewrites every "
        "few seconds: unchanged for this long, the flow is gone, and the stage acts per "
        "`orphan`. Longer than the shared file system's attribute caching.",
    )
    no_intact_checkpoint: Literal["restart", "fail"] = Execution(
        "restart",
        description="What a training stage does when it has checkpoints but none passes its "
        "integrity check (sizes and checksums recorded at save): `restart` from step 0, saying "
        "so, or `fail` naming each damaged file. An intact older checkpoint is always preferred.",
    )
    kubernetes: KubernetesConfig = Execution(
        default_factory=KubernetesConfig,
        description="Image, GPUs, workspace volume and scheduling of the pods when "
        "`infra.launcher` is `kubernetes` (one Indexed Job per stage, one pod per node).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> InfraConfig:
        if self.base_dtype == "bf16" and self.precision == "fp16":
            raise ValueError(
                "base_dtype bf16 with precision fp16 is refused (fp16 compute would cast the bf16 "
                "base down to fp16's narrower range); use precision bf16 or base_dtype fp32"
            )
        if self.nnodes > 1 and not self.rdzv_endpoint and self.launcher == "local":
            raise ValueError(
                f"nnodes {self.nnodes} needs rdzv_endpoint (host:port of the node-rank-0 machine, "
                "reachable from every node)"
            )
        if self.launcher != "local" and self.device == "auto":
            raise ValueError(
                f"launcher {self.launcher} needs infra.device set to cuda or cpu: `auto` would "
                "look at the GPUs of the machine the flow runs on, not the nodes'"
            )
        if self.launcher != "local" and self.devices_per_node == "auto":
            raise ValueError(
                f"launcher {self.launcher} needs infra.devices_per_node set to a number (the "
                "processes per node, one per GPU)"
            )
        if self.precision == "fp16" and not self.loss_scaling:
            raise ValueError(
                "precision fp16 without loss scaling is refused: fp16 gradients underflow and "
                "preference losses go NaN. Set infra.loss_scaling: true, or use bf16/fp32."
            )
        # Last: the launcher's general checks (device, devices_per_node) speak first.
        if self.launcher == "kubernetes":
            self.kubernetes.check_usable()
        return self

    def world_size(self) -> int:
        """Processes of a distributed stage: nnodes x devices_per_node (resolved)."""
        assert isinstance(self.devices_per_node, int), "resolve() first"
        return self.nnodes * self.devices_per_node

    def dp_size(self) -> int:
        """Data-parallel size: the world over the ranks that split one sequence (resolved). A
        world that `sequence_parallel` does not divide is refused by the recipe checks
        (`posttrain.config.sp_check`); here it rounds down."""
        return max(1, self.world_size() // self.sequence_parallel)
