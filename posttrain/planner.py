"""The plan of a run: the recipe's stages in run order, each with its inputs (which artifact
plays which role), its fingerprint and its folder.

Light on purpose (no torch import): the orchestration layer plans a run, decides what is cached,
and launches `python -m <kind.module> --spec <spec.json>` for each stage that must run. What a
stage kind is (its module, what it consumes, whether it trains) comes from the registry
(`posttrain/kinds/`); how stages link comes from the recipe's graph (`posttrain/config/graph.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.artifacts import ArtifactRef, fingerprint, path_identity, stage_dir
from posttrain.config.graph import BASE, StageGraph
from posttrain.config.loader import is_resolved, resolve
from posttrain.config.reach import ServedReach
from posttrain.config.schema import Recipe
from posttrain.data.chat import looks_like_template_file
from posttrain.hub import RepoType, is_hub_id, resolve_sha
from posttrain.kinds import KINDS, StageKind
from posttrain.stage_spec import StageSpec


def stage_inputs(
    recipe: Recipe, name: str, graph: StageGraph | None = None
) -> tuple[dict[str, Any], Any]:
    """(recipe-derived inputs, outside-world inputs) that determine a stage's output.

    Only what changes the result goes in: timeouts, workspace, run name and a stage's own name
    do not (renaming a stage reuses its artifact).
    """
    # `plan` passes the graph it built: rebuilding it per stage re-validates the recipe and
    # re-reads its template files every time.
    graph = graph or recipe.graph()
    kind = KINDS[name] if name in KINDS and KINDS[name].placement != "graph" else None
    if kind is None:
        node = graph.get(name)
        kind, own = node.kind, node.section
        section = node.section_fields()
    else:
        own = getattr(recipe, name)
        section = own.model_dump(mode="json")
    numerics = {
        "seed": recipe.run.seed,
        "precision": recipe.infra.precision,
        "device": recipe.infra.device,
    }
    extra: Any = None
    hub_inputs: dict[str, Any] = {}
    if kind.placement == "first":
        if recipe.ingest.source == "path" and is_hub_id(recipe.ingest.path):
            hub_inputs["path"] = hub_record(recipe.ingest.path, recipe.ingest.revision, "model")
        elif recipe.ingest.source == "path":
            assert recipe.ingest.path
            extra = {"source": path_identity(recipe.ingest.path)}
            section.pop("revision", None)  # means nothing for a local folder
        else:
            section.pop("path", None)
            section.pop("revision", None)
    elif kind.placement == "last":
        # Fields added since: left out at their defaults, so older recipes keep their prints.
        for key in ("policies", "policy"):
            if section.get(key) in ([], None):
                section.pop(key, None)
        # lm-eval tasks (added since): absent when off, so older recipes keep their prints; a
        # custom task folder counts by its content (YAMLs and the data files kept beside them).
        if section.get("lm_eval", 0) is None:
            section.pop("lm_eval")
        include = (section.get("lm_eval") or {}).get("include_path")
        if include:
            section["lm_eval"]["include_path"] = path_identity(include)
        own_verifiers = getattr(own, "verifiers", None)
        if own_verifiers:
            section["verifiers"] = [reward_identity(v) for v in own_verifiers]
        # The verifier report's fields (added since): left out at their defaults.
        fields = type(own).model_fields
        for key in ("verifiers", "pass_threshold", "pass_prompts", "pass_k", "pass_samples"):
            if key in fields and section.get(key) == fields[key].get_default():
                section.pop(key)
        if "pass_sampling" in fields:
            default_sampling = fields["pass_sampling"].get_default(call_default_factory=True)
            if section.get("pass_sampling") == default_sampling.model_dump(mode="json"):
                section.pop("pass_sampling")
    elif kind.trains:
        node = graph.get(name)
        if recipe.infra.base_dtype == "bf16":  # the training stages' base; fp32 keeps old prints
            numerics["base_dtype"] = "bf16"
        if kind.rank_dependent:
            numerics["dp_size"] = recipe.infra.world_size()
            # Execution layout of a step's rows (padded or not, how many per forward), added
            # since: it does not apply to these stages' rollouts; left out of their prints.
            for key in ("padding_free", "by_tokens"):
                section["batch"].pop(key, None)
        else:
            # How the global batch is split (micro x accum x ranks) is execution, not result: the
            # rows of each step and the token-normalised loss do not depend on it, so a run can
            # resume on another number of ranks in the same folder (and reuse a cached artifact).
            section["batch"] = {"global_batch_size": section["batch"]["global_batch_size"]}
        # Which parent plays which role, where the parents' fingerprints alone do not say it.
        if "reference" in node.links and node.links["reference"] != node.links.get("policy"):
            numerics["links"] = dict(sorted(node.links.items()))
        data = node.section.data
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
        # Reward functions: their code decides the result, not where its file lies.
        rewards = getattr(node.section, "rewards", None)
        if rewards:
            section["rewards"] = [reward_identity(spec) for spec in rewards]
        else:
            section.pop("rewards", None)
        # Auto precompute (null, added since) reads as the `false` older recipes fingerprinted.
        if "precompute_reference" in section and section["precompute_reference"] is None:
            section["precompute_reference"] = False
        if section.get("reward_model_weight") == 1.0:
            section.pop("reward_model_weight")
        # Online-RL fields added with the algorithm registry, left out where they mean what the
        # loop did before them (grpo, token mean, symmetric clip, no dynamic sampling).
        if "clip_range" in section:
            for key, before in (
                ("algorithm", ("grpo",)),
                ("loss_aggregation", (None, "token_mean")),
                ("clip_range_high", (None, section["clip_range"])),
                ("dynamic_sampling", (False,)),
            ):
                if key in section and section[key] in before:
                    section.pop(key)
            if not section.get("dynamic_sampling"):
                section.pop("max_sampling_rounds", None)
        # Rollout fields added since: left out at their defaults, so RL recipes keep their prints.
        rollout = section.get("rollout")
        if isinstance(rollout, dict):
            for key, default in (("engine", "hf"), ("drop_finished", False)):
                if rollout.get(key) == default:
                    rollout.pop(key)
        # The guard's spike test decides which finite updates are applied: part of the result.
        # Its stop rule (max_bad_steps, window) only decides whether a stage fails, and skipping
        # non-finite steps is always on, so a spike-free recipe's fingerprint stays as it was.
        if recipe.guard.loss_spike_k is not None:
            numerics["guard"] = recipe.guard.model_dump(
                mode="json", include={"loss_spike_k", "loss_spike_window", "loss_spike_min_history"}
            )
    # export.gguf, added since: left out when empty, so exports keep their fingerprints.
    if kind.produces == "export" and not section.get("gguf"):
        section.pop("gguf", None)
    # A template file's text decides the result, not its name: fingerprint its content.
    template = getattr(own, "chat_template", None)
    if template and looks_like_template_file(template) and Path(template).is_file():
        extra = {**(extra or {}), "chat_template": path_identity(template)}
    # Only recipes with hub ids get the key, so local-path recipes keep their fingerprints.
    hub = {"hub": hub_inputs} if hub_inputs else {}
    return {"section": section, **numerics, **hub}, extra


def reward_identity(spec: Any) -> dict[str, Any]:
    """A reward function's part of the fingerprint: its name, weight, bound kwargs and its
    module's source (sha256), not the module's path."""
    from posttrain.rewards.loader import source_file, source_sha256
    from posttrain.rewards.spec import split_ref

    out = spec.model_dump(mode="json", exclude={"fn"})
    return out | {
        "function": split_ref(spec.fn)[1],
        "source_sha256": source_sha256(source_file(spec.fn)),
    }


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
    # Hang watch (training stages only; see flows.stage_supervise.supervise_stage): seconds without
    # any rank's heartbeat advancing, plus the allowance before the training loop's first beat.
    hang_timeout_s: float | None = None
    hang_startup_s: float = 0.0
    kind: str = ""
    # What its artifact is for the stages that consume it (the kind's `produces`).
    produces: str = ""
    # role -> parent stage name: "base", "policy" (what it starts from), "reference",
    # "reward_model"; evaluate and export also "parent" (the policy's own parent), "heldout"
    # (where held-out conversations come from) and "evaluation".
    roles: dict[str, str] = field(default_factory=dict)
    # GPUs this stage may use (CUDA_VISIBLE_DEVICES), set by the flow when stages run side by
    # side (infra.parallel_stages); None = all the launcher sees.
    visible_devices: str | None = None
    # What runs it (infra.launcher: local, slurm, kubernetes) and the infra section the launcher
    # reads its settings from (JSON-able: the stage travels as a Prefect task parameter).
    launcher: str = "local"
    infra: dict[str, Any] = field(repr=False, default_factory=dict)


def stage_roles(recipe: Recipe, graph: StageGraph, kind: StageKind, name: str) -> dict[str, str]:
    """Which artifact each input of stage `name` is."""
    if kind.placement == "first":
        return {}
    if kind.placement == "graph":
        return {"base": BASE, **graph.get(name).links}
    chosen = getattr(getattr(recipe, name), "policy", None)
    final = chosen or graph.final_policy()
    assert final is not None  # the schema requires a policy stage
    roles = {"base": BASE, "policy": final}
    if (parent := graph.parent(final)) != BASE:
        roles["parent"] = parent
    if (heldout := graph.heldout_source(final)) is not None:
        roles["heldout"] = heldout
    rm = graph.get(final).links.get("reward_model") or (graph.reward_models() or [None])[-1]
    if kind.produces == "evaluation":
        if rm is not None:
            roles["reward_model"] = rm
        if (verifier := graph.verifier_source(final)) is not None:
            roles["verifier"] = verifier
    else:
        evaluation = next(k.name for k in KINDS.values() if k.produces == "evaluation")
        roles["evaluation"] = evaluation
    return roles


def evaluate_reads(recipe: Recipe, graph: StageGraph) -> list[str]:
    """Every stage evaluate's `policies` comparison reads: each listed policy and its parent."""
    out = []
    for n in recipe.evaluate.policies:
        out += [n, graph.parent(n)]
        if (heldout := graph.heldout_source(n)) is not None:
            out.append(heldout)
    return out


@dataclass
class RunPlan:
    """Everything a run needs from its recipe, asked once: the resolved recipe, its stages in
    run order (fingerprints, folders, inputs by role, how each runs) and the devices."""

    recipe: Recipe
    stages: list[PlannedStage]
    device: str  # "cpu" or "cuda"
    parallel: int  # stages that may run at once (infra.parallel_stages, resolved)
    devices_per_stage: int

    def stage(self, name: str) -> PlannedStage:
        return next(s for s in self.stages if s.name == name)

    def pending(self, done: set[str]) -> list[PlannedStage]:
        """The planned stages not in `done`, in run order (what a failed run did not reach)."""
        return [s for s in self.stages if s.name not in done]


def plan(recipe: Recipe, served: ServedReach | None = None) -> RunPlan:
    """The run's plan. `recipe` is resolved here unless it already was (`posttrain run`
    resolves it to validate before anything starts); `served`: the worker's reach, for a run a
    server created from a deployment (its recipe may only narrow it), checked first.
    Raises RecipeError naming each field at fault."""
    if served is not None:
        served.check(recipe)
    if not is_resolved(recipe):
        recipe = resolve(recipe, code_roots=served.reward_roots if served is not None else None)
    infra = recipe.infra
    return RunPlan(
        recipe=recipe,
        stages=_plan_stages(recipe),
        device=str(infra.device),
        parallel=int(infra.parallel_stages),
        devices_per_stage=int(infra.devices_per_node),
    )


def _plan_stages(recipe: Recipe) -> list[PlannedStage]:
    """Fingerprint every stage in run order. `recipe` must be resolved (no `auto` left)."""
    graph = recipe.graph()
    order = [k.name for k in KINDS.values() if k.placement == "first"]
    order += graph.names()
    order += [k.name for k in KINDS.values() if k.placement == "last"]
    out: list[PlannedStage] = []
    fps: dict[str, str] = {}
    for name in order:
        kind = KINDS[name] if name in KINDS and KINDS[name].placement != "graph" else None
        # Looked up here (not taken from the graph) so a test can stand another module in.
        kind = KINDS[(kind or graph.get(name).kind).name]
        roles = stage_roles(recipe, graph, kind, name)
        reads = set(roles.values())
        if kind.produces == "evaluation":
            reads |= set(evaluate_reads(recipe, graph))
        # In run order: the fingerprint hashes the parents' prints in this order.
        parents = {p: fps[p] for p in order if p in reads and p in fps}
        inputs, extra = stage_inputs(recipe, name, graph)
        fp = fingerprint(kind.name, kind.version, inputs, list(parents.values()), extra)
        fps[name] = fp
        nprocs = int(recipe.infra.devices_per_node) if kind.distributed else 1
        nnodes = recipe.infra.nnodes if kind.distributed else 1
        out.append(
            PlannedStage(
                name=name,
                module=kind.module,
                fingerprint=fp,
                out_dir=stage_dir(recipe.run.workspace, kind.name, fp),
                parents=parents,
                nprocs=nprocs,
                timeout_s=recipe.infra.timeouts.for_stage(name),
                inputs=inputs,
                nnodes=nnodes,
                rdzv_endpoint=recipe.infra.rdzv_endpoint if nnodes > 1 else None,
                # Ingest stays where the flow runs (it may download, and compute nodes often
                # have no internet); every other stage goes to the recipe's engine.
                launcher="local" if kind.placement == "first" else recipe.infra.launcher,
                infra=recipe.infra.model_dump(mode="json"),
                # Only training stages beat regularly; ingest, evaluate and export do not.
                hang_timeout_s=recipe.infra.hang_timeout_s if kind.trains else None,
                hang_startup_s=recipe.infra.hang_startup_s,
                kind=kind.name,
                produces=kind.produces,
                roles=roles,
            )
        )
    return out


def spec_for(stage: PlannedStage, recipe: Recipe, parent_refs: dict[str, ArtifactRef]) -> StageSpec:
    """What a stage process builds (`posttrain.stage_spec`): the resolved recipe, the stage's
    fingerprint, folder, inputs and roles, and its parents' refs. Its supervisor adds the
    launch record and writes it to `logs/spec.json`."""
    return StageSpec(
        stage=stage.name,
        kind=stage.kind,
        roles=stage.roles,
        fingerprint=stage.fingerprint,
        out_dir=str(stage.out_dir),
        inputs=stage.inputs,
        parents=parent_refs,
        recipe=recipe.model_dump(mode="json"),
    )
