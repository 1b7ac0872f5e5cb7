"""Memory pre-flight of a training stage: estimate, compare with the device, refuse or warn.

`stage_main` runs `preflight` in every training stage process before it loads anything, so a
stage that cannot fit fails in seconds with the numbers and the fixes, instead of with an
out-of-memory kill minutes (or hours) into loading and sharding. The recipe decides what happens
(`infra.memory_preflight`: refuse | warn | off) and may state the device's memory
(`infra.device_memory_gb`) instead of reading it.

Capacity per process: on GPU the device's free memory (`torch.cuda.mem_get_info`, read after
the CUDA context exists, so the context is already outside it); on CPU this process's RSS (the
runtime, already imported) plus its share of the host's available memory (also bounded by a
cgroup v2 memory limit), since every rank of a node draws on the same RAM.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from posttrain.memory.estimate import (
    GIB,
    Adapter,
    DeviceLayout,
    MemoryEstimate,
    ModelShape,
    StageShape,
    TeacherShape,
    estimate,
    fmt_bytes,
)
from posttrain.memory.fixes import Fix, suggest_fixes

log = logging.getLogger("posttrain.memory")

# Refuse when the estimate exceeds this share of the capacity. The estimate counts the bytes of
# live tensors (measured on CPU: 1.02-1.12x the allocated peak, docs/benchmarks.md); what the
# allocator holds is more. GPU: the caching allocator reserves above what it allocates (not
# measured here; heavy fragmentation is warned about at run time). CPU: glibc keeps freed
# tensor memory in its heap, and the peak RSS reached 1.0-1.75x the estimate
# (bench/memory_estimate.py), hence half the capacity.
SAFETY_FRACTION = {"cuda": 0.9, "cpu": 0.5}


class MemoryPreflightError(RuntimeError):
    """A stage refused before loading anything: its estimate does not fit the device."""


@dataclass(frozen=True)
class Capacity:
    bytes: int
    source: str
    # The runtime's measured memory (CPU: this process's RSS at the pre-flight), used as the
    # estimate's framework row; None = the fixed allowance.
    runtime_bytes: int | None = None


@dataclass
class PreflightReport:
    stage: str
    estimate: MemoryEstimate
    # The same stage with activation checkpointing the other way (on if off, off if on).
    alternative: MemoryEstimate
    capacity: Capacity
    fraction: float = SAFETY_FRACTION["cuda"]
    fixes: list[Fix] = field(default_factory=list)
    # What the estimate was made of, for `batch.by_tokens: auto` (posttrain.runtime.token_budget).
    model: ModelShape | None = None
    shape: StageShape | None = None
    layout: DeviceLayout | None = None

    @property
    def budget(self) -> int:
        return int(self.capacity.bytes * self.fraction)

    @property
    def fits(self) -> bool:
        return self.estimate.total <= self.budget

    def headline(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit"
        return (
            f"stage {self.stage}: estimated peak {fmt_bytes(self.estimate.total)} per device "
            f"{verdict} in {self.fraction:.0%} of {fmt_bytes(self.capacity.bytes)} "
            f"({self.capacity.source})"
        )

    def text(self) -> str:
        """Everything a refusal prints: the verdict, the breakdown, the other checkpointing
        setting and the fixes, each with its own estimate."""
        on = self.alternative.activation_checkpointing
        lines = [
            self.headline(),
            self.estimate.table(),
            f"with activation checkpointing {'on' if on else 'off'}: "
            f"{fmt_bytes(self.alternative.total)}",
        ]
        if self.fixes:
            lines.append(f"fixes (estimated peak each; budget {fmt_bytes(self.budget)}):")
            lines += [
                f"  - {f.change}: {fmt_bytes(f.total)}{' (fits)' if f.fits else ''}"
                for f in self.fixes
            ]
        if not self.fits and not any(f.fits for f in self.fixes):
            # The device the best fix (else the stage as it is) needs: its estimate over the
            # safety fraction.
            need = int(
                min((f.total for f in self.fixes), default=self.estimate.total) / self.fraction
            )
            lines.append(
                f"nothing above fits: this stage needs a device with at least {fmt_bytes(need)}"
            )
        return "\n".join(lines)

    def record(self) -> dict[str, Any]:
        """JSON fields for metrics.jsonl (kind "preflight"), logs/preflight.json and the
        stage summary."""
        return {
            "estimate_bytes": self.estimate.total,
            "estimate_gib": round(self.estimate.total / GIB, 4),
            "estimate_other_checkpointing_gib": round(self.alternative.total / GIB, 4),
            "activation_checkpointing": self.estimate.activation_checkpointing,
            "capacity_gib": round(self.capacity.bytes / GIB, 4),
            "capacity_source": self.capacity.source,
            "safety_fraction": self.fraction,
            "fits": self.fits,
            "peak_phase": self.estimate.peak_phase,
            "components": self.estimate.components(),
            "fixes": [{"change": f.change, "gib": round(f.total / GIB, 4)} for f in self.fixes],
        }


def model_shape(
    recipe: Any, model_dir: str | Path | None = None, base: str = "ingest"
) -> ModelShape:
    """The shape of base `base` (a base's name: `ingest` or an ingest entry of `stages:`): its
    config.json when its artifact exists (exact vocabulary), else the recipe's
    `from_config` numbers for it. Raises ValueError when neither describes a model the estimate
    knows."""
    if model_dir is not None and (Path(model_dir) / "config.json").is_file():
        return ModelShape.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))
    section = recipe.stage(base)
    if section.source == "from_config":
        return ModelShape.from_recipe_model(section.from_config)
    raise ValueError(f"no config.json for the base model ({base}: path) to estimate from")


def _adapter(role: str, lora: Any, trainable: bool) -> Adapter:
    return Adapter(role, lora.r, lora.target_modules, trainable, lora.dropout > 0)


def _base_dtype(infra: Any) -> str:
    """infra.base_dtype as `resolve` makes `auto` (an unresolved recipe: fp32, as precision)."""
    if infra.base_dtype != "auto":
        return infra.base_dtype
    return "bf16" if infra.device == "cuda" and infra.precision == "bf16" else "fp32"


def stage_shape(recipe: Any, stage: str, teacher_dir: str | Path | None = None) -> StageShape:
    """What graph stage `stage` runs, as the estimate needs it (see StageShape): its kind's
    memory function (posttrain/kinds/) over its section, with the adapters shaped by the stages
    that created them (a DPO after SFT trains SFT's adapter; its reference is its `reference`'s
    adapter; the reward model is its reward stage's), and its teacher when it has one (its
    base's shape: `teacher_dir`'s config.json, else the recipe's numbers)."""
    from posttrain.kinds import MemoryInputs
    from posttrain.sections.shared import LoraConfig

    graph = recipe.graph()
    node = graph.get(stage)
    if node.kind.memory is None:
        raise ValueError(f"no memory estimate for stage {stage!r} ({node.kind.name})")
    section = node.section
    micro = section.batch.micro_batch_size
    if micro is None:  # not resolved (a recipe loaded without devices): derive it
        from posttrain.config.loader import section_batch

        micro = section_batch(recipe, stage).micro_batch_size
    common = {
        "micro_batch": micro,
        "precision": recipe.infra.precision if recipe.infra.precision != "auto" else "fp32",
        "activation_checkpointing": section.activation_checkpointing,
        "logits_chunk_tokens": recipe.infra.logits_chunk_tokens,
        "base_dtype": _base_dtype(recipe.infra),
        "padding_free": section.batch.padding_free,
    }

    def adapter(role: str, name: str | None, trainable: bool) -> Adapter | None:
        origin = graph.adapter_origin(name) if name and name in graph else None
        if origin is None:  # from the base: the stage's own new adapter
            lora = getattr(section, "lora", None)
            return _adapter(role, lora, trainable) if lora is not None else None
        return _adapter(role, origin.section.lora, trainable)

    rm = node.links.get("reward_model")
    m = MemoryInputs(
        common=common,
        policy=adapter("policy", node.links.get("policy"), True),
        reference=adapter("reference", node.links.get("reference"), False),
        # None: scored by reward functions alone (no reward role on the base).
        reward_model=_adapter("reward", graph.get(rm).section.lora, False)
        if rm
        else None
        if getattr(section, "rewards", None)
        else _adapter("reward", getattr(section, "lora", None) or LoraConfig(), False),
        world=recipe.infra.dp_size() if isinstance(recipe.infra.devices_per_node, int) else 1,
    )
    shape = replace(node.kind.memory(section, m), label=stage)
    if (teacher := node.links.get("teacher")) is not None:
        shape = replace(shape, teacher=teacher_shape(recipe, stage, teacher, teacher_dir))
    return shape


def teacher_shape(
    recipe: Any, stage: str, teacher: str, model_dir: str | Path | None = None
) -> TeacherShape:
    """The teacher `teacher` of stage `stage` as the estimate counts it: its base's shape, the
    adapter of the stage that created its policy (none for a base), and for a token-level kind
    (distill) the response positions and divergence of its loss."""
    graph = recipe.graph()
    node = graph.get(stage)
    model = model_shape(recipe, model_dir, graph.base_of(teacher))
    origin = graph.adapter_origin(teacher) if teacher in graph else None
    adapter = _adapter("teacher", origin.section.lora, False) if origin is not None else None
    if not node.kind.token_teacher:
        return TeacherShape(model, adapter)
    r = node.section.rollout
    new = r.max_episode_tokens if r.episodes else r.max_new_tokens
    return TeacherShape(model, adapter, positions=new, loss=node.section.loss)


def _per_node(infra: Any) -> int:
    """Devices per node; 1 while unresolved ("auto")."""
    return infra.devices_per_node if isinstance(infra.devices_per_node, int) else 1


def device_layout(recipe: Any) -> DeviceLayout:
    infra, per_node = recipe.infra, _per_node(recipe.infra)
    device = "cuda" if infra.device == "cuda" else "cpu"
    world = infra.nnodes * per_node
    return DeviceLayout(world, infra.layout, per_node, device, infra.sequence_parallel)


def _cgroup_room() -> int | None:
    """Bytes left under this cgroup's (v2) memory limit, or None without a limit."""
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((root / "memory.current").read_text())
    except (OSError, ValueError):
        return None


def detect_capacity(recipe: Any) -> Capacity:
    """This process's memory budget (see the module docstring); `infra.device_memory_gb`
    replaces the device's total (GiB) when set."""
    import psutil

    infra, local = recipe.infra, _per_node(recipe.infra)
    runtime = None if infra.device == "cuda" else psutil.Process().memory_info().rss
    if infra.device_memory_gb is not None:
        override = int(infra.device_memory_gb * GIB)
        return Capacity(override, "infra.device_memory_gb override", runtime)
    if infra.device == "cuda":
        import torch

        index = int(os.environ.get("LOCAL_RANK", "0"))
        free, total = torch.cuda.mem_get_info(index)
        return Capacity(free, f"cuda:{index} free of {fmt_bytes(total)}")
    available = psutil.virtual_memory().available
    room = _cgroup_room()
    where = "host available"
    if room is not None and room < available:
        available, where = room, "cgroup memory.max room"
    assert runtime is not None
    split = f" / {local} ranks" if local > 1 else ""
    source = f"{where} {fmt_bytes(available)}{split} + this process's RSS {fmt_bytes(runtime)}"
    return Capacity(runtime + available // max(1, local), source, runtime)


def preflight(
    recipe: Any,
    stage: str,
    *,
    model: ModelShape | None = None,
    model_dir: str | Path | None = None,
    capacity: Capacity | None = None,
    teacher_dir: str | Path | None = None,
) -> PreflightReport:
    """Estimate `stage` of a resolved recipe against the device (detected unless `capacity`
    is given). `model`/`model_dir`: the base's shape or its folder (see `model_shape`);
    `teacher_dir`: the teacher's base's folder, for a stage with a teacher."""
    if model is None:
        model = model_shape(recipe, model_dir, recipe.graph().base_of(stage))
    shape = stage_shape(recipe, stage, teacher_dir)
    layout = device_layout(recipe)
    cap = capacity or detect_capacity(recipe)
    est = estimate(model, shape, layout, cap.runtime_bytes)
    flipped = replace(shape, activation_checkpointing=not shape.activation_checkpointing)
    other = estimate(model, flipped, layout, cap.runtime_bytes)
    report = PreflightReport(
        stage,
        est,
        other,
        cap,
        SAFETY_FRACTION[layout.device],
        model=model,
        shape=shape,
        layout=layout,
    )
    if not report.fits:
        # The fixes name the stage's own fields: `sft.x`, or `stages.<name>.x` for an entry.
        node = recipe.graph().get(stage)
        accum = node.section.batch.grad_accum_steps or 1
        report.fixes = suggest_fixes(
            model, shape, layout, report.budget, cap.runtime_bytes, node.where, accum
        )
    return report


def enforce(report: PreflightReport, mode: str) -> None:
    """refuse: raise MemoryPreflightError when the estimate does not fit; warn: log it."""
    if report.fits:
        log.info("memory pre-flight: %s", report.headline())
        return
    if mode == "refuse":
        raise MemoryPreflightError(
            report.text() + "\nRefused before loading the model. Apply a fix above, or set "
            "infra.memory_preflight: warn to run anyway (infra.device_memory_gb states the "
            "device's memory if the detected figure is wrong)."
        )
    log.warning("memory pre-flight (warn only):\n%s", report.text())
