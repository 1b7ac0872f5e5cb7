"""What a stage's `run(ctx)` is given: `StageContext`, its planned stage, recipe, parents, rank.

Below the stages: the harness that builds it (`posttrain.stages.common.stage_main`) and the
library code a stage hands it to (`posttrain.eval`, `posttrain.rl`) both import it from here, so
neither reaches up into `posttrain.stages`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain import numerics
from posttrain.config.graph import BASE
from posttrain.config.schema import ResolvedRecipe
from posttrain.kinds import KINDS, StageKind
from posttrain.runtime.spec import PlannedStage
from posttrain.runtime.token_budget import TokenBudget
from posttrain.store.artifacts import ArtifactRef


@dataclass
class StageContext:
    """A stage process's hold on its stage: the planned stage it builds (`stage`: its name,
    fingerprint, folder, roles, inputs, from its spec), the resolved recipe, its parents'
    artifacts, and what this process is (rank, process group, the kind's registry entry)."""

    stage: PlannedStage
    recipe: ResolvedRecipe
    parents: dict[str, ArtifactRef]
    rank: int = 0
    world_size: int = 1
    dist: Any = None  # posttrain.distributed.runtime.DistInfo for distributed stages
    extra_manifest: dict[str, Any] = field(default_factory=dict)
    # The memory pre-flight's record (training stages): metrics.jsonl and the summary get it.
    preflight: dict[str, Any] | None = None
    kind: StageKind | None = None
    # The kind the manifest records (a stand-in's own name when `kind` is None).
    kind_name: str = ""
    # Tokens per forward (`batch.by_tokens`, "auto" resolved by the pre-flight at stage start).
    token_budget: TokenBudget | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def by_tokens(self) -> int | None:
        """Tokens per forward of this stage's training and scoring passes (None: the rows' own
        micro-batches): as resolved at stage start, else the recipe's number."""
        if self.token_budget is not None:
            return self.token_budget.tokens
        asked = getattr(getattr(self.section, "batch", None), "by_tokens", None)
        return asked if isinstance(asked, int) else None

    @property
    def section(self) -> Any:
        """This stage's recipe section (a shorthand section or its `stages:` entry)."""
        return self.recipe.stage(self.stage.name)

    @property
    def where(self) -> str:
        """This stage's section as a field path, which messages start with."""
        return section_path(self.recipe, self.stage.name)

    def has_role(self, role: str) -> bool:
        """A stage playing `role` is among this stage's parents."""
        return self.stage.roles.get(role) in self.parents

    def role_ref(self, role: str) -> ArtifactRef:
        """The artifact playing `role` for this stage (see `PlannedStage.roles`)."""
        return self.parents[self.stage.roles[role]]

    def role_dir(self, role: str) -> Path:
        return self.role_ref(role).path

    def role_manifest(self, role: str) -> dict[str, Any]:
        return self.parent_manifest(self.stage.roles[role])

    def adapter_dir(self, role: str) -> Path | None:
        """The adapter folder of the policy playing `role`; None when it is the base model
        (a stage starting from the base creates its adapter)."""
        if KINDS.get(self.role_ref(role).stage, KINDS[BASE]).produces == "base":
            return None
        return self.role_dir(role) / "adapter"

    def parent_dir(self, name: str) -> Path:
        return self.parents[name].path

    def parent_manifest(self, name: str) -> dict[str, Any]:
        return json.loads((self.parent_dir(name) / "manifest.json").read_text())

    @property
    def device_type(self) -> str:
        """ "cpu" or "cuda": the process group's device, else the recipe's resolved one."""
        return self.dist.device.type if self.dist is not None else self.recipe.infra.device

    def numerics(self) -> dict[str, Any]:
        """What this process's arithmetic depends on besides the stage's inputs
        (`posttrain.numerics.signature`): the key part of a table cached across runs."""
        return numerics.signature(self.recipe.infra, self.device_type)


def section_path(recipe: ResolvedRecipe, name: str) -> str:
    """Stage `name`'s section as a field path: `dpo` (a shorthand section), `stages.dpo2` (a
    `stages:` entry), else the name itself (ingest, evaluate, export, a stage outside the
    graph)."""
    graph = recipe.graph()
    node = graph.bases.get(name) or next((s for s in graph if s.name == name), None)
    return node.where if node is not None else name


def training_base(ctx: StageContext) -> tuple[Any, Any, Any]:
    """(model, tokenizer, weights) of the base a training stage builds on: its `base` role's
    checkpoint, sharded-loadable, in `infra.base_dtype`, with `infra.attention`
    (posttrain.models.loading.base_for_training)."""
    from posttrain.models.loading import base_dtype, base_for_training

    return base_for_training(
        ctx.role_dir("base"),
        ctx.role_manifest("base"),
        base_dtype(ctx.recipe.infra),
        ctx.recipe.infra.attention,
    )
