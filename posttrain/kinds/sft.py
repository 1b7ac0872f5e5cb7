"""sft: LoRA supervised fine-tuning on conversations."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from posttrain.config.section_fields import Result
from posttrain.config.sections import DataConfig, LoraConfig, TrainingSection
from posttrain.kinds._kind import MemoryInputs, StageKind


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
    eval_every: int = Result(
        0, ge=0, description="Held-out loss every N steps (0 = only at the end)."
    )


def _memory(section: SFTConfig, m: MemoryInputs) -> Any:
    from posttrain.memory.estimate import StageShape

    return StageShape("lm", seq_len=section.data.max_seq_len, adapters=(m.policy,), **m.common)


KIND = StageKind(
    name="sft",
    section=SFTConfig,
    module="posttrain.stages.sft",
    help="LoRA supervised fine-tuning; from the base (a new adapter) or a policy (continues it).",
    order=10,
    produces="policy",
    # 2: fingerprints by rule (fields and kinds decide, parents by role).
    version="2",
    consumes=("policy", "teacher"),
    # With a teacher, the teacher answers the training prompts (sequence-level distillation).
    optional=("teacher",),
    data="messages",
    trains=True,
    reads=("run", "infra", "guard"),
    distributed=True,
    new_adapter_from_base=True,
    memory=_memory,
)
