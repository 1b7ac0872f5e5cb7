"""dpo: DPO-family preference tuning (sigmoid, IPO, robust, hinge, SimPO) against a frozen
reference adapter."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from posttrain.kinds._kind import seq_memory, trainer
from posttrain.sections.fields import Result
from posttrain.sections.shared import PreferenceDataConfig, TemplateGuard, TrainingSection


class DPOConfig(TrainingSection, TemplateGuard):
    data: PreferenceDataConfig = Field(description="Preference pairs.")
    loss: Literal["sigmoid", "ipo", "robust", "hinge", "simpo"] = Result(
        "sigmoid",
        description="Preference loss: sigmoid (DPO), ipo, robust (label-smoothing "
        "unbiased), hinge (SLiC), simpo (reference-free, length-normalised).",
    )
    beta: float = Result(0.1, gt=0, description="Strength of the implicit KL constraint.")
    label_smoothing: float = Result(
        0.0, ge=0, lt=0.5, description="Assumed preference-label noise (sigmoid, robust, simpo)."
    )
    simpo_gamma: float = Result(0.5, ge=0, description="SimPO target reward margin.")
    sft_weight: float = Result(
        0.0, ge=0, description="Weight of an added NLL term on the chosen response."
    )
    # A result: the precomputed table's reference log-probs match the online ones to ~1e-5, not
    # bit for bit.
    precompute_reference: bool | None = Result(
        None,
        description="Compute reference log-probs once, store them as an artifact keyed by "
        "reference, data, template, max length and the numerics they were computed under "
        "(device, threads, precision, attention, chunking, batch layout), and reuse them "
        "across runs that would compute the same bits. Default "
        "(null): on when the stage visits its pairs more than once (more than one epoch), "
        "where a reference forward per step would repeat work; true/false force it.",
    )


KIND = trainer(
    name="dpo",
    section=DPOConfig,
    module="posttrain.stages.dpo",
    help="DPO-family preference tuning against a reference policy.",
    order=30,
    version="2",
    consumes=("policy", "reference"),
    data="pairs",
    memory=seq_memory("pairs", "policy", "reference"),
    # Each row's log-prob sums are all-reduced over the group (models.sequence_split).
    sequence_parallel=True,
)
