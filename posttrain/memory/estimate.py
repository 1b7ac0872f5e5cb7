"""Per-device memory of one training stage, from numbers alone (no torch import).

What one device holds, by component:

static, for the whole stage
  base weights       every base parameter x its `infra.base_dtype` bytes (2 for bf16, 4 for
                     fp32) / shards. Frozen, so no master copy: FSDP2's mixed-precision policy
                     casts blocks for compute. A stage loads the base sharded (meta device,
                     then each rank reads only its rows), so no device ever holds it whole: there
                     is no load phase beyond one tensor's rows in flight, far below a step's.
  adapter <role>     each role's LoRA adapter (and head) x 4 / shards, trainable or frozen.
  gradients          trainable parameters only, fp32, / shards.
  optimizer          AdamW exp_avg + exp_avg_sq: 2 x 4 bytes per trainable parameter / shards.
  framework          the runtime: on CPU this process's RSS (Python, torch, transformers, peft),
                     on GPU a fixed allowance (NCCL buffers, cuBLAS workspace, allocator slack).
per phase; the largest phase is what the peak adds to the static part
  step / update      weights gathered by FSDP2 (the root's, plus two blocks: the running one and
                     the prefetched next), activations saved for backward, the logits buffers.
                     With full logits (no chunking) the loss runs after the root's forward has
                     resharded the root, so the gathered weights count only beyond the logits:
                     activations + max(logits buffers, gathered + one logits buffer).
  rollout (RL)       the generation KV cache of one `generate` call and the gathered model
                     (`rollout.keep_gathered` holds every block gathered while decoding).

a teacher (distillation: a stage with a `teacher` link), on a base of its own shape
  teacher weights    its base's parameters x `infra.base_dtype` bytes / shards, and its frozen
                     LoRA adapter (4 bytes a parameter) when the teacher is a policy; static.
  teacher scoring    (token-level only) the phase its no-grad forward runs in: its root and two
                     blocks gathered (when sharded; on one device it is not wrapped), one
                     block's working set, its logits [micro, new, V].
  distillation       (token-level only, in the update) the teacher's logits kept from scoring,
                     the student's [micro, new, V] logits with their gradient, in the compute
                     dtype, and the loss's fp32 working set: DISTILL_CHUNK_TOKENS rows x V x
                     DISTILL_CHUNK_COPIES (posttrain.rl.distill_losses measured them).
                     A teacher that writes text (sft's) answers the prompts before training and
                     is freed (its answers are cached): its weights are a phase of their own,
                     `answering`, not held beside the training step.

shards = data-parallel ranks that split the parameters: world size (fsdp), devices per node
(hsdp), 1 (ddp). With `infra.sequence_parallel` N the world counts the sequence-parallel ranks
too (FSDP2 shards over the whole dp x sp mesh), the activations row is 1/N per rank (but the
padding-free batch's index tensors) and the LM head's positions are the rank's slice
(`head_positions`), and so are the teacher's forward and both distillation heads; the rollout
rows are counted whole (every rank of a group generates).

Activations saved for backward, per token and decoder block (Llama/Qwen2 block, SDPA attention,
frozen base + LoRA; a frozen linear saves nothing, a LoRA linear saves its input and its rank-r
intermediate):
  2 x H x 4        the two RMSNorm inputs (the norms compute in fp32)
  2 x H x c        the two norm outputs (inputs of the q/k/v and gate/up adapters)
  4 x nh x hd x c  SDPA's query, key and value (expanded to all heads when a padding mask is
                   given) and output; attention probabilities are not stored (fused kernels)
  nh x hd x c      the attention output reshaped for o_proj (its adapter's input)
  4 x I x c        MLP: gate (SiLU input), SiLU output, up, and their product (down_proj's input)
  r x c            per adapted linear (LoRA A output, kept for LoRA B)
where c = 2 bytes for bf16/fp16 compute, 4 for fp32. With activation checkpointing each block
keeps only its input (H x c per token) and one block's activations are recomputed at a time.
Logits: the [micro, seq, vocab] output plus its fp32 log-softmax and gradient, 3 buffers of 4
bytes (RL: log-softmax, softmax for the entropy, their product and gradients, 5 buffers). On
small models the logits are often the largest single item. With `infra.logits_chunk_tokens`
(posttrain/models/chunked.py) only [chunk, vocab] fp32 buffers exist at a time: the chunk's logits
and its exp/softmax (RL: and the entropy's product), 2 buffers (RL 3), plus the scored positions'
hidden states and their gradient (2 x tokens x H x c).

This models the bytes of live tensors (what max_memory_allocated reports on a GPU): on CPU it
was 1.02-1.12x the measured allocated peak of real steps built as the stages build them (meta
device, sharded fill, chunked or full logits; Qwen2.5-0.5B's shape included:
`bench/memory_estimate.py`; tests/test_memory_estimate.py keeps it within 1.0-1.25x). It
assumes every sequence is `seq_len` long (batches pad to their longest row, so real steps are
usually smaller).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

GIB = 1024**3
MIB = 1024**2

# What a training step holds, by family (a stage kind's memory function picks one):
#   lm      one causal-LM forward per row (SFT)
#   pairs   two sequences per row through the LM head (DPO-family, ORPO, KTO)
#   score   two sequences per row through a score head, no LM head (reward models)
#   rl      rollouts + response-only logits of an update (PPO, GRPO)
Family = Literal["lm", "pairs", "score", "rl"]
Layout = Literal["fsdp", "hsdp", "ddp"]

# Fixed allowance for what the estimate does not model, per device. GPU: NCCL buffers, cuBLAS
# workspaces, caching-allocator rounding (the CUDA context is already outside the free memory
# the pre-flight reads). CPU: used only when the runtime's RSS is not measured (the pre-flight
# measures it).
FRAMEWORK_OVERHEAD = {"cuda": 1 * GIB, "cpu": 600 * MIB}
# Logits-sized buffers alive at the peak of a training step (see the module docstring).
LOGIT_BUFFERS = {"lm": 3, "pairs": 3, "score": 0, "rl": 5}
# The same with the head in token chunks: [chunk, vocab] fp32 buffers.
CHUNK_BUFFERS = {"lm": 2, "pairs": 2, "score": 0, "rl": 3}
# posttrain.rl.distill_losses.DEFAULT_CHUNK_TOKENS (that module imports torch; a test holds
# the two equal): rows of the flattened [B*T, V] logits the divergence works on at once.
DISTILL_CHUNK_TOKENS = 1024
# [chunk, V] fp32 buffers alive at the peak of one chunk (its backward: recompute plus
# autograd), measured in posttrain.rl.distill_losses: ~7.5 for either KL, ~12 for jsd.
DISTILL_CHUNK_COPIES = {"reverse_kl": 8, "forward_kl": 8, "jsd": 12}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a Llama-style decoder that memory depends on."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # The head's output is transformed into logits (Gemma soft-capping, Cohere/Granite scaling):
    # the chunked head's backward keeps one more [chunk, vocab] buffer
    # (posttrain/models/chunked.py).
    logit_transform: bool = False
    # Soft-capped attention logits (Gemma-2): SDPA cannot confine attention to rows, so the model
    # keeps padded batches and their [B, 1, T, T] mask even when `batch.padding_free` is set
    # (posttrain.models.varlen_attention.padding_free_unsupported).
    padded_attention: bool = False

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelShape:
        """From a transformers config.json (Llama, Qwen2, Mistral and alike). Raises ValueError
        for configs whose blocks this estimate does not describe (mixture of experts, no MLP
        width)."""
        if any(k in cfg for k in ("num_local_experts", "num_experts", "n_routed_experts")):
            raise ValueError(f"model_type {cfg.get('model_type')!r}: mixture of experts")
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            layers, inter = int(cfg["num_hidden_layers"]), int(cfg["intermediate_size"])
            vocab = int(cfg["vocab_size"])
        except KeyError as exc:
            raise ValueError(f"config has no {exc.args[0]}") from None
        bias = bool(cfg.get("attention_bias", False))
        return cls(
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate=inter,
            vocab=vocab,
            # transformers' Llama default is untied; a saved config states it explicitly.
            tied=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 hard-codes q/k/v biases; Llama-style configs say so in attention_bias.
            qkv_bias=bias or cfg.get("model_type") == "qwen2",
            logit_transform=any(
                cfg.get(k) not in (None, 1, 1.0)
                for k in ("final_logit_softcapping", "logit_scale", "logits_scaling")
            ),
            o_bias=bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            padded_attention=cfg.get("attn_logit_softcapping") is not None,
        )

    @classmethod
    def from_recipe_model(cls, m: Any) -> ModelShape:
        """From `ingest.from_config` (a FromConfigModel). Its vocab_size bounds the BPE
        vocabulary from above, so this over-counts the embedding slightly at most."""
        return cls(
            hidden=m.hidden_size,
            layers=m.num_layers,
            heads=m.num_heads,
            kv_heads=m.num_kv_heads or m.num_heads,
            head_dim=m.hidden_size // m.num_heads,
            intermediate=m.intermediate_size,
            vocab=m.embedding_rows or m.vocab_size,
            tied=m.tie_word_embeddings,
            qkv_bias=m.architecture == "qwen2",
        )

    def sequence_split_problem(self, n: int) -> str | None:
        """Why attention cannot be split over `n` sequence-parallel ranks (Ulysses: each rank
        attends for heads / n query heads; key/value heads are split too, or replicated when
        there are fewer than n), None when it can."""
        if self.heads % n:
            return f"its {self.heads} attention heads are not divisible by {n}"
        if self.kv_heads % n and n % self.kv_heads:
            return (
                f"its {self.kv_heads} key/value heads are not divisible by {n}, nor {n} by "
                f"{self.kv_heads} (fewer key/value heads than ranks are replicated)"
            )
        return None

    def linears(self) -> dict[str, tuple[int, int, bool]]:
        """Per block: linear name -> (in features, out features, has bias)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        i = self.intermediate
        return {
            "q_proj": (h, q, self.qkv_bias),
            "k_proj": (h, kv, self.qkv_bias),
            "v_proj": (h, kv, self.qkv_bias),
            "o_proj": (q, h, self.o_bias),
            "gate_proj": (h, i, self.mlp_bias),
            "up_proj": (h, i, self.mlp_bias),
            "down_proj": (i, h, self.mlp_bias),
        }

    def block_params(self) -> int:
        """One decoder block: its linears plus two RMSNorm weights."""
        lin = sum(a * b + (b if bias else 0) for a, b, bias in self.linears().values())
        return lin + 2 * self.hidden

    def root_params(self, head: Literal["lm", "score", "none"]) -> int:
        """Parameters outside the blocks: embedding, final norm, and the head (the LM head only
        when untied; a 1-output score head for a sequence classifier; none)."""
        out = self.vocab * self.hidden + self.hidden
        if head == "lm" and not self.tied:
            out += self.vocab * self.hidden
        if head == "score":
            out += self.hidden
        return out

    def base_params(self, head: Literal["lm", "score", "none"] = "lm") -> int:
        """Every parameter of the base model (`sum(p.numel())` of the transformers model)."""
        return self.layers * self.block_params() + self.root_params(head)

    def lora_params(self, r: int, targets: list[str] | str) -> int:
        """Parameters of one LoRA adapter: r x (in + out) per adapted linear and block.
        `all-linear` adapts every linear of the blocks (peft leaves the output head out)."""
        names = LINEARS if targets == "all-linear" else tuple(targets)
        per_block = sum(r * (a + b) for n, (a, b, _) in self.linears().items() if n in names)
        total = self.layers * per_block
        if "lm_head" in names:
            total += r * (self.hidden + self.vocab)
        return total

    def adapted(self, targets: list[str] | str) -> set[str]:
        return set(LINEARS) if targets == "all-linear" else set(targets) & set(LINEARS)


@dataclass(frozen=True)
class Adapter:
    """One role's LoRA adapter on the shared base."""

    role: str
    r: int
    targets: list[str] | str
    trainable: bool
    dropout: bool = False


@dataclass(frozen=True)
class TeacherShape:
    """A distillation stage's frozen teacher, on its own base (`model`): its adapter when it is
    a policy (frozen), and for token-level distillation the response positions per row its
    logits are compared on and the divergence (`loss`); `positions` None: the teacher writes
    text (sft's teacher), so only its weights are held."""

    model: ModelShape
    adapter: Adapter | None = None
    positions: int | None = None
    loss: str = "reverse_kl"
    chunk_tokens: int = DISTILL_CHUNK_TOKENS
    label: str = "teacher"


@dataclass(frozen=True)
class StageShape:
    """What a stage runs, as far as memory goes. `micro_batch` counts rows of the stage's batch
    (pairs for reward and dpo, which run chosen and rejected together: 2 x micro sequences);
    `seq_len` the longest sequence (for RL: prompt + new tokens)."""

    kind: Family
    micro_batch: int
    seq_len: int
    adapters: tuple[Adapter, ...]
    precision: str = "fp32"
    activation_checkpointing: bool = False
    base_dtype: Literal["fp32", "bf16"] = "fp32"  # the frozen base's (infra.base_dtype)
    # Heads outside the adapters: "score" (reward model, trained in full by the reward stage;
    # frozen in RL) and "value" (PPO's critic head, trained).
    score_head: Literal["none", "trainable", "frozen"] = "none"
    value_head: bool = False
    # RL: positions that go through the LM head in an update (the response), rows per
    # `generate` call on one rank, prompt and new tokens, keep_gathered.
    logit_positions: int | None = None
    rollout_rows: int = 0
    prompt_len: int = 0
    new_tokens: int = 0
    keep_gathered: bool = False
    # `rollout.engine: fast`: the policy's merged plain copy, whole on every rank.
    sampler_copy: bool = False
    # Tokens per pass through the LM head (infra.logits_chunk_tokens); 0 = full logits.
    logits_chunk_tokens: int = 0
    # The stage's name, for reports (default the family).
    label: str = ""
    # A distillation stage's teacher (posttrain.runtime.preflight adds it from its base).
    teacher: TeacherShape | None = None
    # `batch.padding_free`: rows laid end to end, attention confined to each row by index
    # tensors (posttrain.models.varlen_attention) instead of a [B, 1, T, T] mask.
    padding_free: bool = False

    @property
    def sequences(self) -> int:
        """Sequences in one forward: chosen + rejected for pair stages."""
        return self.micro_batch * (2 if self.kind in ("score", "pairs") else 1)


@dataclass(frozen=True)
class DeviceLayout:
    world: int = 1
    layout: Layout = "fsdp"
    devices_per_node: int = 1
    device: Literal["cpu", "cuda"] = "cpu"
    # Ranks that split each sequence (infra.sequence_parallel): a rank saves activations for
    # 1/N of every micro-batch's tokens; parameters stay sharded over all `world` ranks.
    sequence_parallel: int = 1

    @property
    def shards(self) -> int:
        """Ranks that split each parameter (the shard dimension of the data-parallel mesh)."""
        if self.layout == "fsdp":
            return self.world
        if self.layout == "hsdp":
            return self.devices_per_node
        return 1


@dataclass(frozen=True)
class Row:
    name: str
    bytes: int
    note: str = ""
    phase: str = ""  # "" = held for the whole stage


@dataclass
class MemoryEstimate:
    """Bytes per component on one device. Peak = static rows + the largest phase."""

    rows: list[Row] = field(default_factory=list)
    activation_checkpointing: bool = False

    @property
    def static(self) -> int:
        return sum(r.bytes for r in self.rows if not r.phase)

    def phase_totals(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.rows:
            if r.phase:
                out[r.phase] = out.get(r.phase, 0) + r.bytes
        return out

    @property
    def peak_phase(self) -> str:
        phases = self.phase_totals()
        return max(phases, key=phases.__getitem__) if phases else ""

    @property
    def total(self) -> int:
        return self.static + max(self.phase_totals().values(), default=0)

    def component(self, name: str) -> int:
        """Bytes of the rows whose name starts with `name` (e.g. "adapter", "activations")."""
        return sum(r.bytes for r in self.rows if r.name.startswith(name))

    def components(self) -> dict[str, int]:
        """Bytes by row, a phase's rows named `<phase>: <name>`."""
        return {(f"{r.phase}: {r.name}" if r.phase else r.name): r.bytes for r in self.rows}

    def table(self) -> str:
        """The breakdown as aligned text, one row per component, then the peak."""
        lines = [f"{'component':<34} {'phase':<8} {'size':>10}  note"]
        for r in self.rows:
            lines.append(f"{r.name:<34} {r.phase or 'all':<8} {fmt_bytes(r.bytes):>10}  {r.note}")
        phases = self.phase_totals()
        peak = self.peak_phase
        if len(phases) > 1:
            lines.append(
                "phases: "
                + ", ".join(f"{p} {fmt_bytes(b)}" for p, b in phases.items())
                + f" (peak in {peak})"
            )
        lines.append(f"{'estimated peak':<34} {'':<8} {fmt_bytes(self.total):>10}")
        return "\n".join(lines)


def fmt_bytes(n: float) -> str:
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    if abs(n) >= MIB:
        return f"{n / MIB:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def activation_bytes_per_token(
    m: ModelShape, adapters: tuple[Adapter, ...], c: int, checkpointing: bool
) -> tuple[int, int]:
    """(bytes saved per token over all blocks, bytes of one block's activations per token).

    `adapters`: the adapter whose backward runs (one role at a time); see the module docstring
    for what each term is."""
    h, i, q = m.hidden, m.intermediate, m.heads * m.head_dim
    adapted = set().union(*(m.adapted(a.targets) for a in adapters)) if adapters else set()
    per_block = 2 * h * 4  # RMSNorm inputs, fp32
    per_block += 4 * q * c  # SDPA q, k, v (expanded to all heads), output
    if adapted & {"q_proj", "k_proj", "v_proj"}:
        per_block += h * c  # input norm output, shared by the q/k/v adapters
    if "o_proj" in adapted:
        per_block += q * c
    per_block += 3 * i * c  # gate (SiLU input), SiLU output, up: needed for the input gradient
    if adapted & {"gate_proj", "up_proj"}:
        per_block += h * c
    if "down_proj" in adapted:
        per_block += i * c
    for a in adapters:
        per_block += a.r * c * len(m.adapted(a.targets))
        if a.dropout:  # dropout output + its mask (1 byte) per adapted linear input
            lin = m.linears()
            per_block += sum((c + 1) * lin[n][0] for n in m.adapted(a.targets))
    if checkpointing:
        return m.layers * h * c, per_block
    return m.layers * per_block, per_block


def estimate(
    model: ModelShape,
    stage: StageShape,
    layout: DeviceLayout,
    overhead_bytes: int | None = None,
) -> MemoryEstimate:
    """Per-device memory of `stage` on `layout` (see the module docstring): the static rows
    (weights, gradients, optimizer, framework), then the rows of each phase."""
    shards = layout.shards
    # Bytes per element of activations and gathered weights: bf16/fp16 compute is 2, fp32 4; a
    # bf16 base computes in bf16 whatever the precision (`shard_model`).
    c = 2 if stage.base_dtype == "bf16" or stage.precision in ("bf16", "fp16") else 4
    # The reward model's score head is a row of its own (with peft's trained copy), not base.
    head: Literal["lm", "none"] = "none" if stage.kind == "score" else "lm"
    weights, counts = weight_rows(model, stage, shards, head)
    gathered = gathered_step_bytes(model, head, counts, c)
    sp = layout.sequence_parallel
    full_logits = full_logits_bytes(model, stage, sp)
    update = "update" if stage.kind == "rl" else "step"
    trained = counts.trainable
    rows = [
        *weights,
        Row("gradients", trained * 4 // shards, f"{trained:,} trainable params, fp32"),
        Row("optimizer (AdamW)", 2 * 4 * trained // shards, "exp_avg + exp_avg_sq, fp32"),
        framework_row(layout.device, overhead_bytes),
        step_weights_row(stage, gathered, full_logits, update),
        activations_row(model, stage, c, update, sp),
        *logits_rows(model, stage, c, full_logits, update, sp),
        *sampler_rows(model, stage, layout),
        *rollout_rows(model, stage, counts, gathered, c, layout.device),
        *teacher_rows(model, stage, shards, c, update, sp),
    ]
    return MemoryEstimate(rows, stage.activation_checkpointing)


@dataclass(frozen=True)
class ParamCounts:
    """Parameters beside the base that later rows depend on: every adapter's (trainable or
    not), the heads outside the adapters (score, value), and how many of all are trained."""

    adapters: int
    heads: int
    trainable: int


def weight_rows(
    model: ModelShape, stage: StageShape, shards: int, head: Literal["lm", "none"]
) -> tuple[list[Row], ParamCounts]:
    """The static weight rows (the frozen base, each role's adapter, the score and value heads)
    and the parameter counts they add up to."""
    rows = [_frozen_base_row("base weights", model.base_params(head), stage, shards)]

    trainable = 0
    adapter_params = 0
    for a in stage.adapters:
        n = model.lora_params(a.r, a.targets)
        adapter_params += n
        trainable += n if a.trainable else 0
        state = "trainable" if a.trainable else "frozen"
        rows.append(Row(f"adapter {a.role}", n * 4 // shards, f"{n:,} params, r={a.r}, {state}"))
    heads = 0
    if stage.score_head != "none":
        # The reward stage trains the score head as a peft modules_to_save copy: two [1, H].
        n = model.hidden * (2 if stage.score_head == "trainable" else 1)
        heads += n
        trainable += model.hidden if stage.score_head == "trainable" else 0
        rows.append(Row("score head", n * 4 // shards, f"{n:,} params, {stage.score_head}"))
    if stage.value_head:
        heads += model.hidden
        trainable += model.hidden
        rows.append(Row("value head", model.hidden * 4 // shards, "trainable"))
    return rows, ParamCounts(adapter_params, heads, trainable)


def _frozen_base_row(
    name: str, params: int, stage: StageShape, shards: int, phase: str = ""
) -> Row:
    """A frozen base's weights: `params` in `stage.base_dtype`, split over `shards`."""
    b = 2 if stage.base_dtype == "bf16" else 4
    where = f"1/{shards} per device" if shards > 1 else "not sharded"
    note = f"{params:,} params, frozen, {stage.base_dtype}, {where}"
    return Row(name, params * b // shards, note, phase)


def framework_row(device: str, overhead_bytes: int | None) -> Row:
    """The runtime: its measured bytes when given, else the device's fixed allowance."""
    if overhead_bytes is None:
        return Row("framework", FRAMEWORK_OVERHEAD[device], "fixed allowance")
    return Row("framework", overhead_bytes, "runtime, measured")


def gathered_step_bytes(
    model: ModelShape, head: Literal["lm", "none"], counts: ParamCounts, c: int
) -> int:
    """Weights gathered while computing: FSDP2 unshards the root (embedding, final norm, head)
    inside its forward and again for its backward, and one block at a time plus the
    prefetched next."""
    adapter_per_block = counts.adapters // max(1, model.layers)
    block = model.block_params() + adapter_per_block
    return (model.root_params(head) + counts.heads + 2 * block) * c


def full_logits_bytes(model: ModelShape, stage: StageShape, sequence_parallel: int = 1) -> int:
    """The stage's unchunked logits buffers: LOGIT_BUFFERS x [head positions, vocab] fp32."""
    k = LOGIT_BUFFERS[stage.kind]
    return k * head_positions(stage, sequence_parallel) * model.vocab * 4


def head_positions(stage: StageShape, sequence_parallel: int = 1) -> int:
    """Positions one rank sends through the LM head in a forward: every sequence's scored
    positions (RL: the response's). Under sequence parallelism over N ranks a rank's head sees
    only its slice's tokens, ceil(tokens / N) at most (an RL rank's slice may hold all of one
    row's response, so no finer)."""
    scored = stage.sequences * (stage.logit_positions or stage.seq_len)
    if sequence_parallel == 1:
        return scored
    return min(scored, -(-stage.sequences * stage.seq_len // sequence_parallel))


def step_weights_row(stage: StageShape, gathered_step: int, full_logits: int, phase: str) -> Row:
    """The gathered weights of a training step (`gathered_step_bytes`), less what the full
    logits already cover when the head is not chunked."""
    k = LOGIT_BUFFERS[stage.kind]
    if k and not stage.logits_chunk_tokens:
        # Full logits: the loss runs after the root's forward, which reshards the root (and every
        # block) when it returns (measured, torch 2.13), so the k logits buffers and the gathered
        # weights are not live together; the backward gathers the root again beside one buffer
        # (the logits' gradient). Peak = activations + max(k buffers, gathered + 1 buffer): this
        # row is what the gathered weights add above the logits row. Counting both in full
        # over-estimated a Qwen2.5-0.5B-shaped sft step by 19%, its vocabulary on 2 blocks by
        # 32% (bench/memory_estimate.py; now 1.06x and 1.03x).
        extra = max(0, gathered_step - (k - 1) * full_logits // k)
        note = "root + 2 blocks, beyond the full logits"
        return Row("gathered weights", extra, note, phase)
    return Row("gathered weights", gathered_step, "FSDP2 all-gather: root + 2 blocks", phase)


def activations_row(
    model: ModelShape, stage: StageShape, c: int, phase: str, sequence_parallel: int = 1
) -> Row:
    """What a step saves for backward: the blocks' activations (see the module docstring), the
    final norm's input, what confines attention to rows (`attention_rows_bytes`) and the score
    head's input. With sequence parallelism over N ranks each holds 1/N of them (rounded up):
    its slice of the tokens, and inside attention the whole sequence for heads / N heads, the
    same bytes; only the padding-free batch's index tensors are whole on every rank."""
    # The backward of one role at a time: the policy's adapter (RL: the policy's update; the
    # critic's pass has no logits and the same body, so it is not larger).
    running = tuple(a for a in stage.adapters if a.trainable)[:1]
    tokens = stage.sequences * stage.seq_len
    saved, one_block = activation_bytes_per_token(model, running, c, stage.activation_checkpointing)
    ac = "checkpointed: block inputs + 1 block" if stage.activation_checkpointing else "no AC"
    act = tokens * (saved + (one_block if stage.activation_checkpointing else 0))
    act += tokens * model.hidden * 4  # final norm input (fp32)
    split, whole, how = attention_rows_bytes(model, stage)
    act += split
    if stage.kind == "score":
        act += tokens * model.hidden * c  # score head input (trained)
    note = f"{stage.sequences} seqs x {stage.seq_len} tokens, {ac}, {how}"
    if sequence_parallel > 1:
        act = -(-act // sequence_parallel)
        note += f", 1/{sequence_parallel} per rank (sequence parallel)"
    return Row("activations", act + whole, note, phase)


def attention_rows_bytes(model: ModelShape, stage: StageShape) -> tuple[int, int, str]:
    """What keeps attention inside each row, beyond q/k/v and the output: (bytes that split
    over sequence-parallel ranks, bytes every rank holds whole, a note).

    Padded batches: SDPA's [B, 1, T, T] bool mask. Padding-free batches
    (posttrain.models.varlen_attention) build no mask: SDPA runs causally on each row's
    [S, H, L, D] block, saving its fp32 logsumexp [S, H, L] per attention call (every block's,
    or one block's under activation checkpointing; split by heads under sequence parallelism),
    and the batch carries four int64 index tensors of the whole sequence on every rank (the
    position ids and the segments' row_of, pos_of and [S, L] gather)."""
    tokens = stage.sequences * stage.seq_len
    if not stage.padding_free or model.padded_attention:
        return stage.sequences * stage.seq_len * stage.seq_len, 0, "[T, T] mask"
    blocks = 1 if stage.activation_checkpointing else model.layers
    return blocks * tokens * model.heads * 4, 4 * 8 * tokens, "row-confined, no mask"


def logits_rows(
    model: ModelShape,
    stage: StageShape,
    c: int,
    full_logits: int,
    phase: str,
    sequence_parallel: int = 1,
) -> list[Row]:
    """The LM head's buffers of a step: chunked ([chunk, vocab] buffers and the head positions'
    hidden states with their gradient, `head_positions`: a rank's slice under sequence
    parallelism) or full (`full_logits_bytes`); none for a score head."""
    k = LOGIT_BUFFERS[stage.kind]
    if k and stage.logits_chunk_tokens:
        scored = head_positions(stage, sequence_parallel)
        chunk = min(stage.logits_chunk_tokens, scored)
        kc = CHUNK_BUFFERS[stage.kind] + model.logit_transform
        logits = kc * chunk * model.vocab * 4 + 2 * scored * model.hidden * c
        note = f"chunked: {kc} x {chunk} tokens x vocab {model.vocab} x 4 B"
        if sequence_parallel > 1:
            note += f", {scored} positions per rank (sequence parallel)"
        return [Row("logits", logits, note, phase)]
    if k:
        positions = head_positions(stage, sequence_parallel)
        note = f"{k} x {positions} positions x vocab {model.vocab} x 4 B"
        return [Row("logits", full_logits, note, phase)]
    return []


SAMPLER_CACHE_BUCKET = 256  # posttrain.rl.rollout.fast_engine.CACHE_BUCKET


def sampler_bytes(device: str) -> int:
    """Bytes per element of the `fast` engine's copy: bf16 on CUDA, fp32 elsewhere."""
    return 2 if device == "cuda" else 4


def sampler_rows(model: ModelShape, stage: StageShape, layout: DeviceLayout) -> list[Row]:
    """`rollout.engine: fast`: the policy's merged plain copy, held for the whole stage and
    not sharded (every rank holds all of it, whatever the world size)."""
    if stage.kind != "rl" or not stage.sampler_copy:
        return []
    cs = sampler_bytes(layout.device)
    n = model.base_params("lm")
    note = f"rollout.engine fast: {n:,} params x {cs} B, LoRA merged, whole on every rank"
    return [Row("sampler copy", n * cs, note)]


def rollout_rows(
    model: ModelShape,
    stage: StageShape,
    counts: ParamCounts,
    gathered_step: int,
    c: int,
    device: str = "cpu",
) -> list[Row]:
    """The rollout phase of an RL stage (none for other stages, or without rollout rows): the
    KV cache of one `generate` call, the weights gathered while decoding, the prefill.
    `device`: where the `fast` engine's copy and static cache live (their dtype)."""
    if stage.kind != "rl" or not stage.rollout_rows:
        return []
    ctx_len = stage.prompt_len + stage.new_tokens
    if stage.sampler_copy:  # a static cache, its length rounded up, in the copy's dtype
        ctx_len = -(-ctx_len // SAMPLER_CACHE_BUCKET) * SAMPLER_CACHE_BUCKET
        c = sampler_bytes(device)
    kv = stage.rollout_rows * ctx_len * model.layers * 2 * model.kv_heads * model.head_dim * c
    kv_note = f"{stage.rollout_rows} rows x {ctx_len} tokens x {model.layers} layers"
    rows = [Row("KV cache", kv, kv_note, "rollout")]
    if stage.keep_gathered:
        full = (model.base_params("lm") + counts.adapters + counts.heads) * c
        rows.append(Row("gathered weights", full, "keep_gathered: whole model", "rollout"))
    else:
        rows.append(Row("gathered weights", gathered_step, "root + 2 blocks", "rollout"))
    # Prefill without gradients: one block's working set over the prompts, and the sampled
    # position's logits (fp32, a few copies for the sampling filters).
    prefill = stage.rollout_rows * stage.prompt_len * (3 * model.hidden + 3 * model.intermediate)
    prefill = prefill * c + 4 * stage.rollout_rows * model.vocab * 4
    rows.append(Row("prefill working set", prefill, "one block, no grad", "rollout"))
    return rows


def teacher_rows(
    model: ModelShape, stage: StageShape, shards: int, c: int, update: str, sp: int = 1
) -> list[Row]:
    """A teacher's rows (see the module docstring); none without a teacher. `model`: the
    student's base (its vocabulary shapes the student's logits), `c`: compute bytes. Under
    sequence parallelism over `sp` ranks both models run on a rank's slice of the packed rows
    (ceil(tokens / sp)) and both heads on the scored positions in it: at most the slice, and
    at most every answer token (one rank's slice may hold a whole answer)."""
    t = stage.teacher
    if t is None:
        return []
    tm = t.model
    # A token-level teacher is held for the whole stage; a teacher that writes text only while
    # it answers, before training.
    held = "" if t.positions is not None else "answering"
    rows = [_frozen_base_row(f"{t.label} weights", tm.base_params("lm"), stage, shards, held)]
    adapter = 0
    if t.adapter is not None:
        adapter = tm.lora_params(t.adapter.r, t.adapter.targets)
        note = f"{adapter:,} params, r={t.adapter.r}, frozen"
        rows.append(Row(f"{t.label} adapter", adapter * 4 // shards, note, held))
    if t.positions is None:
        return rows
    micro = stage.micro_batch
    tokens = -(-micro * stage.seq_len // sp)  # a rank's slice of the forward's tokens
    pos = min(micro * t.positions, tokens)  # head positions a rank scores
    teacher_logits = pos * tm.vocab * c
    logits_note = f"{pos} positions x vocab {tm.vocab} x {c} B"
    block = tm.block_params() + adapter // max(1, tm.layers)
    gathered = (tm.root_params("lm") + 2 * block) * c
    forward = tokens * (3 * tm.hidden + 3 * tm.intermediate) * c
    if shards > 1:  # on one device the teacher is not wrapped: nothing is gathered
        rows.append(Row(f"{t.label} gathered weights", gathered, "root + 2 blocks", "scoring"))
    rows += [
        Row(f"{t.label} forward", forward, f"{tokens} tokens, one block, no grad", "scoring"),
        Row(f"{t.label} logits", teacher_logits, logits_note, "scoring"),
        Row(f"{t.label} logits (kept)", teacher_logits, logits_note, update),
    ]
    student = 2 * pos * model.vocab * c
    note = f"student's + gradient: 2 x {pos} positions x vocab {model.vocab} x {c} B"
    rows.append(Row("distillation logits", student, note, update))
    chunk = min(t.chunk_tokens, pos)
    copies = DISTILL_CHUNK_COPIES.get(t.loss, max(DISTILL_CHUNK_COPIES.values()))
    work = copies * chunk * max(model.vocab, tm.vocab) * 4
    note = f"{t.loss}: {copies} x {chunk} rows x vocab x 4 B"
    return [*rows, Row("distillation chunks", work, note, update)]
