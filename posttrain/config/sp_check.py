"""Recipe checks of `infra.sequence_parallel` (Ulysses sequence parallelism), one line per
problem, each naming its field: N must divide the devices (where known), every base model's
attention heads (where its shape is known: `from_config` numbers at validate, a local folder's
config.json at resolve), and needs padding-free batches; and a stage that does not split its
sequences yet (its kind's `sequence_parallel`, posttrain.kinds) refuses N > 1 instead of silently running unsplit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from posttrain.memory.estimate import ModelShape

FIELD = "infra.sequence_parallel"
# Rollout engines a sequence-parallel RL stage samples with: the in-process ones, whose
# samples the group takes from its first rank (`posttrain.rl.rollout.sample.sample`): `hf`
# samples on every rank (its forwards are collectives of the sharded model), `fast` on the
# first rank only (its merged copy's are not). A `server` engine's weight syncs, sampler
# checks and off-policy thread are per rank, and not proven under a group.
SP_ROLLOUT_ENGINES = ("hf", "fast")


def sp_errors(recipe: Any, local_bases: bool = False) -> list[str]:
    """Every problem of the recipe's `infra.sequence_parallel` (none at 1). `local_bases`:
    also read local base folders' config.json (at resolve, where paths are absolute)."""
    n = recipe.infra.sequence_parallel
    if n == 1:
        return []
    graph = recipe.graph()
    errors = _device_errors(recipe.infra, n)
    for base in graph.bases.values():
        shape = _base_shape(base.section, local_bases)
        if shape is not None and (problem := shape.sequence_split_problem(n)) is not None:
            errors.append(
                f"{FIELD}: {n} cannot split the attention of base {base.name!r}: {problem}"
            )
    for s in graph:
        batch = getattr(s.section, "batch", None)
        if batch is not None and not batch.padding_free:
            errors.append(
                f"{s.where}.batch.padding_free: false is refused with {FIELD} {n}: each rank "
                "takes a slice of the micro-batch's packed token stream; set it true"
            )
    for s in graph:
        errors += _rollout_errors(s, n)
    unwired = [s.name for s in graph if not s.kind.sequence_parallel]
    if unwired:
        errors.append(
            f"{FIELD}: {n}: sequence parallelism is not yet wired into stage "
            f"{', '.join(unwired)}; set {FIELD}: 1"
        )
    return errors


def _rollout_errors(s: Any, n: int) -> list[str]:
    """An RL stage's rollouts under sequence parallelism: every rank of a group samples the same
    responses itself, so only the `hf` engine, and no episodes (a tool or an environment with
    side effects would act once per rank)."""
    rollout = getattr(s.section, "rollout", None)
    if rollout is None:
        return []
    errors = []
    if rollout.engine not in SP_ROLLOUT_ENGINES:
        errors.append(
            f"{s.where}.rollout.engine: {rollout.engine} is refused with {FIELD} {n}: the ranks "
            "of a sequence-parallel group must train on the same responses, which the in-process "
            "engines are wired to share; set rollout.engine: hf or fast"
        )
    if rollout.tools or rollout.environment is not None:
        field = "tools" if rollout.tools else "environment"
        errors.append(
            f"{s.where}.rollout.{field} is refused with {FIELD} {n}: every rank of a "
            "sequence-parallel group plays the same episodes, so a tool or environment would "
            f"act {n} times; set {FIELD}: 1 for episodes"
        )
    return errors


def _device_errors(infra: Any, n: int) -> list[str]:
    """Layout fsdp, and N dividing nnodes x devices_per_node (unknown while devices_per_node
    is `auto`)."""
    errors = []
    if infra.layout != "fsdp":
        errors.append(
            f"{FIELD}: {n} with infra.layout {infra.layout} is refused: sequence parallelism "
            "shards parameters over the data-parallel and sequence dimensions of one mesh "
            "(layout fsdp); use infra.layout: fsdp"
        )
    if isinstance(infra.devices_per_node, int) and infra.world_size() % n:
        world = infra.world_size()
        errors.append(
            f"{FIELD}: {n} does not divide the {world} devices (nnodes {infra.nnodes} x "
            f"devices_per_node {infra.devices_per_node}); pick a divisor of {world}"
        )
    return errors


def _base_shape(section: Any, local: bool) -> ModelShape | None:
    """A base's shape where known without downloading: its `from_config` numbers, or (with
    `local`) a local folder's config.json. None otherwise (a hub id, a config the estimate does
    not describe): not checked here."""
    try:
        if section.source == "from_config":
            return ModelShape.from_recipe_model(section.from_config)
        config = Path(section.path or "") / "config.json"
        if local and section.path and config.is_file():
            return ModelShape.from_hf_config(json.loads(config.read_text(encoding="utf-8")))
    except ValueError:
        return None
    return None
