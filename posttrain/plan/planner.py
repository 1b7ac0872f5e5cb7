"""The plan of a run: the recipe's stages in run order, each with its inputs (which artifact
plays which role), its fingerprint and its folder.

Light on purpose (no torch import): the orchestration layer plans a run, decides what is cached,
and launches `python -m <kind.module> --spec <spec.json>` for each stage that must run. What a
stage kind is (its module, what it consumes, whether it trains) comes from the registry
(`posttrain/kinds/`); how stages link comes from the recipe's graph (`posttrain/config/graph.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.config.graph import StageGraph
from posttrain.config.schema import Recipe, ResolvedRecipe
from posttrain.kinds import KINDS, StageKind
from posttrain.plan.fingerprints import stage_inputs
from posttrain.runtime.spec import PlannedStage, StageSpec
from posttrain.store.artifacts import ArtifactRef, fingerprint, stage_dir


def stage_roles(recipe: Recipe, graph: StageGraph, kind: StageKind, name: str) -> dict[str, str]:
    """Which artifact each input of stage `name` is."""
    if kind.placement == "first":
        return {}
    if kind.placement == "graph":
        links = graph.get(name).links
        roles = {"base": graph.base_of(name), **links}
        if "teacher" in links:  # the teacher stands on a base of its own
            roles["teacher_base"] = graph.base_of(links["teacher"])
        return roles
    chosen = getattr(getattr(recipe, name), "policy", None)
    final = chosen or graph.final_policy()
    assert final is not None  # the schema requires a policy stage
    # The base of the policy it evaluates or exports.
    roles = {"base": graph.base_of(final), "policy": final}
    if (parent := graph.parent(final)) not in graph.bases:
        roles["parent"] = parent
    if (heldout := graph.heldout_source(final)) is not None:
        roles["heldout"] = heldout
    rm = graph.get(final).links.get("reward_model") or (graph.reward_models() or [None])[-1]
    if kind.produces == "evaluation":
        if rm is not None:
            roles["reward_model"] = rm
        if (verifier := graph.verifier_source(final)) is not None:
            roles["verifier"] = verifier
        if (teacher := graph.get(final).links.get("teacher")) is not None:
            # Distilled: the teacher is scored beside the student, on its own base.
            roles["teacher"] = teacher
            roles["teacher_base"] = graph.base_of(teacher)
    else:
        evaluation = next(k.name for k in KINDS.values() if k.produces == "evaluation")
        if getattr(recipe, evaluation) is not None:  # `evaluate: null`: export reads no report
            roles["evaluation"] = evaluation
    return roles


def evaluate_reads(recipe: Recipe, graph: StageGraph) -> list[str]:
    """Every stage evaluate's `policies` comparison reads: each listed policy and its parent."""
    out: list[str] = []
    for n in recipe.evaluate.policies if recipe.evaluate is not None else []:
        out += [n, graph.parent(n)]
        if (heldout := graph.heldout_source(n)) is not None:
            out.append(heldout)
    return out


@dataclass
class RunPlan:
    """Everything a run needs from its recipe, asked once: the resolved recipe, its stages in
    run order (fingerprints, folders, inputs by role, how each runs) and the devices."""

    recipe: ResolvedRecipe
    stages: list[PlannedStage]
    device: str  # "cpu" or "cuda"
    parallel: int  # stages that may run at once (infra.parallel_stages, resolved)
    devices_per_stage: int
    # The recipe's stages this run leaves out (`--until`/`--only`: posttrain.plan.selection.choose).
    not_selected: list[str] = field(default_factory=list)

    def stage(self, name: str) -> PlannedStage:
        return next(s for s in self.stages if s.name == name)

    def pending(self, done: set[str]) -> list[PlannedStage]:
        """The planned stages not in `done`, in run order (what a failed run did not reach)."""
        return [s for s in self.stages if s.name not in done]


def plan(recipe: ResolvedRecipe) -> RunPlan:
    """The run's plan, of a recipe `posttrain.config.loader.resolve` made concrete (what each
    entry point does once: `load_recipe`, or the flow for a served run's recipe)."""
    if not isinstance(recipe, ResolvedRecipe):  # its `auto`s and relative paths would be planned
        raise TypeError(f"plan takes a ResolvedRecipe (resolve it), not a {type(recipe).__name__}")
    infra = recipe.infra
    return RunPlan(
        recipe=recipe,
        stages=_plan_stages(recipe),
        device=str(infra.device),
        parallel=int(infra.parallel_stages),
        devices_per_stage=int(infra.devices_per_node),
    )


def _plan_stages(recipe: ResolvedRecipe) -> list[PlannedStage]:
    """Fingerprint every stage in run order."""
    graph = recipe.graph()
    # The bases first (`ingest`, then the recipe's ingest entries), then the graph.
    order = list(graph.bases)
    order += graph.names()
    # The last stages (evaluate, export) unless the recipe turns them off (`evaluate: null`).
    order += [k.name for k in KINDS.values() if k.placement == "last" and getattr(recipe, k.name)]
    out: list[PlannedStage] = []
    fps: dict[str, str] = {}
    for name in order:
        fixed = name in KINDS and KINDS[name].placement != "graph"
        node = graph.bases.get(name) or (None if fixed else graph.get(name))
        # Looked up here (not taken from the graph) so a test can stand another module in.
        kind = KINDS[node.kind.name if node is not None else name]
        roles = stage_roles(recipe, graph, kind, name)
        reads = set(roles.values())
        if kind.produces == "evaluation":
            reads |= set(evaluate_reads(recipe, graph))
        parents = {p: fps[p] for p in order if p in reads and p in fps}
        section = node.section if node is not None else getattr(recipe, name)
        inputs = stage_inputs(recipe, kind, section)
        fp = fingerprint(kind.name, kind.version, inputs, parent_prints(parents, roles))
        fps[name] = fp
        out.append(_planned(recipe, kind, name, fp, inputs, parents, roles))
    return out


def parent_prints(parents: dict[str, str], roles: dict[str, str]) -> dict[str, str]:
    """A stage's parents for its fingerprint, by role (which parent is its reference, which
    its policy, is part of what it computes; their stage names are not), and the stages it
    reads by name besides (evaluate's `policies`, named in its section anyway)."""
    by_role = {role: parents[name] for role, name in roles.items() if name in parents}
    named = {f"reads:{n}": fp for n, fp in parents.items() if n not in roles.values()}
    return by_role | named


def _planned(
    recipe: ResolvedRecipe,
    kind: StageKind,
    name: str,
    fp: str,
    inputs: dict[str, Any],
    parents: dict[str, str],
    roles: dict[str, str],
) -> PlannedStage:
    infra = recipe.infra
    nnodes = infra.nnodes if kind.distributed else 1
    return PlannedStage(
        name=name,
        module=kind.module,
        fingerprint=fp,
        out_dir=stage_dir(recipe.run.workspace, kind.name, fp),
        parents=parents,
        nprocs=int(infra.devices_per_node) if kind.distributed else 1,
        timeout_s=infra.timeouts.for_stage(name, kind.name),
        inputs=inputs,
        nnodes=nnodes,
        rdzv_endpoint=infra.rdzv_endpoint if nnodes > 1 else None,
        # Ingest stays where the flow runs (it may download, and compute nodes often have no
        # internet); every other stage goes to the recipe's engine.
        launcher="local" if kind.placement == "first" else infra.launcher,
        infra=infra.model_dump(mode="json"),
        # Only training stages beat regularly; ingest, evaluate and export do not.
        hang_timeout_s=infra.hang_timeout_s if kind.trains else None,
        hang_startup_s=infra.hang_startup_s,
        kind=kind.name,
        produces=kind.produces,
        roles=roles,
    )


def spec_for(
    stage: PlannedStage, recipe: ResolvedRecipe, parent_refs: dict[str, ArtifactRef]
) -> StageSpec:
    """What a stage process builds (`posttrain.runtime.spec`): the planned stage, its parents'
    refs and the resolved recipe. Its supervisor adds the launch record and writes it to
    `logs/spec.json`."""
    return StageSpec(stage=stage, parents=parent_refs, recipe=recipe.model_dump(mode="json"))
