"""kto: the recipe section of the KTO stage (unpaired desirable / undesirable feedback).

KTO (Ethayarajh et al., 2024) tunes a policy from single completions labelled good or bad,
against a frozen reference (by default the policy it starts from); paired preference files are read as they are, each pair
giving one desirable and one undesirable row. The stage process is `posttrain.stages.kto`.
"""

from __future__ import annotations

from pydantic import Field

from posttrain.kinds._kind import seq_memory, trainer
from posttrain.sections.fields import Result
from posttrain.sections.shared import PreferenceDataConfig, TemplateGuard, TrainingSection


class KTODataConfig(PreferenceDataConfig):
    path: str | None = Result(
        None,
        source="data",
        description="JSONL, JSON, Parquet file, a saved `datasets` folder or a hub dataset id "
        "`org/name` of unpaired feedback: `prompt` + `completion` (text or message lists) + "
        "`label` (true = desirable, false = undesirable); or a preference file as it is "
        "(`prompt`/`chosen`/`rejected`, or implicit-prompt `chosen`/`rejected` conversations), "
        "each pair read as a desirable and an undesirable row.",
    )


class KTOConfig(TrainingSection, TemplateGuard):
    data: KTODataConfig = Field(
        description="Labelled completions (or preference pairs, expanded); the held-out split "
        "keeps both rows of a pair together."
    )
    beta: float = Result(
        0.1,
        gt=0,
        description="Scale of the implicit reward beta * (log pi - log ref) inside the sigmoid: "
        "higher stays closer to the reference.",
    )
    desirable_weight: float = Result(
        1.0,
        ge=0,
        description="lambda_D, weight of a desirable row's loss. The paper recommends "
        "desirable_weight x desirable rows / (undesirable_weight x undesirable rows) in "
        "[1, 4/3]; the stage warns outside it.",
    )
    undesirable_weight: float = Result(
        1.0, ge=0, description="lambda_U, weight of an undesirable row's loss."
    )


KIND = trainer(
    name="kto",
    section=KTOConfig,
    module="posttrain.stages.kto",
    help="KTO: unpaired desirable/undesirable completions (or pairs, expanded) against a "
    "reference policy.",
    order=35,
    version="2",
    consumes=("policy", "reference"),
    data="unpaired",
    # One completion per row, plus its mismatched twin for the KL reference point: two
    # sequences per row through policy and reference, as a pair is.
    memory=seq_memory("pairs", "policy", "reference"),
    # Each row's log-prob sums (its mismatched twin's too) are all-reduced over the group.
    sequence_parallel=True,
)
