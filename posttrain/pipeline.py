"""The stage graph and its plan: which stages run, in what order, with which fingerprints.

Light on purpose (no torch import): the orchestration layer plans a run, decides what is cached,
and launches `python -m <StageDef.module> --spec <spec.json>` for each stage that must run.
Adding a stage = one `StageDef` here, its recipe section, its module, its test.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.artifacts import (
    ArtifactRef,
    atomic_write_text,
    fingerprint,
    path_identity,
    stage_dir,
)
from posttrain.config.schema import Recipe
from posttrain.data.chat import looks_like_template_file
from posttrain.hub import RepoType, is_hub_id, resolve_sha


@dataclass(frozen=True)
class StageDef:
    name: str
    module: str
    # Bump when a change to the stage's code should invalidate its cached artifacts.
    version: str
    parents: tuple[str, ...]
    # Distributed stages are launched with torchrun, one process per device.
    distributed: bool = False
    # Optional stages run only when the recipe has their section; parents that do not run are
    # simply not inputs (evaluate without dpo evaluates the SFT policy).
    optional: bool = False


STAGES: dict[str, StageDef] = {
    s.name: s
    for s in (
        StageDef("ingest", "posttrain.stages.ingest", "2", ()),
        StageDef("sft", "posttrain.stages.sft", "1", ("ingest",), distributed=True),
        StageDef(
            "reward",
            "posttrain.stages.reward",
            "1",
            ("ingest", "sft"),
            distributed=True,
            optional=True,
        ),
        StageDef(
            "dpo", "posttrain.stages.dpo", "1", ("ingest", "sft"), distributed=True, optional=True
        ),
        *(
            StageDef(
                name,
                f"posttrain.stages.{name}",
                "1",
                ("ingest", "sft", "reward"),
                distributed=True,
                optional=True,
            )
            for name in ("ppo", "grpo")
        ),
        StageDef(
            "evaluate",
            "posttrain.stages.evaluate",
            "1",
            ("ingest", "sft", "reward", "dpo", "ppo", "grpo"),
        ),
        StageDef(
            "export",
            "posttrain.stages.export",
            "1",
            ("ingest", "sft", "dpo", "ppo", "grpo", "evaluate"),
        ),
    )
}

# Stages that tune the SFT policy further; a recipe has at most one (the schema checks), and
# evaluate/export take the policy from it, or from sft when there is none.
POLICY_STAGES = ("dpo", "ppo", "grpo")


# Online RL samples rollouts per rank (each rank its share of prompts, with its own seed), so its
# result depends on the number of ranks: that stays in its fingerprint.
RANK_DEPENDENT = ("ppo", "grpo")


def policy_stage(parents: Any) -> str:
    """The stage whose adapter is the final policy, among a stage's parents."""
    return next((s for s in POLICY_STAGES if s in parents), "sft")


def stage_inputs(recipe: Recipe, name: str) -> tuple[dict[str, Any], Any]:
    """(recipe-derived inputs, outside-world inputs) that determine a stage's output.

    Only what changes the result goes in: timeouts, workspace and run name do not.
    """
    section = getattr(recipe, name).model_dump(mode="json")
    numerics = {
        "seed": recipe.run.seed,
        "precision": recipe.infra.precision,
        "device": recipe.infra.device,
    }
    extra: Any = None
    hub_inputs: dict[str, Any] = {}
    if name == "ingest":
        if recipe.ingest.source == "path" and is_hub_id(recipe.ingest.path):
            hub_inputs["path"] = hub_record(recipe.ingest.path, recipe.ingest.revision, "model")
        elif recipe.ingest.source == "path":
            assert recipe.ingest.path
            extra = {"source": path_identity(recipe.ingest.path)}
            section.pop("revision", None)  # means nothing for a local folder
        else:
            section.pop("path", None)
            section.pop("revision", None)
    elif name in ("sft", "reward", *POLICY_STAGES):
        if recipe.infra.base_dtype == "bf16":  # the training stages' base; fp32 keeps old prints
            numerics["base_dtype"] = "bf16"
        if name in RANK_DEPENDENT:
            numerics["dp_size"] = recipe.infra.world_size()
        else:
            # How the global batch is split (micro x accum x ranks) is execution, not result: the
            # rows of each step and the token-normalised loss do not depend on it, so a run can
            # resume on another number of ranks in the same folder (and reuse a cached artifact).
            section["batch"] = {"global_batch_size": section["batch"]["global_batch_size"]}
        data = getattr(recipe, name).data
        sources = {k: v for k, v in (("path", data.path), ("eval_path", data.eval_path)) if v}
        extra = {k: path_identity(v) for k, v in sources.items() if not is_hub_id(v)}
        hub_inputs = {
            k: hub_record(v, data.revision, "dataset") for k, v in sources.items() if is_hub_id(v)
        }
        # Hub-only fields mean nothing for local files, and no renames is no renames: left out,
        # a recipe that uses neither keeps the fingerprints it had before they existed.
        if not hub_inputs:
            for key in ("split", "eval_split", "revision", "subset"):
                section["data"].pop(key, None)
        if not data.columns:
            section["data"].pop("columns", None)
        # The guard's spike test decides which finite updates are applied: part of the result.
        # Its stop rule (max_bad_steps, window) only decides whether a stage fails, and skipping
        # non-finite steps is always on, so a spike-free recipe's fingerprint stays as it was.
        if recipe.guard.loss_spike_k is not None:
            numerics["guard"] = recipe.guard.model_dump(
                mode="json", include={"loss_spike_k", "loss_spike_window", "loss_spike_min_history"}
            )
    # A template file's text decides the result, not its name: fingerprint its content.
    template = getattr(getattr(recipe, name), "chat_template", None)
    if template and looks_like_template_file(template) and Path(template).is_file():
        extra = {**(extra or {}), "chat_template": path_identity(template)}
    # Only recipes with hub ids get the key, so local-path recipes keep their fingerprints.
    hub = {"hub": hub_inputs} if hub_inputs else {}
    return {"section": section, **numerics, **hub}, extra


def hub_record(repo_id: str, revision: str, repo_type: RepoType) -> dict[str, str]:
    """A hub id's identity for the fingerprint: the commit its revision resolves to now (a
    moved branch is a new run). The stage process pins this commit (`posttrain.hub.pin`), so it
    reads exactly what was fingerprinted. Raises HubError (what, where, offline or not)."""
    sha = resolve_sha(repo_id, revision, repo_type)
    return {"repo_type": repo_type, "hub_repo": repo_id, "revision": revision, "commit_sha": sha}


@dataclass
class PlannedStage:
    name: str
    module: str
    fingerprint: str
    out_dir: Path
    parents: dict[str, str]  # parent stage name -> fingerprint
    nprocs: int  # processes per node
    timeout_s: float
    inputs: dict[str, Any] = field(repr=False, default_factory=dict)
    nnodes: int = 1
    rdzv_endpoint: str | None = None
    # Hang watch (training stages only; see flows.stage_task.supervise_stage): seconds without
    # any rank's heartbeat advancing, plus the allowance before the training loop's first beat.
    hang_timeout_s: float | None = None
    hang_startup_s: float = 0.0


def plan(recipe: Recipe) -> list[PlannedStage]:
    """Fingerprint every stage in order. `recipe` must be resolved (no `auto` left)."""
    out: list[PlannedStage] = []
    fps: dict[str, str] = {}
    for s in STAGES.values():
        if s.optional and getattr(recipe, s.name) is None:
            continue
        inputs, extra = stage_inputs(recipe, s.name)
        parents = {p: fps[p] for p in s.parents if p in fps}
        fp = fingerprint(s.name, s.version, inputs, list(parents.values()), extra)
        fps[s.name] = fp
        nprocs = int(recipe.infra.devices_per_node) if s.distributed else 1
        nnodes = recipe.infra.nnodes if s.distributed else 1
        # Only training stages beat regularly; ingest's warm-up, evaluate and export do not.
        trains = s.name in ("sft", "reward", *POLICY_STAGES)
        out.append(
            PlannedStage(
                name=s.name,
                module=s.module,
                fingerprint=fp,
                out_dir=stage_dir(recipe.run.workspace, s.name, fp),
                parents=parents,
                nprocs=nprocs,
                timeout_s=getattr(recipe.infra.timeouts, s.name),
                inputs=inputs,
                nnodes=nnodes,
                rdzv_endpoint=recipe.infra.rdzv_endpoint if nnodes > 1 else None,
                hang_timeout_s=recipe.infra.hang_timeout_s if trains else None,
                hang_startup_s=recipe.infra.hang_startup_s,
            )
        )
    return out


def write_spec(stage: PlannedStage, recipe: Recipe, parent_refs: dict[str, ArtifactRef]) -> Path:
    """Write the JSON a stage process reads (`--spec`): the resolved recipe, its fingerprint, its
    output folder and its parents' refs. Kept under logs/ so the manifest does not cover it."""
    spec = {
        "stage": stage.name,
        "fingerprint": stage.fingerprint,
        "out_dir": str(stage.out_dir),
        "inputs": stage.inputs,
        "parents": {k: v.model_dump() for k, v in parent_refs.items()},
        "recipe": recipe.model_dump(mode="json"),
    }
    path = stage.out_dir / "logs" / "spec.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    # Atomically: a concurrent run of the same stage rewrites this file while our process (or
    # one of its ranks) may be reading it.
    atomic_write_text(path, json.dumps(spec, indent=2))
    return path
