"""sft: LoRA supervised fine-tuning on conversations; with a `teacher:` link, on the teacher's
answers to their prompts (off-policy, sequence-level distillation)."""

from __future__ import annotations

from pydantic import Field

from posttrain.kinds._kind import seq_memory, trainer
from posttrain.sections.fields import Result, _Section
from posttrain.sections.shared import DataConfig, LoraConfig, TrainingSection


class TeacherSampling(_Section):
    """How a teacher (`teacher:` on an sft entry) answers the training prompts."""

    max_new_tokens: int = Result(128, ge=1, description="Longest answer.")
    temperature: float = Result(
        0.0, ge=0, description="0 = greedy (sequence-level KD's usual choice); > 0 samples."
    )
    top_p: float | None = Result(None, gt=0, le=1, description="Nucleus filter (sampling).")
    samples_per_prompt: int = Result(
        1, ge=1, description="Answers per prompt, each a training row (sampling)."
    )
    max_prompt_len: int = Result(
        512, ge=8, description="Prompt tokens kept (the tail) when the teacher answers."
    )
    batch_size: int = Result(16, ge=1, description="Prompts per generation batch, per rank.")


class SFTConfig(TrainingSection):
    data: DataConfig = Field(description="Training data.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="Adapter shape.")
    packing: bool = Result(
        False,
        description="Concatenate short rows into sequences of up to max_seq_len tokens before "
        "batching (fewer, fuller rows per step: changes what a step holds). Position ids "
        "restart per row and attention stays inside each row (padding-free batches; with "
        "batch.padding_free: false rows are padded and packed rows see each other).",
    )
    teacher_sampling: TeacherSampling = Field(
        default_factory=TeacherSampling,
        description="With a `teacher:` link (off-policy distillation): how the teacher answers "
        "the training prompts; the held-out rows keep their own answers.",
    )


KIND = trainer(
    name="sft",
    section=SFTConfig,
    module="posttrain.stages.sft",
    help="LoRA supervised fine-tuning; from the base (a new adapter) or a policy (continues it); "
    "with `teacher:`, on the teacher's answers to the training prompts.",
    order=10,
    version="2",
    consumes=("policy", "teacher"),
    # With a teacher, the teacher answers the training prompts (sequence-level distillation).
    optional=("teacher",),
    data="messages",
    new_adapter_from_base=True,
    memory=seq_memory("lm", "policy"),
    sequence_parallel=True,
)
