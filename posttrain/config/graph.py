"""The recipe's stage graph: which stages run, what each one starts from, and checks that the
graph makes sense before anything runs.

A recipe names its stages two ways, which may be mixed:
  - shorthand top-level sections (`sft:`, `reward:`, `dpo:` ...): one stage each, named after
    its kind, in the registry's chain order (sft, reward, dpo, ppo, grpo ...);
  - a `stages:` list: entries with `kind`, a unique `name`, their section's fields and their
    links (`from`, `reference`, `reward_model`, `base`). They come after the shorthand stages.

The bases: the top-level `ingest:` section is the base named `ingest`; every `stages:` entry of
kind `ingest` (with a name of its own) is one more base, ingested like it. They are not graph
stages: each lineage ends at one of them, and every graph stage stands on exactly one (its
`base`), the root of the lineage it starts from.

Links default to what the chain means: `from` = the previous stage that produces a policy (the
base when there is none; the `base:` named when one is), `reference` = the policy it starts from
(lineage-correct, never silently the raw base), `reward_model` = the last reward stage before
it. Stages may be written in any order; they run in an order where every stage follows its
inputs (list order otherwise).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from posttrain.kinds import KINDS, ROLE_FIELDS, StageKind

# The default base model: the top-level `ingest` section's artifact, named by its kind.
BASE = next(k.name for k in KINDS.values() if k.placement == "first")
# Stage names a graph stage cannot take: the fixed stages'.
RESERVED = tuple(k.name for k in KINDS.values() if k.placement != "graph")


class GraphError(ValueError):
    """A stage graph that cannot run; `errors` holds one `field.path: message` per problem."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("; ".join(errors))


@dataclass(frozen=True)
class GraphStage:
    name: str
    kind: StageKind
    # The recipe section (a shorthand section, or a `stages:` entry with its link fields).
    section: Any
    # Field path for messages: `dpo` (shorthand) or `stages.dpo2`.
    where: str
    # role -> stage name (a base's name for a base model): "policy" (from), "reference",
    # "reward_model", "teacher".
    links: dict[str, str] = field(default_factory=dict)
    # The roles of `links` the recipe did not write (filled by default): a cycle names them.
    defaulted: frozenset[str] = frozenset()
    # The base model it stands on (the root of its lineage; its `base` role).
    base: str = BASE


@dataclass
class StageGraph:
    # Run order: every stage after the stages it links to.
    stages: list[GraphStage]
    # The base models by name, the default (`ingest`, the top-level section) first: each a
    # stage of the first kind, its section the top-level `ingest:` or its `stages:` entry.
    bases: dict[str, GraphStage] = field(default_factory=dict)

    def __iter__(self) -> Iterator[GraphStage]:
        return iter(self.stages)

    def __len__(self) -> int:
        return len(self.stages)

    def __contains__(self, name: object) -> bool:
        return any(s.name == name for s in self.stages)

    def get(self, name: str) -> GraphStage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def names(self) -> list[str]:
        return [s.name for s in self.stages]

    def policies(self) -> list[str]:
        return [s.name for s in self.stages if s.kind.produces == "policy"]

    def final_policy(self) -> str | None:
        """The policy the run ships by default: the last policy stage in run order."""
        return (self.policies() or [None])[-1]

    def lineage(self, name: str) -> list[str]:
        """`name`, the policy it started from, that one's, ... (not the base)."""
        out = []
        while name not in self.bases:
            out.append(name)
            name = self.parent(name)
        return out

    def base_of(self, name: str) -> str:
        """The base model stage or base `name` stands on (a base: itself)."""
        return name if name in self.bases else self.get(name).base

    def adapter_origin(self, name: str) -> GraphStage | None:
        """The stage that created the adapter `name` trains (the first of its lineage that
        started from the base), whose `lora` shapes it."""
        line = self.lineage(name)
        return self.get(line[-1]) if line else None

    def heldout_source(self, name: str) -> str | None:
        """The nearest stage of `name`'s lineage that trained on conversations (its held-out
        rows measure held-out loss and exact match)."""
        return next((n for n in self.lineage(name) if self.get(n).kind.data == "messages"), None)

    def verifier_source(self, name: str) -> str | None:
        """The nearest stage of `name`'s lineage scored by reward functions (`rewards`) or an
        environment, else the nearest that trained on prompts: its held-out prompts (and functions) are what
        evaluate's verifiers judge by default."""
        line = self.lineage(name)
        scored = (n for n in line if _own_reward(self.get(n).section))
        prompted = (n for n in line if self.get(n).kind.data == "prompts")
        return next(scored, None) or next(prompted, None)

    def reward_models(self) -> list[str]:
        return [s.name for s in self.stages if s.kind.produces == "reward_model"]

    def parent(self, name: str) -> str:
        """The stage `name` started from (its base's name when it started from a base)."""
        node = self.get(name)
        return node.links.get("policy", node.base)


def _entries(recipe: Any) -> list[tuple[str, str, Any]]:
    """(name, field path, section) of every graph stage and extra base in written order."""
    out = []
    for name in KINDS:
        section = getattr(recipe, name, None) if KINDS[name].placement == "graph" else None
        if section is not None:
            out.append((name, name, section))
    for i, entry in enumerate(getattr(recipe, "stages", None) or []):
        out.append((entry.name, f"stages.{entry.name}" if entry.name else f"stages.{i}", entry))
    return out


def _is_base(section: Any) -> bool:
    """Whether a `stages:` entry is an extra base (an entry of the first kind, ingest)."""
    kind = KINDS.get(getattr(section, "kind", None) or "")
    return kind is not None and kind.placement == "first"


def _name_errors(entries: list[tuple[str, str, Any]]) -> list[str]:
    names = [n for n, _, _ in entries]
    errors = []
    for n, where, section in entries:
        if names.count(n) > 1:
            errors.append(f"{where}: two stages are named {n!r}; give each a unique `name`")
        if n == BASE and _is_base(section):
            errors.append(
                f"{where}.name: an ingest entry is one more base: give it a name of its own "
                f"({BASE!r} is the top-level ingest section's)"
            )
        elif n in RESERVED:
            errors.append(f"{where}.name: {n!r} is reserved for the fixed stage of that name")
    return sorted(set(errors))


def _template_text(value: str | None) -> str | None:
    from posttrain.data.chat import looks_like_template_file

    if value and looks_like_template_file(value) and Path(value).is_file():
        return Path(value).read_text()
    return value


def build_graph(recipe: Any) -> StageGraph:
    """The recipe's stage graph, links filled and checked. Raises GraphError naming each bad
    field (`stages.grpo.reward_model: ...`)."""
    every = _entries(recipe)
    if errors := _name_errors(every):
        raise GraphError(errors)
    first = KINDS[BASE]
    bases = {BASE: GraphStage(BASE, first, recipe.ingest, BASE, base=BASE)}
    for n, where, section in every:
        if _is_base(section):
            bases[n] = GraphStage(n, first, section, where, base=n)
    entries = [e for e in every if not _is_base(e[2])]
    names = [n for n, _, _ in entries]
    kinds = {n: KINDS[getattr(s, "kind", None) or n] for n, _, s in entries}
    produces = {n: k.produces for n, k in kinds.items()}
    stages: list[GraphStage] = []
    errors: list[str] = []
    for i, (n, where, section) in enumerate(entries):
        kind, links, defaulted = kinds[n], {}, set()
        before = names[:i]
        base = getattr(section, "base", None)
        if base is not None and base not in bases:
            errors.append(f"{where}.base: {_not_a_base(base, produces, bases)}")
            continue
        for role, fld in ROLE_FIELDS.items():
            given = getattr(section, "from_" if fld == "from" else fld, None)
            if role not in kind.consumes:
                if given is not None:
                    errors.append(f"{where}.{fld}: a {kind.name} stage takes no {fld}")
                continue
            target = given if given is not None else _default(role, before, produces, links, base)
            if role == "reward_model" and given is None and _own_reward(section):
                # Scored by its reward functions (or its episodes' environment): a reward model
                # joins only when named.
                continue
            if target is None and role in kind.optional:
                continue
            if target is None:
                errors.append(f"{where}.{fld}: {_missing(role, kind.name)}")
                continue
            if problem := _link_problem(role, target, n, produces, kind, bases):
                errors.append(f"{where}.{fld}: {problem}")
                continue
            links[role] = target
            if given is None:
                defaulted.add(role)
        stages.append(
            GraphStage(n, kind, section, where, links, frozenset(defaulted), base or BASE)
        )
    if errors:
        raise GraphError(errors)
    graph = StageGraph(_with_bases(_run_order(stages, bases)), bases)
    if errors := _base_errors(graph):
        raise GraphError(errors)
    errors += _template_errors(graph)
    if not graph.policies():
        errors.append(
            "the recipe trains no policy: add an `sft:` section or a `stages:` entry of a "
            "policy kind (" + ", ".join(k for k, v in KINDS.items() if v.produces == "policy") + ")"
        )
    if errors:
        raise GraphError(errors)
    return graph


def _not_a_base(name: str, produces: Mapping[str, str], bases: Mapping[str, Any]) -> str:
    what = f"{name!r} is a {produces[name]} stage, not a base" if name in produces else None
    return (what or f"no base named {name!r}") + f" (bases: {', '.join(bases)})"


def _with_bases(stages: list[GraphStage]) -> list[GraphStage]:
    """`stages` (in run order) each with its base: the base it starts from, else its
    policy's base (a stage that starts from a policy stands on that policy's base), else the
    base it names (default `ingest`)."""
    out: dict[str, GraphStage] = {}
    for s in stages:
        parent = s.links.get("policy")
        base = out[parent].base if parent in out else parent or s.base
        out[s.name] = replace(s, base=base)
    return list(out.values())


def _base_errors(graph: StageGraph) -> list[str]:
    """A `base:` another than the one its `from` stands on, and a reference or reward model
    trained on another base than the stage's (its adapter would be loaded on the wrong
    model)."""
    errors = []
    for s in graph:
        named = getattr(s.section, "base", None)
        parent = s.links.get("policy")
        if named is not None and named != s.base:
            if parent in graph.bases:
                why = f"the stage starts from the base {parent!r} (`from`); name one base only"
            else:
                why = (
                    f"{parent!r}, the policy it starts from (`from`), stands on {s.base!r}: a "
                    "stage that starts from a policy stands on that policy's base; drop `base`, "
                    f"or start from a policy of base {named!r}"
                )
            errors.append(f"{s.where}.base: {named!r} is not this stage's base: {why}")
            continue
        for role in ("reference", "reward_model"):
            other = s.links.get(role)
            if other is not None and graph.base_of(other) != s.base:
                errors.append(
                    f"{s.where}.{ROLE_FIELDS[role]}: {other!r} stands on the base "
                    f"{graph.base_of(other)!r}, this stage on {s.base!r}; name a stage of "
                    f"base {s.base!r}"
                )
    return errors


def _own_reward(section: Any) -> bool:
    """Whether a stage scores its rollouts itself: reward functions or an environment."""
    rollout = getattr(section, "rollout", None)
    return bool(getattr(section, "rewards", None)) or bool(rollout and rollout.episodes)


def _missing(role: str, kind: str) -> str:
    if role == "teacher":
        return (
            f"a {kind} stage needs a teacher: name the policy stage or base it learns from "
            "(`teacher: <name>`)"
        )
    return (
        f"a {kind} stage needs a reward: add a reward stage before it, name one, or list "
        "reward functions in `rewards`"
    )


def _default(
    role: str,
    before: list[str],
    produces: Mapping[str, str],
    links: Mapping[str, str],
    base: str | None,
) -> str | None:
    if role == "policy":
        # `base:` written: the stage starts from that base (a fresh adapter) unless `from` says
        # otherwise.
        if base is not None:
            return base
        return next((n for n in reversed(before) if produces[n] == "policy"), BASE)
    if role == "reference":
        return links.get("policy", base or BASE)
    if role == "teacher":  # never guessed: which model teaches is the recipe's choice
        return None
    return next((n for n in reversed(before) if produces[n] == "reward_model"), None)


def _link_problem(
    role: str,
    target: str,
    me: str,
    produces: Mapping[str, str],
    kind: StageKind,
    bases: Mapping[str, Any],
) -> str | None:
    valid = sorted(produces) + list(bases)
    if target == me:
        return "a stage cannot take its own output"
    if target not in produces and target not in bases:
        return f"no stage named {target!r} (stages: {', '.join(valid)})"
    what = "base" if target in bases else produces[target]
    if role == "reward_model":
        if what != "reward_model":
            return f"{target!r} is a {what} stage, not a reward model"
        return None
    if what not in ("policy", "base"):
        wanted = "to learn from" if role == "teacher" else "to start from"
        return f"{target!r} produces a {what}, not a policy {wanted}"
    if role == "reference" and what == "base":
        return (
            "the raw base is not a reference: name a policy stage (by default the reference "
            "is the policy the stage starts from)"
        )
    base_start = role == "policy" and what == "base" and kind.produces == "policy"
    if base_start and not kind.new_adapter_from_base:
        return (
            f"a {kind.name} stage starts from a trained policy adapter, not the base: "
            "put a stage that creates one (e.g. sft) before it"
        )
    return None


def _run_order(stages: list[GraphStage], bases: Mapping[str, Any]) -> list[GraphStage]:
    """Stages with every stage after its inputs, otherwise in written order. Raises GraphError
    naming the stages of a cycle."""
    by_name = {s.name: s for s in stages}
    done: list[GraphStage] = []
    placed: set[str] = set()
    waiting = list(stages)
    while waiting:
        ready = next(
            (s for s in waiting if all(t in bases or t in placed for t in s.links.values())), None
        )
        if ready is None:
            raise GraphError([_cycle_error(waiting)])
        waiting.remove(ready)
        done.append(ready)
        placed.add(ready.name)
    assert len(done) == len(by_name)
    return done


def _cycle_error(waiting: list[GraphStage]) -> str:
    """The message for stages that wait on each other: the cycle in the order policies flow
    (`a -> b`: b starts from a), each link the recipe did not write named as a default, since
    a default `from` (the policy stage written before) is the link a reader does not see."""
    by_name = {s.name: s for s in waiting}
    path: list[tuple[GraphStage, str]] = []  # (stage, the role by which it waits on the next)
    stage = waiting[0]
    while all(stage is not p for p, _ in path):
        role, target = next((r, t) for r, t in stage.links.items() if t in by_name)
        path.append((stage, role))
        stage = by_name[target]
    cycle = path[next(i for i, (p, _) in enumerate(path) if p is stage) :]
    # Each stage after the one it waits on, back to where the cycle started.
    flow = [cycle[0][0].name] + [
        s.name + (f" ({s.name}'s default {ROLE_FIELDS[role]})" if role in s.defaulted else "")
        for s, role in reversed(cycle)
    ]
    defaulted = [(s, role) for s, role in cycle if role in s.defaulted]
    where = (defaulted[0][0] if defaulted else cycle[0][0]).where
    text = f"{where}: the stages {' -> '.join(flow)} wait on each other (a cycle)"
    if defaulted:
        s, role = defaulted[0]
        fld = ROLE_FIELDS[role]
        text += (
            f"; {s.name}'s {fld} is not written, so it defaults to the stage before it in "
            f"the recipe: set {s.where}.{fld}"
        )
    return text


def _from_config(base: Any) -> str | None:
    """A from-config base's template text (None for a checkpoint: its own is read when the
    stage runs). `base`: an ingest section."""
    from posttrain.models.chatml import TEMPLATES

    return TEMPLATES[base.from_config.template] if base.source == "from_config" else None


def _no_tool_calls(template: str | None) -> str | None:
    """Why a stage given tools cannot use `template` (None: it can, or it is not known yet)."""
    from posttrain.agents.tool_calls import format_of_template

    if template is None or format_of_template(template) is not None:
        return None
    return (
        "the chat template the policy formats with renders no tool calls; use one that does "
        "(ingest.chat_template, or ingest.from_config.template: chatml_tools)"
    )


def _template_errors(graph: StageGraph) -> list[str]:
    """A stage formatting its data with another chat template than the policy it starts from
    (or than its reward model) learnt, without `allow_template_change`, or given tools under a
    template that renders no tool calls: refused now, before anything trains. Only templates
    the recipe spells out are compared here; the stage compares the recorded ones (sha256)
    when it runs. Each lineage roots at its own base's template."""
    own: dict[str, str | None] = {}
    for s in [*graph.bases.values(), *graph]:
        own[s.name] = _template_text(getattr(s.section, "chat_template", None))

    def effective(name: str) -> str | None:
        while name not in graph.bases:
            if own.get(name):
                return own[name]
            name = graph.parent(name)
        return own[name]

    errors = []
    for s in graph:
        tools = getattr(getattr(s.section, "rollout", None), "tools", None)
        built = _from_config(graph.bases[s.base].section)
        if tools and (problem := _no_tool_calls(effective(s.name) or built)):
            errors.append(f"{s.where}.rollout.tools: {problem}")
        if getattr(s.section, "allow_template_change", False):
            continue
        mine = effective(s.name)
        parent = graph.parent(s.name)
        theirs = effective(parent)
        if own[s.name] and theirs and own[s.name] != theirs:
            errors.append(
                f"{s.where}.chat_template: differs from the template of {parent!r}, the policy "
                "it starts from; set allow_template_change: true if that is on purpose"
            )
        rm = s.links.get("reward_model")
        if rm and mine and effective(rm) and effective(rm) != mine:
            errors.append(
                f"{s.where}.reward_model: {rm!r} was trained with another chat template than "
                "this stage uses; set allow_template_change: true if that is on purpose"
            )
    return errors
