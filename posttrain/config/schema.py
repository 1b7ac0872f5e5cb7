"""The recipe: one pydantic schema for the YAML file, the CLI overrides and the Prefect UI form.

Every field is documented where it is declared; `docs/recipes.md` is generated from these
descriptions (`python -m posttrain.config.docs`). Validation happens at load time, before any
work starts, and every error names the field path (`sft.optim.lr: ...`).

The stage sections come from the stage registry (`posttrain/kinds/`): each kind's section is
declared beside its registration, and this module builds from them the shorthand top-level
sections (`sft:`, `dpo:` ...) and the `stages:` graph entries (`posttrain/config/graph.py`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Field, create_model, model_validator

from posttrain.config.batch import stage_batch
from posttrain.config.graph import GraphError, StageGraph, build_graph
from posttrain.config.sp_check import sp_errors
from posttrain.kinds import KINDS, graph_kinds
from posttrain.kinds.evaluate import EvaluateConfig
from posttrain.kinds.export import ExportConfig
from posttrain.kinds.ingest import IngestConfig
from posttrain.secrets import find_secrets
from posttrain.sections.fields import Execution, _Section
from posttrain.sections.infra import InfraConfig
from posttrain.sections.run import RunConfig, ScheduleConfig, TrackingConfig
from posttrain.sections.shared import GuardConfig, TrainingSection

STAGE_NAME = r"^[A-Za-z][A-Za-z0-9_-]{0,63}$"


class PromotionRule(_Section):
    metric: str = Field(
        description="A key of the evaluate stage's headline, e.g. tuned_loss, lm_eval/mmlu/acc."
    )
    direction: Literal["min", "max"] = Field(description="`min`: lower is better; `max`: higher.")
    tolerance: float = Field(
        0.0, ge=0, description="How much worse than the champion still counts as no regression."
    )


class PromotionConfig(_Section):
    enabled: bool = Field(
        True,
        description="Compare each completed run with the pipeline's champion and promote it "
        "only if no rule regresses.",
    )
    rules: list[PromotionRule] = Field(
        default_factory=lambda: [
            PromotionRule(metric="tuned_loss", direction="min", tolerance=0.02),
            PromotionRule(metric="exact_match_tuned", direction="max", tolerance=0.02),
            PromotionRule(metric="pass@1", direction="max", tolerance=0.02),
            PromotionRule(metric="rm_accuracy", direction="max", tolerance=0.02),
            PromotionRule(metric="win_rate_vs_parent", direction="max", tolerance=0.05),
            PromotionRule(metric="win_rate_vs_champion", direction="max", tolerance=0.05),
        ],
        description="Metric, direction, tolerance; a metric absent from either run is skipped. "
        "`win_rate_vs_champion` (candidate vs champion answers judged by the candidate's reward "
        "model; needs a reward section) is compared with 0.5, the champion against itself; "
        "if its head-to-head fails, the candidate is not promoted.",
    )


class StageName(_Section):
    """The name of a `stages:` entry."""

    name: str = Execution(
        description="Unique stage name (default: its kind); names its folder in reports and "
        "what other stages' links refer to.",
        pattern=STAGE_NAME,
    )

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and "name" not in data and isinstance(data.get("kind"), str):
            data = {**data, "name": data["kind"]}
        return data


class StageLinks(StageName):
    """Where a `stages:` entry sits in the graph."""

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    from_: str | None = Execution(
        None,
        alias="from",
        description="The stage whose policy this one starts from (`ingest` = the base model; "
        "the name of an `ingest` entry = that base). Default: the previous policy stage, else "
        "the base (the one `base` names, when it is written).",
    )
    reference: str | None = Execution(
        None,
        description="The frozen policy its KL / implicit reward is measured against (kinds "
        "with a reference). Default: the policy it starts from.",
    )
    reward_model: str | None = Execution(
        None,
        description="The reward stage whose model scores its rollouts (PPO, GRPO). Default: "
        "the last reward stage before it.",
    )
    base: str | None = Execution(
        None,
        description="The base model this stage stands on: `ingest` (the top-level section) or "
        "the name of an `ingest` entry of `stages:`. Only for a stage that starts from a base "
        "(it then starts from this one unless `from` says otherwise); a stage that starts from "
        "a policy stands on that policy's base. Default: `ingest`.",
    )
    teacher: str | None = Execution(
        None,
        description="The frozen model it learns from (distill; sft: answers the prompts of its "
        "data): a policy stage or a base, on any base whose tokenizer is the student's. No "
        "default.",
    )


def _stage_entry(name: str) -> type:
    kind = KINDS[name]
    # An ingest entry is one more base: named, no links.
    head = StageLinks if kind.placement == "graph" else StageName
    return create_model(  # type: ignore[call-overload]
        f"{kind.section.__name__.removesuffix('Config')}Stage",
        __base__=(head, kind.section),
        __doc__=kind.help,
        # Which kind it is: its fingerprint hashes the kind itself.
        kind=(Literal[name], Execution(description=f"`{name}`: {kind.help}")),
    )


# The kinds a `stages:` entry may be: the graph kinds, and ingest (one more base model).
ENTRY_KINDS = [n for n, k in KINDS.items() if k.placement != "last"]

# One `stages:` entry per entry kind, told apart by its `kind`.
StageEntry = Annotated[
    Union[tuple(_stage_entry(n) for n in ENTRY_KINDS)],  # noqa: UP007
    Field(discriminator="kind"),
]


class _RecipeHead(_Section):
    """A whole post-training run."""

    # A refused recipe's error must not echo its input: it may hold the token it is refused for.
    model_config = ConfigDict(hide_input_in_errors=True)

    run: RunConfig = Field(default_factory=RunConfig, description="Name, workspace, seed.")
    infra: InfraConfig = Field(default_factory=InfraConfig, description="Devices and limits.")
    ingest: IngestConfig = Field(description="Base checkpoint.")


def _shorthand_fields() -> dict[str, Any]:
    return {
        name: (
            kind.section | None,
            Field(
                None,
                description=f"{kind.help} Shorthand for a `stages:` entry named "
                f"`{name}`; omit to skip.",
            ),
        )
        for name, kind in graph_kinds().items()
    }


# The shorthand sections come right after `ingest`, in chain order (a recipe dumps its fields
# in declaration order: the UI form and `plan --resolved` show them so).
_RecipeStages = create_model(  # type: ignore[call-overload]
    "_RecipeStages", __base__=_RecipeHead, **_shorthand_fields()
)


class Recipe(_RecipeStages):  # type: ignore[misc,valid-type]
    """A whole post-training run."""

    # As written (the YAML, the Prefect form, which shows this docstring): see ResolvedRecipe.

    stages: list[StageEntry] = Field(
        default_factory=list,
        description="The stage graph beyond the shorthand sections: entries with `kind`, "
        "`name`, their kind's fields and links (`from`, `reference`, `reward_model`, "
        "`base`, `teacher`); an entry of kind `ingest` (every field of `ingest:`, and a name) is one "
        "more base model. Shorthand sections run first, in chain order; see "
        "docs/stage-graphs.md.",
    )
    evaluate: EvaluateConfig | None = Field(
        default_factory=EvaluateConfig,
        description="Evaluation (on by default). null = no evaluate stage; the promotion "
        "gate, which compares evaluate's metrics, is then off too.",
    )
    export: ExportConfig | None = Field(
        default_factory=ExportConfig,
        description="Merged export (on by default). null = no export stage.",
    )
    guard: GuardConfig = Field(
        default_factory=GuardConfig,
        description="Numerical guards of the training stages: skip non-finite or spiking "
        "steps, stop after too many.",
    )
    promotion: PromotionConfig = Field(
        default_factory=PromotionConfig,
        description="The gate that decides whether a run replaces the pipeline's champion.",
    )
    schedule: ScheduleConfig | None = Field(
        None,
        description="Cron/interval schedule and event trigger for the served deployment "
        "(`posttrain serve`); omit for on-request runs only.",
    )
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig,
        description="Experiment trackers (TensorBoard on by default, MLflow, W&B) fed from "
        "the stages' metrics.jsonl; not part of any fingerprint.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_secrets(cls, data: Any) -> Any:
        # The loader reports these field by field before validating; this catches recipes that
        # arrive by another way (a Prefect UI form, a deployment parameter, code).
        found = find_secrets(data) if isinstance(data, dict) else []
        if found:
            raise ValueError(
                "; ".join(f"{where}: looks like a secret ({kind})" for where, kind in found)
                + ". A recipe holds no credentials: pass them through the environment"
            )
        return data

    @model_validator(mode="before")
    @classmethod
    def _no_gate_without_evaluate(cls, data: Any) -> Any:
        # `evaluate: null` leaves the gate nothing to compare: it goes off with it, unless the
        # recipe asks for it (refused after validation, naming the field).
        off = isinstance(data, dict) and "evaluate" in data and data["evaluate"] is None
        if off and "promotion" not in data:
            data = {**data, "promotion": {"enabled": False}}
        return data

    @model_validator(mode="after")
    def _gate_needs_evaluate(self) -> Recipe:
        if self.evaluate is None and self.promotion.enabled and self.promotion.rules:
            metrics = ", ".join(r.metric for r in self.promotion.rules)
            raise ValueError(
                f"promotion.rules: compare the evaluate stage's metrics ({metrics}), but "
                "`evaluate` is null: keep evaluate, or set promotion.enabled: false"
            )
        return self

    @model_validator(mode="after")
    def _stage_graph(self) -> Recipe:
        graph = build_graph(self)  # GraphError is a ValueError: reported like any field's
        names = set(graph.names()) | set(graph.bases)
        errors = []
        for n in self.evaluate.policies if self.evaluate is not None else []:
            if n not in graph.policies():
                errors.append(f"evaluate.policies: {n!r} is not a policy stage ({_list(graph)})")
            elif (base := graph.base_of(n)) != (final := graph.base_of(graph.final_policy())):
                # Evaluate puts every policy it compares on one base model.
                errors.append(
                    f"evaluate.policies: {n!r} stands on the base {base!r}, the evaluated "
                    f"policy on {final!r}; compare policies of one base"
                )
        if self.evaluate is not None:
            errors += _pass_k_errors(self.evaluate.pass_k_policies, self.evaluate.policies, graph)
        policy = self.export.policy if self.export is not None else None
        if policy is not None and policy not in graph.policies():
            errors.append(f"export.policy: {policy!r} is not a policy stage ({_list(graph)})")
        for key in self.infra.timeouts.model_extra or {}:
            if key not in names:
                errors.append(f"infra.timeouts.{key}: no stage of that name ({_list(graph)})")
        if errors:
            raise GraphError(errors)
        return self

    @model_validator(mode="after")
    def _batch_arithmetic(self) -> Recipe:
        # With devices_per_node = "auto" the data-parallel size is only known once devices are
        # probed; `posttrain.config.loader.resolve` checks it then.
        if isinstance(self.infra.devices_per_node, int):
            for s in self.graph():
                stage_batch(s, self.infra.dp_size())
        return self

    @model_validator(mode="after")
    def _sequence_parallel(self) -> Recipe:
        if errors := sp_errors(self):
            raise GraphError(errors)
        return self

    def graph(self) -> StageGraph:
        """The stage graph (links filled, run order), over this recipe's own section objects
        (built each time: a copied recipe must not see its original's sections)."""
        return build_graph(self)

    def stage(self, name: str) -> Any:
        """The section of graph stage `name` (shorthand section or `stages:` entry), of a base
        (`ingest`, or an ingest entry of `stages:`), or of a fixed stage (evaluate, export)."""
        if name in KINDS and KINDS[name].placement != "graph":
            return getattr(self, name)
        graph = self.graph()
        return (graph.bases[name] if name in graph.bases else graph.get(name)).section

    def training_sections(self) -> dict[str, TrainingSection]:
        """The graph's stages, by name, in run order."""
        return {s.name: s.section for s in self.graph()}


class ResolvedRecipe(Recipe):
    """A `Recipe` made concrete by `posttrain.config.loader.resolve`: no `auto` device, precision
    or parallelism left, paths absolute, batch triples filled. What the planner and a stage
    process take (a stage's spec carries it as JSON: validating that refuses an `auto`)."""

    @model_validator(mode="after")
    def _concrete(self) -> ResolvedRecipe:
        fields = ("device", "devices_per_node", "precision", "base_dtype", "parallel_stages")
        if auto := [f"infra.{f}" for f in fields if getattr(self.infra, f) == "auto"]:
            raise ValueError(f"{', '.join(auto)}: `auto` in a resolved recipe")
        return self


def _list(graph: StageGraph) -> str:
    return "policy stages: " + ", ".join(graph.policies())


def _pass_k_errors(setting: str | list[str], listed: list[str], graph: StageGraph) -> list[str]:
    """`evaluate.pass_k_policies` as a list: each name must be a policy the verifier report
    compares (the final policy's base, parent and teacher, the final policy, `evaluate.policies`)."""
    final = graph.final_policy()
    if not isinstance(setting, list) or final is None:
        return []
    teacher = graph.get(final).links.get("teacher")
    compared = [graph.base_of(final), graph.parent(final), final, *listed, teacher]
    compared = list(dict.fromkeys(n for n in compared if n))
    known = f"the policies evaluate compares: {', '.join(compared)}"
    return [
        f"evaluate.pass_k_policies: {n!r} is not compared ({known}); add it to "
        "evaluate.policies to compare it"
        if n in graph.policies()
        else f"evaluate.pass_k_policies: no policy named {n!r} ({known}; or write `final` or "
        "`all` without brackets)"
        for n in setting
        if n not in compared
    ]
