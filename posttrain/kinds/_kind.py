"""What a stage kind declares about itself (see `posttrain/kinds/__init__.py`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

# What a stage may take from other stages, besides the base model every stage reads:
#   policy        the adapter it starts from (recipe field `from`)
#   reference     the frozen adapter its KL / implicit reward is measured against (`reference`)
#   reward_model  the reward stage whose model scores its rollouts (`reward_model`)
#   teacher       the frozen policy (or base) it distils from (`teacher`), on a base of its own
Role = Literal["policy", "reference", "reward_model", "teacher"]
ROLE_FIELDS: dict[str, str] = {
    "policy": "from",
    "reference": "reference",
    "reward_model": "reward_model",
    "teacher": "teacher",
}

# What a stage's artifact is, for the stages that consume it.
Product = Literal["base", "policy", "reward_model", "evaluation", "export"]

# What its rows look like (evaluate takes held-out conversations from the nearest stage in a
# policy's lineage that trained on `messages`).
DataShape = Literal["none", "messages", "pairs", "prompts", "unpaired"]


@dataclass(frozen=True)
class MemoryInputs:
    """What a kind's memory function gets besides its section: the fields every estimate
    shares (`common`: micro_batch, precision, activation_checkpointing, logits_chunk_tokens,
    base_dtype), the adapters it holds (posttrain.memory.estimate.Adapter, shaped by the stage
    that created each adapter), and the data-parallel size."""

    common: dict[str, Any]
    policy: Any
    reference: Any
    reward_model: Any
    world: int


@dataclass(frozen=True)
class StageKind:
    name: str
    # The recipe-section model (pydantic); a graph stage's entry adds kind/name/from/....
    section: type
    # `python -m <module> --spec <spec.json>` runs one stage of this kind.
    module: str
    # One line for docs/recipes.md and the recipe schema's description.
    help: str
    # Place in the standard chain: shorthand top-level sections run in this order.
    order: int
    produces: Product
    consumes: tuple[Role, ...] = ()
    # Roles of `consumes` the stage may go without (no default is filled in): SFT's teacher.
    optional: tuple[Role, ...] = ()
    # It compares its teacher's next-token distributions with the student's id by id (token-
    # level distillation): both bases must tokenize with one vocabulary, checked when the recipe
    # is resolved (posttrain.config.vocab_check). A teacher that only writes text (SFT's) may
    # tokenize any way.
    token_teacher: bool = False
    data: DataShape = "none"
    # Bump when a change to the stage's code should invalidate its cached artifacts ("2"/"3" on
    # the kinds that were bumped when fingerprints became by rule: fields and kinds decide,
    # parents by role).
    version: str = "1"
    # Training stages beat a heartbeat per step (hang watch), get a memory pre-flight, a batch
    # and the numerics of the fingerprint.
    trains: bool = False
    # Distributed stages are launched with torchrun, one process per device.
    distributed: bool = False
    # Its step functions split each micro-batch's tokens across a sequence-parallel group
    # (`infra.sequence_parallel`); a kind without it is refused above 1 rather than run whole
    # on every rank of a group (posttrain.config.sp_check).
    sequence_parallel: bool = False
    # The shared recipe sections whose `Result` fields are part of its fingerprint, besides its
    # own section (posttrain.plan.fingerprints): `guard` only changes what training stages make.
    reads: tuple[str, ...] = ("run", "infra")
    # What else its result depends on, from the recipe (posttrain.plan.fingerprints): online RL
    # samples rollouts per rank (its own share of prompts, its own seed), so its result depends
    # on the number of ranks.
    inputs: Callable[[Any], dict[str, Any]] | None = None
    # "first"/"last": one per run, at a fixed place (ingest; evaluate and export), recipe field
    # of its own. "graph": any number, in the recipe's stage graph.
    placement: Literal["first", "graph", "last"] = "graph"
    # Starting from the base (`from: ingest`) creates a fresh adapter from `section.lora`.
    new_adapter_from_base: bool = False
    # Seconds before the stage is killed, unless infra.timeouts says otherwise.
    timeout_s: float = 6 * 3600
    # (section, MemoryInputs) -> posttrain.memory.estimate.StageShape, for training stages.
    memory: Callable[[Any, MemoryInputs], Any] | None = None


def trainer(**kw: Any) -> StageKind:
    """A training kind: it makes a policy (unless `produces` says otherwise), runs under
    torchrun, and the numerical guards (`guard`) are part of what it makes."""
    defaults = {"produces": "policy", "trains": True, "distributed": True}
    return StageKind(**{**defaults, "reads": ("run", "infra", "guard"), **kw})


def seq_memory(shape: str, *roles: str) -> Callable[[Any, MemoryInputs], Any]:
    """The memory function of a kind whose rows are `section.data.max_seq_len` tokens through
    the adapters of `roles` (fields of MemoryInputs)."""

    def memory(section: Any, m: MemoryInputs) -> Any:
        from posttrain.memory.estimate import StageShape

        adapters = tuple(getattr(m, r) for r in roles)
        return StageShape(shape, seq_len=section.data.max_seq_len, adapters=adapters, **m.common)

    return memory
