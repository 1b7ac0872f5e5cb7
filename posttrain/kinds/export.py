"""export: merges the shipped policy's adapter into the base and checks the reloaded model."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from posttrain.kinds._kind import StageKind
from posttrain.sections.fields import Result, _Section


class ExportConfig(_Section):
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Result(
        "auto", description="Saved weight dtype; `auto` keeps the base checkpoint's dtype."
    )
    logits_atol: float = Result(
        1e-4,
        gt=0,
        description="Max |logit difference| allowed between the reloaded export and "
        "base+adapter (fp32); scaled up for half-precision exports.",
    )
    gguf: list[Literal["f16", "bf16", "q8_0"]] = Result(
        [],
        description="Also write GGUF files for llama.cpp/Ollama, one per type, to "
        "`gguf/<run name>-<type>.gguf` in the export; each is read back and checked against the "
        "merged weights. Llama and Qwen2 families only: another family is refused when the "
        "recipe loads (a local base) or when the export stage starts (a hub base), before "
        "anything is written. `q8_0` is 8-bit; norms stay f32 in every file.",
    )
    policy: str | None = Result(
        None,
        description="The policy stage (by name) to merge and ship; default the final policy "
        "(the last policy stage of the graph).",
    )

    @field_validator("gguf")
    @classmethod
    def _one_file_per_type(cls, types: list[str]) -> list[str]:
        if len(set(types)) != len(types):
            raise ValueError(f"each GGUF type at most once, got {types}")
        return types


KIND = StageKind(
    name="export",
    section=ExportConfig,
    module="posttrain.stages.export",
    help="Merged export of the shipped policy.",
    order=910,
    produces="export",
    version="2",
    consumes=("policy",),
    placement="last",
    timeout_s=3600,
)
